"""The reference DFlash speculative decode: greedy, lossless, one target forward per block.

    prefill      target over the prompt -> its features (the draft context) and the first token
    repeat       block  = [last accepted token, MASK x (bs-1)] at positions P..P+bs-1
                 drafts = argmax of the draft at block positions 1..bs-1 (context: features of
                          every accepted token before P)
                 verify = ONE target forward over [last token, drafts]
                 accept = the drafts matching the target's own argmax, then the target's next
                          token after them (so at least one token per forward)
                 rollback the target cache to the accepted tokens; append their features to
                 the draft context

Each emitted token is the target's argmax given the tokens before it, so the output equals
the target's greedy decode token for token.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from specforge_core.nn import argmax_last
from specforge_core.protocols import SpeculationResult
from specforge_core.speculative import accept_drafts, prompt_outputs, stop_token_ids

from .model import DFlashBackbone

#: ``draft(model, ctx [1, C, H], anchor_token, position)`` -> the drafted token ids ``[n]`` (bs-1 for DFlash's own;
#: any n >= 0: the loop verifies what it is given).
DraftFn = Callable[[DFlashBackbone, torch.Tensor, int, int], torch.Tensor]


def draft_hidden(model: DFlashBackbone, ctx: torch.Tensor, anchor_token: int, position: int) -> torch.Tensor:
    """Final draft hidden states ``[bs, H]`` of the block ``[anchor_token, MASK x (bs-1)]`` at ``position``.

    ``ctx [1, C, H]`` is the projected context of the ``C = position`` tokens before the
    anchor, all visible (they are strictly before it); the block attends to itself fully.
    """
    bs, device = model.config.block_size, ctx.device
    ids = torch.full((1, bs), model.config.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = anchor_token
    positions = torch.arange(position, position + bs, device=device)[None]
    mask = torch.ones(1, bs, ctx.shape[1] + bs, dtype=torch.bool, device=device)
    return model.run_layers(ctx, model.embed(ids), positions, mask)[0]


def draft_block(model: DFlashBackbone, ctx: torch.Tensor, anchor_token: int, position: int) -> torch.Tensor:
    """Argmax drafts for block positions 1..bs-1 after ``anchor_token`` at ``position`` (see :func:`draft_hidden`)."""
    return argmax_last(model.logits(draft_hidden(model, ctx, anchor_token, position)[1:]))


@torch.no_grad()
def speculative_decode(model: DFlashBackbone, session: Any, prompt_ids: Any, *, feature: str, max_new_tokens: int,
                       eos_token_id: int | Iterable[int] | None = None,
                       draft: DraftFn = draft_block) -> SpeculationResult:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` with ``model`` drafting and ``session`` verifying.

    ``session`` is a :class:`~specforge_core.protocols.VerifySession` opened on the prompt
    (or empty) whose ``extend`` returns ``logits [n, V]`` and the draft's context features under ``feature``
    (``[n, k*H]``). The prefill counts as the first target forward and yields the first
    token; every later forward verifies one block. Stops after an ``eos_token_id``.
    """
    device = model.fc.weight.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    stop = stop_token_ids(eos_token_id)
    if max_new_tokens <= 0:
        return SpeculationResult(tokens=[], target_forwards=0, accept_lengths=[])
    out = prompt_outputs(session, prompt)
    ctx = model.context(out[feature].to(device)[None])  # [1, P, H]
    tokens = [int(argmax_last(out["logits"][-1]))]
    accept_lengths, accepted_drafts = [1], []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        position = session.length  # where the last accepted token goes; the cache holds everything before it
        budget = max_new_tokens - len(tokens)
        # [bs-1], or fewer: a round emits at most the budget's tokens, so drafts past budget-1 would be verified
        # for nothing (the last round's bonus is then the target's token after the last kept draft)
        drafts = draft(model, ctx, tokens[-1], position).cpu()[: budget - 1]
        out = session.extend(torch.cat([torch.tensor([tokens[-1]]), drafts]))
        target_next = argmax_last(out["logits"]).cpu()  # the target's token after each verified position
        accepted, new = accept_drafts(drafts.tolist(), target_next.tolist(), stop=stop, budget=budget)
        session.truncate(position + accepted + 1)  # keep the anchor and the accepted drafts
        ctx = torch.cat([ctx, model.context(out[feature][: accepted + 1].to(device)[None])], dim=1)
        tokens.extend(new)
        accept_lengths.append(len(new))
        accepted_drafts.append(min(accepted, len(new)))
    return SpeculationResult(tokens=tokens, target_forwards=len(accept_lengths), accept_lengths=accept_lengths,
                             accepted_drafts=accepted_drafts)
