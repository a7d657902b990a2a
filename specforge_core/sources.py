"""Where training samples come from: the three sources the runtime can hand the trainer.

* :class:`OfflineSource` — a features directory written by ``specforge capture``: a fixed
  list of refs in a disk store, re-iterated for many epochs.
* :class:`OnlineSource` — the online colocated topology: the target engine captures on a
  producer thread into the feature store, refs go through the control plane (commit with
  dedup, then the channel), the loader consumes them, and the trainer's ack at each
  optimizer boundary marks them durable and releases them. A bounded window of samples in
  flight keeps the memory use flat and lets capture run ahead of training.
* :class:`StreamSource` — the consumer of a disaggregated run: what a producer process
  streams into a shared features directory (see :mod:`.producer`).

All expose the same small surface: ``target``, ``frozen_parts``, ``fingerprint``,
``train_loader(...)``, ``eval_loader_factory(...)``, ``ack``, ``start(skip, global_step)``,
``close()``; the stream source adds ``suggested_train_options()``, ``checkpointed(step)``
and ``finish(step)``, which the runtime calls when present.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch

from .config import RunPlan
from .data.loader import FeatureDataLoader
from .errors import SpecforgeError
from .protocols import BuildContext


class OfflineSource:
    """Samples from a features directory (``--features DIR``)."""

    streaming = False

    def __init__(self, plan: RunPlan, strategy: Any, context: BuildContext) -> None:
        from .features import FeatureSet

        self.features = FeatureSet.open(plan.features)
        self.target = self.features.target
        self.features.check_plan(strategy.capture_plan(self.target), plan["strategy"].spec.name)
        self.store = self.features.open_store(context)
        splits = self.features.refs_by_split(self.store)
        self.refs, self.eval_refs = splits["train"], splits["eval"]
        if not self.refs:
            raise SpecforgeError(f"{plan.features} holds no training samples")
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


def stored_eval_note(features: str, eval_refs: list[Any]) -> str:
    """What a features directory's eval split is, for logs and ``summary.json``."""
    if eval_refs:
        return f"eval split: the {len(eval_refs)} eval samples of {features}"
    return (f"no eval split: {features} holds no eval samples (capture with --eval-data FILE, or keep "
            "data.eval_holdout above 0)")


def stored_token_rows(store: Any, refs: list[Any], limit: int) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of the first ``limit`` of ``refs`` as lists."""
    rows = []
    for ref in refs[:limit]:
        tensors = store.get(ref, ["input_ids", "loss_mask"])
        rows.append((tensors["input_ids"].tolist(), tensors["loss_mask"].tolist()))
    return rows


def stream_loader(store: Any, channel: Any, collate: Callable, batch_size: int) -> FeatureDataLoader:
    """Training batches from a ref channel; samples are released when the trainer completes them."""
    return FeatureDataLoader(store, collate, channel=channel, batch_size=batch_size, release="on_complete",
                             poll_timeout_s=0.5)


def eval_loader(store: Any, refs: list[Any], collate: Callable, batch_size: int, rank: int,
                world_size: int) -> FeatureDataLoader:
    """This rank's share of fixed eval refs, in order, every sample (no short-batch drop), never released."""
    return FeatureDataLoader(store, collate, refs=refs, batch_size=batch_size, shuffle=False, drop_last=False,
                             rank=rank, world_size=world_size, equal_shares=False, release="never")


def capture_batch_size(plan: RunPlan) -> int:
    """Sequences per target forward: the engine's own option when it has one."""
    return int(getattr(plan["target_engine"].options, "capture_batch_size", 8))


def prepared_samples(plan: RunPlan, engine: Any, *, echo: bool = True) -> tuple[list[Any], list[Any], Any, Any]:
    """(train samples, eval samples, the train rows' preparation report, the
    :class:`~specforge_core.data.split.DataFiles`) for a capturing run.

    The eval samples are the eval file's, or the training file's held-out rows (see
    :mod:`specforge_core.data.split`). With ``echo``, says on stderr what was read.
    """
    import sys

    from .data.prepare import PrepareReport, prepare_file
    from .data.split import resolve_data_files

    files = resolve_data_files(plan, engine)
    options = dict(max_length=plan.data.max_length, last_turn_only=plan.data.last_turn_only, strict=plan.data.strict)
    samples, report = prepare_file(files.train_path, engine.tokenizer, keep_line=files.is_train_line, **options)
    if plan.data.max_samples:
        samples = samples[: plan.data.max_samples]
    if not samples:
        raise SpecforgeError(f"{files.train_path} gave no usable training sample: {report.summary()}")
    eval_samples, eval_report = [], PrepareReport()
    if files.eval_path is not None:
        eval_samples, eval_report = prepare_file(files.eval_path, engine.tokenizer, keep_line=files.is_eval_line,
                                                 **options)
    if echo:
        print(f"train data {files.train_path}: {report.summary()}", file=sys.stderr)
        if files.eval_path is not None:
            print(f"eval data {files.eval_path}: {eval_report.summary()}", file=sys.stderr, flush=True)
    return samples, eval_samples, report, files


def stream_sample_id(sample: Any, epoch: int) -> str:
    """The id of one sample's training event: one sample seen in two epochs is two events."""
    return f"{sample.sample_id}@e{epoch}"


def put_captured(store: Any, samples: list[Any], captured: list[dict[str, Any]], *, epoch: int,
                 strategy: str) -> list[Any]:
    """Put one captured batch of training samples of ``epoch``; their refs, in order."""
    refs = []
    for sample, features in zip(samples, captured):
        meta = {"split": "train", "source": sample.source, "num_tokens": len(sample.input_ids), "epoch": epoch,
                "strategy": strategy}
        refs.append(store.put(stream_sample_id(sample, epoch), features, meta))
    return refs


def epoch_order(n: int, epoch: int, seed: int, rank: int = 0, world_size: int = 1, equal: bool = True) -> list[int]:
    """This rank's sample indices for an epoch: the same split rule as the fixed-refs loader."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    end = (n // world_size) * world_size if equal else n
    return order[rank:end:world_size]


class OnlineSource:
    """Capture on a producer thread while training (the default topology)."""

    streaming = True

    def __init__(self, plan: RunPlan, strategy: Any, context: BuildContext, *, build: Callable[[str], Any],
                 window: int) -> None:
        from .features import frozen_fingerprint

        self.plan = plan
        self.context = context
        self.engine = build("target_engine")
        self.target = self.engine.info()
        self.capture_plan = strategy.capture_plan(self.target)
        self._frozen = self.engine.frozen_parts()
        self.fingerprint = frozen_fingerprint(self._frozen)
        self.samples, self.eval_samples, self.report, files = prepared_samples(plan, self.engine,
                                                                              echo=context.rank == 0)
        self.eval_note = files.eval_note
        self.store = build("feature_store")
        self.control = build("control_plane")
        self.window = threading.BoundedSemaphore(window)
        self._window_size = window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.loader: Any = None

    def frozen_parts(self) -> dict[str, Any]:
        return self._frozen

    def stats(self) -> Any:
        from .capture import supervised_token_counts
        from .protocols import DataStats

        counts = supervised_token_counts(((s.input_ids, s.loss_mask) for s in self.samples), self.target.vocab_size)
        return DataStats(token_counts=counts, num_samples=len(self.samples))

    def samples_per_rank(self, world_size: int) -> int:
        return len(self.samples) // world_size

    def eval_token_rows(self, limit: int) -> list[tuple[list[int], list[int]]]:
        """``(input_ids, loss_mask)`` of the first ``limit`` eval samples (the real acceptance check's prompts)."""
        return [(s.input_ids, s.loss_mask) for s in self.eval_samples[:limit]]

    def train_loader(self, collate: Callable, *, batch_size: int, seed: int, rank: int, world_size: int) -> Any:
        self._seed, self._rank, self._world = seed, rank, world_size
        self.loader = stream_loader(self.store, self.control.channel, collate, batch_size)
        return self.loader

    def eval_loader_factory(self, collate: Callable, *, batch_size: int, rank: int, world_size: int) -> Any:
        """Eval samples are captured once, up front, into a retained in-memory store."""
        if not self.eval_samples:
            return None
        from .builtin import MemoryStoreOptions
        from .capture import capture_into
        from .feature_stores.memory import MemoryFeatureStore

        store = MemoryFeatureStore(MemoryStoreOptions(consume_once=False), self.context)
        mine = [self.eval_samples[i] for i in range(rank, len(self.eval_samples), world_size)]
        refs = list(capture_into(store, self.engine, self.capture_plan, mine,
                                 batch_size=capture_batch_size(self.plan), split="eval",
                                 strategy=self.plan["strategy"].spec.name))
        return lambda: eval_loader(store, refs, collate, batch_size, rank=0, world_size=1)  # already this rank's

    # ------------------------------------------------------------------ producer
    def start(self, skip_samples: int = 0, global_step: int = 0) -> None:
        """Start capturing this rank's share, epoch after epoch, after ``skip_samples`` (resume)."""
        self._thread = threading.Thread(target=self._produce, args=(skip_samples,), name="specforge-capture",
                                        daemon=True)
        self._thread.start()

    def _produce(self, skip: int) -> None:
        from .capture import capture_batch

        channel, metadata = self.control.channel, self.control.metadata
        name = self.plan["strategy"].spec.name
        per_epoch = self.samples_per_rank(self._world)
        batch_size = capture_batch_size(self.plan)
        try:
            for epoch in range(skip // per_epoch, self.plan.train.epochs):
                share = epoch_order(len(self.samples), epoch, self._seed, self._rank, self._world)
                if epoch == skip // per_epoch:
                    share = share[skip % per_epoch:]
                for start in range(0, len(share), batch_size):
                    batch = [self.samples[i] for i in share[start:start + batch_size]]
                    for _ in batch:  # bounded window: wait for the trainer to ack older samples
                        while not self.window.acquire(timeout=0.2):
                            if self._stop.is_set():
                                return
                    if self._stop.is_set():
                        return
                    refs = put_captured(self.store, batch, capture_batch(self.engine, self.capture_plan, batch),
                                        epoch=epoch, strategy=name)
                    channel.publish(metadata.commit(refs))
            channel.close()
        except BaseException as exc:  # noqa: BLE001 - the trainer sees it through the channel
            self._error = exc
            channel.fail(f"capture failed: {type(exc).__name__}: {exc}")

    def ack(self, sample_ids: list[str], global_step: int) -> None:
        """Durable ack of one optimizer window, then free those samples and their window slots."""
        self.control.metadata.ack(sample_ids, global_step)
        self.loader.complete(sample_ids)
        self.control.channel.report_consumed(len(sample_ids))
        for _ in sample_ids:
            try:
                self.window.release()
            except ValueError:
                break

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.control.close()
        self.store.close()


class StreamSource:
    """The consumer of a disaggregated run: train from what a producer streams into ``--features DIR``.

    Waits for the producer's ``stream`` record (up to the control plane's
    ``idle_timeout_s``), then reads target info, frozen parts and token counts from the
    directory like an offline run, eval samples from its store, and training refs from the
    control plane's channel (this rank's shard). Exactly once across crashes:

    - an ack at each optimizer boundary records the samples with their global step, durably;
    - their files are deleted only once a checkpoint covers that step, so a consumer that
      crashes and resumes from its last checkpoint finds them again;
    - on start, samples acked after the checkpoint being resumed are made pending again
      (their training was lost with the crash) and the channel is re-read from its start
      skipping what stays acked: the resumed run sees the same samples in the same order
      as one that never crashed.
    """

    streaming = True

    def __init__(self, plan: RunPlan, strategy: Any, context: BuildContext, *,
                 sync: Callable[[], None] = lambda: None) -> None:
        from .features import FeatureSet
        from .producer import CONTROL_DIR, StreamError, hold_lock, stream_control, stream_store

        assert plan.features is not None
        self.plan = plan
        self.sync = sync
        self.rank = context.rank
        self._lock = hold_lock(os.path.join(plan.features, CONTROL_DIR, f"consumer.rank{context.rank}.lock"),
                               f"consumer (rank {context.rank})")
        self.control: Any = None
        try:
            self.control = stream_control(plan, context)
            self.record = _wait_for_stream(plan.features, self.control.channel.idle_timeout_s)
            self.features = FeatureSet.open(plan.features)
            self.target = self.features.target
            self.features.check_plan(strategy.capture_plan(self.target), plan["strategy"].spec.name)
            if plan.train.max_steps is None and self.record["epochs"] != plan.train.epochs:
                raise StreamError(
                    f"the producer streams {self.record['epochs']} epoch(s) of {self.record['train_samples']} samples "
                    f"into {plan.features}, but this consumer plans train.epochs={plan.train.epochs}; set "
                    f"train.epochs={self.record['epochs']} (or train.max_steps) so that it trains what is streamed")
            # The training stream: the plan's cross-process store, or the directory's disk store
            # (consume-once there: a checkpointed sample's file is deleted). Eval samples always
            # come from the directory and are never released.
            self.store = stream_store(plan, context)
            self.eval_store = self.features.open_store(context)
            if self.store is None:
                self.store = self.features.open_store(context, consume_once=True)
            self.eval_refs = self.features.refs_by_split(self.eval_store)["eval"]
            self.eval_note = stored_eval_note(plan.features, self.eval_refs)
        except BaseException:
            self.close()
            raise
        self.fingerprint = self.features.fingerprint
        self.loader: Any = None
        self._unreleased: list[tuple[int, list[str]]] = []  # (ack step, sample ids), oldest first

    def frozen_parts(self) -> dict[str, Any]:
        return self.features.frozen_parts()

    def suggested_train_options(self) -> dict[str, Any]:
        """The producer's target engine's suggested train defaults (as an online run applies them)."""
        return dict(self.record.get("suggested_train_options", {}))

    def stats(self) -> Any:
        from .protocols import DataStats

        return DataStats(token_counts=self.features.stats().token_counts, num_samples=self.record["train_samples"])

    def samples_per_rank(self, world_size: int) -> int:
        return self.record["train_samples"] // world_size

    def eval_token_rows(self, limit: int) -> list[tuple[list[int], list[int]]]:
        """``(input_ids, loss_mask)`` of the first ``limit`` eval samples (the real acceptance check's prompts)."""
        return stored_token_rows(self.eval_store, self.eval_refs, limit)

    def train_loader(self, collate: Callable, *, batch_size: int, seed: int, rank: int, world_size: int) -> Any:
        self.loader = stream_loader(self.store, self.control.channel, collate, batch_size)
        return self.loader

    def eval_loader_factory(self, collate: Callable, *, batch_size: int, rank: int, world_size: int) -> Any:
        if not self.eval_refs:
            return None
        return lambda: eval_loader(self.eval_store, self.eval_refs, collate, batch_size, rank, world_size)

    def start(self, skip_samples: int = 0, global_step: int = 0) -> None:
        """Take up the stream after the checkpoint of ``global_step`` (0: from the beginning).

        Refused when samples trained after that checkpoint were already deleted (a later
        checkpoint covered them): starting over, or from an older checkpoint, would need them.
        """
        from .producer import RELEASED_MARKER, StreamError

        metadata = self.control.metadata
        released = int(metadata.get_marker(RELEASED_MARKER, 0))
        if global_step < released:
            where = "from the beginning" if global_step == 0 else f"from the checkpoint of step {global_step}"
            raise StreamError(
                f"the samples trained up to step {released} of the stream in {self.plan.features} were deleted after "
                f"a checkpoint covered them, so this consumer cannot start {where}: resume from the latest "
                "checkpoint (--resume latest), or stream into a new --features directory for a new run")
        metadata.requeue_acked_after(global_step)
        self.sync()  # every rank sees the requeued samples before any rank re-reads the channel
        acked = self.control.resume_consumer().acked
        if self.rank == 0 and acked:  # covered by the checkpoint: free what a crash left (one rank suffices)
            if global_step > released:  # the marker goes first, as in checkpointed()
                metadata.set_marker(RELEASED_MARKER, global_step)
            for ref in acked:
                self.store.release(ref)

    def ack(self, sample_ids: list[str], global_step: int) -> None:
        """Durable ack of one optimizer window; the files stay until a checkpoint covers it."""
        self.control.metadata.ack(sample_ids, global_step)
        self.control.channel.report_consumed(len(sample_ids))
        self._unreleased.append((global_step, list(sample_ids)))

    def checkpointed(self, global_step: int) -> None:
        """Delete the samples a checkpoint now covers: a resume can no longer need them.

        The step is recorded first, so that no later start can ask for a deleted sample.
        """
        from .producer import RELEASED_MARKER

        if self._unreleased and self._unreleased[0][0] <= global_step:
            self.control.metadata.set_marker(RELEASED_MARKER, global_step)
        while self._unreleased and self._unreleased[0][0] <= global_step:
            self.loader.complete(self._unreleased.pop(0)[1])

    def finish(self, global_step: int) -> None:
        """Training ended normally at ``global_step`` (its checkpoint written): tell the producer."""
        from .producer import FINISHED_MARKER

        if self.rank == 0:
            self.control.metadata.set_marker(FINISHED_MARKER, {"step": global_step})

    def close(self) -> None:
        if getattr(self, "control", None) is not None:
            self.control.close()
        for name in ("store", "eval_store"):
            store = getattr(self, name, None)
            if store is not None:
                store.close()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _wait_for_stream(root: str, wait_s: float) -> dict[str, Any]:
    """The producer's stream record, waiting up to ``wait_s`` for a producer to write it."""
    import sys
    import time

    from .producer import StreamError, read_stream_record

    deadline = time.monotonic() + wait_s
    told = False
    while True:
        record = read_stream_record(root)
        if record is not None:
            return record
        if time.monotonic() >= deadline:
            raise StreamError(f"no producer started a stream in {root} within {wait_s:g}s "
                              "(control_plane.idle_timeout_s): start `specforge run --role producer --features "
                              f"{root}` with the same strategy and data, or point --features at the directory it "
                              "writes")
        if not told:
            print(f"waiting for a producer to stream into {root} ...", file=sys.stderr, flush=True)
            told = True
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
