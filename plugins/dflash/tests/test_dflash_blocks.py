"""Anchors, blocks, labels, weights and the block attention mask, pinned on tiny hand-made cases."""

import math

import torch

from specforge_plugin_dflash.blocks import (anchor_generator, block_attention_mask, build_blocks, decay_weights,
                                            draw_blocks, sample_anchors, valid_anchor_mask)

T, F = True, False
MASK = 99


def test_an_anchor_is_valid_only_where_it_and_the_next_token_are_supervised():
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    assert valid_anchor_mask(loss_mask).tolist() == [[F, T, F, F, T, T, F], [T, T, T, T, T, T, F]]


def test_block_mask_sees_context_strictly_before_its_anchor_and_its_own_block_only():
    # Row 0: S=5, anchors 1 and 3, bs=2. Row 1: length 3 (positions 3, 4 are padding), anchor 4
    # (its context must stop at the padding), then a padding block (anchor 0) that sees only itself.
    mask = block_attention_mask(torch.tensor([[1, 3], [4, 0]]), torch.tensor([5, 3]), seq_len=5, block_size=2)
    #            context 0..4          block0  block1
    expected = [[[T, F, F, F, F,      T, T,   F, F],
                 [T, F, F, F, F,      T, T,   F, F],
                 [T, T, T, F, F,      F, F,   T, T],
                 [T, T, T, F, F,      F, F,   T, T]],
                [[T, T, T, F, F,      T, T,   F, F],
                 [T, T, T, F, F,      T, T,   F, F],
                 [F, F, F, F, F,      F, F,   T, T],
                 [F, F, F, F, F,      F, F,   T, T]]]
    assert mask.tolist() == expected


def test_sampled_anchors_are_valid_sorted_capped_and_rows_with_fewer_keep_fewer():
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 0],   # 7 valid anchors (1..7)
                              [0, 0, 0, 0, 0, 0, 0, 1, 1, 0],   # 1 valid anchor (7)
                              [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]])  # none
    gens = [anchor_generator(0, 5, f"s{i}") for i in range(3)]
    anchors, keep, num_valid = sample_anchors(loss_mask, 4, gens)
    assert num_valid.tolist() == [7, 1, 0]
    assert keep.tolist() == [[T, T, T, T], [T, F, F, F], [F, F, F, F]]
    row = anchors[0].tolist()
    assert row == sorted(row) and len(set(row)) == 4 and all(1 <= a <= 7 for a in row)
    assert anchors[1].tolist() == [7, 0, 0, 0] and anchors[2].tolist() == [0, 0, 0, 0]


def test_every_valid_anchor_can_be_drawn_and_draws_are_roughly_uniform():
    loss_mask = torch.tensor([[1] * 11])  # valid anchors 0..9
    counts = torch.zeros(11)
    for step in range(2000):
        anchors, _keep, _n = sample_anchors(loss_mask, 2, [anchor_generator(0, step, "s")])
        counts[anchors[0]] += 1
    assert counts[10] == 0
    assert counts[:10].min() > 300 and counts[:10].max() < 500  # 400 expected each


def test_anchors_depend_on_seed_step_and_sample_id_only_not_on_the_batch():
    loss_mask = torch.ones(3, 40, dtype=torch.long)
    ids = torch.arange(120).view(3, 40)
    kwargs = dict(seed=3, step=11, num_anchors=5, block_size=4, mask_token_id=MASK)
    together = draw_blocks(ids, loss_mask, ["a", "b", "c"], **kwargs)
    alone = draw_blocks(ids[1:2], loss_mask[1:2], ["b"], **kwargs)
    assert torch.equal(together.anchors[1], alone.anchors[0])
    again = draw_blocks(ids, loss_mask, ["a", "b", "c"], **kwargs)
    assert torch.equal(together.anchors, again.anchors)
    other_step = draw_blocks(ids, loss_mask, ["a", "b", "c"], **{**kwargs, "step": 12})
    assert not torch.equal(together.anchors, other_step.anchors)


def test_blocks_labels_and_weights_match_a_hand_computation_with_decay():
    input_ids = torch.arange(100, 108)[None]               # token at position i is 100 + i; S = 8
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1]])
    anchors, keep = torch.tensor([[1, 6, 0]]), torch.tensor([[T, T, F]])  # the third block is padding
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, torch.tensor([4]), block_size=4, mask_token_id=MASK,
                          gamma=2.0)
    assert blocks.ids.tolist() == [[[101, MASK, MASK, MASK], [106, MASK, MASK, MASK], [MASK] * 4]]
    assert blocks.positions.tolist() == [[[1, 2, 3, 4], [6, 7, 8, 9], [0, 1, 2, 3]]]
    assert blocks.labels[0, :2].tolist() == [[101, 102, 103, 104], [106, 107, 107, 107]]  # clamped past the end
    assert torch.equal(blocks.tokens, blocks.labels)  # label_shift 0: position k's label is its own token
    e = math.exp
    expected = [[0, 1, e(-1 / 2), e(-1)],  # k = 0 never; k = 1..3 -> positions 2, 3, 4 all supervised
                [0, 1, 0, 0],              # position 7 supervised; 8 and 9 are past the end
                [0, 0, 0, 0]]              # padding block
    assert torch.allclose(blocks.weights[0], torch.tensor(expected))
    assert blocks.label_mask[0].tolist() == [[F, T, T, T], [F, T, F, F], [F, F, F, F]]


def test_unsupervised_label_positions_get_no_weight_and_no_decay_means_unit_weights():
    input_ids = torch.arange(6)[None]
    loss_mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    blocks = build_blocks(input_ids, loss_mask, torch.tensor([[0]]), torch.tensor([[T]]), torch.tensor([3]),
                          block_size=4, mask_token_id=MASK)
    assert blocks.weights.tolist() == [[[0.0, 1.0, 0.0, 1.0]]]  # position 2 is not supervised


def test_label_shift_one_supervises_position_zero_with_decay_exp_minus_k_over_gamma():
    input_ids = torch.arange(10)[None]
    blocks = build_blocks(input_ids, torch.ones(1, 10, dtype=torch.long), torch.tensor([[2]]), torch.tensor([[T]]),
                          torch.tensor([9]), block_size=3, mask_token_id=MASK, gamma=4.0, label_shift=1)
    assert blocks.labels.tolist() == [[[3, 4, 5]]]
    assert blocks.tokens.tolist() == [[[2, 3, 4]]]  # what a teacher-forced head reads
    assert torch.allclose(blocks.weights[0, 0], torch.tensor([1.0, math.exp(-1 / 4), math.exp(-2 / 4)]))
    assert torch.allclose(decay_weights(3, 4.0, label_shift=1), blocks.weights[0, 0])
