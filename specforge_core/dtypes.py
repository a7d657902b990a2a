"""Dtype names as they appear in records and safetensors headers, without importing torch."""

from __future__ import annotations

from typing import Any

from .errors import RecordError

#: record name -> (bytes per element, safetensors header code)
_DTYPES = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
}


#: safetensors header code -> (record name, bytes per element), for readers of raw headers
SAFETENSORS_DTYPES = {code: (name, size) for name, (size, code) in _DTYPES.items()}


def dtype_size(name: str) -> int:
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise RecordError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def safetensors_code(name: str) -> str:
    dtype_size(name)
    return _DTYPES[name][1]


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'``."""
    name = str(dtype).removeprefix("torch.")
    dtype_size(name)
    return name


def torch_dtype(name: str) -> Any:
    import torch

    dtype_size(name)
    return getattr(torch, name)
