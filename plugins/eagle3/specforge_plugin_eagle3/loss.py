"""EAGLE3's training objective: alignment, the teacher, the unrolled loss and its metrics.

Normalisation (docs/algorithms.md allows either): the loss is per *supervised token*,

    L = sum_k decay^k * S_k / N_0
    S_k = sum_(b,t) position_mask_k[b,t] * CE(p_T_k[b,t], logits_k[b,t])
    N_0 = sum_(b,t) position_mask_0[b,t]

one denominator for every step, so L is a single ratio (sum_k decay^k S_k, N_0) that pools
exactly over micro-batches, ranks and eval batches, and deeper steps (which have fewer
supervised positions after the shifts) weigh less, as in the reference mean over B*S.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

from specforge_core.nn import argmax_last, linear, softmax_last_

from .head_loss import HeadGradSum, SoftTargets
from .model import Eagle3Draft, UnrollWindows, shift_left

#: ``score(rows [R, h], targets) -> (sum_r w_r CE, draft ids [R])``: the vocabulary head and its loss.
Score = Callable[[torch.Tensor, SoftTargets], tuple[torch.Tensor, torch.Tensor]]


def align(input_ids: torch.Tensor, loss_mask: torch.Tensor, last_hidden: torch.Tensor,
          attention_mask: torch.Tensor, positions: str = "reference") -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """Shift ids and last_hidden left by one, and say which positions are supervised.

    After this, position t pairs the aux features of token t with token t+1 and the target's
    distribution at t+1 (whose argmax is token t+2). Which positions train (``positions``):

    * ``"reference"`` (docs/algorithms.md, SpecForge): the loss mask unshifted, each sample's last
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


def round_depth(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` long, aligned as :func:`align` aligns: at position j, the deepest unroll step a decoding round
    reaches it at, ``k <= depth[j]`` — the offset of token j+1 in its run of response tokens.

    With ``loss_positions: decode`` a round starts at aligned position i only after a response token
    (token i+1), and its step k drafts token i+2+k, scored at the teacher row j = i+k. A row j whose token
    j+1 is the d-th of its reply (from 0) is reached by the rounds starting at j, j-1, ..., j-d only: deeper
    steps would start a round at a prompt token, which decoding never does.
    """
    supervised = loss_mask.bool()
    index = torch.arange(loss_mask.shape[1], device=loss_mask.device).expand_as(loss_mask)
    last_gap = torch.where(supervised, torch.full_like(index, -1), index).cummax(dim=1).values
    return shift_left(index - last_gap - 1)


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
        draft = argmax_last(logits[:, :n])
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
    # argmax_last: argmax's indices (the first of equal maxima), several times faster on CPU (max's indices in
    # half precision: 4096 tokens, 1024 bf16 rows, 3.6 ms instead of 15; float32 by a blocked search)
    target_ids = argmax_last(logits)
    if model.config.draft_vocab_size < model.config.vocab_size:
        # over rows of a 2-D view: index_select along the last dim of the 3-D logits ran 4-5x slower on CPU
        # (SmolLM2's 49152 -> 32000 columns of 1024 rows: 405-435 ms against 89-118, float32 and bf16)
        flat = logits.reshape(-1, logits.shape[-1]).index_select(-1, model.draft_to_target_index())
        logits = flat.view(*logits.shape[:-1], -1)  # [B, S, Vd]
    # the softmax in place: in half precision into the logits' float32 copy, in float32 into the logits themselves
    # (made here, and read no more): one [B, S, Vd] float32 tensor where a fresh softmax made a second (SmolLM2's
    # 32000-token draft vocabulary at 1024 positions: 131 MB, above glibc's ceiling, so mapped and faulted in anew)
    p_t = softmax_last_(logits.float())
    position_mask = model.t2d[target_ids] & loss_mask.bool()
    return p_t, target_ids, position_mask


def unroll_windows(position_mask: torch.Tensor, ttt_length: int) -> UnrollWindows | None:
    """The positions each unroll step must compute for the loss, as :meth:`Eagle3Draft.unroll`'s ``windows``.

    Step k scores hidden row t against the teacher at t+k, and row t of step k feeds only row t
    of step k+1, so from step 1 on sample b needs only positions ``first_b - (K-1) .. last_b - k``,
    where ``first_b`` and ``last_b`` are its first and last supervised positions and K the unroll
    length: its prompt before ``first_b`` (less the K-1 positions deeper steps reach back) and its
    tail after ``last_b - k`` are never computed. Every sample takes the same number of positions
    (the widest need; a window that would run past the end starts earlier), so the steps stay
    batched, and where one start for all would need no more positions, all start there (the
    attention is then one kernel call instead of one per sample). Step 0 stays whole: every
    position's step-0 key is attended to. ``None`` (every step whole) without supervised
    positions. One host sync.
    """
    b, s = position_mask.shape
    positions = torch.arange(s, device=position_mask.device)
    first = torch.where(position_mask, positions, s).amin(1)
    last = torch.where(position_mask, positions, -1).amax(1)
    first_last = torch.stack([first, last], 1).tolist()  # the one host sync
    starts = [max(0, f - (ttt_length - 1)) if l >= 0 else 0 for f, l in first_last]
    spans = [(start, l) for start, (_, l) in zip(starts, first_last) if l >= 0]  # (window start, last)
    if not spans:
        return None
    lows = [lo for lo, _ in spans]
    widths = [s] + [max(1, max(l - k + 1 - lo for lo, l in spans)) for k in range(1, ttt_length)]
    if ttt_length > 1:
        if max(l for _, l in spans) - min(lows) <= widths[1]:  # one start for all costs no width: one kernel call
            starts = [min(lows)] * b
        starts = [min(start, s - widths[1]) for start in starts]
    return UnrollWindows(starts, widths)


def ttt_loss(step_hidden: list[torch.Tensor], score: Score, p_t: torch.Tensor, target_ids: torch.Tensor,
             position_mask: torch.Tensor, loss_mask: torch.Tensor, d2t: torch.Tensor,
             decay: float, windows: UnrollWindows | None = None,
             depth: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """The unrolled loss and its ratio metrics.

    ``step_hidden[k] [B, S, h]`` at position t is supervised by the teacher at t+k: the
    docs/algorithms.md left shift of p_T, position_mask and loss_mask by one per step (zero
    fill). Only supervised rows reach the vocabulary head: the teacher rows j with
    ``position_mask[j]`` are found once, and step k scores hidden row j-k against teacher
    row j, for the rows at positions t >= k (a row at t < k has no hidden row that deep).
    The teacher rows are kept deepest first (positions from K-1 on in their order, then
    K-2, ..., 0), so step k's rows are the first ``n_k`` of them and its teacher rows a view.
    ``score(rows [R, h], targets)`` returns ``(sum_r CE, draft ids [R])``
    (the draft's ``lm_head(norm(rows), targets)``, :mod:`.head_loss`). With ``windows``
    (:func:`unroll_windows`) ``step_hidden[k]`` holds each sample's window only; every row a step
    scores lies inside. ``depth`` (:func:`round_depth`, ``loss_positions: decode``) bounds each row's deepest
    step further: a row is scored, and counted in ``acc_k``, only at the steps a decoding round reaches it at.

    Ratio metrics: ``loss`` (sum_k decay^k S_k, N_0), ``ploss_k`` (S_k, N_k), and ``acc_k``
    (#[d2t(argmax logits_k) == target argmax] over loss_mask_k, #loss_mask_k) — the mask is
    loss_mask_k, not position_mask_k, so a target token outside the draft vocabulary counts
    as a miss, as it would when serving (such a position can never be right, so only
    supervised rows need their argmax).
    """
    b, s = position_mask.shape
    steps = len(step_hidden)
    teacher_rows = position_mask.reshape(-1).nonzero().squeeze(1)  # j = b*S + t, a host sync
    # the deepest step each position is scored at: t (no hidden row deeper), and where decoding starts rounds
    deepest = torch.arange(s, device=position_mask.device).expand(b, s)
    if depth is not None:
        deepest = torch.minimum(deepest, depth)
    reach = deepest.reshape(-1)[teacher_rows].clamp(max=steps - 1)
    teacher_rows = teacher_rows[torch.argsort(reach, descending=True, stable=True)]
    # n_k = #(rows reaching step k) for each step, from the row count per reach: a second host sync
    live = torch.bincount(reach, minlength=steps).flip(0).cumsum(0).flip(0).tolist()
    # every step scores against the same teacher rows: gathered once, read by each step without a copy
    p_rows, wanted = p_t.reshape(b * s, -1).index_select(0, teacher_rows), target_ids.reshape(-1)[teacher_rows]
    starts = None if windows is None else torch.tensor(windows.starts, device=teacher_rows.device)
    total = p_t.new_zeros((), dtype=torch.float32)
    head_grad = HeadGradSum()  # the head's weight gradient, summed over the steps as decay^k times each
    counts: list[torch.Tensor] = []  # S_k, correct_k, M_k per step: moved to the host at once
    for k, hidden in enumerate(step_hidden):
        rows = teacher_rows[:live[k]] - k
        width = hidden.shape[1]
        if starts is not None and k:  # windows: row b*S + t is row b*width + (t - starts[b]) of this step's hidden
            sample = torch.div(rows, s, rounding_mode="floor")
            rows = sample * width + ((rows % s) - starts[sample]).clamp(0, width - 1)
        step_sum, draft_ids = score(hidden.reshape(b * width, -1).index_select(0, rows),
                                    SoftTargets(p_rows[:live[k]], decay ** k, head_grad))
        total = total + decay ** k * step_sum  # each step's loss enters once, times decay^k, as head_grad takes it
        with torch.no_grad():
            correct = (draft_ids + d2t[draft_ids] == wanted[:live[k]]).sum()
            counts += [step_sum.detach(), correct.float(), (loss_mask.bool() & (deepest >= k)).sum().float()]
    loss = total / max(1, live[0])
    values = torch.stack([total.detach(), *counts]).double().cpu().tolist()  # one device sync
    ratios: dict[str, tuple[float, float]] = {"loss": (values[0], float(live[0]))}
    for k in range(steps):
        step_sum, correct, m_k = values[1 + 3 * k: 4 + 3 * k]
        ratios[f"ploss_{k}"] = (step_sum, float(live[k]))
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
