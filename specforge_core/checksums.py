"""crc32 of tensor bytes on several cores, for the stores that record checksums.

One ``zlib.crc32`` runs at about 2-3 GB/s, well below a warm sequential read, so a large
tensor is split into ``CRC_BLOCK`` blocks whose crcs are computed in threads (zlib releases
the GIL). :func:`crc32` joins them with crc32_combine into the plain crc32 of the bytes,
which any tool can recompute; :func:`block_crcs` returns them as they are.
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CRC_BLOCK = 4 << 20
_CRC_POLY = 0xEDB88320  # reflected crc32 polynomial, as in zlib
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def block_crcs(tensor: torch.Tensor) -> list[int]:
    """The crc32 of each ``CRC_BLOCK`` bytes of ``tensor`` (a CPU tensor, any dtype), in order."""
    data = tensor.reshape(-1).view(_uint8()).numpy()
    if data.nbytes <= CRC_BLOCK:
        return [zlib.crc32(data)]
    blocks = [data[start:start + CRC_BLOCK] for start in range(0, data.nbytes, CRC_BLOCK)]
    return list(_threads().map(zlib.crc32, blocks))


def crc32(tensor: torch.Tensor) -> int:
    """The plain crc32 of ``tensor``'s bytes, its blocks computed in parallel."""
    nbytes = tensor.numel() * tensor.element_size()
    crc = 0
    for index, block_crc in enumerate(block_crcs(tensor)):
        crc = _crc32_combine(crc, block_crc, min(CRC_BLOCK, nbytes - index * CRC_BLOCK)) if index else block_crc
    return crc


def _uint8():
    import torch

    return torch.uint8


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="specforge-crc")
        return _pool


def _gf2_multiply(a: int, b: int) -> int:
    """a * b modulo the crc32 polynomial (bit-reflected, as zlib's multmodp)."""
    product, mask = 0, 1 << 31
    while mask:
        if a & mask:
            product ^= b
        mask >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return product


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) from crc1 = crc32(A), crc2 = crc32(B) and len(B) (zlib's crc32_combine)."""
    return _gf2_multiply(_shift_by_bytes(len2), crc1) ^ crc2


@functools.lru_cache(maxsize=64)
def _shift_by_bytes(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial; cached, since every block but a tensor's last has one size."""
    shift, power = 1 << 31, 1 << 30  # x^0 and x^1
    bits = nbytes * 8
    while bits:  # square-and-multiply
        if bits & 1:
            shift = _gf2_multiply(power, shift)
        power = _gf2_multiply(power, power)
        bits >>= 1
    return shift
