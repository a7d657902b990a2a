"""Assemble a run from a :class:`~specforge_core.config.RunPlan` and train.

This is where topologies are chosen — never in the training loop:

* **offline** (``--features DIR``): the disk store of a captured feature set, a fixed list
  of refs (shuffled per epoch, resumable by seek), frozen target parts from the feature set;
* **online colocated** (default): the target engine captures on a producer thread into the
  feature store, refs flow through the control plane's channel, the loader consumes them;
* **disaggregated consumer** (``--role consumer --features DIR``): the training side of a
  stream that a producer process writes into ``DIR`` (see :mod:`.topologies.stream`): refs from the
  sqlite control plane's channel, acks durable with their global step, exactly once across
  restarts of either side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .components import build_component
from .config import RunPlan, with_suggested_train_options
from .errors import SpecforgeError
from .options import options_to_dict
from .plugins import PluginManager
from .protocols import BuildContext


class RunError(SpecforgeError):
    """A run cannot be assembled from the plan."""


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
    from .topologies.colocated import OnlineSource
    from .topologies.offline import OfflineSource
    from .topologies.stream.consumer import StreamSource
    from .training.distributed import barrier, check_same_everywhere, init_distributed, shutdown
    from .training.evaluator import Evaluator
    from .training.trainer import Trainer

    train = plan.train
    info = init_distributed(train.device)
    source: Any = None
    try:
        check_same_everywhere("the installed plugin set", manager.plugin_set(), info)
        if plan.role not in (None, "consumer"):
            raise RunError(f"a {plan.role} does not train; run it with `specforge run --role {plan.role}`")
        topology = _topology(plan)
        role = plan.role or ("offline" if plan.features else "colocated")
        context = BuildContext(run_id=plan.run_id, output_dir=plan.output, rank=info.rank,
                               world_size=info.world_size, role=role)
        strategy = build_component(plan, "strategy", context)
        if plan.role == "consumer":
            source = StreamSource(plan, strategy, context, sync=lambda: barrier(info))
        elif plan.features:
            source = OfflineSource(plan, strategy, context)
        else:
            # Capture may run this many samples ahead of the optimizer (bounded memory).
            window = 4 * train.batch_size * train.accumulation_steps
            source = OnlineSource(plan, strategy, context, build=lambda kind: build_component(plan, kind, context),
                                  window=window)
        suggest = (getattr(source, "suggested_train_options", None)
                   or getattr(getattr(source, "engine", None), "suggested_train_options", None))
        applied: dict[str, Any] = {}
        if suggest is not None:
            plan, applied = with_suggested_train_options(plan, suggest())
            train = plan.train
        torch.manual_seed(train.seed)
        model = strategy.build_model(source.target, source.frozen_parts(), source.stats())
        loader = source.train_loader(strategy.collate, batch_size=train.batch_size, seed=train.seed,
                                     rank=info.rank, world_size=info.world_size)
        batches_per_epoch = source.samples_per_rank(info.world_size) // train.batch_size
        if batches_per_epoch == 0:
            raise RunError(f"{source.samples_per_rank(info.world_size)} training samples per rank make no full "
                           f"batch of {train.batch_size} on {info.world_size} rank(s); lower train.batch_size")
        total_steps = train.max_steps or max(1, train.epochs * batches_per_epoch // train.accumulation_steps)
        make_eval = source.eval_loader_factory(strategy.collate, batch_size=train.batch_size, rank=info.rank,
                                               world_size=info.world_size)
        evaluator = Evaluator(strategy, make_eval, info) if make_eval else None
        spec = plan["strategy"].spec
        summary_extra = {"plugins": manager.plugin_list(), "config": plan.to_dict(), "world_size": info.world_size,
                         "topology": topology,
                         "train_options_suggested_by_engine": applied}
        trainer = Trainer(strategy=strategy, model=model, loader=loader, train=train, info=info,
                          output_dir=plan.output, run_id=plan.run_id, total_steps=total_steps,
                          contract=run_contract(plan, info.world_size, total_steps, source.fingerprint),
                          hooks=manager.hook, ack=source.ack, evaluator=evaluator, best_metric=spec.best_metric,
                          best_mode=spec.best_mode, summary_extra=summary_extra,
                          on_checkpoint=getattr(source, "checkpointed", None))
        manager.hook.specforge_run_started(run_id=plan.run_id, output_dir=str(Path(plan.output)),
                                           config=plan.to_dict())
        if info.is_main:
            from .export import write_run_file

            write_run_file(plan.output, plan, source.target)
        if resume:
            trainer.resume(resume)
        source.start(skip_samples=trainer.state.batch_in_epoch * train.batch_size,
                     global_step=trainer.state.global_step)
        summary = trainer.fit()
        if hasattr(source, "finish"):
            source.finish(trainer.state.global_step)
        summary = finalize(plan, strategy, trainer, source, info, context, summary)
        if info.is_main:
            manager.hook.specforge_run_finished(run_id=plan.run_id, output_dir=str(plan.output), summary=summary)
        # The other ranks wait for rank 0's export and acceptance check, so that no rank tears
        # the process group down while a peer may still be finishing a collective with it.
        barrier(info)
        return summary
    finally:
        if source is not None:
            source.close()
        shutdown()


def _topology(plan: RunPlan) -> str:
    if plan.role == "consumer":
        return "disaggregated-consumer"
    return "offline" if plan.features else "online-colocated"


def _eval_engine(plan: RunPlan, source: Any, context: BuildContext) -> tuple[Any, str | None]:
    """The target engine for the real acceptance check: the run's own, or one built for it."""
    engine = getattr(source, "engine", None)
    if engine is not None:
        return engine, None
    from .features import frozen_fingerprint

    try:
        engine = build_component(plan, "target_engine", context)
    except SpecforgeError as exc:
        return None, f"no target engine for the real check: {exc}"
    if frozen_fingerprint(engine.frozen_parts()) != source.fingerprint:
        return None, ("the target engine's model is not the one the features were captured from; pass "
                      "--set target_engine.model=PATH to measure tau_real")
    return engine, None


def finalize(plan: RunPlan, strategy: Any, trainer: Any, source: Any, info: Any, context: BuildContext,
             summary: dict[str, Any]) -> dict[str, Any]:
    """Export the final draft and measure real acceptance; adds both to ``summary.json``."""
    from .topologies.capture import data_paths
    from .export import export_model
    from .speculative import TAU_SIM_CONVENTION, measure_acceptance, prompts_from_jsonl
    from .training.checkpoint import load_model_state, model_state
    from .training.distributed import DistInfo
    from .training.trainer import write_summary

    train = plan.train
    wants_export = train.export and hasattr(strategy, "export")
    wants_real = train.real_eval_prompts > 0 and hasattr(strategy, "speculate")
    if not (wants_export or wants_real):
        return summary
    state = model_state(trainer.model, info)  # a collective under FSDP2: every rank takes part
    if not info.is_main:
        return summary
    model = strategy.build_model(source.target, source.frozen_parts(), source.stats())
    load_model_state(model, state, DistInfo())
    extra: dict[str, Any] = {"tau_sim": summary.get("final_eval", {}).get("eval/tau_sim"),
                             "tau_sim_convention": TAU_SIM_CONVENTION}
    if wants_export:
        extra["export"] = str(export_model(strategy, model, source.target, Path(plan.output) / "export"))
    if wants_real:
        engine, reason = _eval_engine(plan, source, context)
        eval_path = data_paths(plan, engine)[1] if engine is not None else None
        if engine is not None and eval_path is None:
            reason = "no held-out prompts: pass --set data.eval_path=FILE"
        if reason is None:
            prompts = prompts_from_jsonl(eval_path, engine.tokenizer, limit=train.real_eval_prompts)
            result = measure_acceptance(strategy, model, engine, prompts,
                                        max_new_tokens=train.real_eval_max_new_tokens)
            extra["tau_real"] = result["tau_real"]
            extra["real_eval"] = {k: v for k, v in result.items() if k != "per_prompt"}
        else:
            extra["tau_real"] = None
            extra["real_eval"] = {"skipped": reason}
    summary.update(extra)
    write_summary(plan.output, summary)
    return summary
