"""The draft vocabulary: the Vd target tokens the draft can propose.

    used   = the Vd most frequent supervised tokens (ties: lower id first; fewer than Vd
             seen: padded with the lowest unused ids), sorted ascending
    d2t[i] = used[i] - i          draft id i -> target id i + d2t[i]
    t2d[j] = j in used            target id j is in the draft vocabulary

This is the format SGLang reads (``hot_token_id = d2t + arange(Vd)``).
"""

from __future__ import annotations

import torch

from specforge_core.errors import SpecforgeError


class VocabMappingError(SpecforgeError):
    """The draft vocabulary cannot be built from the statistics given."""


def build_vocab_mapping(token_counts: torch.Tensor | None, vocab_size: int,
                        draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) from supervised token counts [V]."""
    if draft_vocab_size == vocab_size:  # no mapping: the identity
        return torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)
    if token_counts is None:
        raise VocabMappingError(
            f"EAGLE3 builds its {draft_vocab_size}-token draft vocabulary from the supervised token counts of the "
            "training data (DataStats.token_counts), but none were given. Re-capture the feature set with this "
            f"specforge version, or set strategy.draft_vocab_size={vocab_size} (the target vocabulary: no mapping)"
        )
    counts = torch.as_tensor(token_counts).flatten().long().cpu()
    if counts.numel() != vocab_size:
        raise VocabMappingError(f"token_counts has {counts.numel()} entries, but the target vocabulary has "
                                f"{vocab_size} tokens; the counts come from another tokenizer")
    # A stable descending sort ranks equal counts by id, so ties and the zero-count padding
    # both take the lowest ids.
    order = torch.sort(counts, descending=True, stable=True).indices
    used = order[:draft_vocab_size].sort().values
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d
