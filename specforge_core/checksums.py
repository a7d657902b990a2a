"""Checksums of tensor bytes for the stores that record them: xxh3-64, crc32c and crc32 (zlib).

Three kinds, named in what a store records so that a reader knows which one to recompute:

- ``xxh3-64``, the default for new writes: the 64-bit XXH3 hash of the bytes, which the
  ``xxhash`` package computes with the CPU's vector units (SSE2/AVX2/AVX-512 on x86-64,
  NEON on ARM) at roughly 30-60 GB/s per core, about twice crc32c's speed and faster than
  the copy that follows a read, so a verified get costs little more than an unverified
  one. It is a checksum against corruption (flipped, torn or swapped bytes), not against a
  forger, like the crcs it replaced.
- ``crc32c`` (Castagnoli), what new writes recorded before: the ``crc32c`` package computes
  it with the CPU's CRC instructions (SSE4.2 on x86-64, the CRC extension on ARMv8) at
  roughly 10-30 GB/s, or a table-driven loop (under 1 GB/s) where the CPU lacks them
  (:data:`CRC32C_IN_HARDWARE` says which one runs here). Kept so those files stay readable
  and checkable.
- ``crc32`` (zlib), what stores wrote before crc32c: about 2-3 GB/s per core, kept likewise.

For a software crc, a large tensor is split into ``CRC_BLOCK`` blocks whose checksums are
computed in threads (both implementations release the GIL), and :func:`checksum` joins them
with the crc ``combine`` operation into the plain checksum of the bytes, which any tool can
recompute; :func:`block_crcs` returns them as they are. crc32c on CRC instructions runs in
the calling thread: it outruns the memory it reads, and handing blocks to other threads
cost more than it saved on a loaded machine (``bench/feature_stores.py``).
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import attrs
import crc32c
import xxhash

if TYPE_CHECKING:
    import torch

CRC_BLOCK = 4 << 20
_pool: ThreadPoolExecutor | None = None
_verifier: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@attrs.frozen
class ChecksumKind:
    """One checksum over bytes: its recorded ``name``, the function ``(buffer) -> int``
    computing it, and for a crc its bit-reflected ``polynomial`` (for combining block
    checksums) and whether :func:`checksum` splits large tensors over threads (``threaded``:
    a software crc). A kind without a polynomial is always computed in one pass."""

    name: str
    polynomial: int | None
    function: Callable[..., int] = attrs.field(repr=False)
    threaded: bool = attrs.field(default=True)

    @threaded.validator
    def _combinable(self, _attribute, threaded: bool) -> None:
        if threaded and self.polynomial is None:
            raise ValueError(f"checksum {self.name!r} has no polynomial to join block checksums with")


CRC32 = ChecksumKind("crc32", 0xEDB88320, zlib.crc32)
CRC32C = ChecksumKind("crc32c", 0x82F63B78, crc32c.crc32c, threaded=not crc32c.hardware_based)
XXH3_64 = ChecksumKind("xxh3-64", None, xxhash.xxh3_64_intdigest, threaded=False)
#: recorded name -> kind, for every checksum a store may have written
CHECKSUM_KINDS = {kind.name: kind for kind in (CRC32, CRC32C, XXH3_64)}
#: what new writes record
DEFAULT_CHECKSUM = XXH3_64


#: whether crc32c runs on the CPU's CRC instructions here (else a table-driven loop)
CRC32C_IN_HARDWARE = bool(crc32c.hardware_based)


def block_crcs(tensor: torch.Tensor, kind: ChecksumKind = CRC32) -> list[int]:
    """The crc of each ``CRC_BLOCK`` bytes of ``tensor`` (a CPU tensor, any dtype), in order."""
    return _block_crcs(_bytes_of(tensor), kind)


def checksum(tensor: torch.Tensor, kind: ChecksumKind = DEFAULT_CHECKSUM) -> int:
    """The plain checksum of ``tensor``'s bytes (its blocks computed in parallel if ``kind.threaded``)."""
    return checksum_bytes(_bytes_of(tensor), kind)


def checksum_bytes(data: Any, kind: ChecksumKind = DEFAULT_CHECKSUM) -> int:
    """:func:`checksum` of a flat, contiguous buffer of bytes (a ``memoryview`` slice of a mapped file, a uint8
    array): the same value as for a tensor of those bytes, without making the tensor."""
    if not kind.threaded:
        return kind.function(data)
    nbytes = len(data)
    crc = 0
    for index, block_crc in enumerate(_block_crcs(data, kind)):
        if index:
            crc = _combine(kind.polynomial, crc, block_crc, min(CRC_BLOCK, nbytes - index * CRC_BLOCK))
        else:
            crc = block_crc
    return crc


def _bytes_of(tensor: torch.Tensor):
    """``tensor``'s bytes as a flat uint8 array (a view when it is contiguous)."""
    return tensor.reshape(-1).view(_uint8()).numpy()


def _block_crcs(data: Any, kind: ChecksumKind) -> list[int]:
    """``kind`` of each ``CRC_BLOCK`` bytes of the flat buffer ``data``, the blocks of a large one in threads."""
    if len(data) <= CRC_BLOCK:
        return [kind.function(data)]
    blocks = [data[start:start + CRC_BLOCK] for start in range(0, len(data), CRC_BLOCK)]
    return list(_threads().map(kind.function, blocks))


def crc32(tensor: torch.Tensor) -> int:
    """The plain zlib crc32 of ``tensor``'s bytes (what stores recorded before crc32c)."""
    return checksum(tensor, CRC32)


def _uint8():
    import torch

    return torch.uint8


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="specforge-crc")
        return _pool


def submit_check(fn: Callable[[], object]) -> Future:
    """Run ``fn`` (a store's deferred checksum pass) on its own thread; its future.

    Not on the block threads: a deferred pass over a zlib-crc32 file hands its blocks to those,
    and waiting on them from one of their own workers could deadlock.
    """
    global _verifier
    with _pool_lock:
        if _verifier is None:
            _verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specforge-verify")
    return _verifier.submit(fn)


def _gf2_multiply(polynomial: int, a: int, b: int) -> int:
    """a * b modulo ``polynomial`` (bit-reflected, as zlib's multmodp)."""
    product, mask = 0, 1 << 31
    while mask:
        if a & mask:
            product ^= b
        mask >>= 1
        b = (b >> 1) ^ polynomial if b & 1 else b >> 1
    return product


def _combine(polynomial: int, crc1: int, crc2: int, len2: int) -> int:
    """crc(A + B) from crc1 = crc(A), crc2 = crc(B) and len(B) (zlib's crc32_combine, any reflected crc)."""
    return _gf2_multiply(polynomial, _shift_by_bytes(polynomial, len2), crc1) ^ crc2


@functools.lru_cache(maxsize=64)
def _shift_by_bytes(polynomial: int, nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial; cached, since every block but a tensor's last has one size."""
    shift, power = 1 << 31, 1 << 30  # x^0 and x^1
    bits = nbytes * 8
    while bits:  # square-and-multiply
        if bits & 1:
            shift = _gf2_multiply(polynomial, power, shift)
        power = _gf2_multiply(polynomial, power, power)
        bits >>= 1
    return shift
