"""Small crash-safe file operations shared by checkpoints, channels and feature sets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or create inside ``path`` durable (POSIX needs the directory synced).

    Opens read-only and fsyncs, so it also flushes a regular file given by path.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None], *, fsync: bool = True) -> None:
    """Write ``path`` by calling ``write(tmp_path)`` then renaming: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(str(tmp))
    if fsync:
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, fsync: bool = True) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)

    atomic_write(path, write, fsync=fsync)
