"""The base-loss weight λ: exact values over a run, no horizon, and what forward_loss reports."""

import pytest
import torch

from specforge_core.contracts import StepContext

from specforge_plugin_domino.schedule import base_loss_weight


@pytest.mark.parametrize("total, ratio, start, expected", [
    (10, 0.5, 1.0, [1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0]),   # window floor(5) = 5
    (7, 0.5, 1.0, [1.0, 2 / 3, 1 / 3, 0.0, 0.0]),                # window floor(3.5) = 3
    (4, 1.0, 1.0, [1.0, 0.75, 0.5, 0.25, 0.0]),
    (1, 0.5, 1.0, [1.0, 0.0]),                                   # floor(0.5) = 0 -> a window of 1
    (10, 0.0, 1.0, [1.0, 0.0, 0.0]),
    (10, 0.5, 0.5, [0.5, 0.4, 0.3]),
    (10, 0.5, 2.0, [1.0, 1.0, 1.0, 0.8, 0.4, 0.0]),              # clamped to [0, 1]
])
def test_lambda_decays_linearly_from_lambda_start_to_zero_at_floor_t_r(total, ratio, start, expected):
    got = [base_loss_weight(step, total, start=start, decay_ratio=ratio) for step in range(len(expected))]
    assert got == pytest.approx(expected, abs=1e-12)


def test_lambda_is_zero_without_a_horizon():
    assert [base_loss_weight(step, None) for step in (0, 1, 10**6)] == [0.0, 0.0, 0.0]
    assert base_loss_weight(0, None, start=1.0, decay_ratio=1.0) == 0.0


def test_forward_loss_uses_the_contexts_step_and_horizon_and_reports_lambda(make_draft):
    strategy, model = make_draft(lambda_start=1.0, lambda_decay_ratio=0.5, perturb=False)
    gen = torch.Generator().manual_seed(0)
    sample = {"input_ids": torch.randint(3, 90, (12,), generator=gen), "loss_mask": torch.ones(12, dtype=torch.long),
              "target_hidden": torch.randn(12, 96, generator=gen)}
    batch = strategy.collate([sample], ["s"])
    for ctx, expected in [(StepContext(global_step=0, total_steps=10), 1.0),
                          (StepContext(global_step=2, total_steps=10), 0.6),
                          (StepContext(global_step=9, total_steps=10), 0.0),
                          (StepContext(global_step=2, total_steps=10, training=False), 0.6),
                          (StepContext(global_step=2, total_steps=None), 0.0)]:
        with torch.no_grad():
            assert strategy.forward_loss(model, batch, ctx).metrics == {"lambda": pytest.approx(expected)}
