"""Drafting applies the Markov head slot by slot and cuts at low confidence; decoding stays the target's greedy."""

import random

import pytest
import torch

from specforge_core.speculative import greedy_decode
from specforge_plugin_dflash.speculate import draft_hidden

from specforge_plugin_dspark.speculate import draft_dspark_block


def block_inputs(model, trial):
    gen = torch.Generator().manual_seed(trial)
    context_len, anchor = 5 + trial, int(torch.randint(0, 96, (), generator=gen))
    return model.context(torch.randn(1, context_len, 96, generator=gen)), anchor, context_len


@torch.no_grad()
def test_drafts_are_the_markov_corrected_argmax_with_each_draft_as_the_next_slots_previous_token(make_draft):
    _strategy, model = make_draft(block_size=6)
    model.markov_head.markov_w2.weight.mul_(30.0)  # a bias large enough to change drafts
    changed = 0
    for trial in range(6):
        ctx, anchor, position = block_inputs(model, trial)
        drafts = draft_dspark_block(model, ctx, anchor, position)
        assert drafts.shape == (6,)  # every slot drafts: one token more than a DFlash block of the same size
        hidden = draft_hidden(model, ctx, anchor, position)
        previous = torch.cat([torch.tensor([anchor]), drafts[:-1]])  # the anchor, then each slot's draft
        base = model.logits(hidden)
        assert torch.equal(model.markov_logits(base, previous).argmax(-1), drafts)  # the training path, batched
        changed += int((base.argmax(-1) != drafts).sum())
    assert changed > 0, "the Markov bias never changed a draft: the test would not see it applied to the wrong token"


@torch.no_grad()
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.5, 0.7, 1.0])
def test_the_confidence_threshold_cuts_the_block_before_the_first_unconfident_slot(make_draft, threshold):
    _strategy, model = make_draft(block_size=6)
    model.confidence_head.proj.weight.mul_(40.0)  # confidences spread over (0, 1)
    cuts = set()
    for trial in range(8):
        ctx, anchor, position = block_inputs(model, trial)
        full = draft_dspark_block(model, ctx, anchor, position)
        hidden = draft_hidden(model, ctx, anchor, position)
        previous = torch.cat([torch.tensor([anchor]), full[:-1]])
        confidence = torch.sigmoid(model.confidence(hidden, previous))  # [bs]
        low = (confidence < threshold).nonzero().flatten().tolist() if threshold > 0 else []
        keep = low[0] if low else 6
        assert torch.equal(draft_dspark_block(model, ctx, anchor, position, threshold=threshold), full[:keep])
        cuts.add(keep)
    if 0 < threshold < 1:
        assert len(cuts) > 1, f"every block was cut at {cuts}: the test would not see a wrong cut position"


class CountingSession:
    """A verify session that records how many tokens each forward runs (the prefill included)."""

    def __init__(self, session):
        self._session = session
        self.prefill = session.prefill
        self.forward_tokens = [session.length]

    @property
    def length(self):
        return self._session.length

    def extend(self, ids):
        self.forward_tokens.append(len(ids))
        return self._session.extend(ids)

    def truncate(self, length):
        self._session.truncate(length)


def prompts(count, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 16))] for _ in range(count)]


@pytest.mark.parametrize("threshold, scale, bias", [(0.0, 40.0, 0.0), (0.5, 40.0, 0.0), (0.9, 0.0, -50.0)])
def test_speculate_equals_the_targets_greedy_decode_at_any_threshold(engine, make_draft, threshold, scale, bias):
    info = engine.info()
    strategy, model = make_draft(info, engine.frozen_parts(), block_size=4, confidence_threshold=threshold)
    with torch.no_grad():  # confidences spread over (0, 1), or (scale 0, bias -50) all about 0
        model.confidence_head.proj.weight.mul_(scale)
        model.confidence_head.proj.bias.fill_(bias)
    plan = strategy.capture_plan(info)
    verified, whole = [], []
    for prompt in prompts(5, info.vocab_size):
        reference = greedy_decode(engine, prompt, plan, max_new_tokens=16, eos_token_id=None)
        session = CountingSession(engine.session(torch.tensor(prompt), plan))
        result = strategy.speculate(model, session, prompt, max_new_tokens=16)
        assert result.tokens == reference
        assert sum(result.accept_lengths) == 16 and result.target_forwards == len(result.accept_lengths)
        assert len(session.forward_tokens) == result.target_forwards
        assert max(result.accept_lengths) <= 5  # bs drafts plus the bonus token
        verified.extend(session.forward_tokens[1:])
        # never cut: the anchor plus bs drafts, or as many tokens as the budget has left (the last round's)
        whole.extend(min(5, 16 - sum(result.accept_lengths[:r])) for r in range(1, len(result.accept_lengths)))
    if bias < 0:  # no slot is that confident: the target verifies the anchor alone, one token a forward
        assert set(verified) == {1}
    elif threshold == 0.0:
        assert verified == whole and 5 in verified
    else:
        assert 1 <= min(verified) and max(verified) <= 5 and len(set(verified)) > 1
    assert model.training  # speculate restores the mode it found
