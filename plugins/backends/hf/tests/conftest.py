"""Fixtures of the hf plugin's tests: toy targets built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_toy_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny toy target (seconds to build), built once per session into a temp folder."""
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="session")
def toy_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy-target cache of this session: $SPECFORGE_CACHE_DIR when set (CI may keep it
    between runs), else a session temp folder, so tests never write into ~/.cache."""
    preset = os.environ.get("SPECFORGE_CACHE_DIR")
    return Path(preset) if preset else tmp_path_factory.mktemp("specforge-cache")


@pytest.fixture(scope="session")
def default_toy_target(toy_cache_dir: Path) -> Path:
    """The default toy target, built (about two minutes) at most once per session and cached."""
    from specforge_plugin_hf.toy import ensure_toy_target

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECFORGE_CACHE_DIR", str(toy_cache_dir))
        return ensure_toy_target("default", progress=False)


@pytest.fixture
def use_toy_cache(toy_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the toy-target cache of this test at the session cache."""
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(toy_cache_dir))
    return toy_cache_dir
