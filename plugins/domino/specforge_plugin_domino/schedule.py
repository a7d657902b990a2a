"""The base-loss weight λ over a run (docs/algorithms.md, "Domino").

    L        = (1 − λ)·final + λ·base
    λ(step)  = clamp(λ_start · (1 − min(step / max(1, floor(T·r)), 1)), 0, 1)

``step`` is the number of completed optimizer updates (``StepContext.global_step``) and
``T`` the planned total (``StepContext.total_steps``): λ depends on nothing else, so a
resumed run continues the schedule exactly where it stopped. A run with no known horizon
(``T`` is None) trains the final head only (λ = 0). Pure Python, no torch.
"""

from __future__ import annotations

import math


def base_loss_weight(step: int, total_steps: int | None, *, start: float = 1.0, decay_ratio: float = 0.5) -> float:
    """λ at ``step`` of a ``total_steps`` run: ``start`` at step 0, linearly down to 0 at ``floor(T·r)``."""
    if total_steps is None:
        return 0.0
    window = max(1, math.floor(total_steps * decay_ratio))
    return min(max(start * (1.0 - min(step / window, 1.0)), 0.0), 1.0)
