"""A run's output directory: the one guard before a run writes into it, and ``--overwrite``.

A training run owns its ``--output`` directory: ``run.json``, ``metrics.jsonl``, the
checkpoints and their ``latest`` / ``best`` pointers, ``summary.json`` and ``export/``.
Two runs mixed in one directory lose the first one's results and leave a directory that
holds neither run (a resume would pick up the wrong checkpoint, ``metrics.jsonl`` would
hold some steps twice). So before anything is built, :func:`check_output` refuses:

* a new run into a directory that already holds one, unless it continues it
  (``--resume``) or moves it aside first (``--overwrite``, see :func:`move_aside`);
* a directory this user cannot create or write (instead of a ``PermissionError`` deep in
  the first checkpoint, minutes later).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .errors import OptionError, SpecforgeError
from .fileio import fsync_dir

#: What a run was (its resolved config, the target's info): see :mod:`specforge_core.export`.
RUN_FILE = "run.json"
#: Files whose presence means a run wrote into the directory (checkpoint directories are
#: recognised by their ``trainer_state.json``).
RUN_FILES = (RUN_FILE, "metrics.jsonl", "summary.json", "latest", "best")
#: The file that makes a directory a complete checkpoint (:mod:`specforge_core.training.checkpoint`).
CHECKPOINT_STATE = "trainer_state.json"


class OutputDirectoryError(SpecforgeError):
    """The output directory already holds a run, or this user cannot write it."""


def existing_run(path: str | os.PathLike[str]) -> list[str]:
    """What in ``path`` shows that a run wrote there (sorted names), or [] for none."""
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        if entry.name in RUN_FILES or (entry.is_dir() and os.path.exists(os.path.join(entry.path, CHECKPOINT_STATE))):
            found.append(entry.name)
    return sorted(found)


def check_writable(path: str | os.PathLike[str], what: str = "output directory") -> None:
    """Raise unless this user can create ``path`` (or write into it, if it exists)."""
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_dir():
        raise OutputDirectoryError(f"the {what} {path} is a file, not a directory; choose another --output")
    nearest = path
    while not nearest.exists():  # the closest ancestor that exists is where the first mkdir happens
        nearest = nearest.parent
    if not nearest.is_dir():
        raise OutputDirectoryError(f"cannot create the {what} {path}: {nearest} is a file; choose another --output")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise OutputDirectoryError(f"cannot write the {what} {path}: {nearest} is not writable by this user; "
                                   "choose an --output you can write, or change its permissions")


def check_output(path: str | os.PathLike[str], *, resume: str | None, overwrite: bool) -> None:
    """The guard every training run passes before it builds or writes anything.

    A new run (no ``resume``) into a directory that already holds one is refused unless
    ``overwrite``; then :func:`move_aside` must move the old run out of the way before the
    first write. Reads only.
    """
    if resume and overwrite:
        raise OptionError("--resume continues the run in the output directory and --overwrite moves it aside: "
                          "pass one of them")
    if not resume:
        found = existing_run(path)
        if found and not overwrite:
            shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
            if not set(found) - {RUN_FILE, "metrics.jsonl"}:  # it stopped before its first checkpoint
                raise OutputDirectoryError(
                    f"{path} holds a run that stopped before its first checkpoint ({shown}): there is nothing to "
                    f"resume. Pass --overwrite to move it aside (to {path}.old-<time>) and start over, or choose "
                    "another --output directory")
            raise OutputDirectoryError(
                f"{path} already holds a run ({shown}); continue it with --resume latest, start a new run in "
                f"another --output directory, or pass --overwrite to move the old run aside (to {path}.old-<time>) "
                "and start over")
    if overwrite and existing_run(path):  # the old run is renamed within, and the new one created in, the parent
        check_writable(Path(os.path.abspath(path)).parent, "directory of the output directory")
    else:
        check_writable(path)


def move_aside(path: str | os.PathLike[str]) -> Path | None:
    """Rename a directory that holds a run to ``PATH.old-<time>`` (one atomic rename); the new name.

    Returns None when ``path`` holds no run (nothing to move). The old run stays whole
    next to the new one, so an ``--overwrite`` given by mistake loses nothing.
    """
    source = Path(os.path.abspath(path))
    if not existing_run(source):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = source.with_name(f"{source.name}.old-{stamp}")
    suffix = 1
    while target.exists():
        target = source.with_name(f"{source.name}.old-{stamp}-{suffix}")
        suffix += 1
    try:
        os.rename(source, target)
    except OSError as exc:
        raise OutputDirectoryError(f"--overwrite could not move the run in {source} aside to {target}: "
                                   f"{exc.strerror}; move it yourself or choose another --output") from None
    fsync_dir(target.parent)
    return target
