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

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .components import build_component
from .config import RunPlan, data_contract, engine_train_suggestions, with_suggested_train_options
from .errors import SpecforgeError
from .options import options_to_dict
from .plugins import PluginManager
from .preflight import check_strategy
from .protocols import BuildContext


class RunError(SpecforgeError):
    """A run cannot be assembled from the plan."""


def run_contract(plan: RunPlan, world_size: int, total_steps: int, target_fingerprint: str,
                 layer_ids: Any = (), sample_keys: Sequence[str] | None = None) -> dict[str, Any]:
    """What a resume must match; each key is named in the refusal message. ``layer_ids`` are the target
    layers the draft is trained on (resolved from the options and the target), which an export repeats.
    ``seed`` orders the epochs; ``data``, in a run that reads its data itself (not from captured features or a
    stream, which carry their own identity), says which rows train and how: a resume with other data or another
    seed would seek to a position in another order of other samples. ``samples`` (from ``sample_keys``, what
    identifies each training sample in the loader's order, where the source knows them all up front) catches
    what the options cannot: a data file edited in place, features captured again into the same directory."""
    contract = {
        "strategy": plan["strategy"].spec.name,
        "strategy_options": options_to_dict(plan["strategy"].options),
        "layer_ids": [int(i) for i in layer_ids],
        "world_size": world_size,
        "batch_size": plan.train.batch_size,
        "accumulation_steps": plan.train.accumulation_steps,
        "total_steps": total_steps,
        "target": target_fingerprint,
        "seed": plan.train.seed,
    }
    if plan.features is None:
        contract["data"] = data_contract(plan.data)
    if sample_keys is not None:
        contract["samples"] = samples_fingerprint(sample_keys)
    return contract


def samples_fingerprint(keys: Sequence[str]) -> dict[str, Any]:
    """``{"count", "digest"}`` of an ordered list of sample keys: the resume contract's ``samples``."""
    digest = hashlib.blake2b(digest_size=16)
    for key in keys:
        digest.update(key.encode())
        digest.update(b"\n")
    return {"count": len(keys), "digest": digest.hexdigest()}


def train_suggestions(plan: RunPlan, record: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``train`` defaults a run takes from its target engine; None while they cannot be known yet.

    The one resolution ``--dry-run`` and the run share: an online run (and a producer, which
    records them in its stream) asks its engine's spec (no model is loaded), a consumer takes
    what its producer recorded (None before a producer started a stream), an offline run has
    no engine and takes none.
    """
    if plan.role == "consumer":
        from .topologies.stream.record import read_stream_record

        if record is None and plan.features is not None:  # a networked stream's record is read by its source
            record = read_stream_record(str(plan.features))
        return None if record is None else dict(record.get("suggested_train_options", {}))
    if plan.features and plan.role is None:
        return {}
    return engine_train_suggestions(plan)  # a producer records these in its stream


def plan_as_run(plan: RunPlan, record: dict[str, Any] | None = None) -> tuple[RunPlan, dict[str, Any] | None]:
    """(the plan with the engine's suggestions applied where the user set nothing, what was applied);
    a consumer's come from its stream ``record`` when given."""
    suggested = train_suggestions(plan, record)
    if suggested is None:
        return plan, None
    return with_suggested_train_options(plan, suggested)


def execute(plan: RunPlan, manager: PluginManager, *, resume: str | None = None,
            overwrite: bool = False) -> dict[str, Any]:
    """Train according to ``plan``; returns the summary (also written to ``summary.json``).

    Every check comes before the first write into the output directory: the output guard
    (:func:`~specforge_core.run_directory.check_output`) before anything is built, then the
    sources' own checks, then a resume's contract. ``overwrite`` moves a previous run aside
    right after the guard.
    """
    import torch

    from .run_directory import check_output, move_aside
    from .topologies.colocated import OnlineSource
    from .topologies.offline import OfflineSource
    from .topologies.stream.consumer import StreamSource
    from .training.distributed import barrier, check_same_everywhere, init_distributed, shutdown
    from .training.evaluator import Evaluator
    from .training.trainer import Trainer

    from .heap import keep_heap
    from .nn import recompute_mlps
    from .threads import apply_threads

    train = plan.train
    info = init_distributed(train.device)
    apply_threads(train.threads, quiet=not info.is_main)
    heap = keep_heap(train.keep_heap)
    source: Any = None
    try:
        check_same_everywhere("the installed plugin set", manager.plugin_set(), info)
        if plan.role not in (None, "consumer"):
            raise RunError(f"a {plan.role} does not train; run it with `specforge run --role {plan.role}`")
        check_output(plan.output, resume=resume, overwrite=overwrite)  # reads only, on every rank
        if resume:
            check_resume(plan, resume, info.world_size)
        if overwrite and info.is_main:
            moved = move_aside(plan.output)
            if moved is not None:
                print(f"moved the previous run in {plan.output} aside to {moved}", file=sys.stderr, flush=True)
        barrier(info)  # no rank builds into the output directory while rank 0 may still be moving it
        topology = _topology(plan)
        role = plan.role or ("offline" if plan.features else "colocated")
        context = BuildContext(run_id=plan.run_id, output_dir=plan.output, rank=info.rank,
                               world_size=info.world_size, role=role)
        strategy = build_component(plan, "strategy", context)
        check_strategy(strategy, plan["strategy"].spec)  # before the target engine or any feature loads
        if plan.role == "consumer":
            source = StreamSource(plan, strategy, context, sync=lambda: barrier(info))
        elif plan.features:
            source = OfflineSource(plan, strategy, context)
        else:
            # Capture may run this many samples ahead of the optimizer (bounded memory).
            window = 4 * train.batch_size * train.accumulation_steps
            source = OnlineSource(plan, strategy, context, build=lambda kind: build_component(plan, kind, context),
                                  window=window)
        if info.is_main and getattr(source, "data_report", None):
            print(source.data_report, flush=True)
        plan, applied = plan_as_run(plan, getattr(source, "record", None))
        train = plan.train
        torch.manual_seed(train.seed)
        model = strategy.build_model(source.target, source.frozen_parts(), source.stats())
        recomputed = recompute_mlps(model) if train.recompute_mlp else 0
        if train.recompute_mlp and info.is_main:
            said = (f"{recomputed} gated MLP(s) recompute their projections in backward" if recomputed else
                    "the draft has no gated MLP (specforge_core.nn.SwiGLU); nothing is recomputed")
            print(f"train.recompute_mlp: {said}", file=sys.stderr, flush=True)
        plan = with_resolved_strategy_options(plan, strategy)
        loader = source.train_loader(strategy.collate, batch_size=train.batch_size, seed=train.seed,
                                     rank=info.rank, world_size=info.world_size)
        batches_per_epoch = source.samples_per_rank(info.world_size) // train.batch_size
        if batches_per_epoch == 0:
            raise RunError(f"{source.samples_per_rank(info.world_size)} training samples per rank make no full "
                           f"batch of {train.batch_size} on {info.world_size} rank(s); lower train.batch_size")
        epoch_steps = max(1, train.epochs * batches_per_epoch // train.accumulation_steps)  # what the data holds
        total_steps = train.max_steps or epoch_steps
        make_eval = source.eval_loader_factory(strategy.collate, batch_size=train.batch_size, rank=info.rank,
                                               world_size=info.world_size)
        evaluator = Evaluator(strategy, make_eval, info) if make_eval else None
        spec = plan["strategy"].spec
        # Without an eval split the best checkpoint is the one of the lowest training loss: the
        # strategy's eval metric does not exist then.
        best_metric, best_mode = (spec.best_metric, spec.best_mode) if evaluator else ("loss", "min")
        eval_note = getattr(source, "eval_note", "") or ("eval split: yes" if evaluator else "no eval split")
        if info.is_main:
            print(eval_note, file=sys.stderr, flush=True)
        summary_extra = {"plugins": manager.plugin_list(), "config": plan.to_dict(), "world_size": info.world_size,
                         "topology": topology, "eval_split": eval_note, "heap": heap, "recomputed_mlps": recomputed,
                         "train_options_suggested_by_engine": applied or {}}
        trainer = Trainer(strategy=strategy, model=model, loader=loader, train=train, info=info,
                          output_dir=plan.output, run_id=plan.run_id, total_steps=total_steps,
                          contract=run_contract(plan, info.world_size, total_steps, source.fingerprint,
                                                strategy.capture_plan(source.target).layer_ids,
                                                source.sample_keys()),
                          hooks=manager.hook, ack=source.ack, evaluator=evaluator, best_metric=best_metric,
                          best_mode=best_mode, summary_extra=summary_extra,
                          on_checkpoint=getattr(source, "checkpointed", None))
        if resume:
            trainer.resume(resume)  # refuses a changed contract before anything is written
            finished = _finished_summary(plan, trainer.state.global_step, total_steps)
            if finished is not None and "accept_len_convention" in finished:  # nothing to do: its files stay
                if info.is_main:
                    print(f"the run in {plan.output} already finished: step {trainer.state.global_step} of "
                          f"{total_steps}; nothing trained, nothing written. To train longer, raise "
                          "train.max_steps" + ("" if plan.role == "consumer" else " (and train.epochs to match)"),
                          file=sys.stderr, flush=True)
                return finished
            if finished is not None:  # trained to the end, but stopped in its export or acceptance check
                if info.is_main:
                    print(f"the run in {plan.output} trained to step {trainer.state.global_step} but stopped before "
                          "its export and acceptance check finished; doing them now", file=sys.stderr, flush=True)
                summary = finalize(plan, strategy, trainer, source, info, context, finished)
                if info.is_main:
                    manager.hook.specforge_run_finished(run_id=plan.run_id, output_dir=str(plan.output),
                                                        summary=summary)
                barrier(info)
                return summary
        if plan.role != "consumer" and info.is_main:  # a consumer's stream ends where its producer says
            _warn_short_epochs(train, batches_per_epoch, epoch_steps, total_steps, trainer.state.global_step)
        if info.is_main:
            _warn_long_warmup(train, total_steps, trainer.state.global_step, applied or {})
        source.start(skip_samples=trainer.state.batch_in_epoch * train.batch_size,
                     global_step=trainer.state.global_step)
        if info.is_main:  # every check passed: from here on the run writes into its directory
            from .export import write_run_file

            write_run_file(plan.output, plan, source.target)
        manager.hook.specforge_run_started(run_id=plan.run_id, output_dir=str(Path(plan.output)),
                                           config=plan.to_dict())
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


def check_resume(plan: RunPlan, resume: str, world_size: int) -> Path:
    """The checkpoint ``--resume`` names, after the checks that need nothing built: it exists and is complete,
    and the settings its contract records that the plan states as they are (strategy, batch, accumulation,
    seed, ranks) are unchanged. The rest of the contract is checked once the run has built its data."""
    from .training.checkpoint import check_contract, resume_checkpoint

    path = resume_checkpoint(plan.output, resume)
    try:
        saved = json.loads((path / "trainer_state.json").read_text())["contract"]
    except (OSError, ValueError, KeyError, TypeError):
        return path  # the full check, once the run is built, says what is wrong with it
    current = {"strategy": plan["strategy"].spec.name, "world_size": world_size,
               "batch_size": plan.train.batch_size, "accumulation_steps": plan.train.accumulation_steps,
               "seed": plan.train.seed}
    # the strategy's options as given; one left unset (None) may be fixed from the data when the model is built
    given = json.loads(json.dumps({key: value for key, value in options_to_dict(plan["strategy"].options).items()
                                   if value is not None}))
    if isinstance(saved.get("strategy_options"), dict):
        current["strategy_options"] = given
        saved = {**saved, "strategy_options": {key: saved["strategy_options"].get(key) for key in given}}
    for keys in (("strategy",), tuple(current)):  # another strategy is said first: the rest follows from it
        check_contract({key: saved[key] for key in keys if key in saved},
                       {key: current[key] for key in keys if key in saved}, path)
    return path


def _finished_summary(plan: RunPlan, global_step: int, total_steps: int) -> dict[str, Any] | None:
    """The summary of a run that a resume finds finished (at its planned steps, its summary written for that
    step), else None: a run whose last checkpoint was saved but whose summary was not (a crash between the
    two) is finished again instead."""
    if global_step < total_steps:
        return None
    try:
        summary = json.loads((Path(plan.output) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("steps") == global_step else None


def _warn_short_epochs(train: Any, batches_per_epoch: int, steps_in_epochs: int, total_steps: int,
                       global_step: int) -> None:
    """Say up front when the data's ``train.epochs`` passes (``steps_in_epochs`` optimizer steps) end before
    ``train.max_steps``: the run stops there."""
    if global_step < steps_in_epochs < total_steps:
        needed = -(-total_steps * train.accumulation_steps // batches_per_epoch)
        print(f"train.max_steps is {total_steps}, but train.epochs={train.epochs} pass(es) over the data hold "
              f"{steps_in_epochs} optimizer steps: the run will stop at step {steps_in_epochs}. Set "
              f"train.epochs={needed} to reach max_steps.", file=sys.stderr, flush=True)


def _warn_long_warmup(train: Any, total_steps: int, global_step: int, applied: dict[str, Any]) -> None:
    """Say up front when the warmup is longer than the run: the learning rate never reaches ``train.lr``."""
    from .training.optim import lr_factor, warmup_steps

    warmup = warmup_steps(train, total_steps)
    if global_step < total_steps < warmup:
        source = " (the target engine's suggestion)" if "warmup_steps" in applied else ""
        last = lr_factor(total_steps - 1, train, total_steps) * train.lr
        print(f"note: the warmup is {warmup} steps{source} but the run has {total_steps}: the learning rate rises "
              f"all run and ends at {last:.3g}, not train.lr {train.lr:g}. Set train.warmup_steps below "
              f"{total_steps} to reach it.", file=sys.stderr, flush=True)


def with_resolved_strategy_options(plan: RunPlan, strategy: Any) -> RunPlan:
    """The plan with the options the strategy resolved from the data while building its model (e.g.
    EAGLE3's data-sized draft vocabulary), so that run.json, the resume contract and a later export
    rebuild exactly this draft."""
    import attrs

    resolved = getattr(strategy, "options", None)
    if resolved is None or resolved == plan["strategy"].options:
        return plan
    component = attrs.evolve(plan["strategy"], options=resolved)
    return attrs.evolve(plan, components={**plan.components, "strategy": component})


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
                      "--target-model PATH to measure accept_len_real")
    return engine, None


def finalize(plan: RunPlan, strategy: Any, trainer: Any, source: Any, info: Any, context: BuildContext,
             summary: dict[str, Any]) -> dict[str, Any]:
    """Export the final draft and measure its real acceptance and speedup; adds both to ``summary.json``.

    The summary names every acceptance figure in one vocabulary (bonus token included):
    ``accept_len_sim`` (greedy decoding replayed on the eval split) and ``accept_len_real``
    (the draft really decoding held-out prompts); ``tau_sim`` / ``tau_real`` are the former
    names. When an export was written, the draft measured is the export itself, read back as
    `specforge eval` reads it (its weights in the served dtype), so the summary describes the
    folder that gets served; otherwise the trained weights are measured as they are.
    """
    from .acceptance import ACCEPT_LEN_CONVENTION
    from .dtypes import dtype_name
    from .export import export_model
    from .speculative import TAU_SIM_CONVENTION, measure_acceptance, prompts_from_token_rows
    from .training.checkpoint import load_model_state, model_state
    from .training.distributed import DistInfo
    from .training.trainer import write_summary

    train = plan.train
    spec = plan["strategy"].spec
    final_eval = summary.get("final_eval", {})
    summary.update({"accept_len_sim": final_eval.get("eval/accept_len_sim"),
                    "accept_len_convention": ACCEPT_LEN_CONVENTION,
                    "tau_sim": final_eval.get("eval/tau_sim"), "tau_sim_convention": TAU_SIM_CONVENTION})
    wants_export = train.export and bool(spec.export_formats) and hasattr(strategy, "export")
    wants_real = train.real_eval_prompts > 0 and hasattr(strategy, "speculate")
    if not (wants_export or wants_real):
        if info.is_main:
            write_summary(plan.output, summary)
        return summary
    state = model_state(trainer.model, info)  # a collective under FSDP2: every rank takes part
    if not info.is_main:
        return summary
    model = strategy.build_model(source.target, source.frozen_parts(), source.stats())
    load_model_state(model, state, DistInfo())
    extra: dict[str, Any] = {}
    measured, draft = model, f"the trained weights ({dtype_name(next(model.parameters()).dtype)})"
    if wants_export:
        from .export import ExportError

        try:
            out = export_model(strategy, model, source.target, Path(plan.output) / "export", spec=spec,
                               dtype=train.export_dtype)
        except ExportError as exc:  # the trained checkpoints stand; only the serving folder is missing
            print(f"warning: no export written: {exc}", file=sys.stderr, flush=True)
            extra["export"] = {"skipped": str(exc)}
        else:
            extra["export"] = str(out)
            extra["export_format"] = {"format": spec.export_formats[0], "dtype": train.export_dtype}
            if wants_real:
                measured = strategy.load_export(str(out), source.target, source.frozen_parts())
                draft = f"the export in {out.name}/ ({train.export_dtype})"
    if wants_real:
        engine, reason = _eval_engine(plan, source, context)
        prompts = prompts_from_token_rows(source.eval_token_rows(train.real_eval_prompts),
                                          limit=train.real_eval_prompts) if engine is not None else []
        if engine is not None and not prompts:
            reason = f"no held-out prompts ({getattr(source, 'eval_note', 'no eval split')})"
        if reason is None:
            result = measure_acceptance(strategy, measured, engine, prompts,
                                        max_new_tokens=train.real_eval_max_new_tokens)
            extra["accept_len_real"] = extra["tau_real"] = result["accept_len_real"]
            extra["speedup"] = result["speedup"]
            extra["real_eval"] = {**{k: v for k, v in result.items() if k != "per_prompt"}, "draft": draft}
        else:
            extra["accept_len_real"] = extra["tau_real"] = extra["speedup"] = None
            extra["real_eval"] = {"skipped": reason}
    summary.update(extra)
    write_summary(plan.output, summary)
    return summary
