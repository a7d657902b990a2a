"""Block attention in groups of blocks: the dense pattern's keys and result, at a fraction of its work."""

import pytest
import torch

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.blocks import block_attention_mask, grouped_block_attention
from specforge_plugin_dflash.strategy import DFlashStrategy
from specforge_plugin_dflash.testing import grouped_vs_dense


def test_groups_keep_every_visible_key_and_cut_the_context_at_their_last_anchor():
    anchors = torch.tensor([[1, 3, 6, 9, 11], [2, 4, 5, 0, 0]])  # row 1 kept three blocks
    lengths = torch.tensor([14, 7])
    dense = block_attention_mask(anchors, lengths, 14, 2)  # [2, 10, 14 + 10]
    pattern = grouped_block_attention(anchors, lengths, 14, 2, blocks_per_group=2)
    assert pattern.seq_len == 14
    assert [(g.start, g.end, g.context) for g in pattern.groups] == [(0, 4, 4), (4, 8, 9), (8, 10, 11)]
    for group in pattern.groups:
        rows = dense[:, group.start:group.end]
        own = rows[:, :, 14 + group.start:14 + group.end]
        assert torch.equal(group.mask[:, 0], torch.cat([rows[:, :, :group.context], own], dim=-1))
        # nothing the dense pattern lets these queries see is left out of the group
        assert int(rows.sum()) == int(group.mask.sum())
    # 4*(4+4) + 4*(9+4) + 2*(11+2) query-key pairs instead of the dense 10*(14+10)
    assert sum((g.end - g.start) * (g.context + g.end - g.start) for g in pattern.groups) == 110


def test_one_group_of_all_blocks_is_the_dense_mask_cut_at_the_last_visible_context_key():
    anchors, lengths = torch.tensor([[2, 5]]), torch.tensor([6])
    (group,) = grouped_block_attention(anchors, lengths, 9, 3, blocks_per_group=8).groups
    dense = block_attention_mask(anchors, lengths, 9, 3)
    assert (group.start, group.end, group.context) == (0, 6, 5)
    assert torch.equal(group.mask[:, 0], torch.cat([dense[:, :, :5], dense[:, :, 9:]], dim=-1))


#: (dtype, relative loss tolerance, gradient tolerance relative to the largest gradient): float32 to its
#: rounding, bfloat16 to about one of its ulps (2^-7) of the largest gradient.
TOLERANCES = [("float32", 1e-6, 1e-5), ("bfloat16", 1e-3, 1e-2)]


@pytest.mark.parametrize(("dtype", "loss_tol", "grad_tol"), TOLERANCES)
@pytest.mark.parametrize("group_blocks", [1, 2])
def test_dflash_step_in_groups_equals_the_dense_mask_step(dtype, loss_tol, grad_tol, group_blocks):
    result = grouped_vs_dense(DFlashStrategy, DFlashOptions, dtype, group_blocks=group_blocks, loss_decay_gamma=7.0)
    assert result["loss"] > 1.0  # a real loss, not an empty batch
    assert result["loss_diff"] <= loss_tol * result["loss"]
    assert result["grad_diff"] <= grad_tol * result["grad_max"]
