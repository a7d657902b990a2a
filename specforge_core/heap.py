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
step needs anyway, and blocks above 32 MiB are still mapped and unmapped one by one.

Only glibc is tuned (Linux); another C library keeps its own policy. A process whose
environment sets glibc's malloc variables (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_`` or malloc tunables in ``GLIBC_TUNABLES``) keeps
them: they are someone's deliberate choice.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any

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


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise
