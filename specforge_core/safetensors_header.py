"""The checks of a safetensors header's tensor entries, for stores that read that layout.

A safetensors header is JSON: ``{name: {"dtype", "shape", "data_offsets"}}`` plus
``__metadata__``. Before any tensor is handed out, each entry's byte range must match its
dtype and shape, and the ranges must tile the bytes after the header exactly, so a
truncated or padded file (or object) is caught up front. Used by the ``disk`` store and
by plugin stores with a safetensors layout (``mooncake``); each names the damaged file or
object in its own error.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .dtypes import SAFETENSORS_DTYPES


class HeaderError(ValueError):
    """What is wrong with a header's entries; the caller says where (file, object)."""


def check_entries(raw: Mapping[str, Any], data_bytes: int, *, container: str = "file",
                  aligned: bool = False) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """``{name: (dtype, shape, start, end)}`` of the tensor entries of ``raw`` (without
    ``__metadata__``), checked against the ``data_bytes`` bytes that follow the header.

    ``aligned``: each tensor must also start at a multiple of its element size (a layout
    whose tensors are handed out as views of one buffer). Raises :class:`HeaderError`.
    """
    entries, spans = {}, []
    for name, entry in raw.items():
        try:
            code = entry["dtype"]
            if code not in SAFETENSORS_DTYPES:
                raise ValueError(f"unknown safetensors dtype {code!r}; known: {sorted(SAFETENSORS_DTYPES)}")
            dtype, itemsize = SAFETENSORS_DTYPES[code]
            shape = tuple(entry["shape"])
            start, end = entry["data_offsets"]
            numbers = (*shape, start, end)
            if set(map(type, numbers)) - {int} or min(numbers) < 0:
                raise ValueError("shape and offsets must be non-negative integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise HeaderError(f"its header entry for {name!r} is malformed ({exc})") from None
        needed = math.prod(shape) * itemsize
        if end - start != needed:
            raise HeaderError(f"feature {name!r} spans bytes {start}..{end} but {dtype}{list(shape)} needs {needed}")
        if aligned and start % itemsize:
            raise HeaderError(f"feature {name!r} starts at byte {start}, not a multiple of its {itemsize}-byte "
                              f"{dtype} elements")
        entries[name] = (dtype, shape, start, end)
        spans.append((start, end))
    covered = 0
    for start, end in sorted(spans):
        if start != covered:
            raise HeaderError(f"its tensors leave a gap or overlap at byte {start} of the data")
        covered = end
    if covered != data_bytes:
        raise HeaderError(f"its header describes {covered} bytes of tensor data but the {container} holds "
                          f"{data_bytes} (truncated, or extra bytes appended)")
    return entries
