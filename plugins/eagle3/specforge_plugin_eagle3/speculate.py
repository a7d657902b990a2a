"""Real speculative decoding with an EAGLE3 draft: chain drafting, one target forward per round.

Each round: the draft proposes ``depth`` tokens after the last accepted one (the target's
bonus token), the target runs ``[bonus, d_1..d_depth]`` in ONE cached forward, the longest
prefix of drafts equal to the target's own greedy choices is accepted plus the target's
next token (the new bonus), and the target cache drops the rejected positions. Every
emitted token is a target greedy choice, so the output equals the target's greedy decode.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from specforge_core.nn import argmax_last
from specforge_core.protocols import SpeculationResult, VerifySession
from specforge_core.speculative import accept_drafts, prompt_outputs, stop_token_ids

from .model import DraftKV, Eagle3Draft


@torch.no_grad()
def speculate(model: Eagle3Draft, session: VerifySession, prompt_ids: Any, *, max_new_tokens: int,
              eos_token_id: int | Iterable[int] | None, depth: int,
              hidden_feature: str = "aux_hidden") -> SpeculationResult:
    """Decode up to ``max_new_tokens`` tokens after ``prompt_ids`` (stopping after an eos).

    ``session`` is a target :class:`VerifySession` opened on the prompt with the strategy's
    capture plan (so ``extend`` returns ``hidden_feature`` [n, 3H]). The prompt forward
    counts as the first target forward (it produces the first token).
    """
    prompt = [int(t) for t in torch.as_tensor(prompt_ids).flatten().tolist()]
    if not prompt:
        raise ValueError("speculate needs a non-empty prompt")
    if max_new_tokens <= 0:
        return SpeculationResult(tokens=[], target_forwards=0, accept_lengths=[])
    eos = stop_token_ids(eos_token_id)
    out = prompt_outputs(session, torch.tensor(prompt, dtype=torch.long))
    bonus = int(argmax_last(out["logits"][-1]))
    tokens, accept_lengths, accepted_drafts = [bonus], [1], []
    kv = DraftKV()
    # The draft's context rows: features of each accepted token and the token after it.
    ctx_aux, ctx_next = out[hidden_feature], prompt[1:] + [bonus]
    while bonus not in eos and len(tokens) < max_new_tokens:
        # never verify more than can be emitted: a round emits at most k + 1 tokens
        k = min(depth, max_new_tokens - len(tokens) - 1)
        drafts = model.draft(kv, ctx_aux, ctx_next, k)
        base = session.length
        out = session.extend(torch.tensor([bonus] + drafts, dtype=torch.long))
        greedy = argmax_last(out["logits"]).tolist()  # greedy[i]: the target's token after position base + i
        accepted, new = accept_drafts(drafts, greedy, stop=eos)
        if accepted < k:
            session.truncate(base + 1 + accepted)  # keep the bonus and the accepted drafts
        ctx_aux, ctx_next = out[hidden_feature][: accepted + 1], drafts[:accepted] + [greedy[accepted]]
        tokens.extend(new)
        accept_lengths.append(len(new))
        accepted_drafts.append(min(accepted, len(new)))
        bonus = new[-1]
    return SpeculationResult(tokens=tokens, target_forwards=len(accept_lengths), accept_lengths=accept_lengths,
                             accepted_drafts=accepted_drafts)
