"""Fixtures of the domino plugin's tests: DFlash's test kit (one thread, the random and the tiny toy target) and
small Domino drafts."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specforge_plugin_dflash.testing import engine, one_torch_thread, small_draft, tiny  # noqa: E402,F401
from specforge_plugin_dflash.testing import random_target_fixture as random_target  # noqa: E402,F401
from specforge_plugin_domino import DominoOptions  # noqa: E402
from specforge_plugin_domino.strategy import DominoStrategy  # noqa: E402


def _make_draft(info=None, frozen=None, *, perturb=True, **options):
    return small_draft(DominoStrategy, DominoOptions, info, frozen, perturb=perturb, **{"emb_dim": 16, **options})


@pytest.fixture
def make_draft():
    """``make_draft(info=None, frozen=None, *, perturb=True, **options) -> (strategy, model)``: a small Domino draft (block 4, 2 layers, 3 target layers, e=16)
    over ``random_target()`` unless a target is given."""
    return _make_draft
