"""The online colocated topology (the default): capture and training in one process.

The target engine captures on a producer thread into the feature store; refs go through
the control plane (commit with dedup, then the channel); the loader consumes them; the
trainer's ack at each optimizer boundary marks them durable and releases them. A bounded
window of samples in flight keeps the memory use flat and lets capture run ahead of
training. Under ``torchrun`` every rank captures and trains its own share.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..config import RunPlan
from ..protocols import BuildContext
from .capture import (
    capture_batch,
    capture_batch_size,
    capture_into,
    epoch_order,
    eval_loader,
    prepared_samples,
    put_captured,
    stream_loader,
    supervised_token_counts,
)


class OnlineSource:
    """Capture on a producer thread while training (the default topology)."""

    streaming = True

    def __init__(self, plan: RunPlan, strategy: Any, context: BuildContext, *, build: Callable[[str], Any],
                 window: int) -> None:
        from ..features import frozen_fingerprint

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
        from ..protocols import DataStats

        counts = supervised_token_counts(((s.input_ids, s.loss_mask) for s in self.samples), self.target.vocab_size)
        return DataStats(token_counts=counts, num_samples=len(self.samples))

    def samples_per_rank(self, world_size: int) -> int:
        return len(self.samples) // world_size

    def sample_keys(self) -> list[str]:
        """What identifies each training sample, in the loader's order (for the resume contract): its id, which
        names the file and line and hashes its tokens and mask."""
        return [sample.sample_id for sample in self.samples]

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
        from ..builtin import MemoryStoreOptions
        from ..feature_stores.memory import MemoryFeatureStore

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
