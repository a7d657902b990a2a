"""FeatureDataLoader: refs -> store gets -> strategy collate -> prefetched TrainBatches.

Two sources, one loop:

* **fixed refs** (offline, many epochs): a list of refs, re-iterable. Each epoch is a
  seeded permutation (``seed + epoch``), split across data-parallel ranks so every rank gets
  distinct samples and the same number of batches. ``seek(n)`` skips the first ``n`` batches
  of the epoch without reading them (resume). A short final batch is **dropped** when
  ``drop_last`` (the default, so every rank and step sees full batches; a different
  permutation next epoch covers those samples); with ``drop_last=False`` it is yielded short.
* **a channel** (online or disaggregated, consume-once): refs are polled until the channel is
  closed and drained. A short final batch is **always yielded**: a streamed sample is trained
  on exactly once, never dropped.

Batches are built on a background thread into a bounded buffer (``prefetch`` batches), so
store reads and collation overlap training. Errors on that thread (a corrupt sample, a
failed channel, an idle timeout) are re-raised in the training thread at the next batch.

Release and acks: the loader never acks. The training loop acks a window's ``sample_ids``
durably at the optimizer boundary and then calls :meth:`complete`, which releases those
samples from a consume-once store — so a crash between use and ack leaves the sample in the
store to be requeued, never lost. ``release="after_collate"`` frees samples as soon as they
are collated (for stores whose contents die with the process anyway), and ``"never"``
keeps them (retained offline features).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from ..contracts import SampleRef, TrainBatch
from ..errors import SpecforgeError

_RELEASE_MODES = ("on_complete", "after_collate", "never")
_END = object()


class LoaderError(SpecforgeError):
    """The loader was misconfigured or its background thread failed."""


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class FeatureDataLoader:
    """Iterate :class:`TrainBatch` objects from a feature store.

    ``collate(samples, sample_ids)`` is the strategy's collate; ``samples`` is a list of
    ``{feature: tensor}`` dicts as the store returns them.
    """

    def __init__(self, store: Any, collate: Callable[[list[dict[str, Any]], list[str]], TrainBatch], *,
                 batch_size: int, refs: Sequence[SampleRef] | None = None, channel: Any = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, rank: int = 0, world_size: int = 1,
                 prefetch: int = 2, keys: Sequence[str] | None = None, release: str | None = None,
                 poll_timeout_s: float = 1.0, equal_shares: bool = True) -> None:
        if (refs is None) == (channel is None):
            raise LoaderError("FeatureDataLoader needs exactly one source: refs=[...] (fixed) or channel=... (stream)")
        if batch_size < 1:
            raise LoaderError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise LoaderError(f"rank {rank} is outside world_size {world_size}")
        release = release or ("never" if refs is not None else "on_complete")
        if release not in _RELEASE_MODES:
            raise LoaderError(f"release must be one of {', '.join(_RELEASE_MODES)}, got {release!r}")
        self.store = store
        self.collate = collate
        self.batch_size = batch_size
        self.refs = list(refs) if refs is not None else None
        self.channel = channel
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.prefetch = max(1, prefetch)
        self.keys = list(keys) if keys is not None else None
        self.release_mode = release
        self.poll_timeout_s = poll_timeout_s
        self.equal_shares = equal_shares
        self.epoch = 0
        self._skip = 0
        self._in_flight: dict[str, SampleRef] = {}
        self._lock = threading.Lock()
        self.stats = {"batches": 0, "samples": 0, "get_s": 0.0, "collate_s": 0.0, "released": 0}

    # ------------------------------------------------------------ fixed mode
    @property
    def streaming(self) -> bool:
        return self.refs is None

    def _epoch_order(self, epoch: int) -> list[SampleRef]:
        import torch

        assert self.refs is not None
        n = len(self.refs)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        # Training wants equal shares (every rank runs the same number of steps): the tail that
        # does not divide evenly is left to other epochs. Evaluation wants every sample once.
        end = (n // self.world_size) * self.world_size if self.equal_shares else n
        return [self.refs[i] for i in order[self.rank:end:self.world_size]]

    def __len__(self) -> int:
        """Batches per epoch on this rank (fixed mode only)."""
        if self.refs is None:
            raise TypeError("a streaming FeatureDataLoader has no length")
        n = len(self.refs)
        per_rank = n // self.world_size if self.equal_shares else len(range(self.rank, n, self.world_size))
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def seek(self, n_batches: int) -> None:
        """Skip the first ``n_batches`` of the next iteration (resume mid-epoch)."""
        if self.streaming:
            raise LoaderError("seek() needs a fixed list of refs; a channel resumes through its control plane")
        if not 0 <= n_batches <= len(self):
            raise LoaderError(f"cannot seek to batch {n_batches}: an epoch has {len(self)} batches on this rank")
        self._skip = n_batches

    def _fixed_batches(self) -> Iterator[list[SampleRef]]:
        order = self._epoch_order(self.epoch)
        skip, self._skip = self._skip, 0
        for start in range(skip * self.batch_size, len(order), self.batch_size):
            chunk = order[start: start + self.batch_size]
            if len(chunk) < self.batch_size and self.drop_last:
                return
            yield chunk

    # ------------------------------------------------------------ stream mode
    def _stream_batches(self, stop: threading.Event) -> Iterator[list[SampleRef]]:
        pending: list[SampleRef] = []
        while not stop.is_set():
            got = self.channel.poll(self.batch_size - len(pending), timeout=self.poll_timeout_s)
            pending.extend(got)
            if len(pending) >= self.batch_size:
                yield pending
                pending = []
            elif not got and getattr(self.channel, "finished", False):
                break
        if pending and not stop.is_set():
            yield pending  # short final batch: streamed samples are never dropped

    # ------------------------------------------------------------ building
    def _build(self, refs: list[SampleRef]) -> TrainBatch:
        start = time.perf_counter()
        ids = [ref.sample_id for ref in refs]
        collate_s = 0.0

        def collate(samples: list[dict[str, Any]]) -> TrainBatch:
            nonlocal collate_s
            began = time.perf_counter()
            try:
                return self.collate(samples, ids)
            finally:
                collate_s = time.perf_counter() - began

        get_batch = getattr(self.store, "get_batch", None)  # a store may check its reads while the collate runs
        if get_batch is not None:
            batch = get_batch(refs, self.keys, collate)
        else:
            batch = collate([self.store.get(ref, self.keys) for ref in refs])
        end = time.perf_counter()
        self.stats["get_s"] += end - start - collate_s
        self.stats["collate_s"] += collate_s
        self.stats["batches"] += 1
        self.stats["samples"] += len(refs)
        if self.release_mode == "after_collate":
            for ref in refs:
                self.store.release(ref)
            self.stats["released"] += len(refs)
        elif self.release_mode == "on_complete":
            with self._lock:
                for ref in refs:
                    self._in_flight[ref.sample_id] = ref
        return batch

    def complete(self, sample_ids: Sequence[str]) -> None:
        """Release samples the training loop has durably acked (``release="on_complete"``)."""
        if self.release_mode != "on_complete":
            return
        with self._lock:
            refs = [self._in_flight.pop(sid) for sid in sample_ids if sid in self._in_flight]
        for ref in refs:
            self.store.release(ref)
        self.stats["released"] += len(refs)

    @property
    def in_flight(self) -> list[str]:
        """Sample ids handed out but not yet completed."""
        with self._lock:
            return list(self._in_flight)

    def __iter__(self) -> Iterator[TrainBatch]:
        buffer: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    buffer.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                source = self._stream_batches(stop) if self.streaming else self._fixed_batches()
                for refs in source:
                    if not put(self._build(refs)):
                        return
                put(_END)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer thread
                put(_Failure(exc))

        worker = threading.Thread(target=produce, name="specforge-loader", daemon=True)
        worker.start()
        try:
            while True:
                item = buffer.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            stop.set()
            worker.join(timeout=10)
