"""Layers every draft model shares, so plugins do not re-type them.

Parameter names follow the Llama/Qwen checkpoints (``weight``; ``gate_proj``, ``up_proj``,
``down_proj``), so a draft's ``state_dict`` keys are already the names serving engines load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, the statistic in float32 (as Llama and Qwen compute it)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) rotary tables: ``positions [...]`` -> cos, sin ``[..., head_dim]`` in float32.

    A draft needs only to agree with itself between training and serving, and exports write
    no ``rope_scaling``, so a target's scaling is not copied.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., head_dim/2]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by per-position angles (rotate-half convention, as Llama and Qwen3), in
    float32 (float64 for a float64 ``x``), back in ``x``'s dtype. ``cos``/``sin`` broadcast
    against ``x`` (last dim head_dim)."""
    half = x.shape[-1] // 2
    xf = x if x.dtype == torch.float64 else x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
