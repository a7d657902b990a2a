"""The offline topology: capture once into a features directory, train from it many times.

``specforge capture`` (:func:`run_capture`) writes a features directory (see
:mod:`specforge_core.features`): the disk store of every captured sample, its manifest, the
frozen target parts and the supervised token counts. ``specforge run --features DIR``
trains from it through :class:`OfflineSource`: a fixed list of refs, shuffled per epoch and
resumed by seek, with no target model loaded.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ..config import RunPlan
from ..contracts import SampleRef
from ..data.loader import FeatureDataLoader
from ..errors import SpecforgeError
from ..protocols import BuildContext
from .capture import (capture_components, capture_into, eval_loader, report_split, stored_eval_note,
                      stored_token_rows, supervised_token_counts)


def verify_checksums(plan: RunPlan) -> bool:
    """The run's ``feature_store.verify_checksums`` (a features directory is always read through its disk store)."""
    return bool(getattr(plan["feature_store"].options, "verify_checksums", False))


class OfflineSource:
    """Samples from a features directory (``--features DIR``)."""

    streaming = False

    def __init__(self, plan: RunPlan, strategy: Any, context: BuildContext) -> None:
        from ..features import FeatureSet

        self.features = FeatureSet.open(plan.features)
        self.target = self.features.target
        self.features.check_plan(strategy.capture_plan(self.target), plan["strategy"].spec.name)
        self.store = self.features.open_store(context, verify_checksums=verify_checksums(plan))
        splits, self.data_report = self.features.listed_refs(self.store, missing=plan.data.missing_samples)
        self.refs, self.eval_refs = splits["train"], splits["eval"]
        if not self.refs:
            raise SpecforgeError(f"{plan.features} holds no training samples; capture some with `specforge capture "
                                 f"--output {plan.features}`")
        self.fingerprint = self.features.fingerprint
        self.ack = None
        self.eval_note = stored_eval_note(plan.features, self.eval_refs)

    def frozen_parts(self) -> dict[str, Any]:
        return self.features.frozen_parts()

    def stats(self) -> Any:
        return self.features.stats()

    def train_loader(self, collate: Callable, *, batch_size: int, seed: int, rank: int, world_size: int) -> Any:
        return FeatureDataLoader(self.store, collate, refs=self.refs, batch_size=batch_size, shuffle=True, seed=seed,
                                 drop_last=True, rank=rank, world_size=world_size)

    def samples_per_rank(self, world_size: int) -> int:
        return len(self.refs) // world_size

    def sample_keys(self) -> list[str]:
        """What identifies each training sample, in the loader's order (for the resume contract): its id (a
        capture's names the data file and line and hashes the tokens) and its features' shapes."""
        return [ref.sample_id + "".join(f" {name}={'x'.join(map(str, spec.shape))}"
                                        for name, spec in sorted(ref.features.items())) for ref in self.refs]

    def eval_loader_factory(self, collate: Callable, *, batch_size: int, rank: int, world_size: int) -> Any:
        if not self.eval_refs:
            return None
        return lambda: eval_loader(self.store, self.eval_refs, collate, batch_size, rank, world_size)

    def eval_token_rows(self, limit: int) -> list[tuple[list[int], list[int]]]:
        """``(input_ids, loss_mask)`` of the first ``limit`` eval samples (the real acceptance check's prompts)."""
        return stored_token_rows(self.store, self.eval_refs, limit)

    def start(self, skip_samples: int = 0, global_step: int = 0) -> None:
        """Nothing to start: the loader seeks by itself on resume."""

    def close(self) -> None:
        self.store.close()


def _store_bytes(path: Any) -> int:
    """The bytes of a disk store's sample files and packs."""
    from pathlib import Path

    return sum(p.stat().st_size for pattern in ("*.safetensors", "packs/pack-*.data") for p in Path(path).rglob(pattern))


def _pack(store: Any) -> dict[str, int]:
    """Pack the store's sample files (:meth:`DiskFeatureStore.pack`), with a progress bar."""
    from tqdm import tqdm

    bar: list[Any] = []  # made at the first file: no bar when there is nothing to pack

    def advance(nbytes: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(desc="pack features", total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            dynamic_ncols=True, mininterval=0.5))
        bar[0].update(nbytes)

    try:
        return store.pack(progress=advance)
    finally:
        if bar:
            bar[0].close()


def _noting(samples: Any, seen: set[str]) -> Any:
    """``samples`` as they are, each one's id added to ``seen`` as it passes."""
    for sample in samples:
        seen.add(sample.sample_id)
        yield sample


def run_capture(plan: Any, manager: Any, *, batch_size: int = 8, pack: bool = True) -> dict[str, Any]:
    """``specforge capture``: write a features directory for ``plan``'s strategy; resumable. With ``pack``, the
    sample files are moved into packs at the end (:meth:`~specforge_core.feature_stores.disk.DiskFeatureStore.pack`):
    faster to read, epoch after epoch."""
    from tqdm import tqdm

    from ..data.prepare import PrepareReport, iter_samples
    from ..data.split import resolve_data_files
    from ..features import STORE_DIR, create_feature_set, finish_feature_set, save_token_counts
    from ..heap import keep_heap
    from ..options import options_to_dict
    from ..threads import apply_threads

    apply_threads(plan.train.threads)
    keep_heap(plan.train.keep_heap)
    from ..run_directory import check_writable

    check_writable(plan.output, "features directory")
    context, strategy, engine, target, capture_plan = capture_components(plan, role="offline")
    files = resolve_data_files(plan, engine)
    splits = [(split, path, keep) for split, path, keep in (("train", files.train_path, files.is_train_line),
                                                           ("eval", files.eval_path, files.is_eval_line)) if path]
    options = dict(max_length=plan.data.max_length, last_turn_only=plan.data.last_turn_only, strict=plan.data.strict)
    # A first pass tokenizes without capturing: the data report comes first, and a bad split is
    # refused before anything is written.
    usable: dict[str, int] = {}  # what each split will capture: the progress bars' totals
    for split, path, keep in splits:
        report = PrepareReport()
        for _ in iter_samples(path, engine.tokenizer, keep_line=keep, report=report, **options):
            pass
        report_split(split, files, report)
        usable[split] = report.kept
        if split == "train" and plan.data.max_samples and plan.data.max_samples < report.kept:
            usable[split] = plan.data.max_samples
            print(f"train: the first {plan.data.max_samples} of these are captured (data.max_samples)",
                  file=sys.stderr, flush=True)
    name = plan["strategy"].spec.name
    root, store = create_feature_set(plan.output, strategy=name,
                                     strategy_options=options_to_dict(plan["strategy"].options), plan=capture_plan,
                                     target=target, frozen_parts=engine.frozen_parts(), context=context)
    existing = {ref.sample_id: ref for ref in store.scan()}
    counts: dict[str, int] = {}
    by_split: dict[str, list[SampleRef]] = {}
    reports: dict[str, Any] = {}
    tokens = minimum = 0
    for split, path, keep in splits:
        report = PrepareReport()
        samples = iter_samples(path, engine.tokenizer, keep_line=keep, report=report, **options)
        if split == "train" and plan.data.max_samples:
            samples = (s for i, s in zip(range(plan.data.max_samples), samples))
        seen: set[str] = set()  # this run's samples of the split: a sample stored by an earlier capture of other
        samples = _noting(samples, seen)  # data or options is not one of them, and is not listed
        with tqdm(desc=f"capture {split}", total=usable[split], unit="sample", dynamic_ncols=True,
                  mininterval=0.5) as progress:
            fresh = list(capture_into(store, engine, capture_plan, samples, batch_size=batch_size, split=split,
                                      strategy=name, skip=set(existing), progress=progress))
        refs = fresh + [r for r in existing.values() if r.meta.get("split") == split and r.sample_id in seen]
        counts[split] = len(refs)
        by_split[split] = refs
        reports[split] = {"new": len(fresh), "reused": len(refs) - len(fresh), "summary": report.summary(),
                          "skipped": dict(report.skipped)}
        tokens += sum(r.num_tokens for r in refs)
        minimum += sum(r.nbytes for r in refs)  # the tensors' bytes: no padding, no container
    if {"input_ids", "loss_mask"} <= set(capture_plan.features):
        pairs = ((f["input_ids"], f["loss_mask"]) for f in
                 (store.get(r, ["input_ids", "loss_mask"]) for r in by_split.get("train", [])))
        save_token_counts(root, supervised_token_counts(pairs, target.vocab_size))
    packed = _pack(store) if pack else None
    stored = _store_bytes(root / STORE_DIR)
    result = {
        "output": str(root), "strategy": name, "samples": counts, "tokens": tokens, "bytes": stored,
        "bytes_per_token": stored / tokens if tokens else 0.0,
        "ratio_to_unpadded_minimum": stored / minimum if minimum else 0.0, "data": reports,
        "eval_split": files.eval_note, "packed": packed,
    }
    finish_feature_set(root, {split: [ref.sample_id for ref in refs] for split, refs in by_split.items()},
                       {"capture": {k: v for k, v in result.items() if k != "output"}})
    store.close()
    return result
