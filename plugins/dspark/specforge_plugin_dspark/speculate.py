"""DSpark's drafting step for DFlash's reference speculative decode.

DFlash's :func:`~specforge_plugin_dflash.speculate.speculative_decode` owns the lossless loop
(verify in one target forward, accept the matching prefix plus the target's token, roll the
cache back); it takes the drafting step as a callable, and this is DSpark's:

    hidden = DFlash backbone over [anchor, MASK x (bs-1)]          [bs, H]   one pass
    base   = lm_head(hidden)                                       [bs, V]
    for slot k = 0..bs-1, in order (slot k drafts the token after anchor + k):
        prev    = the anchor (k = 0), else the draft of slot k-1
        conf_k  = sigmoid(confidence(h_k, prev))                   stop here if conf_k < threshold
        draft_k = argmax(base_k + markov(prev))

A block drafts up to bs tokens, one more than DFlash's block of the same size. With the
confidence threshold, the block is cut before the first slot the confidence head expects to
be rejected, so the target verifies fewer tokens; the output stays the target's greedy decode.
"""

from __future__ import annotations

import torch

from specforge_core.nn import argmax_last
from specforge_plugin_dflash.speculate import draft_hidden

from .model import DSparkBackbone


def draft_dspark_block(model: DSparkBackbone, ctx: torch.Tensor, anchor_token: int, position: int, *,
                       threshold: float = 0.0) -> torch.Tensor:
    """The drafted tokens ``[n]`` (``n <= bs``) of the block anchored at ``anchor_token`` at ``position``.

    ``ctx [1, C, H]`` is the projected context of the ``C = position`` tokens before the anchor
    (a :data:`~specforge_plugin_dflash.speculate.DraftFn` once ``threshold`` is bound).
    ``threshold`` > 0 stops at the first slot whose confidence is below it.
    """
    hidden = draft_hidden(model, ctx, anchor_token, position)  # [bs, H]
    base = model.logits(hidden)  # [bs, V]
    previous = torch.tensor(anchor_token, device=hidden.device)
    drafts = []
    for k in range(hidden.shape[0]):
        embedding, bias = model.markov_head(previous)
        if threshold > 0 and float(torch.sigmoid(model.confidence(hidden[k], previous, embedding))) < threshold:
            break
        previous = argmax_last(base[k] + bias)
        drafts.append(previous)
    return torch.stack(drafts) if drafts else torch.empty(0, dtype=torch.long, device=hidden.device)
