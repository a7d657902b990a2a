"""How many CPU threads torch uses in a specforge process.

torch sizes its intra-op pool from the machine's physical cores, whatever the process may
actually use: under a CPU affinity mask, a container quota or next to other jobs, its
threads then wait for each other at every parallel region, and one run was measured 35x
slower on a shared 2-core machine. So every command sets the count explicitly:
``train.threads`` when given, else ``OMP_NUM_THREADS`` when set (torchrun sets it to 1 per
rank), else the cores this process may run on.
"""

from __future__ import annotations

import os
import sys

from .errors import OptionError


def available_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def resolve_threads(requested: int | None) -> tuple[int, str]:
    """(thread count, where it came from) for ``requested`` (``train.threads``; None: the default)."""
    if requested is not None:
        return int(requested), "train.threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        try:
            count = int(env)
        except ValueError:
            raise OptionError(f"OMP_NUM_THREADS={env!r} is not a whole number; unset it or set train.threads") from None
        if count < 1:
            raise OptionError(f"OMP_NUM_THREADS={env!r} must be at least 1; unset it or set train.threads")
        return count, "OMP_NUM_THREADS"
    return available_cores(), "the cores this process may use"


def apply_threads(requested: int | None, *, quiet: bool = False) -> int:
    """Set torch's intra-op thread count (see the module doc); says what it chose on stderr."""
    import torch

    count, source = resolve_threads(requested)
    torch.set_num_threads(count)
    if not quiet:
        print(f"using {count} CPU thread(s) ({source}; set train.threads to change)", file=sys.stderr, flush=True)
    return count
