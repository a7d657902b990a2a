"""The small interfaces that components implement (typing.Protocol, structural).

Factories named by specs are called as ``factory(options, context)`` where ``options`` is
the validated options instance and ``context`` a :class:`BuildContext`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import attrs

if TYPE_CHECKING:
    from .contracts import SampleRef


@attrs.frozen(kw_only=True)
class BuildContext:
    """What every component factory is told about the run it belongs to."""

    run_id: str = "run"
    output_dir: str | None = None
    rank: int = 0
    world_size: int = 1
    role: str = "colocated"  # colocated | producer | consumer | offline


@runtime_checkable
class FeatureStore(Protocol):
    """Where feature tensors live between capture and training.

    ``uri`` identifies the store instance (it appears on every ref it returns);
    ``put`` stores a sample's tensors (each unpadded, first dim = tokens where that applies)
    and returns a :class:`SampleRef` with shape and dtype per feature; putting the same
    ``sample_id`` again makes a new generation and makes older refs stale.
    """

    uri: str

    def put(self, sample_id: str, tensors: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> SampleRef: ...

    def get(self, ref: SampleRef, keys: Sequence[str] | None = None) -> dict[str, Any]: ...

    def release(self, ref: SampleRef) -> None: ...

    def abort(self, sample_id: str) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@runtime_checkable
class MetadataStore(Protocol):
    """Durable (or not) bookkeeping of which samples exist and which were trained on."""

    def commit(self, refs: Sequence[SampleRef]) -> list[SampleRef]: ...

    def ack(self, sample_ids: Sequence[str], global_step: int) -> None: ...

    def durable_step(self) -> int: ...

    def reconcile(self) -> Any: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@runtime_checkable
class RefChannel(Protocol):
    """A stream of refs from producers to consumers."""

    def publish(self, refs: Iterable[SampleRef]) -> None: ...

    def poll(self, max_n: int, timeout: float | None = None) -> list[SampleRef]: ...

    def close(self) -> None: ...

    def fail(self, reason: str) -> None: ...


@runtime_checkable
class ControlPlane(Protocol):
    """A metadata store and a ref channel that belong together."""

    metadata: MetadataStore
    channel: RefChannel

    def close(self) -> None: ...
