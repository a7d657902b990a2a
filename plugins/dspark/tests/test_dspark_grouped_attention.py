"""DSpark on DFlash's grouped block attention: the same step as with the dense mask."""

import pytest

from specforge_plugin_dflash.testing import GROUPED_TOLERANCES, HIDDEN, grouped_vs_dense

from specforge_plugin_dspark import DSparkOptions
from specforge_plugin_dspark.strategy import DSparkStrategy


@pytest.mark.parametrize(("dtype", "loss_tol", "grad_tol"), GROUPED_TOLERANCES)
def test_dspark_step_in_groups_equals_the_dense_mask_step(dtype, loss_tol, grad_tol):
    result = grouped_vs_dense(DSparkStrategy, DSparkOptions, dtype, group_blocks=2, markov_rank=16,
                              extra={"last_hidden": HIDDEN})
    assert result["loss"] > 1.0
    assert result["loss_diff"] <= loss_tol * result["loss"]
    assert result["grad_diff"] <= grad_tol * result["grad_max"]
