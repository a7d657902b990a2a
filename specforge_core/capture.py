"""Turning tokenized conversations into stored features with a target engine.

Used by ``specforge capture`` (offline: the disk store of a features directory) and by
the online colocated topology (a producer thread putting into the memory store). The
strategy's capture plan decides which layers and features are captured; ``input_ids``
and ``loss_mask`` come from data preparation and are stored next to the engine's tensors.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch

from .contracts import SampleRef
from .dtypes import torch_dtype
from .protocols import CapturePlan


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
    todo = (s for s in samples if not skip or s.sample_id not in skip)
    for batch in _batched(todo, batch_size):
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


def _store_bytes(path: Any) -> int:
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(path).rglob("*.safetensors"))


def capture_components(plan: Any, *, role: str) -> tuple[Any, Any, Any, Any, CapturePlan]:
    """(build context, strategy, target engine, target info, capture plan) of a capturing command."""
    from .protocols import BuildContext
    from .runtime import build_component

    context = BuildContext(run_id=plan.run_id, output_dir=plan.output, role=role)
    strategy = build_component(plan, "strategy", context)
    engine = build_component(plan, "target_engine", context)
    target = engine.info()
    return context, strategy, engine, target, strategy.capture_plan(target)


def run_capture(plan: Any, manager: Any, *, batch_size: int = 8) -> dict[str, Any]:
    """``specforge capture``: write a features directory for ``plan``'s strategy; resumable."""
    from tqdm import tqdm

    from .data.prepare import PrepareReport, iter_samples
    from .data.split import resolve_data_files
    from .features import STORE_DIR, create_feature_set, finish_feature_set, save_token_counts
    from .options import options_to_dict
    from .threads import apply_threads

    apply_threads(plan.train.threads)
    context, strategy, engine, target, capture_plan = capture_components(plan, role="offline")
    files = resolve_data_files(plan, engine)
    name = plan["strategy"].spec.name
    root, store = create_feature_set(plan.output, strategy=name,
                                     strategy_options=options_to_dict(plan["strategy"].options), plan=capture_plan,
                                     target=target, frozen_parts=engine.frozen_parts(), context=context)
    existing = {ref.sample_id: ref for ref in store.scan()}
    counts: dict[str, int] = {}
    by_split: dict[str, list[SampleRef]] = {}
    reports: dict[str, Any] = {}
    tokens = minimum = 0
    for split, path, keep in (("train", files.train_path, files.is_train_line),
                              ("eval", files.eval_path, files.is_eval_line)):
        if path is None:
            continue
        report = PrepareReport()
        samples = iter_samples(path, engine.tokenizer, max_length=plan.data.max_length, keep_line=keep,
                               last_turn_only=plan.data.last_turn_only, strict=plan.data.strict, report=report)
        if split == "train" and plan.data.max_samples:
            samples = (s for i, s in zip(range(plan.data.max_samples), samples))
        with tqdm(desc=f"capture {split}", unit="sample", dynamic_ncols=True, mininterval=0.5) as progress:
            fresh = list(capture_into(store, engine, capture_plan, samples, batch_size=batch_size, split=split,
                                      strategy=name, skip=set(existing), progress=progress))
        refs = fresh + [r for r in existing.values() if r.meta.get("split") == split]
        counts[split] = len(refs)
        by_split[split] = refs
        reports[split] = {"new": len(fresh), "reused": len(refs) - len(fresh), "summary": report.summary(),
                          "skipped": dict(report.skipped)}
        tokens += sum(r.num_tokens for r in refs)
        minimum += sum(r.nbytes for r in refs)  # the tensors' bytes: no padding, no container
    stored = _store_bytes(root / STORE_DIR)
    if {"input_ids", "loss_mask"} <= set(capture_plan.features):
        pairs = ((f["input_ids"], f["loss_mask"]) for f in
                 (store.get(r, ["input_ids", "loss_mask"]) for r in by_split.get("train", [])))
        save_token_counts(root, supervised_token_counts(pairs, target.vocab_size))
    result = {
        "output": str(root), "strategy": name, "samples": counts, "tokens": tokens, "bytes": stored,
        "bytes_per_token": stored / tokens if tokens else 0.0,
        "ratio_to_unpadded_minimum": stored / minimum if minimum else 0.0, "data": reports,
        "eval_split": files.eval_note,
    }
    finish_feature_set(root, counts, {"capture": {k: v for k, v in result.items() if k != "output"}})
    store.close()
    return result
