"""Capture helpers every topology shares: tokenized conversations into stored features.

Used by ``specforge capture`` (offline: the disk store of a features directory), by the
online colocated topology (a producer thread putting into the memory store) and by a
stream's producer. The strategy's capture plan decides which layers and features are
captured; ``input_ids`` and ``loss_mask`` come from data preparation and are stored next
to the engine's tensors. Nothing here knows which topology it serves: the epoch order, the
id of a sample's training event and the loaders over a store are the same for all.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..contracts import SampleRef
from ..data.loader import FeatureDataLoader
from ..dtypes import torch_dtype
from ..errors import SpecforgeError
from ..protocols import BuildContext, CapturePlan


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def capture_batch(engine: Any, plan: CapturePlan, samples: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
    """Capture one batch of :class:`~specforge_core.data.prepare.TokenizedSample` s.

    Returns one dict per sample with the plan's features, unpadded: the engine's hidden
    states plus ``input_ids`` / ``loss_mask`` in the dtypes the plan declares.
    """
    inputs = [{"input_ids": torch.tensor(s.input_ids, dtype=torch.long)} for s in samples]
    captured = engine.capture(inputs, plan)
    out = []
    for sample, features in zip(samples, captured):
        row = {name: features[name] for name in plan.features if name in features and name not in
               ("input_ids", "loss_mask")}
        for name, values in (("input_ids", sample.input_ids), ("loss_mask", sample.loss_mask)):
            if name in plan.features:
                row[name] = torch.tensor(values, dtype=torch_dtype(plan.features[name].dtype))
        missing = sorted(set(plan.features) - set(row))
        if missing:
            raise ValueError(f"the target engine returned no {missing} for the capture plan; it returned "
                             f"{sorted(features)}")
        out.append(row)
    return out


def capture_into(store: Any, engine: Any, plan: CapturePlan, samples: Iterable[Any], *, batch_size: int,
                 split: str, strategy: str, skip: set[str] | None = None, progress: Any = None,
                 stop: Any = None) -> Iterator[SampleRef]:
    """Capture ``samples`` batch by batch into ``store``; yields the refs as they are stored.

    Samples whose id is in ``skip`` (already captured: a resumed capture) are not run again.
    ``stop`` (a threading.Event) ends the loop early between batches.
    """
    def todo() -> Iterator[Any]:
        for sample in samples:
            if skip and sample.sample_id in skip:
                if progress is not None:  # captured before: counted, not run again
                    progress.update(1)
                continue
            yield sample

    for batch in _batched(todo(), batch_size):
        if stop is not None and stop.is_set():
            return
        for sample, features in zip(batch, capture_batch(engine, plan, batch)):
            meta = {"split": split, "source": sample.source, "num_tokens": len(sample.input_ids),
                    "supervised_tokens": int(sum(sample.loss_mask)), "strategy": strategy}
            yield store.put(sample.sample_id, features, meta)
        if progress is not None:
            progress.update(len(batch))


def supervised_token_counts(pairs: Iterable[tuple[Any, Any]], vocab_size: int) -> torch.Tensor:
    """How often each token id is supervised: ``pairs`` yields ``(input_ids, loss_mask)``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in pairs:
        ids = torch.as_tensor(ids, dtype=torch.long)
        mask = torch.as_tensor(mask).bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def capture_components(plan: Any, *, role: str) -> tuple[Any, Any, Any, Any, CapturePlan]:
    """(build context, strategy, target engine, target info, capture plan) of a capturing command."""
    from ..components import build_component

    context = BuildContext(run_id=plan.run_id, output_dir=plan.output, role=role)
    strategy = build_component(plan, "strategy", context)
    engine = build_component(plan, "target_engine", context)
    target = engine.info()
    return context, strategy, engine, target, strategy.capture_plan(target)


def capture_batch_size(plan: Any) -> int:
    """Sequences per target forward: the engine's own option when it has one."""
    return int(getattr(plan["target_engine"].options, "capture_batch_size", 8))


def prepared_samples(plan: Any, engine: Any, *, echo: bool = True) -> tuple[list[Any], list[Any], Any, Any]:
    """(train samples, eval samples, the train rows' preparation report, the
    :class:`~specforge_core.data.split.DataFiles`) for a capturing run.

    The eval samples are the eval file's, or the training file's held-out rows (see
    :mod:`specforge_core.data.split`). With ``echo``, says on stderr what was read.
    """
    from ..data.prepare import prepare_file
    from ..data.split import resolve_data_files

    files = resolve_data_files(plan, engine)
    options = dict(max_length=plan.data.max_length, last_turn_only=plan.data.last_turn_only, strict=plan.data.strict)
    samples, report = prepare_file(files.train_path, engine.tokenizer, keep_line=files.is_train_line, **options)
    report_split("train", files, report, echo=echo)
    if plan.data.max_samples:
        samples = samples[: plan.data.max_samples]
    eval_samples: list[Any] = []
    if files.eval_path is not None:
        eval_samples, eval_report = prepare_file(files.eval_path, engine.tokenizer, keep_line=files.is_eval_line,
                                                 **options)
        report_split("eval", files, eval_report, echo=echo)
    return samples, eval_samples, report, files


def report_split(split: str, files: Any, report: Any, *, echo: bool = True) -> None:
    """Say what a split's file gave (with ``echo``, on stderr) and refuse a split without a usable sample.

    An eval file the user named must give one; a held-out share may come out empty (the run
    then says it has nothing to evaluate).
    """
    import sys

    path = files.train_path if split == "train" else files.eval_path
    if echo:
        hint = ("\n  skipped rows are not trained: fix or remove them, or set data.strict=true to stop at the first "
                "bad row") if report.skipped and report.kept else ""
        print(f"{split} data {path}: {report.summary()}{hint}", file=sys.stderr, flush=True)
    if report.kept == 0 and (split == "train" or not files.holdout):
        what = "training sample" if split == "train" else "sample for the eval split"
        raise SpecforgeError(f"{path} gave no usable {what}: {report.summary()}")


def stored_eval_note(features: str, eval_refs: list[Any]) -> str:
    """What a features directory's eval split is, for logs and ``summary.json``."""
    if eval_refs:
        return f"eval split: the {len(eval_refs)} eval samples of {features}"
    return (f"no eval split: {features} holds no eval samples (capture with --eval-data FILE, or keep "
            "data.eval_holdout above 0)")


def stored_token_rows(store: Any, refs: list[Any], limit: int) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of the first ``limit`` of ``refs`` as lists (the real check's prompts)."""
    rows = []
    for ref in refs[:limit]:
        tensors = store.get(ref, ["input_ids", "loss_mask"])
        rows.append((tensors["input_ids"].tolist(), tensors["loss_mask"].tolist()))
    return rows


def stream_sample_id(sample: Any, epoch: int, attempt: int = 1) -> str:
    """The id of one sample's training event: one sample seen in two epochs is two events.

    A producer pool captures a position again when the first claim on it expired
    (``attempt`` 2, 3, ...); that capture gets an id of its own, so its object can never
    replace the one a slow first capture may still have stored (a store re-put of one id
    supersedes the older object).
    """
    event = f"{sample.sample_id}@e{epoch}"
    return event if attempt == 1 else f"{event}#{attempt}"


def put_captured(store: Any, samples: list[Any], captured: list[dict[str, Any]], *, epoch: int,
                 strategy: str, attempt: int = 1) -> list[Any]:
    """Put one captured batch of training samples of ``epoch``; their refs, in order."""
    refs = []
    for sample, features in zip(samples, captured):
        meta = {"split": "train", "source": sample.source, "num_tokens": len(sample.input_ids), "epoch": epoch,
                "strategy": strategy}
        refs.append(store.put(stream_sample_id(sample, epoch, attempt), features, meta))
    return refs


def epoch_order(n: int, epoch: int, seed: int, rank: int = 0, world_size: int = 1, equal: bool = True) -> list[int]:
    """This rank's sample indices for an epoch: the same split rule as the fixed-refs loader."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    end = (n // world_size) * world_size if equal else n
    return order[rank:end:world_size]


def stream_loader(store: Any, channel: Any, collate: Callable, batch_size: int) -> FeatureDataLoader:
    """Training batches from a ref channel; samples are released when the trainer completes them."""
    return FeatureDataLoader(store, collate, channel=channel, batch_size=batch_size, release="on_complete",
                             poll_timeout_s=0.5)


def eval_loader(store: Any, refs: list[Any], collate: Callable, batch_size: int, rank: int,
                world_size: int) -> FeatureDataLoader:
    """This rank's share of fixed eval refs, in order, every sample (no short-batch drop), never released."""
    return FeatureDataLoader(store, collate, refs=refs, batch_size=batch_size, shuffle=False, drop_last=False,
                             rank=rank, world_size=world_size, equal_shares=False, release="never")
