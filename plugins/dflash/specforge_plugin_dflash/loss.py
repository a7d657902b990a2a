"""The DFlash loss and metrics.

    L          = Σ w·CE / Σ w                        over every block position (weights from blocks.py)
    acc        = Σ [argmax = label]·m / Σ m          m = label_mask (not weighted by the decay)
    accept_len = mean over kept blocks of 1 + (length of the correct prefix among positions 1..bs-1)

The logits of N blocks are ``[B, N, bs, V]``, which for a large vocabulary does not fit, so
:func:`chunked_cross_entropy` asks a callable for a few blocks' logits at a time; under
autograd each chunk is checkpointed (recomputed in backward), so only one chunk's logits
exist at any moment, in forward and in backward (a batch whose blocks fit one chunk is
computed once, without the recomputation). DFlash's own loss, through the frozen target
lm_head, is :func:`frozen_head_cross_entropy`: the same sums, fused, with the input gradient
computed in forward, a tile of whole blocks at a time (:func:`block_tiles`: about
:data:`TILE_ELEMENTS` logits, so they stay in cache and the step's transient memory stays small;
Domino's and DSpark's fused losses take the same tiles).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specforge_core.nn import argmax_last, frozen_head, softmax_logsumexp_, upcasts

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
        return (ce * chunk_weights).flatten(-3).sum(-1), argmax_last(logits)

    zero = weights.new_zeros(weights.shape[:-3])
    total, predictions = reduce_chunks(chunk, labels.shape[1], chunk_blocks)
    return zero + total, predictions


def softmax_cross_entropy_terms(z: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the fused losses, per row of logits ``z [R, V]``: the cross-entropy against ``label [R, 1]`` and the
    argmax, from one pass for the maximum and one softmax pass (one exp per logit). ``z`` is left holding
    ``softmax(z)`` (see :func:`to_logit_gradient`)."""
    picked = z.gather(-1, label).squeeze(-1)
    lse, predictions = softmax_logsumexp_(z)
    return lse - picked, predictions


def minus_onehot_(z: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """``softmax - onehot(label)``, the gradient of the cross-entropy for the logits, in ``z``'s buffer, which
    :func:`softmax_cross_entropy_terms` left holding the softmax (one entry per row changes)."""
    return z.scatter_add_(-1, label, torch.full(label.shape, -1.0, dtype=z.dtype, device=z.device))


def to_logit_gradient(z: torch.Tensor, label: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w (softmax - onehot(label))``, the gradient of ``Σ w·CE`` for the logits, in ``z``'s buffer, which
    :func:`softmax_cross_entropy_terms` left holding the softmax; ``w [R]`` per row."""
    return z.mul_(w[:, None]).scatter_add_(-1, label, -w[:, None])


#: Logits per tile of the fused losses on CPU (1 MiB of float32): a chunk of blocks is cut into tiles of whole
#: blocks of about this many logits, so they stay in the CPU's L2 cache through the passes over them and the
#: step's transient memory stays small however many blocks a chunk holds; never fewer than
#: :data:`MIN_TILE_ROWS` rows.
TILE_ELEMENTS = 1 << 18
#: Each tile's GEMM passes over the whole head, so a tile has at least this many rows to amortise that.
MIN_TILE_ROWS = 128


def block_tiles(batch: int, blocks: int, block_size: int, vocab: int, chunk_blocks: int, *,
                cache_sized: bool = True) -> list[tuple[slice, slice]]:
    """``(samples, blocks)`` slices tiling ``[batch, blocks]`` whole blocks, block ranges outermost, every block
    once: at most ``chunk_blocks`` blocks of a sample per tile and, ``cache_sized`` (on CPU), about
    :data:`TILE_ELEMENTS` logits (``rows * vocab``, ``rows`` = samples x blocks x ``block_size``) unless a
    single block is wider, at least :data:`MIN_TILE_ROWS` rows where there are that many. Without
    ``cache_sized`` (CUDA, whose GEMMs want many rows and whose caches are not the point) a tile is every
    sample's ``chunk_blocks`` blocks."""
    if not cache_sized:
        return [(slice(0, batch), slice(start, min(start + chunk_blocks, blocks)))
                for start in range(0, blocks, chunk_blocks)]
    rows = max(MIN_TILE_ROWS, TILE_ELEMENTS // max(1, vocab))
    per_sample = max(1, min(chunk_blocks, rows // block_size))
    samples = max(1, rows // (per_sample * block_size))
    return [(slice(first, min(first + samples, batch)), slice(start, min(start + per_sample, blocks)))
            for start in range(0, blocks, per_sample) for first in range(0, batch, samples)]


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """:func:`frozen_head_cross_entropy`'s forward; its input gradient is computed there, so backward scales it."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                chunk_blocks: int, weighting: LossWeighting | None) -> tuple[torch.Tensor, torch.Tensor]:
        batch, blocks, bs, width = hidden.shape
        vocab = head.shape[0]
        grads = ctx.needs_input_grad[0]
        tiles = block_tiles(batch, blocks, bs, vocab, chunk_blocks, cache_sized=hidden.device.type == "cpu")
        most = max((samples.stop - samples.start) * (part.stop - part.start) * bs for samples, part in tiles)
        gemm = torch.float32 if upcasts(most, head) else head.dtype
        acc = torch.promote_types(gemm, torch.float32)  # the logits' dtype, as DFlashBackbone.logits gives them
        frozen = frozen_head(head, gemm)  # packed once for oneDNN or MKL where that pays (a vocabulary-wide head)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        predictions = torch.empty(labels.shape, dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grads else None
        # one buffer for every tile's logits, reused, and where the GEMMs run in another dtype one for their
        # product (then the logits' gradient in that dtype); packed heads' products come in buffers of their own,
        # and a packed head's product in the GEMMs' dtype holds that gradient in turn
        logits = None if frozen.packed and gemm == acc else torch.empty(most, vocab, dtype=acc, device=hidden.device)
        narrow = None if gemm == acc or frozen.packed else torch.empty(most, vocab, dtype=gemm, device=hidden.device)
        for samples, part in tiles:
            rows = hidden[samples, part].reshape(-1, width).to(head.dtype).to(gemm)
            count, low = rows.shape[0], None
            if gemm == acc:
                z = frozen.logits(rows, out=None if logits is None else logits[:count])
            else:
                low = frozen.logits(rows, out=None if narrow is None else narrow[:count])
                z = logits[:count].copy_(low)
            tile_labels = labels[samples, part]
            label = tile_labels.reshape(-1, 1)
            ce, ids = softmax_cross_entropy_terms(z, label)  # z now holds softmax(z)
            ce = ce.view(tile_labels.shape)
            w = weights[samples, part] if weighting is None else weighting.reweight(ce, weights[samples, part])
            total += (w * ce).sum()
            predictions[samples, part] = ids.view(ce.shape)
            if grads:  # dz = softmax - onehot in place, then w dz W: the row weights scale the [R, H] product
                # (one pass over the tile fewer), or, converted to the GEMMs' dtype, dz itself in that same pass
                dz, row_w = minus_onehot_(z, label), w.reshape(-1, 1).to(acc)
                target = grad_hidden[samples, part]
                if low is None:
                    torch.mul(frozen.input_grad(dz).view(target.shape), row_w.view(*target.shape[:-1], 1), out=target)
                else:
                    target.copy_(frozen.input_grad(torch.mul(dz, row_w, out=low)).view(target.shape))
            z = dz = low = None  # a tile's own logits (a packed head's) go before the next tile's are made
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(predictions)
        return total, predictions

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_predictions: torch.Tensor | None):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None


def frozen_head_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                              chunk_blocks: int, *,
                              weighting: LossWeighting | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ w·CE`` of the logits ``hidden [B, N, bs, H] @ head [V, H]^T`` against ``labels [B, N, bs]``, and the
    argmax predictions ``[B, N, bs]``: what :func:`chunked_cross_entropy` gives for a frozen head, fused.

    Per tile of whole blocks (:func:`block_tiles`: at most ``chunk_blocks`` blocks of a sample, on CPU about
    :data:`TILE_ELEMENTS` logits) the logits are computed into one buffer reused by every tile, and
    their logsumexp, the label's logit, the argmax and — under autograd — the gradient
    ``w (softmax - onehot) head`` for ``hidden`` run while they are in cache, with one exp per logit.
    What the step keeps for backward is that ``[B, N, bs, H]`` gradient, not logits, and nothing is
    recomputed. ``head`` gets no gradient (DFlash's is the target's frozen lm_head): pass the model's own
    parameter, which :func:`specforge_core.nn.frozen_head` packs for oneDNN or MKL once where that pays (a
    vocabulary-wide head on x86-64, in float32 or native bf16; its products then come in buffers of their
    own). ``weighting`` (D-PACE) reweights each tile from its own cross-entropies, which is why tiles hold
    whole blocks.
    Logits are float32 (float64 for a float64 head), as
    :meth:`~specforge_plugin_dflash.model.DFlashBackbone.logits` computes them; half precision
    runs its GEMMs in float32 on CPUs whose own bf16 GEMM is the slower (:func:`specforge_core.nn.upcasts`).
    """
    return _FrozenHeadCrossEntropy.apply(hidden, head, labels, weights, chunk_blocks, weighting)


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
