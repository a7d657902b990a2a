"""specforge-plugin-tensorboard: every run written as TensorBoard events, through the lifecycle hooks only.

An observer plugin needs nothing from the core but its hooks: this module implements
``specforge_run_started`` (opens ``OUTPUT/tensorboard`` and writes the resolved config as
text), ``specforge_step_end`` (training scalars under ``train/``), ``specforge_eval_end``
(eval scalars under ``eval/``), ``specforge_checkpoint_saved`` (the checkpoint's step and
path) and ``specforge_run_finished`` (the final figures under ``final/``, then closes).

Installed, it writes for every run; ``SPECFORGE_DISABLE_PLUGINS=tensorboard`` turns it off,
``SPECFORGE_TENSORBOARD_DIR`` puts the events elsewhere (a run id sub-folder per run).
Only rank 0 writes. torch's ``SummaryWriter`` is imported when a run starts, never when
``specforge plugins`` loads this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specforge_core import hookimpl

__version__ = "0.1.0"

#: Open writers, by run id (a process may run several runs one after another, e.g. in tests).
_WRITERS: dict[str, Any] = {}


def log_dir(run_id: str, output_dir: str) -> Path:
    """Where a run's events go: ``$SPECFORGE_TENSORBOARD_DIR/RUN_ID``, else ``OUTPUT/tensorboard``."""
    root = os.environ.get("SPECFORGE_TENSORBOARD_DIR")
    return Path(root) / run_id if root else Path(output_dir) / "tensorboard"


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _scalars(writer: Any, prefix: str, values: dict[str, Any], step: int) -> None:
    for name, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:  # not NaN
            writer.add_scalar(f"{prefix}/{name}", float(value), global_step=step)


@hookimpl
def specforge_run_started(run_id: str, output_dir: str, config: dict[str, Any]) -> None:
    if not _is_main():
        return
    from torch.utils.tensorboard import SummaryWriter

    old = _WRITERS.pop(run_id, None)
    if old is not None:
        old.close()
    writer = SummaryWriter(log_dir=str(log_dir(run_id, output_dir)))
    text = json.dumps(config, indent=2, sort_keys=True, default=str)
    writer.add_text("config", "    " + text.replace("\n", "\n    "), global_step=0)  # markdown code block
    _WRITERS[run_id] = writer


@hookimpl
def specforge_step_end(run_id: str, global_step: int, metrics: dict[str, float]) -> None:
    writer = _WRITERS.get(run_id)
    if writer is not None:
        _scalars(writer, "train", metrics, global_step)


@hookimpl
def specforge_eval_end(run_id: str, global_step: int, metrics: dict[str, float]) -> None:
    writer = _WRITERS.get(run_id)
    if writer is not None:
        _scalars(writer, "eval", metrics, global_step)
        writer.flush()


@hookimpl
def specforge_checkpoint_saved(run_id: str, global_step: int, path: str) -> None:
    writer = _WRITERS.get(run_id)
    if writer is not None:
        writer.add_text("checkpoints", f"step {global_step}: {path}", global_step=global_step)
        writer.flush()


@hookimpl
def specforge_run_finished(run_id: str, output_dir: str, summary: dict[str, Any]) -> None:
    writer = _WRITERS.pop(run_id, None)
    if writer is None:
        return
    final = {key: summary.get(key) for key in ("accept_len_sim", "accept_len_real", "tokens_per_s", "steps")}
    _scalars(writer, "final", final, int(summary.get("steps") or 0))
    writer.close()
