"""The two label alignments on a hand-checked sample: labels, masks, weights, GRU inputs and states, suffixes.

Sample: ``input_ids = 50..57`` (S = 8), ``loss_mask = [0,0,0,1,1,1,1,0]``, block size 3, γ = 2.
Valid anchors (loss_mask[i] = loss_mask[i+1] = 1) are 3, 4, 5, and with num_anchors = 8 all
three are drawn.
"""

import math

import pytest
import torch

from specforge_core.contracts import StepContext

E = math.exp
INPUT_IDS = torch.arange(50, 58)
LOSS_MASK = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0])
TOKENS = [[53, 54, 55], [54, 55, 56], [55, 56, 57]]  # the real tokens at anchor + 0..2

#                 labels                            label_mask                                 weights
SHIFTED = ([[54, 55, 56], [55, 56, 57], [56, 57, 57]],  # a+k+1 (clamped past the end)
           [[1, 1, 1], [1, 1, 0], [1, 0, 0]],            # loss_mask[a+k+1], inside the sample
           [[1, E(-1 / 2), E(-1)], [1, E(-1 / 2), 0], [1, 0, 0]])  # exp(-k/γ)
UNSHIFTED = ([[53, 54, 55], [54, 55, 56], [55, 56, 57]],  # a+k (DFlash)
             [[0, 1, 1], [0, 1, 1], [0, 1, 0]],            # position 0 never supervised
             [[0, 1, E(-1 / 2)], [0, 1, E(-1 / 2)], [0, 1, 0]])  # exp(-(k-1)/γ)


def blocks_of(make_draft, **options):
    strategy, model = make_draft(block_size=3, num_anchors=8, loss_decay_gamma=2.0, **options)
    sample = {"input_ids": INPUT_IDS, "loss_mask": LOSS_MASK, "target_hidden": torch.randn(8, 96)}
    batch = strategy.collate([sample], ["s"])
    return model, strategy.draw_blocks(model, batch, StepContext(), label_shift=model.head_config.label_shift)


@pytest.mark.parametrize("shift_label, expected", [(True, SHIFTED), (False, UNSHIFTED)])
def test_labels_masks_and_decay_weights_follow_the_alignment(make_draft, shift_label, expected):
    _model, blocks = blocks_of(make_draft, shift_label=shift_label, pure_draft_prefix_len=0)
    labels, label_mask, weights = expected
    assert blocks.anchors.tolist() == [[3, 4, 5]]
    assert blocks.tokens.tolist() == [TOKENS]
    assert blocks.labels.tolist() == [labels]
    assert blocks.label_mask.int().tolist() == [label_mask]
    assert torch.allclose(blocks.weights, torch.tensor([weights]))


@pytest.mark.parametrize("shift_label, gru_inputs", [
    (True, [[53, 54, 55], [54, 55, 56], [55, 56, 57]]),   # tokens a..a+bs-1
    (False, [[53, 54], [54, 55], [55, 56]]),              # tokens a..a+bs-2
])
def test_the_gru_reads_the_real_block_tokens_and_position_k_gets_the_state_the_alignment_names(
        make_draft, shift_label, gru_inputs):
    model, blocks = blocks_of(make_draft, shift_label=shift_label, pure_draft_prefix_len=0)
    seen = []
    prefix_states = model.prefix_states
    model.prefix_states = lambda tokens, state=None: (seen.append(tokens.tolist()), prefix_states(tokens, state))[1]
    with torch.no_grad():
        states = model.block_states(blocks.tokens)  # [1, 3, 3, g]
    assert seen == [gru_inputs]
    assert states.shape == (1, 3, 3, model.head_config.gru_hidden_dim)
    for n, tokens in enumerate(TOKENS):
        for k in range(3):
            read = tokens[: k + 1] if shift_label else tokens[:k]  # a..a+k  or  a..a+k-1
            if not read:
                assert torch.equal(states[0, n, k], torch.zeros_like(states[0, n, k]))
                continue
            with torch.no_grad():
                _, last = model.prefix_gru(model.embed(torch.tensor([read])))
            assert torch.allclose(states[0, n, k], last[0, 0], atol=1e-6), (n, k)


@pytest.mark.parametrize("shift_label, pure, corrected", [
    (True, 0, [1, 1, 1]),    # suffix_start = pure
    (True, 1, [0, 1, 1]),
    (False, 0, [0, 1, 1]),   # suffix_start = 1 + pure
    (False, 1, [0, 0, 1]),
])
def test_only_positions_from_suffix_start_get_the_correction(make_draft, shift_label, pure, corrected):
    model, blocks = blocks_of(make_draft, shift_label=shift_label, pure_draft_prefix_len=pure)
    assert model.head_config.suffix_start == corrected.index(1)
    hidden = torch.randn(1, 3, 3, 32)
    with torch.no_grad():
        states = model.block_states(blocks.tokens)
        base = model.logits(hidden)
        final = model.final_logits(base, hidden, states)  # [1, 3, 3, V]
        correction = model.correction(hidden, states)
    changed = (final != base).any(-1)  # [1, 3, 3]
    assert changed.int().tolist() == [[corrected] * 3]
    mask = torch.tensor(corrected, dtype=torch.bool)[:, None]
    assert torch.allclose(final, torch.where(mask, base + correction, base), atol=1e-6)
