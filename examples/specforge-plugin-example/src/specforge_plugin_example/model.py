"""The draft: K residual heads over the target's last hidden state, read out by the frozen target lm_head.

    h          = last_hidden[t]                          [.., H]   the target's lm_head input at position t
    h_j        = h + silu(W_j h)                         [.., H]   head j, W_j: Linear(H -> H)
    logits_j   = lm_head(h_j)                            [.., V]   frozen target lm_head
    head j predicts the token at t + 2 + j               (lm_head(h) itself is the target's token t + 1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExampleDraft(nn.Module):
    """``num_heads`` residual heads and the target's frozen lm_head (a frozen parameter: never trained or saved)."""

    def __init__(self, hidden_size: int, num_heads: int, lm_head: torch.Tensor, init_std: float = 0.02) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_heads))
        for head in self.heads:
            nn.init.normal_(head.weight, std=init_std)
        self.lm_head = nn.Parameter(lm_head.detach(), requires_grad=False)  # [V, H], shared with the target

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """``[.., H]`` -> logits of every head ``[.., K, V]`` (float32)."""
        hidden = last_hidden.to(self.heads[0].weight.dtype)
        states = torch.stack([hidden + F.silu(head(hidden)) for head in self.heads], dim=-2)  # [.., K, H]
        return F.linear(states.to(self.lm_head.dtype), self.lm_head).float()
