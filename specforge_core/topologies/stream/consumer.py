"""The consumer of a disaggregated run: train from what a producer streams (``--role consumer``)."""

from __future__ import annotations

import os
from typing import Any, Callable

from ...config import RunPlan
from ...protocols import BuildContext
from ..capture import eval_loader, stream_loader
from .networked import (
    MANIFEST_MARKER,
    RECORD_MARKER,
    LeaseKeeper,
    StreamFeatureSet,
    describe,
    end_stream,
    holder_id,
    is_networked,
    open_control,
    open_store,
    wait_for_marker,
)
from .record import (
    CONTROL_DIR,
    FINISHED_MARKER,
    RELEASED_MARKER,
    StreamError,
    hold_lock,
    stream_control,
    stream_store,
    wait_for_stream,
)


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
        self.plan = plan
        self.sync = sync
        self.rank = context.rank
        self.control: Any = None
        self._lock: int | None = None
        self._keeper: Any = None
        self._finished = False
        try:
            if is_networked(plan):
                self._open_networked(plan, context)
            else:
                self._open_directory(plan, context)
            self.target = self.features.target
            self.features.check_plan(strategy.capture_plan(self.target), plan["strategy"].spec.name)
            if plan.train.max_steps is None and self.record["epochs"] != plan.train.epochs:
                raise StreamError(
                    f"the producer streams {self.record['epochs']} epoch(s) of {self.record['train_samples']} samples "
                    f"into {self.where}, but this consumer plans train.epochs={plan.train.epochs}; set "
                    f"train.epochs={self.record['epochs']} (or train.max_steps) so that it trains what is streamed")
        except BaseException:
            self.close()
            raise
        self.fingerprint = self.features.fingerprint
        self.loader: Any = None
        self._unreleased: list[tuple[int, list[str]]] = []  # (ack step, sample ids), oldest first

    def _open_directory(self, plan: RunPlan, context: BuildContext) -> None:
        """The stream of a shared features directory (sqlite control plane, lock files)."""
        from ...features import FeatureSet

        assert plan.features is not None
        self.where = str(plan.features)
        self._lock = hold_lock(os.path.join(plan.features, CONTROL_DIR, f"consumer.rank{context.rank}.lock"),
                               f"consumer (rank {context.rank})")
        self.control = stream_control(plan, context)
        self.record = wait_for_stream(plan.features, self.control.channel.idle_timeout_s)
        self.features = FeatureSet.open(plan.features)
        # The training stream: the plan's cross-process store, or the directory's disk store
        # (consume-once there: a checkpointed sample's file is deleted). Eval samples always
        # come from the directory and are never released.
        self.store = stream_store(plan, context)
        self.eval_store = self.features.open_store(context)
        if self.store is None:
            self.store = self.features.open_store(context, consume_once=True)
        self.eval_refs = self.features.refs_by_split(self.eval_store)["eval"]

    def _open_networked(self, plan: RunPlan, context: BuildContext) -> None:
        """The stream of a networked control plane: record, manifest and lease there, tensors in the store."""
        self.control = open_control(plan, context)
        self.where = describe(self.control)
        self._keeper = LeaseKeeper(self.control, holder_id(f"consumer.rank{context.rank}"))
        self._keeper.take(f"consumer.rank{context.rank}")
        metadata = self.control.metadata
        self.record = wait_for_marker(metadata, RECORD_MARKER, self.control.channel.idle_timeout_s,
                                      f"no producer started {self.where}: start `specforge run --role producer` "
                                      "with the same control plane, feature store and data")
        self.store = open_store(plan, context, self.control)
        self.eval_store = None  # the eval split lives in the same store and is never released
        self.features = StreamFeatureSet(path=self.where, manifest=metadata.get_marker(MANIFEST_MARKER),
                                         store=self.store)
        self.eval_refs = self.features.eval_refs()

    def frozen_parts(self) -> dict[str, Any]:
        return self.features.frozen_parts()

    def suggested_train_options(self) -> dict[str, Any]:
        """The producer's target engine's suggested train defaults (as an online run applies them)."""
        return dict(self.record.get("suggested_train_options", {}))

    def stats(self) -> Any:
        from ...protocols import DataStats

        return DataStats(token_counts=self.features.stats().token_counts, num_samples=self.record["train_samples"])

    def samples_per_rank(self, world_size: int) -> int:
        return self.record["train_samples"] // world_size

    def train_loader(self, collate: Callable, *, batch_size: int, seed: int, rank: int, world_size: int) -> Any:
        self.loader = stream_loader(self.store, self.control.channel, collate, batch_size)
        return self.loader

    def eval_loader_factory(self, collate: Callable, *, batch_size: int, rank: int, world_size: int) -> Any:
        if not self.eval_refs:
            return None
        return lambda: eval_loader(self.eval_store or self.store, self.eval_refs, collate, batch_size, rank, world_size)

    def start(self, skip_samples: int = 0, global_step: int = 0) -> None:
        """Take up the stream after the checkpoint of ``global_step`` (0: from the beginning).

        Refused when samples trained after that checkpoint were already deleted (a later
        checkpoint covered them): starting over, or from an older checkpoint, would need them.
        """
        metadata = self.control.metadata
        released = int(metadata.get_marker(RELEASED_MARKER, 0))
        if global_step < released:
            where = "from the beginning" if global_step == 0 else f"from the checkpoint of step {global_step}"
            raise StreamError(
                f"the samples trained up to step {released} of the stream in {self.where} were deleted after "
                f"a checkpoint covered them, so this consumer cannot start {where}: resume from the latest "
                "checkpoint (--resume latest), or start a new stream (a new --features directory or "
                "control_plane.schema) for a new run")
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
        if self._unreleased and self._unreleased[0][0] <= global_step:
            self.control.metadata.set_marker(RELEASED_MARKER, global_step)
        while self._unreleased and self._unreleased[0][0] <= global_step:
            self.loader.complete(self._unreleased.pop(0)[1])

    def finish(self, global_step: int) -> None:
        """Training ended normally at ``global_step`` (its checkpoint written): tell the producer."""
        if self.rank == 0:
            self.control.metadata.set_marker(FINISHED_MARKER, {"step": global_step})
            self._finished = True

    def close(self) -> None:
        """Release everything; after a finished networked run, rank 0 first frees the stream's
        objects (every rank has passed the run's last barrier by then: nobody reads them)."""
        try:
            if self._finished and self._keeper is not None:
                end_stream(self.control, self.store, self.features.manifest)
        finally:
            if self._keeper is not None:  # before the control plane's connection goes
                self._keeper.stop()
                self._keeper = None
            if getattr(self, "control", None) is not None:
                self.control.close()
            for name in ("store", "eval_store"):
                store = getattr(self, name, None)
                if store is not None:
                    store.close()
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None
