"""Right padding of variable-length token rows, shared by capture, toy training and the bench."""

from __future__ import annotations

from typing import Any, Sequence

import torch


def right_pad(rows: Sequence[Any], pad_value: int, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S_max]`` long tensor of the rows padded on the right, and its attention mask (1 = real token)."""
    width = max(len(row) for row in rows)
    padded = torch.full((len(rows), width), pad_value, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        padded[i, :len(row)] = torch.as_tensor(row)
        mask[i, :len(row)] = 1
    return padded, mask
