"""The records that flow between components.

Metadata records (:class:`FeatureSpec`, :class:`SampleRef`, :class:`StepContext`) are frozen
attrs classes with an exact JSON round trip: ``Record.from_json(r.to_json()) == r``. They
travel through control planes, manifests and checkpoints, so they must never hold a tensor;
:func:`check_record` enforces that.

:class:`TrainBatch` is the only tensor carrier, and :class:`StepOutput` is what a strategy's
``forward_loss`` returns. This module does not import torch.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Mapping

import attrs

from .errors import RecordError

#: Bumped when the meaning of a stored sample changes incompatibly.
SCHEMA_VERSION = 1

_JSON_SCALARS = (str, int, float, bool, type(None))


def _is_tensor_like(value: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    # numpy arrays and anything else exporting a buffer protocol for arrays
    return hasattr(value, "__array_interface__") or hasattr(value, "__dlpack__")


def check_record(value: Any, path: str = "record") -> None:
    """Raise :class:`RecordError` unless ``value`` is plain JSON-able metadata.

    Tensors and arrays get their own message because carrying one in a control-plane
    record is the bug this guards against: features belong in a feature store, and
    records only carry refs to them.
    """
    if _is_tensor_like(value):
        raise RecordError(
            f"{path} holds a {type(value).__module__}.{type(value).__name__}; control-plane "
            "records carry metadata only. Put tensors in a feature store and pass the SampleRef."
        )
    if isinstance(value, _JSON_SCALARS):
        if isinstance(value, float) and value != value:  # NaN does not round-trip
            raise RecordError(f"{path} is NaN, which JSON records cannot carry")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise RecordError(f"{path} has a non-string key {key!r}")
            check_record(item, f"{path}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_record(item, f"{path}[{index}]")
        return
    raise RecordError(
        f"{path} holds a {type(value).__name__}, which is not JSON metadata "
        "(allowed: str, int, float, bool, None, lists and string-keyed mappings)"
    )


def _freeze_meta(value: Mapping[str, Any] | None) -> dict[str, Any]:
    meta = dict(value or {})
    check_record(meta, "meta")
    return meta


def _as_shape(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen
class FeatureSpec:
    """Shape and dtype of one feature tensor.

    In a capture plan a dimension may be ``-1`` (the sequence length, unknown in advance);
    on a :class:`SampleRef` every dimension is concrete.
    """

    shape: tuple[int, ...] = attrs.field(converter=_as_shape)
    dtype: str = attrs.field()

    @dtype.validator
    def _check_dtype(self, _attribute: Any, value: str) -> None:
        if not isinstance(value, str) or value.startswith("torch."):
            raise RecordError(f"FeatureSpec.dtype must be a bare dtype name like 'bfloat16', got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FeatureSpec:
        return cls(shape=data["shape"], dtype=data["dtype"])

    def accepts(self, concrete: FeatureSpec) -> bool:
        """Whether a concrete spec fits this (possibly ``-1``-wildcarded) one."""
        if self.dtype != concrete.dtype or len(self.shape) != len(concrete.shape):
            return False
        return all(want in (-1, got) for want, got in zip(self.shape, concrete.shape))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _features(value: Mapping[str, Any]) -> dict[str, FeatureSpec]:
    out = {}
    for key, spec in value.items():
        out[str(key)] = spec if isinstance(spec, FeatureSpec) else FeatureSpec.from_dict(spec)
    return out


class _JsonRecord:
    """JSON round trip shared by the metadata records."""

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - overridden
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RecordError(f"{cls.__name__} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RecordError(f"{cls.__name__} JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)


@attrs.frozen(kw_only=True)
class SampleRef(_JsonRecord):
    """Where one captured sample lives and what it holds; metadata only.

    ``store`` is the store's URI (``memory://<id>``, ``disk:///abs/dir``, ...);
    ``generation`` increases each time the same ``sample_id`` is put again, and a store
    refuses a ref whose generation is no longer current.
    """

    sample_id: str
    run_id: str
    store: str
    features: dict[str, FeatureSpec] = attrs.field(converter=_features)
    strategy: str = ""
    schema_version: int = SCHEMA_VERSION
    num_tokens: int = 0
    generation: int = 0
    meta: dict[str, Any] = attrs.field(factory=dict, converter=_freeze_meta)

    @property
    def nbytes(self) -> int:
        from .dtypes import dtype_size

        return sum(spec.numel * dtype_size(spec.dtype) for spec in self.features.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "run_id": self.run_id,
            "store": self.store,
            "features": {k: v.to_dict() for k, v in sorted(self.features.items())},
            "strategy": self.strategy,
            "schema_version": self.schema_version,
            "num_tokens": self.num_tokens,
            "generation": self.generation,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SampleRef:
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecordError(f"SampleRef has unknown fields {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise RecordError(f"SampleRef record is incomplete: {exc}") from None


@attrs.frozen(kw_only=True)
class StepContext(_JsonRecord):
    """What a strategy knows about where training stands when ``forward_loss`` is called.

    ``global_step`` counts completed optimizer updates; ``total_steps`` is the planned
    number of optimizer updates, or ``None`` when the horizon is unknown (a streaming run
    with no step budget).
    """

    global_step: int = 0
    total_steps: int | None = None
    epoch: int = 0
    training: bool = True

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepContext:
        return cls(**data)


@attrs.frozen(kw_only=True)
class TrainBatch:
    """A collated batch: the one record allowed to carry tensors.

    ``tensors`` maps names to batched tensors (padded as the strategy chooses);
    ``sample_ids`` lets the trainer ack exactly these samples at the optimizer boundary;
    ``num_tokens`` counts real (unpadded) tokens, used for throughput.
    """

    tensors: dict[str, Any]
    sample_ids: tuple[str, ...] = attrs.field(converter=tuple)
    num_tokens: int = 0

    def __getitem__(self, key: str) -> Any:
        return self.tensors[key]

    def to(self, device: Any) -> TrainBatch:
        moved = {k: v.to(device, non_blocking=True) for k, v in self.tensors.items()}
        return attrs.evolve(self, tensors=moved)


@attrs.frozen(kw_only=True)
class StepOutput:
    """What ``forward_loss`` returns.

    ``loss`` is the scalar tensor to backpropagate. ``metrics`` are plain floats logged as
    they are. ``ratio_metrics`` map a name to ``(numerator, denominator)`` so that pooling
    across micro-batches, ranks and eval batches is ``Σnum / Σden`` and does not depend on
    batch size or rank count.
    """

    loss: Any
    metrics: dict[str, float] = attrs.field(factory=dict)
    ratio_metrics: dict[str, tuple[float, float]] = attrs.field(factory=dict)

    def to_record(self) -> dict[str, Any]:
        """Metadata view (loss as a float), safe to log or send through a control plane."""
        loss = float(self.loss.detach()) if hasattr(self.loss, "detach") else float(self.loss)
        ratios = {k: [float(n), float(d)] for k, (n, d) in self.ratio_metrics.items()}
        return {"loss": loss, "metrics": {k: float(v) for k, v in self.metrics.items()}, "ratio_metrics": ratios}
