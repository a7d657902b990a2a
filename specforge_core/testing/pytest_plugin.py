"""pytest fixtures for plugin authors, auto-loaded wherever specforge-core is installed.

* ``fake_site`` — a :class:`~specforge_core.testing.FakeSite` in a temporary directory
  for installing fake distributions with entry points;
* ``plugin_manager`` — a fresh, loaded plugin manager over the real installed plugins,
  also installed as the process-wide manager for the duration of the test.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from ..plugins import PluginManager, set_plugin_manager
from .distributions import FakeSite


@pytest.fixture
def fake_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeSite]:
    site = FakeSite(tmp_path_factory.mktemp("site"))
    yield site
    site.cleanup()


@pytest.fixture
def plugin_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginManager]:
    for key in ("SPECFORGE_DISABLE_PLUGINS", "SPECFORGE_ALLOW_PLUGINS"):
        monkeypatch.delenv(key, raising=False)
    manager = PluginManager().load()
    previous = set_plugin_manager(manager)
    yield manager
    set_plugin_manager(previous)
