"""How one sample generation is laid out in one Mooncake object: a safetensors blob.

::

    u64 little-endian header length N
    N bytes of JSON header, padded with spaces so the tensor data starts 64-byte aligned
    tensor bytes, back to back, largest element size first (each tensor aligned to its dtype)

The header is safetensors' own (``{name: {dtype, shape, data_offsets}}`` plus a
``__metadata__`` map of strings), so an object fetched by hand loads with
``safetensors.torch.load``. Its metadata says which sample and generation the object
holds (``specforge.key``) and, with checksums on, the checksum of each tensor's bytes: its kind
in ``specforge.checksum`` (``xxh3-64``, on the CPU's vector units) and the values in
``specforge.checksums``. Objects of format ``specforge-mooncake/1`` (earlier releases) record a
zlib crc32 per 4 MiB block of each tensor instead (``specforge.crc32``); they are read and
checked as they are. Nothing here unpickles: an object is data, never code.

:func:`encode` returns the header and one flat byte view per tensor, so a put can hand
Mooncake the tensors' own memory without first copying them into one buffer;
:func:`decode` checks a received object completely (header, exact size, identity, shapes,
checksums) before returning tensors that are views into the received buffer.
"""

from __future__ import annotations

import json
from typing import Mapping

import torch

from specforge_core.checksums import CHECKSUM_KINDS, CRC_BLOCK, DEFAULT_CHECKSUM, ChecksumKind, block_crcs, checksum
from specforge_core.contracts import FeatureSpec
from specforge_core.dtypes import dtype_name, dtype_size, safetensors_code, torch_dtype
from specforge_core.safetensors_header import HeaderError, check_entries

FORMAT = "specforge-mooncake/2"
#: formats a get reads: /1 recorded zlib crc32s per 4 MiB block, /2 the checksum kind and one value per tensor
FORMATS = ("specforge-mooncake/1", FORMAT)
_FORMAT_KEY = "specforge.format"
_KEY_KEY = "specforge.key"  # "<generation>:<ascii() of the sample id>"
_CHECKSUM_KEY = "specforge.checksum"  # the kind of checksums the object records ("xxh3-64")
_CHECKSUMS_KEY = "specforge.checksums"  # {"name": checksum of the tensor's bytes}
_CRC_KEY = "specforge.crc32"  # format /1: {"name": [crc of each 4 MiB block]}
_ALIGN = 64
_HEADER_LIMIT = 100 * 2**20  # the largest header safetensors itself accepts


class LayoutError(ValueError):
    """A received object is not a complete, matching sample (the text says why)."""


def identity(sample_id: str, generation: int) -> str:
    return f"{generation}:{sample_id!a}"


def encode(sample_id: str, generation: int, tensors: Mapping[str, torch.Tensor], *,
           checksums: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(header, parts)``: the object is ``header`` followed by every part, in order.

    ``tensors`` must be contiguous CPU tensors. Each part is a flat ``uint8`` view of one
    tensor's memory (no copy); the header is a ``uint8`` tensor of its own.
    """
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    entries: dict[str, dict] = {}
    parts, offset = [], 0
    for name in order:
        tensor = tensors[name]
        flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        entries[name] = {"dtype": safetensors_code(dtype_name(tensor.dtype)), "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + flat.numel()]}
        offset += flat.numel()
        parts.append(flat)
    metadata = {_FORMAT_KEY: FORMAT, _KEY_KEY: identity(sample_id, generation)}
    if checksums:
        metadata[_CHECKSUM_KEY] = DEFAULT_CHECKSUM.name
        metadata[_CHECKSUMS_KEY] = json.dumps({name: checksum(part, DEFAULT_CHECKSUM)
                                               for name, part in zip(order, parts)}, separators=(",", ":"))
    text = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode("utf-8")
    padded = -(-(8 + len(text)) // _ALIGN) * _ALIGN - 8
    header = bytearray(8 + padded)
    header[:8] = padded.to_bytes(8, "little")
    header[8:] = text + b" " * (padded - len(text))
    return torch.frombuffer(header, dtype=torch.uint8), parts


def header_room(sample_id: str, features: Mapping[str, FeatureSpec]) -> int:
    """A generous bound on the header :func:`encode` writes for such a sample.

    A get sizes its receive buffer as tensor bytes plus this, so one round trip fetches the
    whole object; a header that outgrows it costs one more round trip, never an error.
    """
    blocks = sum(-(-spec.numel * dtype_size(spec.dtype) // CRC_BLOCK) + 1 for spec in features.values())
    # a feature's entry and its checksum (a name and up to 20 digits; a format /1 object's crcs: 12 per block)
    per_feature = sum(128 + 12 * len(name) + 22 * len(spec.shape) for name, spec in features.items())
    return 512 + 6 * len(sample_id) + per_feature + 12 * blocks + _ALIGN


def decode(buffer: torch.Tensor, size: int, *, sample_id: str, generation: int,
           features: Mapping[str, FeatureSpec], names: list[str], verify: bool) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the object held in ``buffer[:size]``, as views into ``buffer``.

    Raises :class:`LayoutError` unless the header is well formed, describes exactly
    ``size`` bytes, names this sample and generation, matches the ref's shapes and dtypes,
    and (``verify``, when the object has them) every tensor's checksum matches (format /1: every
    4 MiB block's crc32).
    """
    if size < 8:
        raise LayoutError(f"it is {size} bytes, shorter than a header")
    length = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
    if length > min(size - 8, _HEADER_LIMIT):
        raise LayoutError(f"its header claims {length} bytes but the object is {size} (truncated)")
    try:
        raw = json.loads(buffer[8:8 + length].numpy().tobytes().decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise LayoutError(f"its header is not JSON ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("__metadata__"), dict):
        raise LayoutError("its header is not a specforge sample header")
    metadata = raw.pop("__metadata__")
    if metadata.get(_FORMAT_KEY) not in FORMATS:
        raise LayoutError(f"its format is {metadata.get(_FORMAT_KEY)!r}, not one of {', '.join(map(repr, FORMATS))} "
                          "(an object a later release wrote: read it with that release)")
    if metadata.get(_KEY_KEY) != identity(sample_id, generation):
        raise LayoutError(f"it records {metadata.get(_KEY_KEY)} (generation:sample id), but the ref names "
                          f"{identity(sample_id, generation)}")
    data_start, entries = 8 + length, _check_entries(raw, size - 8 - length)
    recorded = _recorded_checksums(metadata) if verify else None
    tensors = {}
    for name in names:
        if name not in entries:
            raise LayoutError(f"it has no tensor {name!r}, which the ref lists")
        dtype, shape, start, end = entries[name]
        want = features[name]
        if dtype != want.dtype or shape != tuple(want.shape):
            raise LayoutError(f"feature {name!r} is {dtype}{list(shape)} but the ref says "
                              f"{want.dtype}{list(want.shape)}")
        flat = buffer[data_start + start:data_start + end]
        if recorded is not None and name in recorded[1]:
            kind, values = recorded
            if (block_crcs(flat) if kind is None else checksum(flat, kind)) != values[name]:
                raise LayoutError(f"feature {name!r} fails its {'crc32' if kind is None else kind.name} check: its "
                                  "bytes changed after the put")
        torch_type = torch_dtype(dtype)
        tensors[name] = flat.view(torch_type).view(shape) if flat.numel() else torch.empty(shape, dtype=torch_type)
    return tensors


def _check_entries(raw: dict, data_bytes: int) -> dict[str, tuple]:
    """``{name: (dtype, shape, start, end)}``, checked to tile ``data_bytes`` exactly, each aligned."""
    try:
        return check_entries(raw, data_bytes, container="object", aligned=True)
    except HeaderError as exc:
        raise LayoutError(str(exc)) from None


def _recorded_checksums(metadata: dict) -> tuple[ChecksumKind | None, dict] | None:
    """``(kind, {name: value})`` the object records: ``kind`` None for format /1's crc32 lists per 4 MiB block;
    None when it was written with checksums off (the size and identity checks still run)."""
    if _CHECKSUM_KEY in metadata:
        kind = CHECKSUM_KINDS.get(metadata[_CHECKSUM_KEY])
        if kind is None:
            raise LayoutError(f"it records checksums of kind {metadata[_CHECKSUM_KEY]!r}, which this specforge does "
                              f"not know (known: {', '.join(sorted(CHECKSUM_KINDS))})")
        key = _CHECKSUMS_KEY
    elif _CRC_KEY in metadata:
        kind, key = None, _CRC_KEY
    else:
        return None
    try:
        values = json.loads(metadata[key])
    except (TypeError, ValueError, KeyError) as exc:
        raise LayoutError(f"its recorded checksums are malformed ({exc!r})") from None
    if not isinstance(values, dict):
        raise LayoutError("its recorded checksums are not a map")
    return kind, values
