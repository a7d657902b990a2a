"""D-PACE loss weighting (arXiv 2605.18810): position weights from the draft's own confidence.

A DFlash-family loss sums a cross-entropy per block position. ``loss_type: dflash`` weights
position k by DFlash's decay (see :mod:`.blocks`) and divides by the weights' sum; the D-PACE
types weight it by how much accepted continuation it is worth (docs/algorithms.md, "D-PACE")::

    p_k = exp(-CE_k)                          the draft's probability of the label
    s_k = (1 - α)·p_k + α                     smoothed (α = dpace_alpha); s = 1 where m_k = 0
    P_k = Π_{i≤k} s_i                         within the block
    dpace                              W_k = Σ_{j≥k} P_j·m_j
    dpace-cumulative-confidence-only   W_k = P_k
    dpace-continuation-value-only      W_k = (Σ_{j≥k} P_j·m_j) / P_k
    L = Σ CE·m·W / B                          W detached, B = sequences in the batch

``m`` is the validity of a position (a supervised label), never DFlash's decay. The sum is
divided by the batch size rather than by Σ m·W: dividing by the weights would cancel the
magnitudes the objective encodes, and a per-rank data-dependent denominator would bias the
data-parallel gradient average.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from . import LOSS_TYPES  # DFlash's decayed CE, then the D-PACE objective and its two ablations
from .loss import weighted_mean

__all__ = ["LOSS_TYPES", "LossWeighting", "dpace_weights"]


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, *, alpha: float, loss_type: str = "dpace") -> torch.Tensor:
    """``W [..., bs]`` of D-PACE ``loss_type`` from the per-position ``ce`` and ``valid [..., bs]`` (bool).

    Computed without gradient: the weights scale the loss, they are not trained through.
    The last dimension is the block; earlier dimensions are independent blocks.
    """
    if loss_type not in LOSS_TYPES[1:]:
        raise ValueError(f"{loss_type!r} is not a D-PACE loss type; choose one of {', '.join(LOSS_TYPES[1:])}")
    with torch.no_grad():
        ce = ce.detach().float()
        mask = valid.to(ce.dtype)
        smoothed = torch.where(valid, (1.0 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(smoothed, dim=-1)  # P_k
        if loss_type == "dpace-cumulative-confidence-only":
            return prefix
        # V_k = Σ_{j≥k} P_j·m_j / P_k = Σ_{j≥k} m_j·Π_{k<i≤j} s_i, by V_k = m_k + s_{k+1}·V_{k+1}: no division,
        # so it stays finite where P_k underflows (α = 0 and a confident miss).
        value = torch.empty_like(prefix)
        value[..., -1] = mask[..., -1]
        for k in range(prefix.shape[-1] - 2, -1, -1):
            value[..., k] = mask[..., k] + smoothed[..., k + 1] * value[..., k + 1]
        return prefix * value if loss_type == "dpace" else value


@attrs.frozen
class LossWeighting:
    """How a DFlash-family loss weights and normalises its per-position cross-entropies.

    ``loss_type`` is one of :data:`LOSS_TYPES`, ``alpha`` D-PACE's smoothing constant. For
    ``dflash`` every method returns what the plain DFlash loss computes, operation for
    operation, so choosing it changes nothing.
    """

    loss_type: str = attrs.field(default="dflash", validator=attrs.validators.in_(LOSS_TYPES))
    alpha: float = 0.5

    @classmethod
    def from_options(cls, options: Any) -> LossWeighting:
        """From a strategy's options (``loss_type``, ``dpace_alpha``)."""
        return cls(options.loss_type, options.dpace_alpha)

    @property
    def dpace(self) -> bool:
        return self.loss_type != "dflash"

    def position_weights(self, decayed: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
        """What the loss multiplies before reweighting: DFlash's ``decayed`` weights, or (D-PACE) the
        validity ``label_mask`` as floats. Both ``[B, N, bs]``."""
        return label_mask.to(decayed.dtype) if self.dpace else decayed

    def reweight(self, ce: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` times D-PACE's ``W`` from ``ce`` (unchanged for ``dflash``).

        ``ce [..., bs]`` broadcasts against ``weights [..., bs]``; a leading weights dimension
        holds separate losses (Domino's two heads), each reweighted over its own non-zero
        positions.
        """
        if not self.dpace:
            return weights
        return weights * dpace_weights(ce, weights > 0, alpha=self.alpha, loss_type=self.loss_type)

    def normalize(self, weighted: torch.Tensor, weights: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, float]:
        """``(loss, denominator)``: ``Σ / Σw`` for ``dflash`` (0 where nothing is weighted), ``Σ / B`` for D-PACE."""
        if not self.dpace:
            return weighted_mean(weighted, weights)
        return weighted / max(1, batch_size), float(max(1, batch_size))
