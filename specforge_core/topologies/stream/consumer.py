"""The consumer of a disaggregated run: train from what a producer streams (``--role consumer``)."""

from __future__ import annotations

from typing import Any, Callable

from ...config import RunPlan
from ...protocols import BuildContext
from ..capture import eval_loader, stored_eval_note, stored_token_rows, stream_loader
from .record import FINISHED_MARKER, RELEASED_MARKER, StreamError, check_consumer_fits
from .state import open_stream


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
        self.stream: Any = None
        self.store: Any = None
        self.eval_store: Any = None
        self._finished = False
        try:
            self.stream = open_stream(plan, context, f"consumer.rank{context.rank}")
            self.stream.hold(f"consumer.rank{context.rank}", f"consumer (rank {context.rank})")
            self.control, self.where = self.stream.control, self.stream.where
            self.record = self.stream.wait_for_record(self.control.channel.idle_timeout_s)
            self.features, self.store, self.eval_store, self.eval_refs = self.stream.consumer_features()
            self.eval_note = stored_eval_note(self.where, self.eval_refs)
            self.target = self.features.target
            check_consumer_fits(plan, self.record, self.where, self.stream.remedy)
            self.features.check_plan(strategy.capture_plan(self.target), plan["strategy"].spec.name)
        except BaseException:
            self.close()
            raise
        self.fingerprint = self.features.fingerprint
        self.loader: Any = None
        self._unreleased: list[tuple[int, list[str]]] = []  # (ack step, sample ids), oldest first

    def frozen_parts(self) -> dict[str, Any]:
        return self.features.frozen_parts()

    def stats(self) -> Any:
        from ...protocols import DataStats

        return DataStats(token_counts=self.features.stats().token_counts, num_samples=self.record["train_samples"])

    def samples_per_rank(self, world_size: int) -> int:
        return self.record["train_samples"] // world_size

    def sample_keys(self) -> None:
        """None: a stream's samples arrive as the producer makes them (its record's contract says which)."""
        return None

    def eval_token_rows(self, limit: int) -> list[tuple[list[int], list[int]]]:
        """``(input_ids, loss_mask)`` of the first ``limit`` eval samples (the real acceptance check's prompts)."""
        return stored_token_rows(self.eval_store, self.eval_refs, limit)

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
        """Release everything; after a finished run, rank 0 first ends the stream (every rank
        has passed the run's last barrier by then: nobody reads its objects any more)."""
        try:
            if self._finished:
                self.stream.end(self.store, self.features.manifest)
        finally:
            for store in (self.store, self.eval_store):
                if store is not None:
                    store.close()
            self.store = self.eval_store = None
            if self.stream is not None:
                self.stream.close()
                self.stream = None
