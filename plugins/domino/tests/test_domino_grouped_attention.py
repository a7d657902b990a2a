"""Domino on DFlash's grouped block attention: the same step as with the dense mask."""

import pytest

from specforge_plugin_dflash.testing import GROUPED_TOLERANCES, grouped_vs_dense

from specforge_plugin_domino import DominoOptions
from specforge_plugin_domino.strategy import DominoStrategy


@pytest.mark.parametrize(("dtype", "loss_tol", "grad_tol"), GROUPED_TOLERANCES)
@pytest.mark.parametrize("shift_label", [True, False])
def test_domino_step_in_groups_equals_the_dense_mask_step(dtype, loss_tol, grad_tol, shift_label):
    result = grouped_vs_dense(DominoStrategy, DominoOptions, dtype, group_blocks=2, emb_dim=16,
                              shift_label=shift_label)
    assert result["loss"] > 1.0
    assert result["loss_diff"] <= loss_tol * result["loss"]
    assert result["grad_diff"] <= grad_tol * result["grad_max"]
