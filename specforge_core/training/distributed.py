"""Process group setup, FSDP2 wrapping and exact cross-rank reductions.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the default process group is started with gloo on
CPU and NCCL on CUDA; a single process never creates a process group.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import attrs
import torch
import torch.distributed as dist

from ..errors import SpecforgeError


class DistributedError(SpecforgeError):
    """Ranks disagree (plugin set, configuration) or the process group cannot start."""


@attrs.frozen
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(preference: str = "auto", local_rank: int = 0) -> str:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise DistributedError("train.device=cuda was requested but CUDA is not available; use train.device=cpu")
    return f"cuda:{local_rank}"


def init_distributed(device_preference: str = "auto") -> DistInfo:
    """Start the process group when launched by torchrun; otherwise a single-process DistInfo."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_reduce_sums(values: Sequence[float], info: DistInfo) -> list[float]:
    """Sum float64 values across ranks (exact for integer counts below 2**53)."""
    if not info.distributed or not values:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64)
    if info.device.startswith("cuda"):
        tensor = tensor.to(info.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu().tolist()


def all_reduce_max(value: int, info: DistInfo) -> int:
    if not info.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=info.device if info.device.startswith("cuda") else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_same_everywhere(name: str, value: Any, info: DistInfo) -> None:
    """Fail on every rank, naming the ranks, when ``value`` differs between ranks."""
    values = gather_objects(value, info)
    if any(v != values[0] for v in values):
        differing = [r for r, v in enumerate(values) if v != values[0]]
        raise DistributedError(f"ranks disagree on {name}: rank 0 has {values[0]!r}, ranks {differing} differ "
                               f"(e.g. rank {differing[0]}: {values[differing[0]]!r}); every rank must run the "
                               "same installation")


def shard_model(model: torch.nn.Module, info: DistInfo, *, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Wrap with FSDP2 (``fully_shard``) across all ranks; a single process is left as it is.

    Each direct child holding trainable parameters becomes its own FSDP unit (each element
    of a ``ModuleList`` / ``ModuleDict``: containers have no forward to hook), then the
    root, so parameters are gathered layer by layer.
    """
    if not info.distributed:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    def units(module: torch.nn.Module):
        for child in module.children():
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                yield from child.children()
            else:
                yield child

    for unit in units(model):
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Skip the gradient reduce-scatter on micro-steps that are not optimizer boundaries."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)
