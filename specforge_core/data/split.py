"""Which rows train and which evaluate: the data files of a run and its eval split.

An eval split always exists when it can:

* ``data.eval_path`` names one: its rows evaluate;
* else the toy target's held-out conversations (when the run uses the toy's data), with
  the target's own replies (see the hf engine's ``default_eval_data``);
* else ``data.eval_holdout`` of the training file's rows is held out (default 5%, at
  least 1 and at most ``data.eval_holdout_max``). The rows are chosen by a hash of the
  file's name and the row's line number, so every run, topology and rank holds out the
  same ones, and a capture, its producer and an online run agree without talking;
* with ``eval_holdout=0``, or a training file of a single row, there is none, and
  :attr:`DataFiles.eval_note` says why.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import attrs

from ..errors import OptionError


@attrs.frozen
class DataFiles:
    """The training file, where eval rows come from, and a note for logs and ``summary.json``.

    ``holdout`` holds the line numbers of ``train_path`` that evaluate instead of training
    (empty when ``eval_path`` is a file of its own or there is no eval split).
    """

    train_path: str
    eval_path: str | None
    holdout: frozenset[int] = frozenset()
    eval_note: str = ""

    @property
    def has_eval(self) -> bool:
        return self.eval_path is not None

    def is_train_line(self, line: int) -> bool:
        return line not in self.holdout

    def is_eval_line(self, line: int) -> bool:
        """Rows of the eval file that evaluate: all of a separate file, the held-out ones of a shared one."""
        return not self.holdout or line in self.holdout


def resolve_data_files(plan: Any, engine: Any) -> DataFiles:
    """The :class:`DataFiles` of ``plan`` (its ``data`` options) for ``engine`` (which may ship default data)."""
    data = plan.data
    if data.path is None:
        default = getattr(engine, "default_data", lambda: None)() if engine is not None else None
        if default is None:
            raise OptionError("no training data: pass --data FILE (JSONL conversations) or set data.path; only the "
                              "toy target ships bundled data")
        train, bundled_eval = (str(p) for p in default)
        # The engine's on-policy version of its bundled eval split, when it has one (the toy does).
        own = getattr(engine, "default_eval_data", lambda: None)() if data.eval_path is None else None
        evaluation = data.eval_path or own or bundled_eval
        return DataFiles(train, str(evaluation), eval_note=f"eval split: {evaluation}")
    if data.eval_path is not None:
        return DataFiles(str(data.path), str(data.eval_path), eval_note=f"eval split: {data.eval_path}")
    if data.eval_holdout <= 0:
        return DataFiles(str(data.path), None, eval_note="no eval split: data.eval_holdout=0 and no data.eval_path")
    lines = _row_lines(str(data.path))
    count = min(data.eval_holdout_max, max(1, round(data.eval_holdout * len(lines))))
    if len(lines) < 2:
        return DataFiles(str(data.path), None,
                         eval_note=f"no eval split: {data.path} has {len(lines)} row(s), too few to hold one out; "
                                   "pass --eval-data FILE")
    chosen = sorted(lines, key=lambda line: _line_hash(str(data.path), line))[:count]
    return DataFiles(str(data.path), str(data.path), holdout=frozenset(chosen),
                     eval_note=f"eval split: {count} of the {len(lines)} rows of {data.path} held out "
                               f"(data.eval_holdout={data.eval_holdout:g}, at most {data.eval_holdout_max})")


def _row_lines(path: str) -> list[int]:
    """The line numbers (1-based) of the non-blank lines of ``path``: its rows."""
    from .prepare import DataError

    try:
        with open(path, "rb") as handle:
            return [number for number, raw in enumerate(handle, 1) if raw.strip()]
    except OSError as exc:
        raise DataError(f"cannot read data file {path}: {exc.strerror}") from exc


def _line_hash(path: str, line: int) -> bytes:
    """The order rows are held out in: a hash of the file's name and the line, the same on every machine."""
    return hashlib.blake2b(f"{os.path.basename(path)}:{line}".encode(), digest_size=8).digest()
