"""The EAGLE3 math pinned on small hand-checked cases: mask, shifts, vocabulary, loss, tau_sim."""

import math
import re

import pytest
import torch

from specforge_core.contracts import StepContext
from specforge_core.protocols import DataStats
from specforge_core.training.checkpoint import model_state
from specforge_core.training.distributed import DistInfo

from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.export import EXPORT_KEYS
from specforge_plugin_eagle3.head_loss import head_soft_cross_entropy
from specforge_plugin_eagle3.loss import align, round_depth, tau_sim, ttt_loss, unroll_windows
from specforge_core.nn import apply_rope
from specforge_plugin_eagle3.model import (CAUSAL, DraftKV, UnrollWindows, additive_mask, repeat_kv, right_padded,
                                          shift_left, take_rows, ttt_attention, ttt_key_mask)
from specforge_plugin_eagle3.strategy import Eagle3Strategy
from specforge_plugin_eagle3.testing import V, tiny_batch, tiny_target
from specforge_plugin_eagle3.vocab import VocabMappingError, build_vocab_mapping



def counts_for(vocab, hot):
    counts = torch.zeros(vocab, dtype=torch.long)
    for token, count in hot.items():
        counts[token] = count
    return DataStats(token_counts=counts)


def tiny_draft(stats=None, **options):
    """(target info, frozen parts, strategy, draft) on the tiny random target."""
    info, frozen = tiny_target()
    strategy = Eagle3Strategy(Eagle3Options(**options))
    return info, frozen, strategy, strategy.build_model(info, frozen, stats or DataStats())


# ---------------------------------------------------------------- attention pattern
def test_ttt_attention_mask_on_a_padded_row_at_step_two():
    # S = 4, the row holds 3 real tokens and 1 pad; step 2 of a K = 3 unroll sees the step-0
    # block (causal, pad key hidden) and one diagonal key for each of steps 1 and 2.
    mask = ttt_key_mask(torch.tensor([[1, 1, 1, 0]]), step=2)[0]
    expected = torch.tensor([
        # step-0 keys   step-1 keys   step-2 keys
        [1, 0, 0, 0,    1, 0, 0, 0,   1, 0, 0, 0],
        [1, 1, 0, 0,    0, 1, 0, 0,   0, 1, 0, 0],
        [1, 1, 1, 0,    0, 0, 1, 0,   0, 0, 1, 0],
        [1, 1, 1, 0,    0, 0, 0, 1,   0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_ttt_key_mask_at_step_zero_is_causal_within_the_valid_length():
    mask = ttt_key_mask(torch.tensor([[1, 1, 0]]), step=0)[0]
    assert torch.equal(mask, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool))


def dense_attention(q, keys, values, mask):
    """Plain softmax attention over concatenated keys with a dense boolean mask [B, S, T]."""
    groups = q.shape[1] // keys.shape[1]
    scores = q @ repeat_kv(keys, groups).transpose(2, 3) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ repeat_kv(values, groups)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_attention_with_the_additive_bias_built_once_equals_the_boolean_mask_in_output_and_gradients(dtype, tol):
    gen = torch.Generator().manual_seed(1)
    b, nh, nkv, s, d = 2, 4, 2, 7, 8
    attention_mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    mask0 = ttt_key_mask(attention_mask, 0)[:, None]
    bias = additive_mask(mask0)
    assert bias.dtype == torch.float32 and set(bias.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    tensors = [torch.randn(b, n, s, d, generator=gen).to(dtype) for n in (nh, nkv, nkv, nkv, nkv)]
    results = []
    for mask in (mask0, bias):
        q, k0, v0, k1, v1 = (t.clone().requires_grad_() for t in tensors)
        out = ttt_attention(q, k0, v0, mask, [(k1, v1)])
        (out.float() * torch.linspace(-1, 1, d)).sum().backward()
        results.append([out.detach().float(), *(t.grad.float() for t in (q, k0, v0, k1, v1))])
    for got, want in zip(results[1], results[0]):
        assert (got - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("chunk", [64, 4])  # one causal call; chunks of 4 queries (the last one short)
@pytest.mark.parametrize("diagonals", [0, 1, 3])
def test_causal_flash_attention_plus_diagonal_keys_equals_the_boolean_mask_on_real_rows(monkeypatch, diagonals,
                                                                                          chunk):
    """CAUSAL (the CPU flash kernel over the step-0 keys, diagonal keys merged by log-sum-exp) against the
    bool mask of a right-padded batch: equal outputs at the real queries and equal gradients of a loss
    over them, GQA included."""
    from specforge_core import nn as sf_nn

    monkeypatch.setattr(sf_nn, "CAUSAL_CHUNK", chunk)
    gen = torch.Generator().manual_seed(2)
    b, nh, nkv, s, d = 2, 4, 2, 9, 8
    attention_mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    assert right_padded(attention_mask) and not right_padded(torch.tensor([[0, 1, 1]]))
    real = attention_mask.bool()[:, None, :, None]  # [B, 1, S, 1]: the queries that count
    tensors = [torch.randn(b, n, s, d, generator=gen) for n in (nh, nkv, nkv) + (nkv, nkv) * diagonals]
    results = []
    for mask in (ttt_key_mask(attention_mask, 0)[:, None], CAUSAL):
        leaves = [t.clone().requires_grad_() for t in tensors]
        q, k0, v0, *rest = leaves
        out = ttt_attention(q, k0, v0, mask, list(zip(rest[0::2], rest[1::2])))
        (out * real * torch.linspace(-1, 1, d)).sum().backward()
        results.append([(out * real).detach(), *(t.grad for t in leaves)])
    for got, want in zip(results[1], results[0]):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_causal_attention_in_bfloat16_is_no_further_from_the_exact_result_than_the_boolean_mask_path():
    """In bf16 the CPU path computes in float32 and rounds its output and gradients once: over a few random
    draws its largest relative error against the same inputs in float32 is no larger than the bf16 matmul
    path's, which rounds its scores and probabilities too."""
    gen = torch.Generator().manual_seed(5)
    b, nh, nkv, s, d = 2, 4, 2, 70, 16  # more than one chunk of queries
    attention_mask = torch.ones(b, s, dtype=torch.long)
    masks = {"bool": ttt_key_mask(attention_mask, 0)[:, None], "causal": CAUSAL}
    errors = {name: 0.0 for name in masks}
    for _ in range(3):
        tensors = [torch.randn(b, n, s, d, generator=gen).to(torch.bfloat16).float() for n in (nh, nkv, nkv, nkv, nkv)]
        weights = torch.randn(b, nh, s, d, generator=gen)

        def run(leaves, mask):
            q, k0, v0, k1, v1 = leaves
            out = ttt_attention(q, k0, v0, mask, [(k1, v1)])
            return [out, *torch.autograd.grad((out.float() * weights).sum(), leaves)]

        exact = run([t.clone().requires_grad_() for t in tensors], masks["bool"])
        for name, mask in masks.items():
            got = run([t.to(torch.bfloat16).requires_grad_() for t in tensors], mask)
            assert all(t.dtype == torch.bfloat16 for t in got)
            errors[name] = max(errors[name], *(float((g.float() - w).abs().max() / w.abs().max())
                                               for g, w in zip(got, exact)))
    assert 0 < errors["causal"] <= errors["bool"] < 2.0 ** -5


def test_bfloat16_keys_read_from_the_caches_float32_copies_give_the_converting_paths_values_bit_for_bit():
    """The CPU causal path with the keys' and values' float32 copies from :meth:`DraftKV.float32` (longer
    diagonal pairs cut to the queries, a window of queries from position 2) gives the output and gradients of
    the path that converts each one itself; the cache makes a copy once per tensor, and again for one changed
    in place."""
    gen = torch.Generator().manual_seed(7)
    b, nh, nkv, s, d = 2, 4, 2, 9, 8
    k0, v0 = (torch.randn(b, nkv, s, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    diag = [(torch.randn(b, nkv, n, d, generator=gen).to(torch.bfloat16),
             torch.randn(b, nkv, n, d, generator=gen).to(torch.bfloat16)) for n in (7, 6)]
    q = torch.randn(b, nh, 6, d, generator=gen).to(torch.bfloat16)
    weights = torch.randn(b, nh, 6, d, generator=gen)
    kv = DraftKV()
    kv.add_step0(k0, v0)
    kv.diag.extend(diag)
    results = []
    for float32 in (None, kv.float32()):
        leaves = [t.clone().requires_grad_() for t in (q, k0, v0, *(t for pair in diag for t in pair))]
        q_, k0_, v0_, *rest = leaves
        out = ttt_attention(q_, k0_, v0_, CAUSAL, list(zip(rest[0::2], rest[1::2])), query_start=2, float32=float32)
        results.append([out, *torch.autograd.grad((out.float() * weights).sum(), leaves)])
    assert all(torch.equal(got, want) for got, want in zip(results[1], results[0]))
    copies = kv.float32()
    assert copies.k0.dtype == torch.float32 and torch.equal(copies.k0, k0.float())
    assert kv.float32().k0 is copies.k0 and kv.float32().diag[1][0] is copies.diag[1][0]  # made once
    k0.mul_(2)
    assert kv.float32().k0 is not copies.k0 and torch.equal(kv.float32().k0, k0.float())


def test_a_bfloat16_unroll_converts_each_key_and_value_to_float32_once_for_its_attention():
    """Every unroll step's attention reads the step-0 keys and values and each earlier step's, in forward and in
    backward; the CPU causal path computes in float32 and now converts each of them once. A 3-step bf16 unroll
    converts tensors of the keys' shape 12 times: each step's key and value once for the attention, and its key
    forward and its key's gradient backward in the rotary embedding (converted per reading, it was 30)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Conversions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.bfloat16 \
                    and out.dtype == torch.float32 and args[0].dim() == 4 and args[0].shape[1] == 2:
                self.shapes.append(tuple(args[0].shape))
            return out

    info, frozen, strategy, model = tiny_draft(ttt_length=3, dtype="bfloat16")
    _samples, batch = tiny_batch(strategy, info, lengths=(6, 6))
    with Conversions() as seen:
        strategy.forward_loss(model, batch, StepContext()).loss.backward()
    assert sorted(seen.shapes) == [(2, 2, 2, 4)] * 4 + [(2, 2, 3, 4)] * 4 + [(2, 2, 6, 4)] * 4


def test_causal_attention_is_refused_off_cpu_naming_what_to_pass_instead():
    q, kv = torch.empty(1, 4, 3, 8, device="meta"), torch.empty(1, 2, 3, 8, device="meta")
    with pytest.raises(ValueError, match="mask0='causal' runs on CPU's flash kernel; on meta pass the additive"):
        ttt_attention(q, kv, kv, CAUSAL, [])


def test_compact_attention_equals_dense_attention_under_the_pinned_mask():
    gen = torch.Generator().manual_seed(0)
    b, nh, nkv, s, d, steps = 2, 4, 2, 6, 8, 3
    attention_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    q = torch.randn(b, nh, s, d, generator=gen, dtype=torch.float64)
    keys = [torch.randn(b, nkv, s, d, generator=gen, dtype=torch.float64) for _ in range(steps)]
    values = [torch.randn(b, nkv, s, d, generator=gen, dtype=torch.float64) for _ in range(steps)]
    mask0 = ttt_key_mask(attention_mask, 0)[:, None]
    compact = ttt_attention(q, keys[0], values[0], mask0, list(zip(keys[1:], values[1:])))
    dense = dense_attention(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_key_mask(attention_mask, steps - 1))
    assert torch.allclose(compact, dense, atol=1e-12)


def reference_unroll(model, ids, aux, attention_mask, steps):
    """The unroll written densely: every step's keys kept, attention masked with ttt_key_mask."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    b, s = ids.shape
    hidden, keys, values, out = model.fc(aux), [], [], []
    for k in range(steps):
        x = torch.cat([layer.input_layernorm(model.embed(ids)), layer.hidden_norm(hidden)], -1)
        cos, sin = model.rope(torch.arange(s) + k)
        q = apply_rope(attn.q_proj(x).view(b, s, attn.num_heads, -1).transpose(1, 2), cos, sin)
        keys.append(apply_rope(attn.k_proj(x).view(b, s, attn.num_kv_heads, -1).transpose(1, 2), cos, sin))
        values.append(attn.v_proj(x).view(b, s, attn.num_kv_heads, -1).transpose(1, 2))
        o = dense_attention(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_key_mask(attention_mask, k))
        hidden = hidden + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        out.append(model.lm_head(model.norm(hidden)))
        ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    return out


def test_the_unrolled_forward_equals_a_dense_reference_with_rope_offsets_and_shifted_ids():
    info, frozen, strategy, model = tiny_draft(ttt_length=4)
    _samples, batch = tiny_batch(strategy, info, lengths=(6, 4))
    with torch.no_grad():
        got = model(batch["input_ids"], batch["aux_hidden"], batch["attention_mask"], 4)
        want = reference_unroll(model, batch["input_ids"], batch["aux_hidden"], batch["attention_mask"], 4)
    real = batch["attention_mask"].bool()
    for g, w in zip(got, want):
        assert torch.allclose(g[real], w[real], atol=1e-5)


def test_the_unroll_gives_every_parameter_the_dense_references_gradient():
    """The token half of q/k/v computed once for all steps (and the stacked weights' own backward) gives the
    gradients of the reference, which concatenates [norm(embed) ; norm(hidden)] at every step."""
    info, frozen, strategy, model = tiny_draft(ttt_length=4)
    model = model.double()
    _samples, batch = tiny_batch(strategy, info, lengths=(6, 4))
    ids, aux, attention_mask = batch["input_ids"], batch["aux_hidden"].double(), batch["attention_mask"]
    real = attention_mask.bool()
    gen = torch.Generator().manual_seed(3)
    params = [p for p in model.parameters() if p.requires_grad]

    def gradients(outputs):
        loss = sum((out[real] * torch.randn(out[real].shape, generator=gen, dtype=out.dtype)).sum()
                   for out in outputs)
        return torch.autograd.grad(loss, params)

    got = gradients(model(ids, aux, attention_mask, 4))
    gen.manual_seed(3)
    want = gradients(reference_unroll(model, ids, aux, attention_mask, 4))
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert "midlayer.input_layernorm.weight" in names and "midlayer.self_attn.q_proj.weight" in names
    for name, g, w in zip(names, got, want):
        assert w.abs().max() > 0, name
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-12), name


def test_take_rows_is_gather_along_the_sequence_in_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6], [6, 2, 2, 0]])
    grad = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    got = take_rows(x, rows)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    want = x.gather(1, rows[..., None].expand(-1, -1, 5))
    (want_grad,) = torch.autograd.grad(want, x, grad)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert got[2, 1].tolist() == x[2, 2].tolist() and got_grad[2, 2].tolist() == (grad[2, 1] + grad[2, 2]).tolist()


def test_padding_does_not_change_the_logits_of_real_positions():
    info, frozen, strategy, model = tiny_draft(ttt_length=3)
    samples, batch = tiny_batch(strategy, info, lengths=(7, 3))
    alone = strategy.collate(samples[1:], ["s1"])
    with torch.no_grad():
        padded = model(batch["input_ids"], batch["aux_hidden"], batch["attention_mask"], 3)
        single = model(alone["input_ids"], alone["aux_hidden"], alone["attention_mask"], 3)
    for p, a in zip(padded, single):
        assert torch.allclose(p[1, :3], a[0], atol=1e-5)


# ---------------------------------------------------------------- alignment
def test_alignment_shifts_ids_and_last_hidden_and_drops_each_samples_last_position():
    ids = torch.tensor([[5, 6, 7, 8], [3, 4, 0, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    last = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])[..., None]  # collate zero-pads
    a_ids, a_mask, a_last = align(ids, loss_mask, last, attention_mask)
    assert a_ids.tolist() == [[6, 7, 8, 0], [4, 0, 0, 0]]
    assert a_mask.tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert a_last[..., 0].tolist() == [[2.0, 3.0, 4.0, 0.0], [6.0, 0.0, 0.0, 0.0]]
    # decode positions: a round drafts after each reply token but the last (bonus t+1 and draft t+2 in the reply)
    _, d_mask, _ = align(ids, loss_mask, last, attention_mask, "decode")
    assert d_mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]


def test_round_depth_is_each_positions_offset_in_its_reply_so_no_round_starts_on_a_prompt_token():
    # two replies (tokens 2-4 and 7-8) after prompts; aligned position j is about token j + 1
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1]])
    assert round_depth(loss_mask).tolist() == [[-1, 0, 1, 2, -1, -1, 0, 1, 0]]
    # the decode rows (j + 1 and j + 2 in a reply) and the steps that score them: j = 2 (token 3, the reply's
    # second) only at steps 0 and 1; step 2 would start its round at j = 0, after a prompt token
    _, mask, _ = align(loss_mask, loss_mask, torch.zeros(1, 9, 1), torch.ones(1, 9, dtype=torch.long), "decode")
    assert mask.tolist() == [[0, 1, 1, 0, 0, 0, 1, 0, 0]]
    p_t = torch.full((1, 9, 2), 0.5)
    hidden = [torch.zeros(1, 9, 2, requires_grad=True) for _ in range(3)]
    score = lambda rows, targets: head_soft_cross_entropy(rows, torch.eye(2), targets)  # noqa: E731
    _, ratios = ttt_loss(hidden, score, p_t, torch.zeros(1, 9, dtype=torch.long), mask.bool(), mask,
                         torch.zeros(2, dtype=torch.long), 0.8, depth=round_depth(loss_mask))
    assert [ratios[f"ploss_{k}"][1] for k in range(3)] == [3.0, 1.0, 0.0]
    assert [ratios[f"acc_{k}"] for k in range(3)] == [(3.0, 3.0), (1.0, 1.0), (0.0, 0.0)]
    _, unbounded = ttt_loss(hidden, score, p_t, torch.zeros(1, 9, dtype=torch.long), mask.bool(), mask,
                            torch.zeros(2, dtype=torch.long), 0.8)  # without depth: t >= k alone
    assert [unbounded[f"ploss_{k}"][1] for k in range(3)] == [3.0, 3.0, 2.0]


def test_shift_left_zero_fills_and_handles_shifts_past_the_end():
    x = torch.tensor([[1, 2, 3]])
    assert shift_left(x, 2).tolist() == [[3, 0, 0]]
    assert shift_left(x, 3).tolist() == [[0, 0, 0]]


# ---------------------------------------------------------------- vocabulary mapping
def test_vocab_mapping_takes_the_most_frequent_tokens_sorted_ascending():
    counts = torch.tensor([0, 5, 3, 5, 0, 1, 0, 0])
    d2t, t2d = build_vocab_mapping(counts, 8, 4)
    # used = [1, 2, 3, 5]; d2t[i] = used[i] - i
    assert d2t.tolist() == [1, 1, 1, 2]
    assert t2d.tolist() == [False, True, True, True, False, True, False, False]


def test_vocab_mapping_breaks_ties_by_lower_id():
    d2t, t2d = build_vocab_mapping(torch.tensor([0, 2, 2, 2, 0, 7]), 6, 3)
    assert (torch.arange(3) + d2t).tolist() == [1, 2, 5]  # 5 (7 times), then 1 and 2 of the tied 1, 2, 3
    assert t2d.tolist() == [False, True, True, False, False, True]


def test_vocab_mapping_pads_with_the_lowest_unused_ids():
    d2t, t2d = build_vocab_mapping(torch.tensor([0, 0, 0, 0, 0, 0, 4, 0]), 8, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 6]
    assert d2t.tolist() == [0, 0, 4]
    assert t2d.nonzero().flatten().tolist() == [0, 1, 6]


def test_full_draft_vocabulary_is_the_identity_mapping_without_counts():
    d2t, t2d = build_vocab_mapping(None, 5, 5)
    assert d2t.tolist() == [0] * 5 and t2d.all()


def test_a_reduced_vocabulary_without_token_counts_is_refused_with_the_fix():
    with pytest.raises(VocabMappingError, match="DataStats.token_counts.*draft_vocab_size=9"):
        build_vocab_mapping(None, 9, 4)
    with pytest.raises(VocabMappingError, match="10 entries, but the target vocabulary has 9"):
        build_vocab_mapping(torch.ones(10), 9, 4)


def test_training_data_without_token_counts_is_refused_but_a_rebuild_for_a_checkpoint_is_not():
    info, frozen = tiny_target()
    strategy = Eagle3Strategy(Eagle3Options(draft_vocab_size=3))
    with pytest.raises(VocabMappingError, match="DataStats.token_counts"):
        strategy.build_model(info, frozen, DataStats(num_samples=10))
    rebuilt = strategy.build_model(info, frozen, DataStats())  # export/eval: the checkpoint brings d2t/t2d
    assert rebuilt.draft_to_target_index().tolist() == [0, 1, 2]


def test_build_model_installs_the_mapping_from_data_stats():
    info, frozen, strategy, model = tiny_draft(counts_for(V, {9: 4, 2: 1, 7: 4}), draft_vocab_size=3)
    assert model.draft_to_target_index().tolist() == [2, 7, 9]
    assert model.to_target_ids(torch.tensor([0, 1, 2])).tolist() == [2, 7, 9]


# ---------------------------------------------------------------- loss and metrics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_vocab", [V, 5])
def test_the_teacher_softmax_is_torchs_in_the_one_float32_tensor_of_its_shape(dtype, draft_vocab):
    """The teacher's distribution is torch's softmax of the draft vocabulary's float32 logits, bit for bit,
    computed in the one float32 ``[B, S, Vd]`` tensor the teacher makes: a fresh softmax made a second one,
    at SmolLM2's sizes 131 MB mapped and faulted in anew every step."""
    from torch.profiler import ProfilerActivity, profile

    from specforge_plugin_eagle3.loss import teacher

    info, frozen = tiny_target()
    strategy = Eagle3Strategy(Eagle3Options(draft_vocab_size=draft_vocab, dtype=str(dtype).split(".")[1]))
    model = strategy.build_model(info, {name: part.to(dtype) for name, part in frozen.items()},
                                 counts_for(V, {9: 4, 2: 1, 7: 4}))
    gen = torch.Generator().manual_seed(3)
    last_hidden = (torch.randn(2, 5, info.hidden_size, generator=gen) * 2).to(dtype)
    loss_mask = torch.ones(2, 5, dtype=torch.long)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        p_t, target_ids, _ = teacher(model, last_hidden, loss_mask)
    logits = torch.nn.functional.linear(last_hidden, model.target_lm_head)
    assert torch.equal(target_ids, logits.float().argmax(-1))
    restricted = logits[..., model.draft_to_target_index()] if draft_vocab < V else logits
    assert p_t.dtype == torch.float32 and torch.equal(p_t, torch.softmax(restricted.float(), dim=-1))
    float32_distributions = [e for e in prof.events() if e.self_cpu_memory_usage == p_t.numel() * 4]
    assert len(float32_distributions) == 1


def test_ttt_loss_matches_a_hand_computation():
    # B = 1, S = 3, Vd = 2 (target ids 0 and 2 of V = 3), K = 2 steps, decay 0.5.
    d2t = torch.tensor([0, 1])
    p_t = torch.tensor([[[0.75, 0.25], [0.5, 0.5], [0.1, 0.9]]])
    target_ids = torch.tensor([[0, 1, 2]])  # position 1's target argmax (id 1) is not in the draft vocab
    loss_mask = torch.tensor([[1, 1, 1]])
    position_mask = torch.tensor([[True, False, True]])
    logits = [torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]]]),
              torch.tensor([[[0.5, 0.5], [2.0, 0.0], [0.0, 0.0]]])]
    identity_head = lambda rows, targets: head_soft_cross_entropy(rows, torch.eye(2), targets)  # noqa: E731
    loss, ratios = ttt_loss(logits, identity_head, p_t, target_ids, position_mask, loss_mask, d2t, decay=0.5)

    def ce(p, z):
        log_norm = math.log(sum(math.exp(v) for v in z))
        return -sum(pi * (zi - log_norm) for pi, zi in zip(p, z))

    s0, s1 = 0.0, 0.0
    for t in range(3):  # step 0: position t against the teacher at t
        if position_mask[0, t]:
            s0 += ce(p_t[0, t].tolist(), logits[0][0, t].tolist())
    for t in range(2):  # step 1: position t against the teacher at t + 1
        if position_mask[0, t + 1]:
            s1 += ce(p_t[0, t + 1].tolist(), logits[1][0, t].tolist())
    n0 = 2
    assert loss.item() == pytest.approx((s0 + 0.5 * s1) / n0, rel=1e-6)
    assert ratios["loss"] == pytest.approx((s0 + 0.5 * s1, 2))
    assert ratios["ploss_0"] == pytest.approx((s0, 2)) and ratios["ploss_1"] == pytest.approx((s1, 1))
    # step 0 argmax (draft ids 0, 1, 0) -> target ids (0, 2, 0) vs (0, 1, 2): 1 of 3 correct
    assert ratios["acc_0"] == (1.0, 3.0)
    # step 1 argmax (0, 0) -> (0, 0) vs targets at t + 1 (1, 2): 0 of 2
    assert ratios["acc_1"] == (0.0, 2.0)


def test_ttt_loss_scores_each_step_at_the_positions_that_deep_in_every_sample_with_their_gradients():
    """Two samples whose supervised positions interleave in depth (rows too shallow for a step sit between
    the other sample's deep ones) and a fifth step that reaches no supervised position: the loss, each step's
    sum and count, the accuracies and the gradients of every step's hidden rows against a loop over positions."""
    gen = torch.Generator().manual_seed(3)
    d2t, steps, decay = torch.tensor([0, 0, 1]), 5, 0.7  # draft ids 0, 1, 2 -> target ids 0, 1, 3
    position_mask = torch.tensor([[False, True, False, True], [True, False, True, False]])
    loss_mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]])
    target_ids = torch.tensor([[0, 1, 2, 3], [3, 0, 1, 2]])
    p_t = torch.softmax(torch.randn(2, 4, 3, generator=gen, dtype=torch.float64), -1)
    hidden = [torch.randn(2, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    identity_head = lambda rows, targets: head_soft_cross_entropy(rows, torch.eye(3, dtype=torch.float64),  # noqa: E731
                                                                  targets)
    loss, ratios = ttt_loss(hidden, identity_head, p_t, target_ids, position_mask, loss_mask, d2t, decay=decay)
    want_total, sums, counts, correct = 0.0, [0.0] * steps, [0] * steps, [0] * steps
    for k in range(steps):
        for b in range(2):
            for t in range(k, 4):  # hidden row t - k of step k against the teacher at t
                if position_mask[b, t]:
                    ce = -(p_t[b, t] * torch.log_softmax(hidden[k][b, t - k], -1)).sum()
                    want_total = want_total + decay ** k * ce
                    sums[k] += ce.item()
                    counts[k] += 1
                    draft = int(hidden[k][b, t - k].argmax())
                    correct[k] += draft + int(d2t[draft]) == int(target_ids[b, t])
    assert counts == [4, 3, 2, 1, 0]
    assert loss.item() == pytest.approx(want_total.item() / 4, rel=1e-12)
    for k in range(steps):
        assert ratios[f"ploss_{k}"] == pytest.approx((sums[k], counts[k]), rel=1e-12)
        assert ratios[f"acc_{k}"] == (correct[k], int(loss_mask[:, k:].sum()))
    assert ratios["loss"] == pytest.approx((want_total.item(), 4), rel=1e-12)
    got = torch.autograd.grad(loss, hidden)
    want = torch.autograd.grad(want_total / 4, hidden, allow_unused=True)
    for k in range(steps):
        expected = torch.zeros_like(hidden[k]) if want[k] is None else want[k]
        assert torch.allclose(got[k], expected, rtol=0, atol=1e-12), k
    assert got[4].abs().max() == 0 and got[3].count_nonzero() == 3  # step 3: the one row at depth 3 (0, 0)


def supervised_at(mask, t, u, n, positions):
    """Whether step u - t of the round at aligned position t, scored against the target at aligned position u
    (token u + 2), is supervised, per ``loss_positions``."""
    if positions == "reference":  # docs/algorithms.md: token u is a response token and u + 1 exists
        return u + 1 < n and bool(mask[u])
    # decode: the round starts after a reply token (t + 1) and drafts up to token u + 2 inside the same reply
    return u + 2 < n and all(bool(mask[i]) for i in range(t + 1, u + 3))


@pytest.mark.parametrize("positions, prompt", [("decode", 1), ("reference", 1), ("decode", 3)])
def test_forward_loss_equals_an_explicit_loop_over_steps_positions_and_tokens(positions, prompt):
    info, frozen = tiny_target()
    options = Eagle3Options(ttt_length=3, draft_vocab_size=6, loss_decay=0.8, loss_positions=positions)
    strategy = Eagle3Strategy(options)
    samples, batch = tiny_batch(strategy, info, lengths=(6 + prompt, 4 + prompt), prompt=prompt)
    counts = torch.zeros(V, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["input_ids"], minlength=V)
    model = strategy.build_model(info, frozen, DataStats(token_counts=counts))
    with torch.no_grad():
        out = strategy.forward_loss(model, batch, StepContext())
        ids, _, _ = align(batch["input_ids"], batch["loss_mask"], batch["last_hidden"], batch["attention_mask"],
                          positions)
        step_logits = model(ids, batch["aux_hidden"], batch["attention_mask"], 3)
    used = model.draft_to_target_index().tolist()
    total, supervised = 0.0, 0
    correct, seen = [0] * 3, [0] * 3
    for b, sample in enumerate(samples):
        n = len(sample["input_ids"])
        head = frozen["lm_head"]
        for t in range(n - 1):  # the last real position has no next token
            for k in range(3):
                u = t + k  # step k at t is supervised by the target at position u + 1
                if not supervised_at(sample["loss_mask"], t, u, n, positions):
                    continue
                z_t = (head @ sample["last_hidden"][u + 1]).tolist()
                target_argmax = max(range(V), key=lambda j: z_t[j])
                pred = used[int(step_logits[k][b, t].argmax())]
                correct[k] += pred == target_argmax
                seen[k] += 1
                if target_argmax not in used:
                    continue
                z_r = [z_t[j] for j in used]
                norm = math.log(sum(math.exp(v) for v in z_r))
                p = [math.exp(v - norm) for v in z_r]
                logit = step_logits[k][b, t].tolist()
                log_q = [v - math.log(sum(math.exp(w) for w in logit)) for v in logit]
                total += 0.8 ** k * -sum(pi * qi for pi, qi in zip(p, log_q))
                supervised += k == 0
    assert out.loss.item() == pytest.approx(total / supervised, rel=1e-5)
    for k in range(3):
        assert out.ratio_metrics[f"acc_{k}"] == (correct[k], seen[k])


def test_tau_sim_is_the_sum_of_running_products_of_pooled_step_accuracies():
    assert tau_sim({"acc_0": 0.5, "acc_1": 0.5, "acc_2": 0.2}) == pytest.approx(0.5 + 0.25 + 0.05)
    assert tau_sim({"acc_0": 1.0, "acc_1": 1.0}) == 2.0
    assert tau_sim({"acc_0": 0.5, "acc_1": float("nan"), "acc_2": 1.0}) == 0.5  # nothing supervised that deep
    assert math.isnan(tau_sim({"loss": 1.0}))


def test_derived_tau_sim_comes_from_the_ratios_pooled_over_batches():
    info, frozen, strategy, model = tiny_draft(ttt_length=3)
    samples, _ = tiny_batch(strategy, info, lengths=(8, 5, 6))
    sums = {}
    with torch.no_grad():
        for i, sample in enumerate(samples):
            for name, (num, den) in strategy.forward_loss(model, strategy.collate([sample], [str(i)]),
                                                          StepContext()).ratio_metrics.items():
                acc = sums.setdefault(name, [0.0, 0.0])
                acc[0] += num
                acc[1] += den
        whole = strategy.forward_loss(model, strategy.collate(samples, ["0", "1", "2"]), StepContext())
    pooled = {name: num / den for name, (num, den) in sums.items()}
    acc = [pooled[f"acc_{k}"] for k in range(3)]
    expected = acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    assert strategy.derived_metrics(pooled) == {"tau_sim": pytest.approx(expected)}
    whole_pooled = {name: num / den for name, (num, den) in whole.ratio_metrics.items()}
    assert strategy.derived_metrics(whole_pooled) == {"tau_sim": pytest.approx(expected)}  # one batch: the same


# ---------------------------------------------------------------- frozen parts
def test_frozen_target_parts_are_shared_untrained_and_left_out_of_checkpoints():
    info, frozen, strategy, model = tiny_draft(counts_for(V, {1: 3, 4: 2}), ttt_length=2, draft_vocab_size=6)
    assert model.embed_tokens.data_ptr() == frozen["embed_tokens"].data_ptr()  # no copy of the target's
    assert model.target_lm_head.data_ptr() == frozen["lm_head"].data_ptr()
    assert all(p.requires_grad for p in model.parameters())
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    assert frozen["embed_tokens"].data_ptr() not in param_ptrs and frozen["lm_head"].data_ptr() not in param_ptrs
    saved = model_state(model, DistInfo())  # exactly what the trainer writes into a checkpoint
    assert set(saved) == set(EXPORT_KEYS)
    before = {k: v.clone() for k, v in frozen.items()}
    _samples, batch = tiny_batch(strategy, info)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    strategy.forward_loss(model, batch, StepContext()).loss.backward()
    optimizer.step()
    assert all(torch.equal(before[k], frozen[k]) for k in frozen)
    assert model.embed_tokens.grad is None and model.target_lm_head.grad is None


def test_a_few_optimizer_steps_lower_the_loss_on_a_fixed_batch():
    info, frozen, strategy, model = tiny_draft(ttt_length=3)
    _samples, batch = tiny_batch(strategy, info, lengths=(9, 7))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        out = strategy.forward_loss(model, batch, StepContext())
        losses.append(out.loss.item())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    assert losses[-1] < 0.8 * losses[0]


def test_bfloat16_drafts_train_with_float32_features():
    info, frozen, strategy, model = tiny_draft(ttt_length=2, dtype="bfloat16")
    assert model.fc.weight.dtype == torch.bfloat16 and model.embed_tokens.dtype == torch.float32
    _samples, batch = tiny_batch(strategy, info)
    out = strategy.forward_loss(model, batch, StepContext())
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.lm_head.weight.grad.dtype == torch.bfloat16


def test_collate_refuses_samples_that_miss_a_feature_or_disagree_on_length():
    from specforge_plugin_eagle3.strategy import Eagle3BatchError

    info, _ = tiny_target()
    strategy = Eagle3Strategy()
    samples, _ = tiny_batch(strategy, info)
    broken = dict(samples[0])
    del broken["last_hidden"]
    with pytest.raises(Eagle3BatchError, match="'x' lacks feature\\(s\\) \\['last_hidden'\\]"):
        strategy.collate([broken], ["x"])
    short = dict(samples[0], aux_hidden=samples[0]["aux_hidden"][:-1])
    with pytest.raises(Eagle3BatchError, match="different lengths"):
        strategy.collate([short], ["x"])


@pytest.mark.parametrize(("vocab", "rows"), [(1024, 1024), (4096, 256), (8192, 128), (49152, 128), (151936, 128)])
def test_a_head_loss_chunk_holds_4_mib_of_logits_and_never_fewer_than_128_rows(vocab, rows):
    from specforge_plugin_eagle3.head_loss import chunk_rows

    assert chunk_rows(vocab) == rows


@pytest.mark.parametrize("chunk", [16, 3])
def test_the_fused_head_loss_and_its_gradients_match_autograd_over_the_logits(monkeypatch, chunk):
    """Rows 0..6 of 7-wide hidden states against an 11-token head, teacher rows gathered by index (repeats
    included); in one chunk and in chunks of 3 rows (the last one short)."""
    from specforge_plugin_eagle3 import head_loss
    from specforge_plugin_eagle3.head_loss import HeadSoftCrossEntropy, SoftTargets

    monkeypatch.setattr(head_loss, "MIN_CHUNK_ROWS", chunk)
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(9, 11, generator=gen, dtype=torch.float64), -1)
    rows = torch.tensor([8, 0, 3, 3, 5, 1, 7])
    total, draft = head_soft_cross_entropy(x, weight, SoftTargets(p[rows]))
    logits = x @ weight.t()
    want = -(p[rows] * torch.log_softmax(logits, -1)).sum()
    assert total.item() == pytest.approx(want.item(), rel=1e-12)
    assert draft.tolist() == logits.argmax(-1).tolist() and not draft.requires_grad
    got_grads = torch.autograd.grad(2.5 * total, (x, weight))
    want_grads = torch.autograd.grad(2.5 * want, (x, weight))
    assert all(torch.allclose(g, w) for g, w in zip(got_grads, want_grads))
    assert torch.autograd.gradcheck(lambda a, w: HeadSoftCrossEntropy.apply(a, w, p[rows])[0],
                                    (x, weight))
    with torch.no_grad():  # no gradients wanted: the same sum and argmax
        again, again_draft = head_soft_cross_entropy(x, weight, SoftTargets(p[rows]))
    assert again.item() == pytest.approx(want.item(), rel=1e-12) and torch.equal(again_draft, draft)


def _unrolled_head_losses(coefficients, shared, weights=None):
    """Three unroll steps' fused head losses over one 13 x 6 head, their rows 9, 7 and 4 (a step with fewer rows
    each deeper), summed as ``sum_k weights_k S_k`` (``weights`` defaults to the coefficients the steps are told;
    a weight of None leaves the step out);
    the total and what autograd kept for backward (bytes)."""
    from specforge_plugin_eagle3.head_loss import HeadGradSum, SoftTargets

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(9, 13, generator=gen, dtype=torch.float64), -1)
    head_grad = HeadGradSum() if shared else None
    saved = []
    total = 0
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        for k, (rows, c, w) in enumerate(zip((9, 7, 4), coefficients, weights or coefficients)):
            step_sum, _ = head_soft_cross_entropy(torch.tanh(x[:rows] * (k + 1)), weight,
                                                  SoftTargets(p[:rows], c, head_grad))
            if w is not None:  # None: the step is left out of the total
                total = total + w * step_sum
    return x, weight, total, sum(saved)


@pytest.mark.parametrize("coefficients", [(1.0, 0.8, 0.64), (1.0, 0.0, 0.0)])
def test_unroll_steps_sum_the_heads_weight_gradient_in_one_tensor_with_the_per_step_gradients(coefficients):
    """With a HeadGradSum the steps add c_k dW_k into one sum as they run and backward hands it over once: the
    gradients are those of each step keeping its own dW_k (decay 0 too: steps with c_k = 0 add nothing), and
    no step keeps a [Vd, h] gradient for backward."""
    x, weight, total, kept = _unrolled_head_losses(coefficients, shared=False)
    want = torch.autograd.grad(0.25 * total, (x, weight))
    x_s, weight_s, total_s, kept_s = _unrolled_head_losses(coefficients, shared=True)
    got = torch.autograd.grad(0.25 * total_s, (x_s, weight_s))
    assert total_s.item() == pytest.approx(total.item(), rel=1e-14)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    per_step_weight_grads = 3 * 13 * 6 * 8
    assert kept_s == kept - per_step_weight_grads


def test_the_summed_head_gradient_is_handed_over_again_on_a_second_backward_pass():
    x, weight, total, _ = _unrolled_head_losses((1.0, 0.5, 0.25), shared=True)
    first = torch.autograd.grad(total, weight, retain_graph=True)[0]
    again = torch.autograd.grad(2.0 * total, weight)[0]
    torch.testing.assert_close(again, 2.0 * first, rtol=1e-14, atol=0)


def test_a_loss_leaving_out_a_step_whose_head_gradient_was_summed_is_refused_at_the_end_of_backward():
    """A step left out of the total is never reached by backward, yet its c_k dW_k is in the sum handed to the
    head: the pass's end says so (a check of counts alone, so on every device)."""
    x, weight, total, _ = _unrolled_head_losses((1.0, 0.5, 0.25), shared=True, weights=(1.0, 0.5, None))
    with pytest.raises(RuntimeError, match="backward reached 2 of the 3 unroll steps whose head gradients were "
                                           "summed.*every step's loss must enter the total once"):
        torch.autograd.grad(total, weight)


def test_a_step_loss_weighted_otherwise_than_its_coefficient_is_refused_in_backward():
    """The sum assumes every step enters the loss as c_k S_k; a loss weighting a step otherwise would get a wrong
    head gradient, so backward refuses it and says why."""
    x, weight, total, _ = _unrolled_head_losses((1.0, 0.5, 0.25), shared=True, weights=(1.0, 0.5, 0.75))
    with pytest.raises(RuntimeError, match="every step's loss must enter the total once, times its coefficient"):
        torch.autograd.grad(total, weight)


def test_a_backward_pass_after_a_refused_one_hands_the_summed_head_gradient_over_as_usual():
    """A pass refused midway never reaches its end: the next pass over the same graph (retain_graph) starts
    afresh instead of being checked against the refused pass's gradient, and the head gets the sum."""
    from specforge_plugin_eagle3.head_loss import HeadGradSum, SoftTargets

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(9, 13, generator=gen, dtype=torch.float64), -1)
    coefficients = (1.0, 0.5, 0.25)

    def step_sums(shared):
        return [head_soft_cross_entropy(torch.tanh(x[:rows] * (k + 1)), weight, SoftTargets(p[:rows], c, shared))[0]
                for k, (rows, c) in enumerate(zip((9, 7, 4), coefficients))]

    want = torch.autograd.grad(sum(c * s for c, s in zip(coefficients, step_sums(None))), weight)[0]
    sums = step_sums(HeadGradSum())
    with pytest.raises(RuntimeError, match="every step's loss must enter the total once"):
        torch.autograd.grad(sum(w * s for w, s in zip((1.0, 0.5, 0.75), sums)), weight, retain_graph=True)
    got = torch.autograd.grad(sum(c * s for c, s in zip(coefficients, sums)), weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("route", ["native", "fp32"])  # bf16 GEMMs (logits in a float32 scratch chunk) / float32 ones
def test_the_fused_head_loss_in_bfloat16_matches_the_float32_one_and_keeps_bfloat16_gradients(half_gemm, route):
    from specforge_plugin_eagle3.head_loss import SoftTargets

    half_gemm(route)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(64, 16, generator=gen) / 4).to(torch.bfloat16).requires_grad_()
    p = torch.softmax(torch.randn(40, 64, generator=gen), -1)
    targets = SoftTargets(p)
    total, _ = head_soft_cross_entropy(x, weight, targets)
    total.backward()
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    want = -(p * torch.log_softmax(x32 @ w32.t(), -1)).sum()
    want.backward()
    assert total.dtype == torch.float32 and total.item() == pytest.approx(want.item(), rel=1e-4)
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    # within bfloat16 roundings of the float32 gradients: on CPUs with bf16 GEMM instructions (and on CUDA) the
    # gradient GEMMs take the logits' gradient rounded to bfloat16, as autograd in bfloat16 would; elsewhere they
    # run in float32. Either way the error is a few bf16 ulps of the gradient's scale, not more.
    for got, want32 in ((x.grad, x32.grad), (weight.grad, w32.grad)):
        scale = float(want32.abs().max())
        assert 0 < (got.float() - want32).abs().max() <= 2 ** -7 * scale

# ---------------------------------------------------------------- unroll windows
def _supervised(length, *positions_per_sample):
    mask = torch.zeros(len(positions_per_sample), length, dtype=torch.bool)
    for b, positions in enumerate(positions_per_sample):
        mask[b, list(positions)] = True
    return mask


@pytest.mark.parametrize(("mask", "steps", "starts", "widths"), [
    # each sample from K-1 before its first supervised position; as wide as the widest need, less one a step
    (_supervised(20, range(8, 16), range(10, 18)), 3, (6, 8), (20, 9, 8)),
    (_supervised(20, [1, 19]), 4, (0,), (20, 19, 18, 17)),  # from position 0 at the earliest
    (_supervised(8, [6]), 7, (0,), (8, 6, 5, 4, 3, 2, 1)),
    (_supervised(8, [6]), 3, (4,), (8, 2, 1)),
    (_supervised(8, [2]), 4, (0,), (8, 2, 1, 1)),  # never empty, even past the last supervised position
    (_supervised(20, range(2, 18), [18]), 3, (0, 3), (20, 17, 16)),  # 16 would run past the end: 3 instead
    (_supervised(10, range(5, 8), []), 2, (4, 4), (10, 3)),  # a sample without supervision takes no width
    (_supervised(20, range(8, 16), range(9, 13)), 3, (6, 6), (20, 9, 8)),  # one start for all costs nothing here
])
def test_unroll_windows_start_k_minus_1_before_each_samples_first_supervised_position(mask, steps, starts, widths):
    assert unroll_windows(mask, steps) == UnrollWindows(starts, widths)


def test_unroll_windows_are_none_without_a_supervised_position():
    assert unroll_windows(torch.zeros(2, 5, dtype=torch.bool), 3) is None


@pytest.mark.parametrize("right_padded_rows", [True, False])  # the CPU flash path; the additive-mask path
@pytest.mark.parametrize("starts", [(9, 3), (5, 5)])  # one call per sample; one call for the batch
def test_a_windowed_unroll_is_the_whole_unroll_on_its_rows_with_the_same_gradients(right_padded_rows, starts):
    info, frozen, strategy, model = tiny_draft(ttt_length=4)
    _samples, batch = tiny_batch(strategy, info, lengths=(24, 19), seed=3)
    ids, aux, attention_mask = batch["input_ids"], batch["aux_hidden"], batch["attention_mask"].clone()
    if not right_padded_rows:
        attention_mask[0, 2] = 0  # a hole: not right-padded, so the unroll masks with the bias built once
    windows = UnrollWindows(starts, (24, 12, 11, 7))
    weights = [torch.randn(2, 24, info.hidden_size, generator=torch.Generator().manual_seed(k)) for k in range(4)]

    def rows_of(hidden, k, start, whole):
        width = 24 if k == 0 else windows.widths[k]
        first = 0 if k == 0 else start
        return (hidden[:, first:first + width] if whole else hidden), first, width

    def scored(step_hidden, whole):  # a weighted sum of the windows' rows
        total = 0
        for k, (hidden, weight) in enumerate(zip(step_hidden, weights)):
            for b, start in enumerate(starts):
                part, first, width = rows_of(hidden[b:b + 1], k, start, whole)
                total = total + (part * weight[b:b + 1, first:first + width]).sum()
        return total

    whole = model.unroll(ids, aux, attention_mask, 4)
    cut = model.unroll(ids, aux, attention_mask, 4, windows)
    assert [tuple(h.shape[:2]) for h in cut] == [(2, 24), (2, 12), (2, 11), (2, 7)]
    for k, (hidden, part) in enumerate(zip(whole, cut)):
        for b, start in enumerate(starts):
            torch.testing.assert_close(part[b:b + 1], rows_of(hidden[b:b + 1], k, start, True)[0],
                                       rtol=1e-5, atol=1e-5)
    params = [*model.fc.parameters(), *model.midlayer.parameters()]  # the unroll's (the head is the loss's)
    want = torch.autograd.grad(scored(whole, True), params)
    got = torch.autograd.grad(scored(model.unroll(ids, aux, attention_mask, 4, windows), False), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("starts", "widths", "why"), [
    ((2, 2), (10, 9), "2 widths for 3 unroll steps"),
    ((2,), (10, 9, 8), "1 starts for 2 samples"),
    ((2, 2), (9, 9, 8), "step 0 must be whole: width 10, not 9"),
    ((2, 2), (10, 7, 8), "widths must not grow from one step to the next, nor reach 0"),
    ((2, 2), (10, 7, 0), "widths must not grow from one step to the next, nor reach 0"),
    ((2, 4), (10, 7, 6), "every start must leave step 1's 7 positions inside the sequence"),
    ((-1, 0), (10, 7, 6), "every start must leave step 1's 7 positions inside the sequence"),
])
def test_windows_that_do_not_fit_the_batch_are_refused(starts, widths, why):
    info, frozen, strategy, model = tiny_draft(ttt_length=3)
    _samples, batch = tiny_batch(strategy, info, lengths=(10, 10))
    with pytest.raises(ValueError, match=re.escape(f"unroll windows (starts {list(starts)}, widths {list(widths)}) "
                                                   f"for 2 samples of 10: {why}")):
        model.unroll(batch["input_ids"], batch["aux_hidden"], batch["attention_mask"], 3,
                     UnrollWindows(starts, widths))


def test_training_computes_only_the_windows_and_its_loss_and_gradients_are_the_whole_unrolls():
    """Long prompts (12 and 9 of 24 and 20 tokens): the training step unrolls steps 1.. over 13, 12 and 11
    positions of each sample only (from positions 8 and 5), and its loss, metrics and gradients equal those
    of the eval path, which unrolls every position."""
    info, frozen = tiny_target()
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=4, draft_vocab_size=V))  # every target token supervised
    samples, _ = tiny_batch(strategy, info, lengths=(24, 20), seed=4)
    for sample, prompt in zip(samples, (12, 9)):
        sample["loss_mask"][:prompt] = 0
    batch = strategy.collate(samples, ["a", "b"])
    counts = sum(torch.bincount(s["input_ids"], minlength=V) for s in samples)
    model = strategy.build_model(info, frozen, DataStats(token_counts=counts))
    seen = []
    real_unroll = model.unroll
    model.unroll = lambda *args: seen.append(args[4]) or real_unroll(*args)
    params = [p for p in model.parameters() if p.requires_grad]
    train = strategy.forward_loss(model, batch, StepContext(training=True))
    train_grads = torch.autograd.grad(train.loss, params)
    full = strategy.forward_loss(model, batch, StepContext(training=False))
    full_grads = torch.autograd.grad(full.loss, params)
    untrimmed = Eagle3Strategy(Eagle3Options(ttt_length=4, draft_vocab_size=V, trim_unroll=False))
    off = untrimmed.forward_loss(model, batch, StepContext(training=True))  # trim_unroll off: every position
    assert len(seen) == 3 and seen[2] is None and off.loss.item() == pytest.approx(full.loss.item(), rel=1e-6)
    # decode positions: sample a supervised at 11..21, b at 8..17
    assert seen[0] == UnrollWindows((8, 5), (24, 13, 12, 11)) and seen[1] is None
    assert train.loss.item() == pytest.approx(full.loss.item(), rel=1e-6)
    for k in range(4):
        assert train.ratio_metrics[f"acc_{k}"] == full.ratio_metrics[f"acc_{k}"]
        assert train.ratio_metrics[f"ploss_{k}"] == pytest.approx(full.ratio_metrics[f"ploss_{k}"], rel=1e-5)
    for g, w in zip(train_grads, full_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("spec_depth, replayed", [(None, 4), (2, 2), (9, 4)])
def test_the_decode_replay_drafts_as_deep_as_speculate_within_the_unroll(spec_depth, replayed):
    """eval's accept_len_sim replays rounds of spec_depth drafts, as speculate proposes them; the unroll has
    ttt_length steps, so a deeper spec_depth replays those."""
    info, frozen = tiny_target()
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=4, draft_vocab_size=V, spec_depth=spec_depth))
    samples, _ = tiny_batch(strategy, info, lengths=(24, 20), seed=4)
    batch = strategy.collate(samples, ["a", "b"])
    counts = sum(torch.bincount(s["input_ids"], minlength=V) for s in samples)
    model = strategy.build_model(info, frozen, DataStats(token_counts=counts))
    with torch.no_grad():
        ratios = strategy.forward_loss(model, batch, StepContext(training=False)).ratio_metrics
    assert sorted(k for k in ratios if k.startswith("accept_rate_")) == [f"accept_rate_{k}" for k in
                                                                          range(1, replayed + 1)]
