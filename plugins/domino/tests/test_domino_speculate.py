"""Drafting runs the GRU over the drafted tokens; speculative decoding stays identical to target greedy."""

import random

import pytest
import torch

from specforge_core.speculative import greedy_decode
from specforge_plugin_dflash.speculate import draft_hidden

from specforge_plugin_domino.speculate import draft_domino_block

ALIGNMENTS = [(True, 0), (True, 1), (False, 0), (False, 1)]  # (shift_label, pure_draft_prefix_len)


@pytest.mark.parametrize("shift_label, pure", ALIGNMENTS)
def test_drafts_are_the_teacher_forced_final_argmax_with_the_drafted_tokens_as_the_real_ones(
        make_draft, shift_label, pure):
    _strategy, model = make_draft(block_size=6, shift_label=shift_label, pure_draft_prefix_len=pure)
    with torch.no_grad():
        model.embed_proj[2].weight.mul_(30.0)  # a correction large enough to change drafts
    s = model.head_config.label_shift
    corrected = 0
    for trial in range(6):
        gen = torch.Generator().manual_seed(trial)
        context_len, anchor = 5 + trial, int(torch.randint(0, 97, (), generator=gen))
        with torch.no_grad():
            ctx = model.context(torch.randn(1, context_len, 96, generator=gen))
            drafts = draft_domino_block(model, ctx, anchor, context_len)  # [bs-1]
            hidden = draft_hidden(model, ctx, anchor, context_len)  # [bs, H]
            tokens = torch.cat([torch.tensor([anchor]), drafts])  # [bs]: the anchor, then the drafted tokens
            base = model.logits(hidden)
            final = model.final_logits(base, hidden, model.block_states(tokens[None])[0])
        drafted = slice(1 - s, 6 - s)  # shift_label: positions 0..bs-2, else 1..bs-1
        assert drafts.shape == (5,)
        assert torch.equal(final[drafted].argmax(-1), drafts)
        corrected += int((base[drafted].argmax(-1) != drafts).sum())
    assert corrected > 0, "the correction never changed a draft: the test would not see a misaligned GRU"


def prompts(count, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 16))] for _ in range(count)]


@pytest.mark.parametrize("shift_label, pure", [(True, 1), (False, 0)])
def test_speculate_equals_the_targets_greedy_decode(engine, make_draft, shift_label, pure):
    info = engine.info()
    strategy, model = make_draft(info, engine.frozen_parts(), block_size=4, shift_label=shift_label,
                                 pure_draft_prefix_len=pure)
    plan = strategy.capture_plan(info)
    for prompt in prompts(6, info.vocab_size):
        reference = greedy_decode(engine, prompt, plan, max_new_tokens=16, eos_token_id=None)
        result = strategy.speculate(model, engine.session(torch.tensor(prompt), plan), prompt, max_new_tokens=16)
        assert result.tokens == reference
        assert sum(result.accept_lengths) == 16 and result.target_forwards == len(result.accept_lengths)
        assert max(result.accept_lengths) <= 4
    assert model.training  # speculate restores the mode it found
