"""Metadata stores: which samples exist, which were trained on, where training stands.

The contract every store follows (the SQLite one in :mod:`.sqlite` adds durability):

* ``commit(refs)`` returns the *fresh* refs, in order: a ``sample_id`` seen before (in an
  earlier batch or earlier in the same batch) is a duplicate, counted in
  ``stats()["duplicates"]`` and left out. Only the fresh refs should be published, which is
  what makes a re-run producer harmless. Anything that is not a :class:`SampleRef` (above
  all a tensor) rejects the whole batch with :class:`RecordError`; nothing of it is kept.
* ``ack(sample_ids, global_step)`` marks the samples as trained on and raises the durable
  global-step marker to ``global_step``, atomically. Acking an id that was never committed
  rejects the whole batch (:class:`ControlPlaneError` listing the unknown ids); acking an
  acked id again is harmless and keeps its first step.
* ``durable_step()`` is the highest global step ever acked (0 before the first ack). It is
  a maximum rather than "the latest call" so that a data-parallel rank acking a step late
  cannot move the marker backwards.
* ``reconcile()`` returns a :class:`Reconciliation` of acked and pending refs in commit
  order: after a restart the acked samples are released from the feature store and the
  pending ones are trained on again.
* ``set_marker(key, value)`` / ``get_marker(key, default)`` keep small JSON-able values
  (data positions, run contracts) next to the acks. Their namespace is the caller's own:
  the durable step and the duplicate count are kept apart from it.
* ``stats()`` counts ``committed`` (distinct samples), ``acked``, ``duplicates`` and
  ``pending`` (committed and not yet acked).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Iterable, Sequence

import attrs

from ..contracts import SampleRef, check_record
from ..errors import ControlPlaneError, RecordError


@attrs.frozen(kw_only=True)
class Reconciliation:
    """What a restarted run must do with the samples committed before it.

    ``acked``: trained on and durably acked; release them from the feature store.
    ``pending``: committed but never acked; train on them again. Both in commit order.
    ``durable_step``: the store's durable global step at the time of the reconcile.
    """

    acked: tuple[SampleRef, ...] = attrs.field(converter=tuple, factory=tuple)
    pending: tuple[SampleRef, ...] = attrs.field(converter=tuple, factory=tuple)
    durable_step: int = 0


def require_sample_refs(refs: Iterable[SampleRef], what: str = "refs") -> list[SampleRef]:
    """Return ``refs`` as a list, or raise :class:`RecordError` if any item is not a SampleRef.

    Control-plane records carry metadata only, so a tensor gets :func:`check_record`'s
    message; any other stray object (a dict, a sample id) is named with its position.
    The whole batch is checked before the caller writes anything.
    """
    if isinstance(refs, (SampleRef, str, bytes)) or isinstance(refs, dict):
        raise RecordError(f"{what} must be a list of SampleRef, got a single {type(refs).__name__}; "
                          "wrap it in a list")
    items = list(refs)
    for index, item in enumerate(items):
        if isinstance(item, SampleRef):
            continue
        check_record(item, f"{what}[{index}]")  # raises the tensor-specific message
        raise RecordError(f"{what}[{index}] is a {type(item).__name__}, not a SampleRef; commit and publish the "
                          "SampleRef a feature store's put() returned")
    return items


def require_ack_args(sample_ids: Sequence[str], global_step: int) -> list[str]:
    """Validate ``ack`` arguments; return the ids as a list."""
    if isinstance(sample_ids, (str, bytes)):
        raise ControlPlaneError(f"ack() takes a list of sample ids, got the single string {sample_ids!r}; "
                                "wrap it in a list")
    ids = list(sample_ids)
    bad = [sid for sid in ids if not isinstance(sid, str)]
    if bad:
        raise ControlPlaneError(f"ack() sample ids must be strings, got {bad[:5]!r}")
    if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
        raise ControlPlaneError(f"ack() global_step must be an int >= 0, got {global_step!r}")
    return ids


def unknown_ids_error(unknown: Sequence[str]) -> ControlPlaneError:
    shown = ", ".join(repr(s) for s in unknown[:10])
    more = f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else ""
    return ControlPlaneError(
        f"ack() of {len(unknown)} sample id(s) that were never committed: {shown}{more}. Nothing of this ack "
        "was applied; ack only the sample_ids of refs that came out of this control plane."
    )


def encode_marker(key: str, value: Any) -> str:
    """Check a marker and return its JSON text (what the stores keep)."""
    if not isinstance(key, str) or not key:
        raise RecordError(f"marker key must be a non-empty string, got {key!r}")
    check_record(value, f"marker {key!r}")
    return json.dumps(value, sort_keys=True)


class _InProcessStore:
    """The lock, closed-state guard and in-memory markers the in-process stores share."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # producer thread commits while the trainer thread acks
        self._closed = False
        self._markers: dict[str, str] = {}

    def _check_open(self) -> None:
        if self._closed:
            raise ControlPlaneError(f"{type(self).__name__} is closed; open a new control plane")

    def set_marker(self, key: str, value: Any) -> None:
        text = encode_marker(key, value)
        with self._lock:
            self._check_open()
            self._markers[key] = text

    def get_marker(self, key: str, default: Any = None) -> Any:
        # Kept as JSON text so a caller mutating what it got back cannot change the store.
        text = self._markers.get(key)
        return default if text is None else json.loads(text)

    def close(self) -> None:
        self._closed = True


class NoopMetadataStore(_InProcessStore):
    """A store that keeps no per-sample bookkeeping: **no exactly-once guarantee**.

    ``commit`` returns every (valid) ref, duplicates included; ``ack`` validates its
    arguments and forgets them; ``durable_step`` stays 0 and ``reconcile`` is empty, so a
    restarted run cannot tell what was trained on. Markers live in memory. Tensors are
    still rejected: that rule holds for every control plane. ``stats`` are plain counters.
    """

    def __init__(self) -> None:
        super().__init__()
        self._committed = 0
        self._acked = 0

    def commit(self, refs: Sequence[SampleRef]) -> list[SampleRef]:
        items = require_sample_refs(refs)
        with self._lock:
            self._check_open()
            self._committed += len(items)
        return items

    def ack(self, sample_ids: Sequence[str], global_step: int) -> None:
        ids = require_ack_args(sample_ids, global_step)
        with self._lock:
            self._check_open()
            self._acked += len(ids)

    def durable_step(self) -> int:
        return 0

    def reconcile(self) -> Reconciliation:
        return Reconciliation()

    def stats(self) -> dict[str, int]:
        return {"committed": self._committed, "acked": self._acked, "duplicates": 0,
                "pending": max(0, self._committed - self._acked)}


class MemoryMetadataStore(_InProcessStore):
    """In-process bookkeeping with dedup and ack checks; lost when the process ends.

    Same contract as the SQLite store except durability, so an online colocated run gets
    exactly-once delivery within its lifetime. Thread-safe.
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[str, SampleRef] = {}  # insertion order is commit order
        self._acked: dict[str, int] = {}  # sample_id -> step of its first ack
        self._duplicates = 0
        self._durable_step = 0

    def commit(self, refs: Sequence[SampleRef]) -> list[SampleRef]:
        items = require_sample_refs(refs)
        fresh = []
        with self._lock:
            self._check_open()
            for ref in items:
                if ref.sample_id in self._refs:
                    self._duplicates += 1
                else:
                    self._refs[ref.sample_id] = ref
                    fresh.append(ref)
        return fresh

    def ack(self, sample_ids: Sequence[str], global_step: int) -> None:
        ids = require_ack_args(sample_ids, global_step)
        with self._lock:
            self._check_open()
            unknown = [sid for sid in dict.fromkeys(ids) if sid not in self._refs]
            if unknown:
                raise unknown_ids_error(unknown)
            for sid in ids:
                self._acked.setdefault(sid, global_step)
            self._durable_step = max(self._durable_step, global_step)

    def durable_step(self) -> int:
        return self._durable_step

    def reconcile(self) -> Reconciliation:
        with self._lock:
            acked = [ref for sid, ref in self._refs.items() if sid in self._acked]
            pending = [ref for sid, ref in self._refs.items() if sid not in self._acked]
            return Reconciliation(acked=acked, pending=pending, durable_step=self._durable_step)

    def stats(self) -> dict[str, int]:
        with self._lock:
            committed, acked = len(self._refs), len(self._acked)
            return {"committed": committed, "acked": acked, "duplicates": self._duplicates,
                    "pending": committed - acked}
