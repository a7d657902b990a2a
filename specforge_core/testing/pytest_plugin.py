"""pytest fixtures for plugin authors, auto-loaded wherever specforge-core is installed.

* ``fake_site`` — a :class:`~specforge_core.testing.FakeSite` in a temporary directory
  for installing fake distributions with entry points;
* ``plugin_manager`` — a fresh, loaded plugin manager over the real installed plugins,
  also installed as the process-wide manager for the duration of the test;
* ``half_gemm`` — ``half_gemm("fp32" | "native" | "")`` chooses how half-precision GEMMs run
  on CPU (``SPECFORGE_CPU_HALF_GEMM``, :func:`specforge_core.nn.upcast_half_gemm_on_cpu`) for
  one test, whatever the machine's CPU would choose;
* ``float32_gemm`` — ``float32_gemm("onednn" | "torch" | "")`` likewise for the float32 GEMMs that
  :func:`specforge_core.nn.mm` and :class:`specforge_core.nn.ReusedWeight` take
  (``SPECFORGE_CPU_FP32_GEMM``, :func:`specforge_core.nn.onednn_float32`).
"""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from ..plugins import PluginManager, set_plugin_manager
from .distributions import FakeSite


@pytest.fixture
def fake_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeSite]:
    site = FakeSite(tmp_path_factory.mktemp("site"))
    yield site
    site.cleanup()


def _switch(monkeypatch: pytest.MonkeyPatch, variable: str, choice: Callable[[], object]) -> Iterator[
        Callable[[str], None]]:
    """A fixture's ``choose(value)``: sets ``variable`` for the test and forgets ``choice``'s cached answer, before
    and after."""
    def choose(value: str) -> None:
        monkeypatch.setenv(variable, value)
        choice.cache_clear()  # type: ignore[attr-defined]  # the choice is cached per process
    yield choose
    choice.cache_clear()  # type: ignore[attr-defined]


@pytest.fixture
def half_gemm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    from .. import nn as sf_nn

    yield from _switch(monkeypatch, sf_nn.HALF_GEMM_ENV, sf_nn.upcast_half_gemm_on_cpu)


@pytest.fixture
def float32_gemm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """``float32_gemm("onednn" | "torch" | "")``: sets ``SPECFORGE_CPU_FP32_GEMM`` for the test and forgets the
    cached choice (:func:`specforge_core.nn.onednn_float32`), before and after."""
    from .. import nn as sf_nn

    yield from _switch(monkeypatch, sf_nn.FP32_GEMM_ENV, sf_nn.onednn_float32)


@pytest.fixture
def plugin_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginManager]:
    for key in ("SPECFORGE_DISABLE_PLUGINS", "SPECFORGE_ALLOW_PLUGINS"):
        monkeypatch.delenv(key, raising=False)
    manager = PluginManager().load()
    previous = set_plugin_manager(manager)
    yield manager
    set_plugin_manager(previous)
