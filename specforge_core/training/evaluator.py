"""Evaluation whose numbers do not depend on batch size or the number of ranks."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..contracts import StepContext
from .distributed import DistInfo, all_reduce_max, gather_objects
from .metrics import RatioPool


def derived_metrics(strategy: Any, pooled: dict[str, float]) -> dict[str, float]:
    """Metrics a strategy computes from pooled ratios (e.g. τ_sim = Σ_k Π_{i≤k} acc_i)."""
    derive = getattr(strategy, "derived_metrics", None)
    return dict(derive(pooled)) if derive is not None else {}


class Evaluator:
    """Runs ``strategy.forward_loss`` without gradients over an eval set.

    Ratio metrics are pooled as float64 ``Σnum / Σden`` over all batches and ranks, then the
    strategy's ``derived_metrics(pooled)`` (if it has one) adds what is not a ratio itself. Under
    FSDP2 every forward is a collective, so ranks with fewer batches repeat their last batch
    (results discarded) until every rank has run as many forwards as the busiest one.
    """

    def __init__(self, strategy: Any, make_loader: Callable[[], Any], info: DistInfo) -> None:
        self.strategy = strategy
        self.make_loader = make_loader
        self.info = info

    @torch.no_grad()
    def run(self, model: torch.nn.Module, *, global_step: int, total_steps: int | None) -> dict[str, float]:
        was_training = model.training
        model.eval()
        ctx = StepContext(global_step=global_step, total_steps=total_steps, training=False)
        batches = list(self.make_loader())
        rounds = all_reduce_max(len(batches), self.info)
        pool = RatioPool()
        last = None
        for index in range(rounds):
            if index < len(batches):
                last = batches[index].to(self.info.device)
                pool.add(self.strategy.forward_loss(model, last, ctx).ratio_metrics)
            elif last is not None:
                self.strategy.forward_loss(model, last, ctx)  # keep FSDP collectives in step
        # A rank with no eval batch has no names yet: agree on the union first.
        names = sorted({n for rank_names in gather_objects(sorted(pool.sums), self.info) for n in rank_names})
        values = pool.reduce(self.info, names)
        values.update(derived_metrics(self.strategy, values))
        model.train(was_training)
        return values
