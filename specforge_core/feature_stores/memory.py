"""The ``memory`` feature store: tensors kept in this process, for online colocated runs."""

from __future__ import annotations

import itertools
import uuid
from typing import TYPE_CHECKING

import attrs
import torch

from ..contracts import SampleRef
from ..errors import StoreFullError
from .base import BaseFeatureStore, format_bytes, stale_error

if TYPE_CHECKING:
    from ..builtin import MemoryStoreOptions
    from ..protocols import BuildContext


@attrs.frozen
class _Stored:
    ref: SampleRef
    tensors: dict[str, torch.Tensor]
    nbytes: int


class MemoryFeatureStore(BaseFeatureStore):
    """Feature tensors held in this process's memory (CPU or GPU, wherever they were put).

    Ownership: ``put`` takes ownership of the tensors it is given and ``get`` hands out the
    very tensors it keeps, without copying. Callers must not modify a tensor after putting
    it, nor a tensor returned by ``get``. A tensor that does not own exactly its bytes (a
    slice of a padded batch, a non-contiguous view) is stored as a compact copy so that it
    does not pin the whole batch.

    Capacity: with ``max_bytes`` set, a put that would take the resident bytes past the cap
    raises :class:`StoreFullError` and stores nothing, leaving every existing sample intact.
    It raises rather than blocks on purpose: the producer owns the backpressure (its
    bounded in-flight window), and a put that blocked inside the store could deadlock a
    run whose only consumer is the thread doing the put.

    Generations come from one counter per store, so they never repeat, even for a sample
    put again after it was released or aborted.
    """

    def __init__(self, options: MemoryStoreOptions, context: BuildContext) -> None:
        super().__init__(run_id=context.run_id, consume_once=options.consume_once)
        self.uri = f"memory://{context.run_id}/{uuid.uuid4().hex[:12]}"
        self.max_bytes = options.max_bytes
        self._samples: dict[str, _Stored] = {}
        self._bytes = 0
        self._generations = itertools.count(1)

    def _store(self, draft: SampleRef, tensors: dict[str, torch.Tensor]) -> SampleRef:
        nbytes = draft.nbytes
        with self._lock:
            previous = self._samples.get(draft.sample_id)
            # a re-put replaces the previous generation, so its bytes do not count twice
            after = self._bytes - (previous.nbytes if previous else 0) + nbytes
            if self.max_bytes is not None and after > self.max_bytes:
                raise StoreFullError(
                    f"{self.uri} is full: {format_bytes(self._bytes)} resident, cap max_bytes={self.max_bytes}, "
                    f"sample {draft.sample_id!r} needs {format_bytes(nbytes)}; nothing was stored. Release "
                    "consumed samples (consume_once=True), shrink the producer's in-flight window, or raise max_bytes"
                )
            ref = attrs.evolve(draft, generation=next(self._generations))
            self._samples[draft.sample_id] = _Stored(ref, tensors, nbytes)
            self._bytes = after
        return ref

    def _load(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        with self._lock:
            stored = self._samples.get(ref.sample_id)
        if stored is None:
            raise self._not_found(ref)
        if stored.ref.generation != ref.generation:
            raise stale_error(ref, stored.ref.generation)
        return {name: stored.tensors[name] for name in names}

    def _release(self, ref: SampleRef) -> bool:
        with self._lock:
            stored = self._samples.get(ref.sample_id)
            if stored is None or stored.ref.generation != ref.generation:
                return False
            if self.consume_once:
                del self._samples[ref.sample_id]
                self._bytes -= stored.nbytes
            return True

    def _drop(self, sample_id: str) -> bool:
        with self._lock:
            stored = self._samples.pop(sample_id, None)
            if stored is not None:
                self._bytes -= stored.nbytes
        return stored is not None

    def _resident(self) -> tuple[int, int]:
        with self._lock:
            return len(self._samples), self._bytes

    def _close(self) -> None:
        with self._lock:
            self._samples.clear()
            self._bytes = 0
