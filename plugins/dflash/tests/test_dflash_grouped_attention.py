"""Block attention in groups of blocks: the dense pattern's keys and result, at a fraction of its work."""

import pytest
import torch

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.blocks import block_attention_mask, grouped_block_attention
from specforge_plugin_dflash.strategy import DFlashStrategy
from specforge_plugin_dflash.testing import GROUPED_TOLERANCES, grouped_vs_dense


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


@pytest.mark.parametrize("group_blocks", [1, 2, 3])
def test_context_bias_is_the_masks_context_part_and_flags_rows_that_see_no_context(group_blocks):
    anchors = torch.tensor([[0, 0, 3, 9, 20], [1, 5, 5, 30, 35], [0, 2, 8, 16, 38]])  # padding blocks at 0
    lengths = torch.tensor([40, 36, 25])  # row 2 ends before its last anchors
    pattern = grouped_block_attention(anchors, lengths, 40, 4, blocks_per_group=group_blocks)
    assert torch.equal(pattern.visible, torch.tensor([[0, 0, 3, 9, 20], [1, 5, 5, 30, 35], [0, 2, 8, 16, 25]]))
    checked = 0
    for group, part in zip(pattern.groups, pattern.context_biases()):
        if group.context == 0:
            assert part is None
            continue
        bias, empty = part
        seen = group.mask[..., :group.context]  # [B, 1, Qg, context]
        assert bias.dtype == torch.float32 and bias.shape == seen.shape
        assert torch.equal(bias == 0, seen) and torch.equal(bias == float("-inf"), ~seen)
        assert torch.equal(empty, ~seen.any(-1))
        checked += 1
    assert checked == len(pattern.groups)
    assert list(pattern.context_biases())[-1][0].shape[-1] == 35  # the last group's context: row 1's anchor 35
    # a group whose blocks all sit at position 0 has no context at all
    first, second = grouped_block_attention(torch.tensor([[0, 5]]), torch.tensor([9]), 9, 2, 1).context_biases()
    assert first is None and second[0].shape == (1, 1, 2, 5) and not second[1].any()


@pytest.mark.parametrize(("dtype", "loss_tol", "grad_tol"), GROUPED_TOLERANCES)
@pytest.mark.parametrize("group_blocks", [1, 2])
def test_dflash_step_in_groups_equals_the_dense_mask_step(dtype, loss_tol, grad_tol, group_blocks):
    result = grouped_vs_dense(DFlashStrategy, DFlashOptions, dtype, group_blocks=group_blocks, loss_decay_gamma=7.0)
    assert result["loss"] > 1.0  # a real loss, not an empty batch
    assert result["loss_diff"] <= loss_tol * result["loss"]
    assert result["grad_diff"] <= grad_tol * result["grad_max"]


@pytest.mark.parametrize("group_blocks", [1, 2, 5])
def test_cpu_attention_of_context_views_and_own_blocks_merged_equals_the_dense_mask(group_blocks):
    """On CPU the grouped pattern runs as flash calls over each group's context prefix (a view of the keys)
    and over each block's own keys, merged by log-sum-exp: outputs and gradients equal the dense mask's,
    with padding blocks (anchor 0: no context key) and a row shorter than its last anchors, GQA 4:2."""
    from specforge_plugin_dflash.model import attend, attend_grouped

    gen = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, dim, seq, blocks, bs = 3, 4, 2, 8, 40, 5, 4
    anchors = torch.tensor([[0, 0, 3, 9, 20], [1, 5, 5, 30, 35], [0, 2, 8, 16, 38]])
    lengths = torch.tensor([40, 36, 25])
    pattern = grouped_block_attention(anchors, lengths, seq, bs, blocks_per_group=group_blocks)
    assert pattern.block_size == bs
    if group_blocks == 1:  # the first group's row 0 (a padding block) sees no context key
        bias, empty = list(pattern.context_biases())[1]
        assert empty[0, 0].all() and not empty[1, 0].any() and bias.dtype == torch.float32
    tensors = [torch.randn(batch, n, width, dim, generator=gen)
               for n, width in ((heads, blocks * bs), (kv_heads, seq + blocks * bs), (kv_heads, seq + blocks * bs))]
    weights = torch.randn(batch, heads, blocks * bs, dim, generator=gen)
    results = []
    for run in (lambda q, k, v: attend(q, k, v, block_attention_mask(anchors, lengths, seq, bs)[:, None], "sdpa"),
                lambda q, k, v: attend_grouped(q, k, v, pattern, "sdpa")):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = run(*leaves)
        (out * weights).sum().backward()
        results.append([out.detach(), *(t.grad for t in leaves)])
    for got, want in zip(results[1], results[0]):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_cpu_merged_attention_in_bfloat16_is_no_further_from_the_float32_result_than_the_dense_kernel():
    """In bfloat16 the merged path computes in float32 and rounds once: over five random draws its largest
    output and gradient error against the float32 attention is at most the dense bfloat16 kernel's."""
    from specforge_plugin_dflash.model import attend, attend_grouped

    gen = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, dim, seq, blocks, bs = 3, 4, 2, 8, 40, 5, 4
    anchors = torch.tensor([[0, 0, 3, 9, 20], [1, 5, 5, 30, 35], [0, 2, 8, 16, 38]])
    lengths = torch.tensor([40, 36, 25])
    pattern = grouped_block_attention(anchors, lengths, seq, bs, blocks_per_group=2)
    mask = block_attention_mask(anchors, lengths, seq, bs)[:, None]
    paths = {"dense": lambda q, k, v: attend(q, k, v, mask, "sdpa"),
             "merged": lambda q, k, v: attend_grouped(q, k, v, pattern, "sdpa")}
    errors = {name: 0.0 for name in paths}
    for _ in range(5):
        tensors = [torch.randn(batch, n, width, dim, generator=gen).to(torch.bfloat16).float()
                   for n, width in ((heads, blocks * bs), (kv_heads, seq + blocks * bs),
                                    (kv_heads, seq + blocks * bs))]
        weights = torch.randn(batch, heads, blocks * bs, dim, generator=gen)
        exact = [t.clone().requires_grad_() for t in tensors]
        exact_out = paths["dense"](*exact)
        exact_results = [exact_out, *torch.autograd.grad((exact_out * weights).sum(), exact)]
        for name, run in paths.items():
            leaves = [t.to(torch.bfloat16).requires_grad_() for t in tensors]
            out = run(*leaves)
            results = [out, *torch.autograd.grad((out.float() * weights).sum(), leaves)]
            errors[name] = max(errors[name], *(float((got.float() - want).abs().max() / want.abs().max())
                                               for got, want in zip(results, exact_results)))
    assert 0 < errors["merged"] <= errors["dense"] < 2.0 ** -5


def test_attention_keeps_the_shared_context_for_backward_not_a_joined_copy_per_layer():
    """k and v come from the context and the block rows as two matmuls joined after: backward keeps the
    context tensor itself (which every layer shares), no ``[B, S+Q, H]`` join of it with the block rows, and
    the result is the joined-input matmul's."""
    from specforge_core.nn import apply_rope, rope_cos_sin
    from specforge_plugin_dflash.config import DFlashConfig
    from specforge_plugin_dflash.model import DFlashAttention

    torch.manual_seed(0)
    batch, seq, queries, hidden = 2, 12, 8, 16
    config = DFlashConfig(hidden_size=hidden, intermediate_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                          head_dim=8, vocab_size=10, block_size=4)
    attn = DFlashAttention(config)
    ctx, x = torch.randn(batch, seq, hidden, requires_grad=True), torch.randn(batch, queries, hidden)
    positions = torch.arange(seq + queries).expand(batch, -1)
    rope_k = [t[:, :, None] for t in rope_cos_sin(positions, 8, 10000.0)]
    rope_q, rope_ctx = [t[:, seq:] for t in rope_k], [t[:1, :seq] for t in rope_k]
    mask = torch.ones(batch, queries, seq + queries, dtype=torch.bool)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = attn(x, ctx, rope_q, rope_ctx, mask, "sdpa")
    assert not any(t.shape == (batch, seq + queries, hidden) for t in saved)
    assert any(t.untyped_storage().data_ptr() == ctx.untyped_storage().data_ptr() for t in saved)
    joined = torch.cat([ctx, x], dim=1)
    k = attn.k_norm((joined @ attn.k_proj.weight.t()).view(batch, seq + queries, 2, 8))
    v = (joined @ attn.v_proj.weight.t()).view(batch, seq + queries, 2, 8)
    q = attn.q_norm((x @ attn.q_proj.weight.t()).view(batch, queries, 4, 8))
    q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_k)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            enable_gqa=True)
    want = attn.o_proj(want.transpose(1, 2).reshape(batch, queries, -1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_cpu_grouped_attention_gives_each_input_its_gradient_in_the_inputs_layout():
    """A layer's q, k and v are ``[B, S, h, d]`` projections seen as ``[B, h, S, d]``: the grouped CPU attention
    returns each gradient in that same layout, so the layer's transposes and views pass it on without copying
    it (a ``[B, h, S, d]``-ordered gradient made autograd copy k's and v's whole gradient in every layer)."""
    from specforge_plugin_dflash.model import attend_grouped

    gen = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, dim, seq, blocks, bs = 2, 4, 2, 8, 24, 4, 4
    anchors = torch.tensor([[0, 3, 9, 20], [1, 5, 12, 18]])
    pattern = grouped_block_attention(anchors, torch.tensor([24, 22]), seq, bs, blocks_per_group=2)
    q, k, v = (torch.randn(batch, width, n, dim, generator=gen).transpose(1, 2).requires_grad_()
               for n, width in ((heads, blocks * bs), (kv_heads, seq + blocks * bs), (kv_heads, seq + blocks * bs)))
    out = attend_grouped(q, k, v, pattern, "sdpa")
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=gen).transpose(1, 2)
                                .contiguous().transpose(1, 2))
    for grad, given in zip(grads, (q, k, v)):
        assert grad.shape == given.shape and grad.stride() == given.stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 3), (4, 1)])
def test_cpu_half_precision_backward_one_kv_head_at_a_time_equals_all_heads_at_once(monkeypatch, dtype, heads,
                                                                                     kv_heads):
    """In half precision the grouped CPU attention's backward runs one KV head (and its query heads) at a time:
    its gradients are those of all heads at once bit for bit, in the inputs' layouts, and the largest float32
    tensor it makes is one KV head's keys, not all of them (a single KV head has nothing to split)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specforge_plugin_dflash import model

    class LargestFloat32(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.numel = max(self.numel, t.numel())
            return out

    gen = torch.Generator().manual_seed(6)
    batch, dim, seq, blocks, bs = 3, 8, 40, 5, 4
    anchors = torch.tensor([[0, 0, 3, 9, 20], [1, 5, 5, 30, 35], [0, 2, 8, 16, 38]])
    pattern = grouped_block_attention(anchors, torch.tensor([40, 36, 25]), seq, bs, blocks_per_group=2)
    keys = seq + blocks * bs
    tensors = [torch.randn(batch, width, n, dim, generator=gen).to(dtype).transpose(1, 2)
               for n, width in ((heads, blocks * bs), (kv_heads, keys), (kv_heads, keys))]
    grad_out = torch.randn(batch, blocks * bs, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    results, largest = {}, {}
    for split in (True, False):
        if not split:
            monkeypatch.setattr(model, "_kv_head_parts", lambda q, k: None)
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = model.attend_grouped(*leaves, pattern, "sdpa")
        with LargestFloat32() as mode:
            grads = torch.autograd.grad(out, leaves, grad_out)
        results[split], largest[split] = [out, *grads], mode.numel
        assert all(grad.dtype == dtype and grad.stride() == given.stride() for grad, given in zip(grads, leaves))
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    if kv_heads == 1:
        assert largest[True] == largest[False]
    else:
        assert largest[False] == batch * kv_heads * keys * dim
        assert largest[True] == batch * keys * dim


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_attention_keeps_group_biases_for_the_batch_in_float32_only_and_half_precision_keeps_no_float32_output(
        monkeypatch, dtype):
    """Float32 makes the groups' context biases once and shares them (the pattern keeps them); half precision
    makes them afresh for each call and keeps none, and keeps for backward the output it returns (which the
    layer's o_proj keeps anyway), not a float32 copy. Both give the float32 path's result to bf16 rounding."""
    from specforge_plugin_dflash.blocks import GroupedBlockAttention
    from specforge_plugin_dflash.model import attend_grouped

    made = []
    biases = GroupedBlockAttention.context_biases
    monkeypatch.setattr(GroupedBlockAttention, "context_biases", lambda self: made.append(1) or biases(self))
    gen = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, dim, seq, blocks, bs = 2, 4, 2, 8, 24, 4, 4
    anchors = torch.tensor([[0, 3, 9, 20], [1, 5, 12, 18]])
    tensors = [torch.randn(batch, width, n, dim, generator=gen).transpose(1, 2)
               for n, width in ((heads, blocks * bs), (kv_heads, seq + blocks * bs), (kv_heads, seq + blocks * bs))]
    grad_out = torch.randn(batch, heads, blocks * bs, dim, generator=gen)
    results = {}
    for run_dtype in (torch.float32, dtype):
        pattern = grouped_block_attention(anchors, torch.tensor([24, 22]), seq, bs, blocks_per_group=2)
        made.clear()
        leaves = [t.to(run_dtype).requires_grad_() for t in tensors]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = attend_grouped(*leaves, pattern, "sdpa")
        grads = torch.autograd.grad(out, leaves, grad_out.to(run_dtype))
        results[run_dtype] = [out.float(), *(g.float() for g in grads)]
        # float32: made once for forward and backward; half precision: forward, then backward per KV head (two)
        assert len(made) == (1 if run_dtype == torch.float32 else 1 + kv_heads)
        if run_dtype != torch.float32:
            assert [t.dtype for t in saved if t.shape == out.shape] == [run_dtype, run_dtype]  # q and the output
            assert any(t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for t in saved)
    for got, want in zip(results[dtype], results[torch.float32]):
        assert 0 < (got - want).abs().max() <= 2 ** -6 * want.abs().max()


def test_layers_keep_one_row_of_context_rotary_tables_for_the_whole_batch():
    """The keys' rotary tables backward keeps: the context's once for the batch (``[1, S, 1, d]``, as views over
    the batch) and the block's those of the queries, so no ``[B, S+Q, 1, d]`` tables (per sample, the block's
    made twice) are kept; the hidden states are those of the keys rotated by the joined tables."""
    from specforge_core.nn import apply_rope, rope_cos_sin
    from specforge_plugin_dflash.testing import random_target, small_draft

    info, frozen = random_target()
    _, model = small_draft(DFlashStrategy, DFlashOptions, info, frozen)
    batch, seq, queries, d = 3, 20, 8, model.config.head_dim
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randn(batch, seq, model.config.hidden_size, generator=gen, requires_grad=True)
    x = torch.randn(batch, queries, model.config.hidden_size, generator=gen)
    positions = torch.randint(0, 40, (batch, queries), generator=gen)
    mask = torch.ones(batch, queries, seq + queries, dtype=torch.bool)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model.run_layers(ctx, x, positions, mask)
    tables = {t.untyped_storage().data_ptr(): t for t in saved if t.dim() == 4 and t.shape[-2:] == (1, d)}
    assert sorted(tuple(t.untyped_storage().nbytes() for t in tables.values())) == \
        sorted([seq * d * 4] * 2 + [batch * queries * d * 4] * 2)  # cos and sin: the context's row, the blocks'
    assert not any(t.shape[:2] == (batch, seq + queries) for t in tables.values())
    # the same layers with the joined tables of every sample
    joined = [t[:, :, None] for t in rope_cos_sin(torch.cat([torch.arange(seq).expand(batch, -1), positions], 1),
                                                  d, model.config.rope_theta)]
    h = x
    rope_q = [t[:, seq:] for t in joined]
    for layer in model.layers:
        attn = layer.self_attn
        normed = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(normed).view(batch, queries, -1, d))
        k = attn.k_norm(torch.cat([attn.k_proj(ctx), attn.k_proj(normed)], 1).view(batch, seq + queries, -1, d))
        v = torch.cat([attn.v_proj(ctx), attn.v_proj(normed)], 1).view(batch, seq + queries, -1, d)
        q, k = apply_rope(q, *rope_q), apply_rope(k, *joined)
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            attn_mask=mask[:, None], enable_gqa=True)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(batch, queries, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    torch.testing.assert_close(out, model.norm(h), rtol=1e-5, atol=1e-5)
