"""EAGLE3's training objective: alignment, the teacher, the unrolled loss and its metrics.

Normalisation (ALGORITHMS.md allows either): the loss is per *supervised token*,

    L = sum_k decay^k * S_k / N_0
    S_k = sum_(b,t) position_mask_k[b,t] * CE(p_T_k[b,t], logits_k[b,t])
    N_0 = sum_(b,t) position_mask_0[b,t]

one denominator for every step, so L is a single ratio (sum_k decay^k S_k, N_0) that pools
exactly over micro-batches, ranks and eval batches, and deeper steps (which have fewer
supervised positions after the shifts) weigh less, as in the reference mean over B*S.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from specforge_core.nn import linear

from .model import Eagle3Draft, shift_left


def align(input_ids: torch.Tensor, loss_mask: torch.Tensor, last_hidden: torch.Tensor,
          attention_mask: torch.Tensor, positions: str = "reference") -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """Shift ids and last_hidden left by one, and say which positions are supervised.

    After this, position t pairs the aux features of token t with token t+1 and the target's
    distribution at t+1 (whose argmax is token t+2). Which positions train (``positions``):

    * ``"reference"`` (ALGORITHMS.md, SpecForge): the loss mask unshifted, each sample's last
      real position zeroed (``loss_mask * shift_left(attention_mask)``: it has no token t+1);
    * ``"decode"``: the positions speculative decoding drafts from, ``loss_mask[t+1] *
      loss_mask[t+2]``. A round drafts after the target's last token t+1; that token is a
      response token that is not the turn's last (after the last, decoding stops), and the
      first draft, token t+2, is a response token. The reference mask trains position t
      when token t is a response token: it never trains the round after the first response
      token (position r-1, which decoding runs once per reply) and trains two positions
      drafting past the end-of-turn token, which decoding never runs.
    """
    if positions == "decode":
        mask = shift_left(loss_mask) * shift_left(loss_mask, 2)
    else:
        mask = loss_mask * shift_left(attention_mask)
    return shift_left(input_ids), mask, shift_left(last_hidden)


@torch.no_grad()
def simulated_acceptance(step_logits: list[torch.Tensor], target_ids: torch.Tensor, response: torch.Tensor,
                         d2t: torch.Tensor) -> dict[str, tuple[float, float]]:
    """``accept_len_sim`` and ``accept_rate_k``: greedy decoding replayed over the batch's responses.

    ``step_logits[k][:, t]`` drafts token t+2+k (aligned: ``target_ids[:, t+k]`` is the target's
    choice there); ``response [B, S]`` is the unshifted loss mask. A round whose bonus token is
    at position j runs from aligned position j-1 and accepts the leading steps whose draft
    equals the target's choice and lies inside the response (see
    :func:`specforge_core.acceptance.simulated_decode`).
    """
    from specforge_core.acceptance import leading_true, simulated_decode

    b, s = target_ids.shape
    depth = len(step_logits)
    inside = response.bool()
    correct = torch.zeros(b, s, depth, dtype=torch.bool, device=target_ids.device)
    for k, logits in enumerate(step_logits):
        n = s - k - 2  # positions whose draft token t+2+k exists
        if n <= 0:
            break
        draft = logits[:, :n].argmax(-1)
        correct[:, :n, k] = (draft + d2t[draft] == target_ids[:, k:k + n]) & inside[:, k + 2:k + 2 + n]
    accepted = torch.zeros(b, s, dtype=torch.long, device=target_ids.device)
    accepted[:, 1:] = leading_true(correct)[:, :-1]  # the bonus at j drafts from aligned position j-1
    return simulated_decode(accepted, inside, depth)


@torch.no_grad()
def teacher(model: Eagle3Draft, last_hidden: torch.Tensor,
            loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's distribution from its frozen lm_head, restricted to the draft vocabulary.

    last_hidden [B, S, H] (aligned; already final-normed) ->
    ``p_T [B, S, Vd]`` (softmax over the draft vocabulary's target logits, i.e. restricted
    and renormalised), ``target_ids [B, S]`` (argmax of the full target distribution), and
    ``position_mask [B, S]`` = t2d[target_ids] * loss_mask: a position whose target argmax
    the draft cannot express is not supervised.
    """
    if model.target_lm_head is None:
        raise ValueError("this draft was built without the target lm_head (the teacher); pass frozen_parts['lm_head']")
    head = model.target_lm_head
    logits = linear(last_hidden.to(head.dtype), head)  # [B, S, V]
    target_ids = logits.argmax(-1)
    if model.config.draft_vocab_size < model.config.vocab_size:
        logits = logits.index_select(-1, model.draft_to_target_index())  # [B, S, Vd]
    p_t = torch.softmax(logits.float(), dim=-1)
    position_mask = model.t2d[target_ids] & loss_mask.bool()
    return p_t, target_ids, position_mask


class ShiftedSoftCrossEntropy(torch.autograd.Function):
    """``sum_(b,t) w[b,t+k] * CE(p[b,t+k], z[b,t])`` over t < S-k, with its gradient written out.

    CE(p, z) = -sum_v p_v log_softmax(z)_v = logsumexp(z) - p.z   (p sums to 1)
    dCE/dz   = softmax(z) - p

    Written by hand so that the backward keeps no [B, S, Vd] log-softmax per unroll step
    (only the per-position logsumexp) and the shift by k needs neither a shifted copy of p
    nor the zero-padded gradient that slicing the logits would cost in autograd.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor, weight: torch.Tensor, shift: int) -> torch.Tensor:
        n = logits.shape[1] - shift
        z = logits[:, :n].to(torch.promote_types(logits.dtype, torch.float32))  # [B, S-k, Vd]
        lse = torch.logsumexp(z, dim=-1)  # [B, S-k]
        ce = lse - (p[:, shift:] * z).sum(-1)
        ctx.save_for_backward(logits, p, weight, lse)
        ctx.shift = shift
        return (ce * weight[:, shift:]).sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, p, weight, lse = ctx.saved_tensors
        shift = ctx.shift
        n = logits.shape[1] - shift
        grad = torch.empty(logits.shape, dtype=lse.dtype, device=logits.device)  # float32 (or float64)
        grad[:, n:] = 0  # positions with no teacher this deep
        body = grad[:, :n]
        torch.sub(logits[:, :n], lse[..., None], out=body)
        body.exp_().sub_(p[:, shift:]).mul_((weight[:, shift:] * grad_out)[..., None])  # (softmax - p) * w
        return grad.to(logits.dtype), None, None, None


def ttt_loss(step_logits: list[torch.Tensor], p_t: torch.Tensor, target_ids: torch.Tensor,
             position_mask: torch.Tensor, loss_mask: torch.Tensor, d2t: torch.Tensor,
             decay: float) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """The unrolled loss and its ratio metrics.

    ``step_logits[k] [B, S, Vd]`` at position t is supervised by the teacher at t+k: the
    ALGORITHMS.md left shift of p_T, position_mask and loss_mask by one per step (zero
    fill), written as slices (``x[:, k:]`` against ``logits[:, :S-k]``) so nothing is copied.

    Ratio metrics: ``loss`` (sum_k decay^k S_k, N_0), ``ploss_k`` (S_k, N_k), and ``acc_k``
    (#[d2t(argmax logits_k) == target argmax] over loss_mask_k, #loss_mask_k) — the mask is
    loss_mask_k, not position_mask_k, so a target token outside the draft vocabulary counts
    as a miss, as it would when serving.
    """
    s = p_t.shape[1]
    weight = position_mask.float()
    total = p_t.new_zeros(())
    counts: list[torch.Tensor] = []  # S_k, N_k, correct_k, M_k per step: moved to the host at once
    for k, logits in enumerate(step_logits):
        step_sum = ShiftedSoftCrossEntropy.apply(logits, p_t, weight, k)
        total = total + decay ** k * step_sum
        with torch.no_grad():
            lmask = loss_mask[:, k:].bool()
            draft_ids = logits[:, : s - k].argmax(-1)
            correct = ((draft_ids + d2t[draft_ids] == target_ids[:, k:]) & lmask).sum()
            counts += [step_sum.detach(), weight[:, k:].sum(), correct.float(), lmask.sum().float()]
    supervised = weight.sum()
    loss = total / supervised.clamp(min=1)
    values = torch.stack([total.detach(), supervised, *counts]).double().cpu().tolist()  # one device sync
    ratios: dict[str, tuple[float, float]] = {"loss": (values[0], values[1])}
    for k in range(len(step_logits)):
        step_sum, n_k, correct, m_k = values[2 + 4 * k: 6 + 4 * k]
        ratios[f"ploss_{k}"] = (step_sum, n_k)
        ratios[f"acc_{k}"] = (correct, m_k)
    return loss, ratios


def tau_sim(pooled: Mapping[str, float]) -> float:
    """The former simulated figure ``sum_k prod_(i<=k) acc_i`` from pooled ``acc_k`` values (bonus excluded).

    ``pooled["acc_k"]`` is the pooled ratio sum(num) / sum(den). The sum stops at the first
    step with no value (missing or NaN: no supervised position that deep). NaN without
    ``acc_0``. It overstates real acceptance on short replies (per-step accuracies pooled
    over positions decoding jumps over, no end of the reply): ``accept_len_sim`` replaces it.
    """
    if not _finite(pooled.get("acc_0")):
        return float("nan")
    total, survive, k = 0.0, 1.0, 0
    while _finite(pooled.get(f"acc_{k}")):
        survive *= pooled[f"acc_{k}"]
        total += survive
        k += 1
    return total


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
