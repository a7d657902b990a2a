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
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import attrs
import crc32c
import xxhash

if TYPE_CHECKING:
    import torch

CRC_BLOCK = 4 << 20
#: :meth:`TensorCheck.copy` hashes and copies a tensor above twice this many bytes a part of this size at a time:
#: one pass over memory instead of two (a 64 MiB bf16 tensor verified and copied 1.23x as fast as with the whole
#: tensor hashed first, 2 MiB parts 1.06x as fast as 1 MiB ones; docs/benchmarks.md)
FUSED_PART = 2 << 20
_pool: ThreadPoolExecutor | None = None
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
    #: ``() -> hasher`` with ``update(bytes)`` and ``intdigest()``: the checksum a part at a time
    stream: Callable[[], Any] = attrs.field(default=None, repr=False)

    @threaded.validator
    def _combinable(self, _attribute, threaded: bool) -> None:
        if threaded and self.polynomial is None:
            raise ValueError(f"checksum {self.name!r} has no polynomial to join block checksums with")


class _CrcStream:
    """A crc a part at a time (``function(data, crc)`` continues ``crc``), as xxhash's hashers are used."""

    __slots__ = ("function", "value")

    def __init__(self, function: Callable[..., int]) -> None:
        self.function, self.value = function, 0

    def update(self, data: Any) -> None:
        self.value = self.function(data, self.value)

    def intdigest(self) -> int:
        return self.value


CRC32 = ChecksumKind("crc32", 0xEDB88320, zlib.crc32, stream=functools.partial(_CrcStream, zlib.crc32))
CRC32C = ChecksumKind("crc32c", 0x82F63B78, crc32c.crc32c, threaded=not crc32c.hardware_based,
                      stream=functools.partial(_CrcStream, crc32c.crc32c))
XXH3_64 = ChecksumKind("xxh3-64", None, xxhash.xxh3_64_intdigest, threaded=False, stream=xxhash.xxh3_64)
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


class TensorCheck:
    """One tensor's recorded checksum, checked later: calling it hashes ``data`` (the tensor's bytes where they lie,
    a flat buffer such as a slice of a file's map) with ``kind`` and raises ``fail(actual)`` unless the result is
    ``expected``. A store hands these to a batch read (:func:`copies_checking`) so that each runs just before the
    collate's copy of ``tensor``, which then reads the bytes from the CPU cache the hash left them in."""

    __slots__ = ("tensor", "data", "kind", "expected", "fail")

    def __init__(self, tensor: torch.Tensor, data: Any, kind: ChecksumKind, expected: int | None,
                 fail: Callable[[int], BaseException]) -> None:
        self.tensor, self.data, self.kind, self.expected, self.fail = tensor, data, kind, expected, fail

    def __call__(self) -> None:
        actual = checksum_bytes(self.data, self.kind)
        if actual != self.expected:
            raise self.fail(actual)

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        """The check, then ``dest.copy_(source)`` (``source`` is this check's tensor). A tensor larger than
        ``2 * FUSED_PART`` bytes copied into a contiguous one of its shape and dtype is hashed and copied about
        ``FUSED_PART`` bytes at a time, each part copied from the CPU cache its hash just read it into; the check
        then raises after the last part (``dest`` holds bytes that failed)."""
        nbytes = len(self.data)
        if nbytes <= 2 * FUSED_PART or dest.shape != source.shape or dest.dtype != source.dtype \
                or self.kind.threaded or self.kind.stream is None or not source.is_contiguous() \
                or not dest.is_contiguous():
            self()
            dest.copy_(source)
            return
        flat_dest, flat_source, size = dest.view(-1), source.view(-1), source.element_size()
        step = max(1, FUSED_PART // size)
        hasher = self.kind.stream()
        for first in range(0, flat_source.shape[0], step):
            hasher.update(self.data[first * size:(first + step) * size])
            flat_dest[first:first + step].copy_(flat_source[first:first + step])
        actual = hasher.intdigest()
        if actual != self.expected:
            raise self.fail(actual)


class TensorChecks(list):
    """A sample's :class:`TensorCheck` s; calling it runs them all, in order."""

    def __call__(self) -> None:
        for check in self:
            check()


_copies = threading.local()  # .pending: {id(tensor): TensorCheck} while a batch read's collate runs in this thread


class copies_checking:  # noqa: N801 - used as a context manager, like a function
    """While open, :func:`copy_checked` in this thread runs the pending check of each tensor it copies from, once.

    :meth:`unchecked` are the checks no copy ran (and one whose copy failed: a collate that catches the error
    still has it raised after it), for the caller to run after; ``failed`` says whether a check failed in a copy.
    Nests (the outer set comes back on exit)."""

    def __init__(self, checks: list[TensorCheck]) -> None:
        self.pending: dict[int, TensorCheck] = {}
        self.others: list[TensorCheck] = []  # a second check of one tensor object, run after
        for check in checks:
            if id(check.tensor) in self.pending:
                self.others.append(check)
            else:
                self.pending[id(check.tensor)] = check
        self.failed = False
        self._outer = None

    def unchecked(self) -> list[TensorCheck]:
        return [*self.pending.values(), *self.others]

    def __enter__(self) -> copies_checking:
        self._outer = getattr(_copies, "pending", None)
        _copies.pending = self
        return self

    def __exit__(self, *_exc: object) -> None:
        _copies.pending = self._outer


def copy_checked(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest.copy_(source)``; inside :class:`copies_checking`, ``source``'s pending checksum first, if it has one.

    What a collate copies a sample's tensors with (:func:`specforge_core.data.collate.pad_right` does), so that a
    verifying store's check of each tensor runs just before its copy (a large tensor's a part at a time,
    :meth:`TensorCheck.copy`): the copy reads the bytes from the CPU cache the hash leaves them in, not from memory
    a second time. A check that fails raises here."""
    copies = getattr(_copies, "pending", None)
    if copies is not None and copies.pending:
        check = copies.pending.pop(id(source), None)  # the check holds its tensor: an id matched is that tensor
        if check is not None:
            try:
                check.copy(dest, source)
            except BaseException:
                copies.pending[id(source)] = check  # still unchecked: raised again after a collate that caught it
                copies.failed = True
                raise
            return
    dest.copy_(source)


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
