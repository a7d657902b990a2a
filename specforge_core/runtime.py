"""Assemble a run from a :class:`~specforge_core.config.RunPlan` and train.

This is where topologies are chosen — never in the training loop:

* **offline** (``--features DIR``): the disk store of a captured feature set, a fixed list
  of refs (shuffled per epoch, resumable by seek), frozen target parts from the feature set;
* **online colocated** (default): the target engine captures on a producer thread into the
  feature store, refs flow through the control plane's channel, the loader consumes them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .config import RunPlan
from .errors import SpecforgeError
from .options import options_to_dict
from .plugins import PluginManager
from .protocols import BuildContext


class RunError(SpecforgeError):
    """A run cannot be assembled from the plan."""


def build_component(plan: RunPlan, kind: str, context: BuildContext) -> Any:
    resolved = plan[kind]
    factory = resolved.spec.load_factory()
    return factory(resolved.options, context)


def run_contract(plan: RunPlan, world_size: int, total_steps: int, target_fingerprint: str) -> dict[str, Any]:
    """What a resume must match; each key is named in the refusal message."""
    return {
        "strategy": plan["strategy"].spec.name,
        "strategy_options": options_to_dict(plan["strategy"].options),
        "world_size": world_size,
        "batch_size": plan.train.batch_size,
        "accumulation_steps": plan.train.accumulation_steps,
        "total_steps": total_steps,
        "target": target_fingerprint,
    }


def execute(plan: RunPlan, manager: PluginManager, *, resume: str | None = None) -> dict[str, Any]:
    """Train according to ``plan``; returns the summary (also written to ``summary.json``)."""
    from .data.loader import FeatureDataLoader
    from .features import FeatureSet
    from .training.distributed import check_same_everywhere, init_distributed, shutdown
    from .training.evaluator import Evaluator
    from .training.trainer import Trainer

    train = plan.train
    info = init_distributed(train.device)
    try:
        check_same_everywhere("the installed plugin set", manager.plugin_set(), info)
        context = BuildContext(run_id=plan.run_id, output_dir=plan.output, rank=info.rank,
                               world_size=info.world_size, role="offline" if plan.features else "colocated")
        strategy = build_component(plan, "strategy", context)
        if not plan.features:
            raise RunError("online runs (no --features) need a target engine that can capture; "
                           "capture features first with `specforge capture` and pass --features DIR")
        features = FeatureSet.open(plan.features)
        target = features.target
        features.check_plan(strategy.capture_plan(target), plan["strategy"].spec.name)
        store = features.open_store(context)
        refs = features.refs(store, "train")
        eval_refs = features.refs(store, "eval")
        if not refs:
            raise RunError(f"{plan.features} holds no training samples")
        torch.manual_seed(train.seed)
        model = strategy.build_model(target, features.frozen_parts())
        loader = FeatureDataLoader(store, strategy.collate, refs=refs, batch_size=train.batch_size, shuffle=True,
                                   seed=train.seed, drop_last=True, rank=info.rank, world_size=info.world_size)
        if len(loader) == 0:
            raise RunError(f"{len(refs)} training samples make no full batch of {train.batch_size} per rank on "
                           f"{info.world_size} rank(s); lower train.batch_size")
        total_steps = train.max_steps or max(1, train.epochs * len(loader) // train.accumulation_steps)
        evaluator = None
        if eval_refs:
            def eval_loader() -> Any:
                return FeatureDataLoader(store, strategy.collate, refs=eval_refs, batch_size=train.batch_size,
                                         shuffle=False, drop_last=False, rank=info.rank,
                                         world_size=info.world_size, equal_shares=False)
            evaluator = Evaluator(strategy, eval_loader, info)
        spec = plan["strategy"].spec
        summary_extra = {
            "plugins": manager.plugin_list(),
            "config": plan.to_dict(),
            "world_size": info.world_size,
            "features": os.fspath(plan.features),
        }
        trainer = Trainer(strategy=strategy, model=model, loader=loader, train=train, info=info,
                          output_dir=plan.output, run_id=plan.run_id, total_steps=total_steps,
                          contract=run_contract(plan, info.world_size, total_steps, features.fingerprint),
                          hooks=manager.hook, evaluator=evaluator, best_metric=spec.best_metric,
                          best_mode=spec.best_mode, summary_extra=summary_extra)
        manager.hook.specforge_run_started(run_id=plan.run_id, output_dir=str(Path(plan.output)),
                                           config=plan.to_dict())
        if resume:
            trainer.resume(resume)
        summary = trainer.fit()
        if info.is_main:
            manager.hook.specforge_run_finished(run_id=plan.run_id, output_dir=str(plan.output), summary=summary)
        store.close()
        return summary
    finally:
        shutdown()
