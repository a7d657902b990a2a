"""The DFlash loss and metrics.

    L          = Σ w·CE / Σ w                        over every block position (weights from blocks.py)
    acc        = Σ [argmax = label]·m / Σ m          m = label_mask (not weighted by the decay)
    accept_len = mean over kept blocks of 1 + (length of the correct prefix among positions 1..bs-1)

The logits of N blocks are ``[B, N, bs, V]``, which for a large vocabulary does not fit, so
:func:`chunked_cross_entropy` asks a callable for a few blocks' logits at a time; under
autograd each chunk is checkpointed (recomputed in backward), so only one chunk's logits
exist at any moment, in forward and in backward (a batch whose blocks fit one chunk is
computed once, without the recomputation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from .dpace import LossWeighting

#: ``logits_fn(start, end)`` -> float logits ``[B, end-start, bs, V]`` of blocks ``start:end``.
LogitsFn = Callable[[int, int], torch.Tensor]
#: ``chunk_fn(start, end)`` -> ``(sums, *per_block)``: tensors of blocks ``start:end`` (see :func:`reduce_chunks`).
ChunkFn = Callable[[int, int], tuple[torch.Tensor, ...]]


def reduce_chunks(chunk_fn: ChunkFn, num_blocks: int, chunk_blocks: int) -> tuple[torch.Tensor, ...]:
    """Run ``chunk_fn`` over block ranges of ``chunk_blocks`` blocks; add up its first output, concatenate the rest.

    ``chunk_fn(start, end)`` returns ``(sums, *per_block)``: ``sums`` (any shape) is summed over
    the chunks, each ``per_block`` tensor ``[B, end-start, ...]`` is concatenated along dim 1.
    Under autograd each chunk is checkpointed (recomputed in backward), so only one chunk's
    logits exist at a time; ``chunk_fn`` must then be deterministic. A single chunk (all
    blocks fit one) is not checkpointed: recomputing it would bound nothing, only cost time.
    """
    total: torch.Tensor | None = None
    pieces: list[list[torch.Tensor]] = []
    recompute = torch.is_grad_enabled() and num_blocks > chunk_blocks
    for start in range(0, num_blocks, chunk_blocks):
        end = min(start + chunk_blocks, num_blocks)
        if recompute:
            part, *per_block = checkpoint(chunk_fn, start, end, use_reentrant=False, preserve_rng_state=False)
        else:
            part, *per_block = chunk_fn(start, end)
        total = part if total is None else total + part
        pieces.append(per_block)
    return (total, *(torch.cat(list(tensors), dim=1) for tensors in zip(*pieces)))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy ``[...]`` of ``logits [..., V]`` (taken in float32, float64 kept) against
    ``labels [...]``."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)


def chunked_cross_entropy(logits_fn: LogitsFn, labels: torch.Tensor, weights: torch.Tensor,
                          chunk_blocks: int, *, weighting: LossWeighting | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ w·CE`` over ``labels``/``weights [B, N, bs]``, and the argmax predictions ``[B, N, bs]``.

    ``logits_fn`` is called on block ranges of ``chunk_blocks`` blocks; the result does not
    depend on the chunk size (up to float summation order). ``weights`` may also be
    ``[G, B, N, bs]``: then the result is ``[G]``, one weighted sum per row of weights, so
    several losses over the same logits (Domino's base and final heads) take one pass.
    ``weighting`` (D-PACE, :mod:`.dpace`) reweights each chunk's positions from their own
    cross-entropy; None or ``dflash`` uses ``weights`` as given.
    """

    def chunk(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_fn(start, end)  # [B, c, bs, V]
        ce = cross_entropy(logits, labels[:, start:end])
        chunk_weights = weights[..., start:end, :]
        if weighting is not None and weighting.dpace:
            chunk_weights = weighting.reweight(ce, chunk_weights)
        return (ce * chunk_weights).flatten(-3).sum(-1), logits.argmax(-1)

    zero = weights.new_zeros(weights.shape[:-3])
    total, predictions = reduce_chunks(chunk, labels.shape[1], chunk_blocks)
    return zero + total, predictions


def acceptance_lengths(correct: torch.Tensor, *, label_shift: int = 0, drafted: int | None = None) -> torch.Tensor:
    """``[B, N]``: 1 + the length of the all-correct prefix of the drafted positions of ``correct [B, N, bs]``.

    The bs-1 drafted positions are ``1..bs-1`` (``label_shift`` 0, DFlash), or ``0..bs-2`` with
    ``label_shift`` 1 (Domino's ``shift_label``: position k predicts ``anchor + k + 1``).
    ``drafted`` overrides how many positions from the first are drafted (DSpark drafts all
    ``bs`` positions ``0..bs-1``).
    """
    first = 1 - label_shift
    count = correct.shape[-1] - 1 if drafted is None else drafted
    return 1 + correct[..., first: first + count].long().cumprod(dim=-1).sum(dim=-1)


def block_metrics(predictions: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor,
                  keep: torch.Tensor, *, prefix: str = "", label_shift: int = 0,
                  drafted: int | None = None) -> dict[str, tuple[float, float]]:
    """Ratio metrics ``{prefix}acc`` and ``{prefix}accept_len`` as (numerator, denominator).

    A position counts as correct only where it is supervised (``label_mask``), so a block's
    accepted prefix stops at the end of the response; only kept blocks count. ``label_shift``
    is the one the blocks were drawn with, ``drafted`` how many positions a block drafts
    (see :func:`acceptance_lengths`).
    """
    correct = (predictions == labels) & label_mask  # [B, N, bs]
    accepted = acceptance_lengths(correct, label_shift=label_shift, drafted=drafted)[keep]
    return {f"{prefix}acc": (float(correct.sum()), float(label_mask.sum())),
            f"{prefix}accept_len": (float(accepted.sum()), float(accepted.numel()))}


def weighted_mean(weighted_ce: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(Σw·CE / Σw, Σw)``: the loss and its denominator; where nothing is weighted (Σw = 0, so Σw·CE = 0
    too) the loss is that 0, not NaN."""
    weight = weights.sum()
    return weighted_ce / torch.where(weight > 0, weight, torch.ones_like(weight)), float(weight)


def no_anchor_samples(num_valid: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Ratio metric ``no_anchor_samples``: pooled, the fraction of samples with no valid anchor
    (numerator: their count; ``num_valid [B]`` from :class:`~specforge_plugin_dflash.blocks.Blocks`)."""
    return {"no_anchor_samples": (float((num_valid == 0).sum()), float(num_valid.numel()))}
