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

The softmax, the cross-entropy, the L1 term, the argmax and ``dz`` share one pass over a
chunk's logits, and what backward keeps is ``dh``, ``de`` and ``dW2``, scaled by the incoming
gradient of ``S``. The confidence head's BCE, whose target ``accept`` carries no gradient, stays
with autograd. Half precision runs its GEMMs in float32 on CPUs without bf16 GEMM instructions
(:func:`specforge_core.nn.upcasts`); the logits and everything after them are float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from specforge_core.nn import upcasts
from specforge_plugin_dflash.loss import softmax_cross_entropy_terms

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
        rows = labels.numel()
        gemm = torch.float32 if upcasts(rows, head) else head.dtype
        acc = torch.promote_types(gemm, torch.float32)
        head_g, w2_g = head.to(gemm), w2.to(gemm)
        h = hidden.reshape(rows, width).to(head.dtype).to(gemm)
        e = embedding.reshape(rows, rank).to(w2.dtype).to(gemm)
        z = (h @ head_g.t()).to(acc)
        z += (e @ w2_g.t()).to(acc)  # [R, V] logits
        teacher = torch.softmax((teacher_hidden.reshape(rows, width).to(head.dtype).to(gemm) @ head_g.t()).to(acc),
                                dim=-1)
        label = labels.reshape(rows, 1)
        ce, predictions, mass = softmax_cross_entropy_terms(z, label)
        p = z.div_(mass[:, None])  # z now holds the draft's softmax
        ce = ce.view(shape)
        sign = teacher.neg_().add_(p)  # p - t, in the teacher's buffer
        l1 = sign.abs().sum(-1).view(shape)
        sign.sign_()
        w = weights if weighting is None else weighting.reweight(ce, weights)
        w = w.clone() if w is weights else w  # an output of its own, not the input
        sums = torch.stack([(w * ce).sum(), (w * l1).sum()])
        accept = (1.0 - l1 / 2).clamp(0.0, 1.0)
        predictions = predictions.view(shape)
        grads: list[torch.Tensor | None] = [None, None, None]
        if any(ctx.needs_input_grad[:3]):
            # dz = p ⊙ w (a_ce + a_l1 (s - <p, s>)) - w a_ce onehot, built in the sign buffer
            w_rows = w.reshape(rows, 1).to(acc)
            inner = (p * sign).sum(-1, keepdim=True)
            dz = sign.sub_(inner).mul_(l1_alpha).add_(ce_alpha).mul_(p).mul_(w_rows)
            dz.scatter_add_(-1, label, -ce_alpha * w_rows)
            dz_g = dz.to(gemm)
            if ctx.needs_input_grad[0]:
                grads[0] = (dz_g @ head_g).view(hidden.shape).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                grads[1] = (dz_g @ w2_g).view(embedding.shape).to(embedding.dtype)
            if ctx.needs_input_grad[2]:
                grads[2] = (dz_g.t() @ e).to(w2.dtype)
        ctx.save_for_backward(*grads)
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
        terms.hidden, embedding, w2, terms.head.detach(), terms.teacher_hidden.detach(), terms.labels, terms.weights,
        terms.weighting, terms.ce_alpha, terms.l1_alpha)
    return DistillationSums(loss, sums, weights, accept, predictions)
