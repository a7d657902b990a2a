"""AdamW (with fp32 master weights for bf16 parameters) and the warmup + cosine/constant schedule."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from ..config import TrainOptions


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW that keeps fp32 master copies of low-precision parameters.

    The model keeps its bf16 parameters (fast forward/backward, half the memory); the
    optimizer updates fp32 masters, so small updates are not rounded away, and copies them
    back after each step.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs: Any) -> None:
        self.model_params = [p for p in params]
        masters = [p.detach().clone().float().requires_grad_(True) for p in self.model_params]
        super().__init__(masters, **kwargs)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        masters = [p for group in self.param_groups for p in group["params"]]
        for master, param in zip(masters, self.model_params):
            master.grad = None if param.grad is None else param.grad.detach().float()
        loss = super().step(closure)
        for master, param in zip(masters, self.model_params):
            param.copy_(master)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model_params:
            param.grad = None
        super().zero_grad(set_to_none=set_to_none)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


#: Device types whose parameters AdamW updates with torch's fused kernel.
FUSED_DEVICES = ("cpu", "cuda")


def fused_adamw(params: Iterable[torch.Tensor]) -> bool:
    """Whether AdamW runs torch's fused kernel over ``params``: all on one device type of
    :data:`FUSED_DEVICES`, floating point.

    The fused kernel updates a parameter and both its moments in one pass, one call per parameter;
    torch's default on CPU is the for-loop form, about ten elementwise ops per parameter (at the step
    bench's shapes, one thread: a DFlash draft's optimizer step 0.54 ms instead of 1.65, Domino's 1.7
    instead of 7.6).
    The update is AdamW's, equal to the for-loop's up to float rounding (tested).
    """
    params = list(params)
    kinds = {p.device.type for p in params}
    return len(kinds) == 1 and kinds <= set(FUSED_DEVICES) and all(p.is_floating_point() for p in params)


def build_optimizer(model: torch.nn.Module, train: TrainOptions) -> torch.optim.Optimizer:
    params = trainable_parameters(model)
    if not params:
        raise ValueError("the draft model has no trainable parameters")
    kwargs: dict[str, Any] = dict(lr=train.lr, weight_decay=train.weight_decay, betas=(0.9, 0.95), eps=1e-8)
    if fused_adamw(params):  # elsewhere torch's own default (fused=False would also turn its foreach off)
        kwargs["fused"] = True
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        return MasterWeightAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def warmup_steps(train: TrainOptions, total_steps: int) -> int:
    """The warmup length: ``train.warmup_steps`` when set, else ``warmup_ratio`` of the planned steps."""
    return train.warmup_steps or round(train.warmup_ratio * total_steps)


def lr_factor(step: int, train: TrainOptions, total_steps: int) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based)."""
    warmup = warmup_steps(train, total_steps)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if train.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    floor = train.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainOptions, total_steps: int) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train, total_steps))
