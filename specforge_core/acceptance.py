"""The simulated acceptance length: greedy speculative decoding replayed over eval conversations.

One vocabulary for every strategy (the README's metrics table):

* ``accept_len_sim`` — tokens per target verification forward, **bonus token included**,
  simulated on the eval split: the number :func:`specforge_core.speculative.measure_acceptance`
  measures as ``accept_len_real`` by really decoding, and what serving engines report;
* ``accept_rate_k`` — the share of simulated rounds whose k-th draft token was accepted.

How the simulation works. A strategy scores its draft teacher-forced on an eval sample and
says, for every position ``j`` of a response, how many draft tokens a round would accept if
``j`` held the last token the target emitted (the bonus of the previous round):
``accepted[j]`` = the length of the prefix of drafts equal to the target's own greedy choices,
none past the end of the response. :func:`simulated_decode` then walks every response the
way decoding does: the first token comes from the prompt's forward (not counted, as in the
real measurement), each round emits its accepted drafts plus the target's bonus token and
moves on by that many, and a round whose accepted drafts reach the end-of-turn token emits no
bonus (decoding stops there). Averaging ``accepted + 1`` over *all* positions instead
overweights the positions a real decode jumps over, and pooling per-step accuracies
(``Π acc_i``) ignores both the walk and the end of the response; both overstate the real
figure on short replies.

The replay predicts the real figure when the eval replies are the target's own greedy
continuation (``specforge regenerate`` writes such data); on other replies the drafts are
scored against the target's choices after the data's prefix, which decoding never visits.
"""

from __future__ import annotations

from typing import Any

import torch

#: How ``accept_len_sim`` and ``accept_len_real`` count, for summaries and docs.
ACCEPT_LEN_CONVENTION = ("tokens per target verification forward, bonus token included (as serving engines "
                         "report); the prompt's forward and the first token it yields are not counted")


def simulated_decode(accepted: torch.Tensor, response: torch.Tensor, depth: int) -> dict[str, tuple[float, float]]:
    """Replay greedy speculative decoding over every response of a batch; ratio metrics.

    ``accepted [B, S]`` (integer): drafts a round accepts when position ``j`` holds its
    bonus token; ``response [B, S]`` (bool): the supervised (response) tokens, each run of
    them one assistant turn ending with its end-of-turn token; ``depth``: drafts per round.
    Returns ``accept_len_sim`` as (tokens emitted, rounds) and ``accept_rate_k`` for k in
    1..depth as (rounds accepting at least k drafts, rounds), pooled exactly over batches.
    """
    counts = accepted.detach().long().cpu().tolist()
    masks = response.detach().bool().cpu().tolist()
    tokens = rounds = 0
    reached = [0] * (depth + 1)  # reached[k]: rounds that accepted at least k drafts
    for row, mask in zip(counts, masks):
        for start, end in _runs(mask):
            position, last = start, end - 1  # the turn's first token comes from the previous forward
            while position < last:
                drafts = min(row[position], depth, last - position)
                emitted = drafts if position + drafts >= last else drafts + 1  # no bonus after the end token
                tokens += emitted
                rounds += 1
                for k in range(1, drafts + 1):
                    reached[k] += 1
                position += emitted
    metrics = {"accept_len_sim": (float(tokens), float(rounds))}
    metrics.update({f"accept_rate_{k}": (float(reached[k]), float(rounds)) for k in range(1, depth + 1)})
    return metrics


def leading_true(correct: torch.Tensor) -> torch.Tensor:
    """``[..., K] -> [...]``: how many entries along the last dim are True before the first False."""
    return correct.long().cumprod(dim=-1).sum(dim=-1)


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of True in ``mask``."""
    runs, start = [], None
    for index, value in enumerate(mask):
        if value and start is None:
            start = index
        elif not value and start is not None:
            runs.append((start, index))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def accept_rates(drafts: Any, depth: int) -> list[float]:
    """Per-position acceptance of a real decode: the accepted drafts of each verification round
    (``SpeculationResult.accepted_drafts``) -> the share of rounds accepting at least k drafts, k = 1..depth."""
    rounds = [int(n) for n in drafts]
    if not rounds:
        return []
    return [sum(1 for drafts in rounds if drafts >= k) / len(rounds) for k in range(1, depth + 1)]
