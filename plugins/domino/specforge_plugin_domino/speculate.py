"""Domino's drafting step for DFlash's reference speculative decode.

DFlash's :func:`~specforge_plugin_dflash.speculate.speculative_decode` owns the lossless
loop (verify in one target forward, accept the matching prefix plus the target's token,
roll the cache back); it takes the drafting step as a callable, and this is Domino's:

    hidden = DFlash backbone over [anchor, MASK x (bs-1)]          [bs, H]   one pass
    base   = lm_head(hidden)                                       [bs, V]
    for each drafted position k (shift_label: 0..bs-2, else 1..bs-1), in order:
        g_k   = GRU state after [anchor, drafts so far]            the real tokens are unknown
        draft = argmax(base_k + [k >= suffix_start]·embed_proj([h_k ; g_k]))

With the drafted tokens in place of the real ones this is exactly the teacher-forced
``final_logits`` of training (the tests check the two agree).
"""

from __future__ import annotations

import torch

from specforge_core.nn import argmax_last
from specforge_plugin_dflash.speculate import draft_hidden

from .model import DominoBackbone


def draft_domino_block(model: DominoBackbone, ctx: torch.Tensor, anchor_token: int, position: int) -> torch.Tensor:
    """The bs-1 drafted tokens ``[bs-1]`` of the block anchored at ``anchor_token`` at ``position``.

    ``ctx [1, C, H]`` is the projected context of the ``C = position`` tokens before the anchor
    (a :data:`~specforge_plugin_dflash.speculate.DraftFn`).
    """
    head = model.head_config
    hidden = draft_hidden(model, ctx, anchor_token, position)  # [bs, H]
    base = model.logits(hidden)  # [bs, V]
    bs = hidden.shape[0]
    token = torch.tensor([[anchor_token]], device=hidden.device)  # [1, 1]: the GRU's next input
    state, drafts = None, []
    for k in range(1 - head.label_shift, bs - head.label_shift):
        _, state = model.prefix_states(token, state)  # [1, 1, g]: after the anchor and drafts before position k
        logits = base[k]
        if k >= head.suffix_start:
            logits = logits + model.correction(hidden[k], state[0, 0]).to(logits.dtype)
        token = argmax_last(logits).view(1, 1)
        drafts.append(token)
    return torch.cat(drafts).flatten()
