"""Keeping a training process's C heap between steps (``train.keep_heap``).

torch's CPU tensors come from ``malloc``. A train step allocates and frees the same tens of
megabytes every step, and glibc's defaults hand much of that back to the kernel as the step
ends: whenever the free memory at the top of the heap exceeds its trim threshold (twice its
mmap threshold, which it raises up to 32 MiB as large blocks are freed), it shrinks the heap,
and the next step's allocations fault every page in again, each page zeroed by the kernel. In
``bench/versus_reference.py``'s Domino step that was 3000-6000 page faults per step; kept, the
DFlash step ran 1.04x and Domino's 1.03x as fast (``bench/versus_commit.py``, 15 interleaved
pairs, on a virtual machine with 4 KiB pages), EAGLE3's about 3% faster. Where a step's time is
its GEMMs it changes nothing measurable (SmolLM2-135M DFlash offline, 2.7 s steps).

:func:`keep_heap` sets both thresholds once for the process: blocks up to 32 MiB (glibc's own
ceiling for its dynamic threshold) come from the heap, and the heap is trimmed only when more
than 1 GiB is free at its top. After the first steps a step then reuses pages it already has:
the resident memory stays at the step's high-water mark between steps, which is what the
step needs anyway, and blocks above 32 MiB are still mapped and unmapped one by one (a collate's
large batches are not: :func:`empty_reused` hands them memory earlier batches left).

Only glibc is tuned (Linux); another C library keeps its own policy. A process whose
environment sets glibc's malloc variables (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_`` or malloc tunables in ``GLIBC_TUNABLES``) keeps
them: they are someone's deliberate choice.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import threading
from typing import Any, Sequence

from .switches import env_choice

#: ``mallopt`` parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap: glibc's ceiling for its dynamic mmap threshold (64-bit)
MMAP_THRESHOLD = 32 * 2**20
#: the heap is trimmed when more than this is free at its top
TRIM_THRESHOLD = 2**30
#: glibc's environment settings of its malloc, each of which :func:`keep_heap` leaves alone
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_heap(enabled: bool = True) -> str:
    """Set this process's glibc heap thresholds as the module docstring says (once is enough; repeating is
    harmless). Returns what the process's heap now does, for a log line."""
    if not enabled:
        return "the C library's default heap policy (train.keep_heap is off)"
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return f"the C library's heap as the environment sets it ({', '.join(user)})"
    libc = _glibc()
    if libc is None:
        return "the C library's default heap policy (not glibc)"
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "the C library's default heap policy (glibc refused the thresholds)"
    return f"the heap kept between steps (blocks up to {MMAP_THRESHOLD >> 20} MiB, trimmed above " \
           f"{TRIM_THRESHOLD >> 20} MiB free)"


def _glibc() -> ctypes.CDLL | None:
    """The process's own C library when it is glibc (it alone has ``gnu_get_libc_version``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - the probe: AttributeError elsewhere
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return libc


#: :func:`advise_huge_pages` advises tensors of at least this many bytes: the blocks glibc maps on their own,
#: beyond the heap that :func:`keep_heap` keeps, whose pages are faulted in afresh each time one is made
HUGE_PAGES_FROM_BYTES = MMAP_THRESHOLD
_HUGE_PAGE = 2 << 20  # x86-64's and most ARM64 kernels' transparent huge page
_MADV_HUGEPAGE = 14  # Linux's madvise advice
#: ``SPECFORGE_HUGE_PAGES=off`` keeps :func:`advise_huge_pages` from advising anything (``on`` or unset: advise)
HUGE_PAGES_ENV = "SPECFORGE_HUGE_PAGES"


def advise_huge_pages(tensor: Any) -> bool:
    """Ask Linux to back a large, fresh CPU tensor's memory with transparent huge pages before it is first
    written (``madvise(MADV_HUGEPAGE)`` over its 2 MiB-aligned part); whether the kernel accepted the advice.

    Such a tensor's memory is mapped afresh by the C library, and writing it faults each 4 KiB page in
    alone: a collate's 64 MiB batch took 34 ms to fill against 6 ms for a buffer already in use, and 12 ms
    with the advice (docs/benchmarks.md). The kernel follows it when its transparent huge pages are
    ``madvise`` or ``always`` (which needs no advice) and ignores it under ``never``; nothing changes for
    tensors under :data:`HUGE_PAGES_FROM_BYTES`, off Linux, off the CPU, or with ``SPECFORGE_HUGE_PAGES=off``
    (for a host whose kernel stalls compacting memory to find huge pages: its ``defrag`` setting).
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < HUGE_PAGES_FROM_BYTES or tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    if env_choice(HUGE_PAGES_ENV, ("on", "off")) == "off":
        return False
    madvise = _madvise()
    if madvise is None:
        return False
    start = tensor.data_ptr()
    first = (start + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    last = (start + nbytes) & ~(_HUGE_PAGE - 1)
    return last > first and madvise(first, last - first, _MADV_HUGEPAGE) == 0


def empty_advised(shape: Sequence[int], dtype: Any, device: Any = "cpu") -> Any:
    """``torch.empty(shape, dtype=dtype, device=device)``, advised to huge pages (:func:`advise_huge_pages`)."""
    import torch

    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    advise_huge_pages(out)
    return out


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


#: ``SPECFORGE_BATCH_REUSE=off`` makes :func:`empty_reused` allocate afresh every time (``on`` or unset: reuse)
BATCH_REUSE_ENV = "SPECFORGE_BATCH_REUSE"


class BlockPool:
    """Large CPU blocks handed out again once nothing holds them: :meth:`empty` is ``torch.empty`` over a
    block no tensor uses any more, or over a new one.

    A block is a torch storage this pool keeps a reference to. Every tensor made over it (and every view of
    those, every tensor autograd saved, every array sharing its memory) holds the storage too, so a block is
    free exactly when the pool's reference is the only one left (its use count). Nothing is ever written to a
    block before that, so reuse never changes a tensor someone still holds. At most ``keep`` blocks are kept;
    when all of them are in use a request gets plain new memory. A request no free block serves drops the free
    blocks smaller than it, and its new block evicts the least recently used free one if the pool is full.
    A block serves requests from half its size up to its size; new blocks get 1/8 headroom,
    rounded to 2 MiB, so a batch padded a little longer than the last still fits.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._blocks: list[Any] = []  # storages, least recently handed out first
        self._lock = threading.Lock()
        self.stats = {"reused": 0, "new": 0, "unpooled": 0}

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """A CPU tensor of ``shape`` and ``dtype`` whose contents are garbage, as ``torch.empty``'s."""
        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            block = self._take(nbytes)
        if block is None:  # every kept block in use: plain memory, advised as a new block is
            return empty_advised(shape, dtype)
        return torch.empty(0, dtype=dtype).set_(block, 0, tuple(shape))

    def free_blocks(self) -> int:
        """How many kept blocks no tensor uses now."""
        with self._lock:
            return sum(1 for block in self._blocks if _use_count(block) == 1)

    def clear(self) -> None:
        """Drop every kept block (the memory of those still in use goes when its last tensor does)."""
        with self._lock:
            self._blocks.clear()

    def _take(self, nbytes: int) -> Any:
        import torch

        fitting = [block for block in self._blocks
                   if nbytes <= block.nbytes() <= 2 * nbytes and _use_count(block) == 1]
        if fitting:
            block = min(fitting, key=lambda b: b.nbytes())
            self._blocks.remove(block)
            self._blocks.append(block)
            self.stats["reused"] += 1
            return block
        # Free blocks too small for this request go first: batches grow as long as the longest sample, and a
        # block kept for a shorter batch would only hold memory.
        self._blocks = [block for block in self._blocks if block.nbytes() >= nbytes or _use_count(block) > 1]
        if len(self._blocks) >= self.keep:
            evictable = [block for block in self._blocks if _use_count(block) == 1]
            if not evictable:
                self.stats["unpooled"] += 1
                return None
            self._blocks.remove(evictable[0])
        size = -(-(nbytes + nbytes // 8) // _HUGE_PAGE) * _HUGE_PAGE
        block = empty_advised((size,), torch.uint8).untyped_storage()
        self._blocks.append(block)
        self.stats["new"] += 1
        return block


def _use_count(storage: Any) -> int:
    """How many references a storage has: the pool's own is one (``torch._C._storage_Use_Count``, which torch's
    own CUDA-graph memory reuse reads the same way)."""
    import torch

    return torch._C._storage_Use_Count(storage._cdata)


#: the process's pool of large collate batches (:func:`empty_reused`)
BATCHES = BlockPool()


def empty_reused(shape: Sequence[int], dtype: Any, device: Any) -> Any:
    """``torch.empty(shape, dtype=dtype, device=device)``; a CPU tensor of :data:`HUGE_PAGES_FROM_BYTES` or more
    comes from :data:`BATCHES`, memory an earlier batch used and nothing holds any more, so it is not mapped,
    faulted in and zeroed afresh (``SPECFORGE_BATCH_REUSE=off``: always afresh). Fresh memory is advised to
    huge pages (:func:`advise_huge_pages`)."""
    import torch

    if torch.device(device).type == "cpu" and math.prod(shape) * dtype.itemsize >= HUGE_PAGES_FROM_BYTES \
            and env_choice(BATCH_REUSE_ENV, ("on", "off")) != "off" and hasattr(torch._C, "_storage_Use_Count"):
        return BATCHES.empty(shape, dtype)
    return empty_advised(shape, dtype, device)
