"""DSpark's cross-entropy and L1 distillation terms, fused: the block logits are never kept for backward.

For the rows r of a chunk of blocks (draft hidden ``h_r``, the Markov embedding ``e_r`` of the
token before the slot, the teacher's lm_head input ``u_r``, the label ``y_r``)::

    z_r   = h_r W^T + e_r W2^T                     logits: frozen target lm_head W, Markov head W2
    p_r   = softmax(z_r),   t_r = softmax(u_r W^T)  the draft's and the teacher's distributions
    CE_r  = logsumexp(z_r) - z_r[y_r]
    L1_r  = |p_r - t_r|_1,  accept_r = clamp(1 - L1_r / 2, 0, 1)   (accept: a target, no gradient)
    w_r   = the loss weighting's weights (D-PACE: from the chunk's own CE, detached)
    S     = a_ce Σ w_r CE_r + a_l1 Σ w_r L1_r
    dz_r  = w_r (a_ce (p_r - onehot(y_r)) + a_l1 p_r ⊙ (sign(p_r - t_r) - <p_r, sign(p_r - t_r)>))
    dh = dz W,   de = dz W2,   dW2 = dz^T e          three GEMMs, in forward

A chunk is computed a tile of whole blocks at a time (:func:`specforge_plugin_dflash.loss.block_tiles`);
the softmax, the cross-entropy, the L1 term, the argmax and ``dz`` share one pass over a tile's
logits, and what backward keeps is ``dh``, ``de`` and ``dW2``, scaled by the incoming
gradient of ``S``. The confidence head's BCE, whose target ``accept`` carries no gradient, stays
with autograd. Half precision runs its GEMMs in float32 on CPUs whose own bf16 GEMM is the slower
(:func:`specforge_core.nn.upcasts`); the logits and everything after them are float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from specforge_core.nn import add_product_, frozen_head, mm_wide, upcasts
from specforge_plugin_dflash.loss import block_tiles, softmax_cross_entropy_terms

if TYPE_CHECKING:
    from specforge_plugin_dflash.dpace import LossWeighting


@attrs.frozen(kw_only=True)
class DistillationTerms:
    """What :class:`~specforge_plugin_dspark.model.MarkovHead` needs besides the previous tokens to compute the
    fused terms of a chunk of blocks ``[B, c, bs]``: the draft's final hidden states ``[B, c, bs, H]``, the frozen
    target lm_head ``[V, H]``, the teacher's lm_head inputs ``[B, c, bs, H]``, the labels and weights, the
    loss weighting and the two terms' factors."""

    hidden: torch.Tensor
    head: torch.Tensor
    teacher_hidden: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    weighting: LossWeighting | None
    ce_alpha: float
    l1_alpha: float


@attrs.frozen
class DistillationSums:
    """The fused terms of a chunk: ``loss`` = a_ce Σw·CE + a_l1 Σw·L1 (differentiable), and without gradient the
    two sums ``[2]``, the weights ``w`` the loss used ``[B, c, bs]`` (the confidence term is weighted by them too),
    ``accept`` and the argmax ``predictions`` ``[B, c, bs]``."""

    loss: torch.Tensor
    sums: torch.Tensor
    weights: torch.Tensor
    accept: torch.Tensor
    predictions: torch.Tensor


class _Distillation(torch.autograd.Function):
    """The module docstring's ``S`` for one chunk; gradients for ``hidden``, ``embedding`` and ``w2``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, embedding: torch.Tensor, w2: torch.Tensor, head: torch.Tensor,
                teacher_hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                weighting: LossWeighting | None, ce_alpha: float, l1_alpha: float):
        shape, width, rank = labels.shape, hidden.shape[-1], embedding.shape[-1]
        tiles = block_tiles(*shape, head.shape[0], shape[1],  # whole blocks, on CPU cache-sized
                            cache_sized=hidden.device.type == "cpu")
        most = max((samples.stop - samples.start) * (part.stop - part.start) for samples, part in tiles) * shape[2]
        gemm = torch.float32 if upcasts(most, head) else head.dtype
        acc = torch.promote_types(gemm, torch.float32)
        frozen, w2_g = frozen_head(head, gemm), w2.to(gemm)  # the frozen head packed once where that pays
        grads_needed = any(ctx.needs_input_grad[:3])
        ce, l1 = (torch.empty(shape, dtype=acc, device=hidden.device) for _ in range(2))
        w = torch.empty(shape, dtype=weights.dtype, device=hidden.device)
        predictions = torch.empty(shape, dtype=torch.long, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) \
            if grads_needed and ctx.needs_input_grad[0] else None
        grad_e = torch.empty(embedding.shape, dtype=embedding.dtype, device=hidden.device) \
            if grads_needed and ctx.needs_input_grad[1] else None
        grad_w2 = torch.zeros(w2.shape, dtype=acc, device=w2.device) \
            if grads_needed and ctx.needs_input_grad[2] else None
        for samples, part in tiles:
            tile = labels[samples, part].shape
            rows = tile.numel()
            h = hidden[samples, part].reshape(rows, width).to(head.dtype).to(gemm)
            e = embedding[samples, part].reshape(rows, rank).to(w2.dtype).to(gemm)
            z = frozen.logits(h).to(acc)
            z += mm_wide(e, w2_g).to(acc)  # [R, V] logits of the tile
            teacher = torch.softmax(frozen.logits(teacher_hidden[samples, part].reshape(rows, width).to(head.dtype)
                                                  .to(gemm)).to(acc), dim=-1)
            label = labels[samples, part].reshape(rows, 1)
            tile_ce, tile_predictions = softmax_cross_entropy_terms(z, label)
            p = z  # z now holds the draft's softmax
            tile_ce = tile_ce.view(tile)
            sign = teacher.neg_().add_(p)  # p - t, in the teacher's buffer
            tile_l1 = sign.abs().sum(-1).view(tile)
            sign.sign_()
            tile_w = weights[samples, part]
            if weighting is not None:
                tile_w = weighting.reweight(tile_ce, tile_w)
            ce[samples, part], l1[samples, part], w[samples, part] = tile_ce, tile_l1, tile_w
            predictions[samples, part] = tile_predictions.view(tile)
            if grads_needed:
                # dz = p ⊙ w (a_ce + a_l1 (s - <p, s>)) - w a_ce onehot, built in the sign buffer
                w_rows = tile_w.reshape(rows, 1).to(acc)
                inner = (p * sign).sum(-1, keepdim=True)
                dz = sign.sub_(inner).mul_(l1_alpha).add_(ce_alpha).mul_(p).mul_(w_rows)
                dz.scatter_add_(-1, label, -ce_alpha * w_rows)
                dz_g = dz.to(gemm)
                if grad_h is not None:
                    grad_h[samples, part] = frozen.input_grad(dz_g).view(*tile, width)
                if grad_e is not None:
                    grad_e[samples, part] = (dz_g @ w2_g).view(*tile, rank)
                if grad_w2 is not None:
                    add_product_(grad_w2, dz_g.t(), e)
            z = p = teacher = sign = dz = dz_g = None  # a tile's logits go before the next tile's are made
        sums = torch.stack([(w * ce).sum(), (w * l1).sum()])
        accept = (1.0 - l1 / 2).clamp(0.0, 1.0)
        ctx.save_for_backward(grad_h, grad_e, None if grad_w2 is None else grad_w2.to(w2.dtype))
        ctx.mark_non_differentiable(sums, w, accept, predictions)
        loss = ce_alpha * sums[0] + l1_alpha * sums[1]
        return loss, sums, w, accept, predictions

    @staticmethod
    def backward(ctx, grad_loss, *_ignored):
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return (*scaled, None, None, None, None, None, None, None)


def distillation_terms(embedding: torch.Tensor, w2: torch.Tensor, terms: DistillationTerms) -> DistillationSums:
    """The fused terms of the module docstring for a chunk whose previous tokens have Markov ``embedding``
    ``[B, c, bs, r]`` under the Markov head's ``w2 [V, r]`` (called by the head's forward, which holds them)."""
    loss, sums, weights, accept, predictions = _Distillation.apply(
        terms.hidden, embedding, w2, terms.head, terms.teacher_hidden.detach(), terms.labels, terms.weights,
        terms.weighting, terms.ce_alpha, terms.l1_alpha)
    return DistillationSums(loss, sums, weights, accept, predictions)
