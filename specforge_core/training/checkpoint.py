"""Checkpoints: atomic directories, ``latest`` / ``best`` pointers, rotation, resume contract.

Layout of ``{output}/{run_id}-step{N}/``::

    model.safetensors          trainable draft weights (+ persistent buffers); frozen target
                               parts are not saved, their fingerprint is in trainer_state.json
    optim.rank{r}.safetensors  each rank's optimizer state tensors (its shard under FSDP2)
    optim.rank{r}.json         the non-tensor optimizer state (param groups, scalars)
    rng.rank{r}.safetensors    each rank's torch RNG state(s)
    trainer_state.json         global step, epoch, data position, scheduler, best, contract

The directory is written as ``.tmp-{name}`` and renamed into place by rank 0 after every
rank has written its files, so a half-written checkpoint is never picked up. ``latest`` and
``best`` are small files holding a checkpoint's directory name, replaced atomically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import SpecforgeError
from ..fileio import atomic_write_text, fsync_dir
from ..run_directory import CHECKPOINT_STATE as STATE_FILE
from ..run_directory import existing_run
from .distributed import DistInfo, barrier

_STEP_DIR = re.compile(r"^(?P<run>.+)-step(?P<step>\d+)$")


class CheckpointError(SpecforgeError):
    """A checkpoint is missing, incomplete, or does not match the run resuming from it."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.detach().cpu().contiguous().clone()


def model_state(model: torch.nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """Full (gathered) state of trainable parameters and persistent buffers; frozen params left out.

    A collective under FSDP2: every rank must call it; only rank 0's result is complete.
    """
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if info.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items() if k not in frozen}


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], info: DistInfo) -> None:
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    expected = set(model.state_dict()) - frozen
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint weights do not fit the draft model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    if info.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(state, strict=False)


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into safetensors-able tensors and JSON metadata."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = _local(value)
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        index, _, key = name.partition(".")
        param = params[int(index)]
        if isinstance(param, DTensor) and value.dim() > 0:
            value = DTensor.from_local(value.to(param.to_local().device), param.device_mesh, param.placements,
                                       shape=param.shape, stride=param.stride())
        elif value.dim() > 0:
            value = value.to(param.device)
        state.setdefault(int(index), {})[key] = value
    for index, entry in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entry)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


class CheckpointManager:
    """Saves, finds and rotates a run's checkpoints under ``output_dir``."""

    def __init__(self, output_dir: str | os.PathLike[str], run_id: str, info: DistInfo, keep_last: int = 2) -> None:
        self.output_dir = Path(output_dir)
        self.run_id = run_id
        self.info = info
        self.keep_last = keep_last

    # ------------------------------------------------------------------ save
    def save(self, *, global_step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], is_best: bool = False) -> Path:
        """Write a checkpoint on every rank; returns its final path. Collective."""
        name = f"{self.run_id}-step{global_step}"
        final = self.output_dir / name
        tmp = self.output_dir / f".tmp-{name}"
        weights = model_state(model, self.info)  # collective under FSDP2
        if self.info.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)  # leftover of a crash while saving this very step
            tmp.mkdir(parents=True)
        barrier(self.info)
        rank = self.info.rank
        opt_tensors, opt_meta = optimizer_state(optimizer)
        save_file(opt_tensors, str(tmp / f"optim.rank{rank}.safetensors"))
        (tmp / f"optim.rank{rank}.json").write_text(json.dumps(opt_meta))
        save_file(rng_state(), str(tmp / f"rng.rank{rank}.safetensors"))
        barrier(self.info)
        if self.info.is_main:
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
            for path in tmp.iterdir():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
            fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.output_dir)
            atomic_write_text(self.output_dir / "latest", name + "\n")
            if is_best:
                atomic_write_text(self.output_dir / "best", name + "\n")
            self._rotate()
        barrier(self.info)
        return final

    def pointer(self, which: str) -> str | None:
        """The checkpoint name ``latest`` or ``best`` points at, or None."""
        path = self.output_dir / which
        return path.read_text().strip() if path.exists() else None

    def checkpoints(self) -> list[Path]:
        """This run's complete checkpoints, oldest first."""
        found = []
        if not self.output_dir.exists():
            return found
        for path in self.output_dir.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and match["run"] == self.run_id and (path / STATE_FILE).exists():
                found.append((int(match["step"]), path))
        return [path for _step, path in sorted(found)]

    def _rotate(self) -> None:
        keep = {self.pointer("best"), self.pointer("latest")}
        existing = self.checkpoints()
        for path in existing[:-self.keep_last] if self.keep_last else existing:
            if path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def resolve(self, which: str) -> Path:
        """``latest``, ``best`` or a path -> a complete checkpoint directory."""
        return resume_checkpoint(self.output_dir, which)

    def load(self, path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore weights, this rank's optimizer and RNG state; return the trainer state."""
        state = json.loads((path / STATE_FILE).read_text())
        rank = self.info.rank
        optim_file = path / f"optim.rank{rank}.safetensors"
        if not optim_file.exists():
            raise CheckpointError(f"{path} has no optimizer state for rank {rank}")
        load_model_state(model, load_file(str(path / "model.safetensors")), self.info)
        load_optimizer_state(optimizer, load_file(str(optim_file)),
                             json.loads((path / f"optim.rank{rank}.json").read_text()))
        set_rng_state(load_file(str(path / f"rng.rank{rank}.safetensors")))
        return state


def resume_checkpoint(output_dir: str | os.PathLike[str], which: str) -> Path:
    """The complete checkpoint ``--resume which`` names for a run in ``output_dir``: ``latest`` or ``best`` (the
    pointer files there) or a checkpoint directory. Reads only, so a run checks it before it builds anything."""
    output_dir = Path(output_dir)
    if which in ("latest", "best"):
        pointer = output_dir / which
        if not pointer.exists():
            start = ("start over with --overwrite (it moves what is there aside) or in another --output directory"
                     if existing_run(output_dir) else "run without --resume to start fresh")
            raise CheckpointError(f"no '{which}' checkpoint in {output_dir}: nothing to resume ({start})")
        path = output_dir / pointer.read_text().strip()
    else:
        path = Path(which)
        if not path.exists():
            raise CheckpointError(f"--resume {which}: no such checkpoint directory; pass --resume latest, best, or a "
                                  "checkpoint directory (OUTPUT/RUN_ID-stepN)")
    if not (path / STATE_FILE).exists() or not (path / "model.safetensors").exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {STATE_FILE} or model.safetensors); pass "
                              "--resume latest, best, or a checkpoint directory (OUTPUT/RUN_ID-stepN)")
    return path


#: The contract field a resume may change: the planned number of optimizer steps (``train.max_steps``, or
#: ``train.epochs`` through the data size), so a finished run can be extended.
HORIZON = "total_steps"
#: Contract fields checkpoints of earlier releases did not record: a saved contract without one is not checked
#: on it (the run resumes as those releases let it).
RECORDED_LATER = frozenset({"seed", "data", "samples"})
#: What a changed contract field means, where its name alone does not say
CHANGE_HINTS = {"samples": "the training samples are not those the checkpoint trained on (a data file edited in "
                           "place, features captured again into the same directory, another tokenizer)"}


def check_contract(saved: dict[str, Any], current: dict[str, Any], path: Path, *, completed: int = 0) -> None:
    """Refuse a resume whose contract changed, naming the first field that differs.

    The planned number of steps may change, to any number at least the ``completed`` steps
    of the checkpoint: the learning-rate schedule (and any strategy schedule reading
    ``StepContext.total_steps``) then runs to the new horizon from where it stands.
    """
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if key in RECORDED_LATER and key not in saved:
            continue
        if key == HORIZON and isinstance(new, int):
            if new < completed:
                raise CheckpointError(f"cannot resume from {path}: it has already trained {completed} optimizer steps, "
                                      f"more than the {new} this run plans; raise train.max_steps (or train.epochs) "
                                      f"to at least {completed}")
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            for sub in sorted(set(old) | set(new)):
                if old.get(sub) != new.get(sub):
                    raise CheckpointError(
                        f"cannot resume from {path}: {key}.{sub} changed (checkpoint: {old.get(sub)!r}, "
                        f"now: {new.get(sub)!r}){_hint(key)}; resume with the same setting or start a new run")
        elif old != new:
            raise CheckpointError(f"cannot resume from {path}: {key} changed (checkpoint: {old!r}, now: {new!r})"
                                  f"{_hint(key)}; resume with the same setting or start a new run")


def _hint(key: str) -> str:
    return f": {CHANGE_HINTS[key]}" if key in CHANGE_HINTS else ""
