"""Domino's two cross-entropies, fused: neither head's logits are kept for backward.

For the rows r of a chunk of blocks (draft hidden ``h_r``, label ``y_r``, block position
``k_r``) and, at positions ``k >= suffix_start``, the correction's hidden activation
``a_r = silu(W1 [h_r ; g_r])``::

    b_r   = h_r W^T                                  base logits: frozen target lm_head W
    f_r   = b_r + a_r W2^T      (k_r >= start)       final logits; below start f_r = b_r
    CEb_r = logsumexp(b_r) - b_r[y_r],   CEf_r likewise of f_r
    wb, wf = the loss weighting's weights of each head (D-PACE: from that head's own CE, detached)
    S     = λ Σ wb CEb + (1 - λ) Σ wf CEf
    df_r  = (1 - λ) wf_r (softmax(f_r) - onehot(y_r))                           k_r >= start
    db_r  = (λ wb_r + (1 - λ) wf_r [k_r < start]) (softmax(b_r) - onehot(y_r)) + df_r [k_r >= start]
    dh = db W,   da = df W2,   dW2 = df^T a           three GEMMs, in forward

A chunk is computed a tile of whole blocks at a time (:func:`specforge_plugin_dflash.loss.block_tiles`);
each head's softmax, cross-entropy, argmax and logit gradient share one pass over the tile's
logits, and what backward keeps is ``dh``, ``da`` and ``dW2``, scaled by the incoming gradient
of ``S``. ``W1`` and the SiLU stay with autograd (through ``da``). Half precision runs the GEMMs
in float32 on CPUs whose own bf16 GEMM is the slower (:func:`specforge_core.nn.upcasts`); the
logits and everything after them are float32 (float64 for a float64 head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from specforge_core.nn import add_product_, frozen_head, mm_wide, upcasts
from specforge_plugin_dflash.loss import block_tiles, softmax_cross_entropy_terms, to_logit_gradient

if TYPE_CHECKING:
    from specforge_plugin_dflash.dpace import LossWeighting


@attrs.frozen(kw_only=True)
class DualHeadTerms:
    """What the correction's projection needs besides its input to score a chunk of blocks ``[B, c, bs]``: the
    draft's hidden states ``[B, c, bs, H]``, the frozen target lm_head ``[V, H]``, the labels and position
    weights, the loss weighting, the first corrected position and λ (the base head's share)."""

    hidden: torch.Tensor
    head: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    weighting: LossWeighting | None
    suffix_start: int
    base_weight: float


@attrs.frozen
class DualHeadSums:
    """A chunk's fused terms: ``loss`` = λ Σwb·CEb + (1-λ) Σwf·CEf (differentiable) and, without gradient, the two
    sums ``[2]`` (base, final) and each head's argmax ``[B, c, bs]``."""

    loss: torch.Tensor
    sums: torch.Tensor
    base_predictions: torch.Tensor
    predictions: torch.Tensor


class _DualHead(torch.autograd.Function):
    """The module docstring's ``S`` for one chunk; gradients for ``hidden``, ``activation`` and ``w2``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, activation: torch.Tensor, w2: torch.Tensor, head: torch.Tensor,
                labels: torch.Tensor, weights: torch.Tensor, weighting: LossWeighting | None, start: int,
                lam: float):
        width, rank, bs = hidden.shape[-1], activation.shape[-1], labels.shape[-1]
        tiles = block_tiles(*labels.shape, head.shape[0], labels.shape[1],  # whole blocks, on CPU cache-sized
                            cache_sized=hidden.device.type == "cpu")
        most = max((samples.stop - samples.start) * (part.stop - part.start) for samples, part in tiles) * bs
        gemm = torch.float32 if upcasts(most, head) else head.dtype
        acc = torch.promote_types(gemm, torch.float32)
        frozen, w2_g = frozen_head(head, gemm), w2.to(gemm)  # the frozen head packed once where that pays
        needed = ctx.needs_input_grad
        base_ce, final_ce = (torch.empty(labels.shape, dtype=acc, device=hidden.device) for _ in range(2))
        base_predictions, predictions = (torch.empty(labels.shape, dtype=torch.long, device=hidden.device)
                                         for _ in range(2))
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if needed[0] else None
        grad_a = torch.empty(activation.shape, dtype=activation.dtype, device=hidden.device) if needed[1] else None
        grad_w2 = torch.zeros(w2.shape, dtype=acc, device=w2.device) if needed[2] else None
        sums = torch.zeros(2, dtype=acc, device=hidden.device)
        for samples, part in tiles:
            tile = labels[samples, part].shape  # [b, c, bs]
            rows, suffix_shape = tile.numel(), (*tile[:2], bs - start)
            h = hidden[samples, part].reshape(rows, width).to(head.dtype).to(gemm)
            a = activation[samples, part].reshape(-1, rank).to(w2.dtype).to(gemm)
            base = frozen.logits(h).to(acc).view(*tile, -1)  # [b, c, bs, V]
            final = mm_wide(a, w2_g).to(acc).view(*suffix_shape, -1)
            final += base[:, :, start:]  # [b, c, bs - start, V]: the corrected logits
            tile_labels = labels[samples, part]
            label = tile_labels.reshape(-1, 1)
            label_s = tile_labels[..., start:].reshape(-1, 1)
            base, final = base.view(rows, -1), final.view(label_s.shape[0], -1)  # the same buffers, rows of logits
            tile_base_ce, tile_base_pred = softmax_cross_entropy_terms(base, label)  # base, final: now softmaxes
            final_ce_s, final_pred_s = softmax_cross_entropy_terms(final, label_s)
            tile_base_ce, tile_base_pred = tile_base_ce.view(tile), tile_base_pred.view(tile)
            tile_final_ce = torch.cat([tile_base_ce[..., :start], final_ce_s.view(suffix_shape)], dim=-1)
            base_ce[samples, part], final_ce[samples, part] = tile_base_ce, tile_final_ce
            base_predictions[samples, part] = tile_base_pred
            predictions[samples, part] = torch.cat([tile_base_pred[..., :start], final_pred_s.view(suffix_shape)],
                                                   dim=-1)
            tile_weights = weights[samples, part]
            wb = tile_weights if weighting is None else weighting.reweight(tile_base_ce, tile_weights)
            wf = tile_weights if weighting is None else weighting.reweight(tile_final_ce, tile_weights)
            sums += torch.stack([(wb * tile_base_ce).sum(), (wf * tile_final_ce).sum()])
            if any(needed[:3]):
                coefficient = lam * wb.to(acc)
                coefficient[..., :start] += (1.0 - lam) * wf[..., :start].to(acc)
                d_final = to_logit_gradient(final, label_s, (1.0 - lam) * wf[..., start:].reshape(-1).to(acc))
                d_base = to_logit_gradient(base, label, coefficient.reshape(-1))
                d_base.view(*tile, -1)[:, :, start:] += d_final.view(*suffix_shape, -1)
                d_final_g = d_final.to(gemm)
                if grad_h is not None:
                    grad_h[samples, part] = frozen.input_grad(d_base.to(gemm)).view(*tile, width)
                if grad_a is not None:
                    grad_a[samples, part] = (d_final_g @ w2_g).view(*suffix_shape, rank)
                if grad_w2 is not None:
                    add_product_(grad_w2, d_final_g.t(), a)
            base = final = d_base = d_final = d_final_g = None  # a tile's logits go before the next tile's are made
        ctx.save_for_backward(grad_h, grad_a, None if grad_w2 is None else grad_w2.to(w2.dtype))
        ctx.mark_non_differentiable(sums, base_predictions, predictions)
        return lam * sums[0] + (1.0 - lam) * sums[1], sums, base_predictions, predictions

    @staticmethod
    def backward(ctx, grad_loss, *_ignored):
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return (*scaled, None, None, None, None, None, None)


def dual_head_terms(activation: torch.Tensor, w2: torch.Tensor, terms: DualHeadTerms) -> tuple[torch.Tensor, ...]:
    """The fused terms of the module docstring for a chunk whose corrected positions have the hidden activation
    ``activation [B, c, bs - start, e]`` under the correction's output weight ``w2 [V, e]`` (called by the
    projection's forward, which holds them): the fields of :class:`DualHeadSums`, in order, as plain tensors
    (what FSDP2 hooks on a module's outputs to gather its weights again for backward)."""
    return _DualHead.apply(terms.hidden, activation, w2, terms.head, terms.labels, terms.weights,
                           terms.weighting, terms.suffix_start, float(terms.base_weight))
