"""The shared draft layers and helpers in specforge_core.nn and specforge_core.hfconfig."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specforge_core.hfconfig import config_value, rope_theta
from specforge_core.nn import (MAX_BLOCK, RMSNorm, SwiGLU, apply_rope, apply_rope_split, argmax_last, gated_down_proj,
                               in_float32, linear, max_last, recompute_mlps, rms_norm, rope_cos_sin, softmax_last_,
                               softmax_logsumexp_)


@pytest.mark.parametrize(("config", "theta"), [
    ({"rope_theta": 500000.0}, 500000.0),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}, 1000000.0),
    ({"rope_theta": 5.0, "rope_parameters": {"rope_theta": 7.0}}, 5.0),  # the flat key wins
    ({"rope_parameters": None}, 10000.0),
    ({}, 10000.0),
])
def test_rope_theta_reads_both_config_styles(config, theta):
    assert rope_theta(config) == theta


def test_config_value_treats_null_as_missing_but_keeps_falsy_values():
    config = {"head_dim": None, "num_key_value_heads": 0, "rms_norm_eps": 1e-5}
    assert config_value(config, "head_dim", 64) == 64
    assert config_value(config, "absent", 7) == 7
    assert config_value(config, "num_key_value_heads", 8) == 0
    assert config_value(config, "rms_norm_eps", 1e-6) == 1e-5


def test_rope_tables_match_the_closed_form():
    cos, sin = rope_cos_sin(torch.tensor([0, 3]), head_dim=4, theta=100.0)
    assert cos.shape == sin.shape == (2, 4) and cos.dtype == torch.float32
    assert torch.equal(cos[0], torch.ones(4)) and torch.equal(sin[0], torch.zeros(4))
    # frequencies 1 and 1/10 for head_dim 4, theta 100; the half-split layout repeats them
    angles = [3.0, 0.3, 3.0, 0.3]
    assert cos[1].tolist() == pytest.approx([math.cos(a) for a in angles], abs=1e-6)
    assert sin[1].tolist() == pytest.approx([math.sin(a) for a in angles], abs=1e-6)


def test_rope_tables_keep_leading_dimensions():
    cos, _ = rope_cos_sin(torch.arange(6).view(2, 3), head_dim=8, theta=10000.0)
    assert cos.shape == (2, 3, 8)


def test_apply_rope_rotates_each_half_pair_by_its_angle():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # pairs (x0, x2) and (x1, x3)
    cos, sin = rope_cos_sin(torch.tensor([2]), head_dim=4, theta=100.0)
    out = apply_rope(x, cos, sin)
    a, b = 2.0, 0.2
    expected = [1 * math.cos(a) - 3 * math.sin(a), 2 * math.cos(b) - 4 * math.sin(b),
                3 * math.cos(a) + 1 * math.sin(a), 4 * math.cos(b) + 2 * math.sin(b)]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.linalg.vector_norm(out).item() == pytest.approx(torch.linalg.vector_norm(x).item(), rel=1e-6)


def test_apply_rope_returns_the_input_dtype_and_is_identity_at_position_zero():
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.zeros(3, dtype=torch.long), head_dim=8, theta=10000.0)
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16 and torch.equal(out, x)


def _written_out_rope(x, cos, sin):
    half = x.shape[-1] // 2
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_apply_rope_backward_is_the_written_out_forms(dtype):
    gen = torch.Generator().manual_seed(0)
    cos, sin = (t[:, :, None] for t in rope_cos_sin(torch.arange(12).view(2, 6) * 7, head_dim=8, theta=100.0))
    x = torch.randn(2, 6, 3, 8, generator=gen).to(dtype).transpose(1, 2).transpose(1, 2)  # [B, S, heads, d]
    grad = torch.randn(2, 6, 3, 8, generator=gen).to(dtype)
    mine, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = apply_rope(mine, cos, sin)
    expected = _written_out_rope(theirs, cos, sin)
    # the forward is the written-out form up to its rounding: the sine terms are fused multiply-adds there
    ulp = {torch.float64: 2e-16, torch.float32: 2.4e-7, torch.bfloat16: 2 ** -8}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=ulp, atol=4 * ulp)
    out.backward(grad)
    expected.backward(grad)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    assert mine.grad.dtype == dtype and torch.allclose(mine.grad, theirs.grad, atol=tol, rtol=tol)
    # the transpose of a rotation is the rotation back: the gradient of a rotated unit vector
    assert float((mine.grad.double() - _written_out_rope(grad.double(), cos.double(), -sin.double())).abs().max()) \
        < {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]


def test_apply_rope_checks_gradients_against_float64_finite_differences():
    cos, sin = rope_cos_sin(torch.tensor([1, 5, 9]), head_dim=4, theta=10.0)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos.double(), sin.double()), (x,))


def test_apply_rope_refuses_tables_that_want_a_gradient():
    cos, sin = rope_cos_sin(torch.tensor([1, 2]), head_dim=4, theta=10.0)
    with pytest.raises(ValueError, match="cos and sin are position tables and take no gradient"):
        apply_rope(torch.ones(2, 4, requires_grad=True), cos.requires_grad_(True), sin)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_apply_rope_split_is_apply_rope_of_the_joined_tables_bit_for_bit(dtype):
    """Rows [:, :split] by one pair of tables (here one row of them the batch shares), the rest by another: the
    values and gradients of apply_rope over the two joined, exactly."""
    gen = torch.Generator().manual_seed(0)
    split, rest = 5, 3
    blocks = torch.randint(0, 40, (2, rest), generator=gen)
    shared = [t[:, :, None] for t in rope_cos_sin(torch.arange(split)[None], head_dim=8, theta=100.0)]  # [1, 5, 1, 8]
    own = [t[:, :, None] for t in rope_cos_sin(blocks, head_dim=8, theta=100.0)]  # [2, 3, 1, 8]
    joined = [torch.cat([a.expand(2, -1, -1, -1), b], dim=1) for a, b in zip(shared, own)]
    x = torch.randn(2, split + rest, 3, 8, generator=gen).to(dtype)
    grad = torch.randn(2, split + rest, 3, 8, generator=gen).to(dtype)
    mine, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, expected = apply_rope_split(mine, split, shared, own), apply_rope(theirs, *joined)
    assert out.dtype == dtype and torch.equal(out, expected)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(mine.grad, theirs.grad)
    with torch.no_grad():
        assert torch.equal(apply_rope_split(x, split, shared, own), apply_rope(x, *joined))
    with pytest.raises(ValueError, match="cos and sin are position tables and take no gradient"):
        apply_rope_split(mine, split, shared, [own[0].requires_grad_(True), own[1]])


def test_rmsnorm_and_swiglu_follow_their_formulas():
    x = torch.tensor([[3.0, 4.0]])
    norm = RMSNorm(2, eps=0.0)
    assert norm(x)[0].tolist() == pytest.approx([3 / math.sqrt(12.5), 4 / math.sqrt(12.5)])
    mlp = SwiGLU(2, 3)
    with torch.no_grad():
        for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            layer.weight.fill_(0.5)
    gate = up = 0.5 * 7.0  # each of the 3 hidden units sees 0.5 * (3 + 4)
    hidden = gate / (1 + math.exp(-gate)) * up
    assert mlp(x)[0].tolist() == pytest.approx([0.5 * 3 * hidden] * 2, rel=1e-6)
    assert sorted(name for name, _ in mlp.named_parameters()) == ["down_proj.weight", "gate_proj.weight",
                                                                 "up_proj.weight"]


def _dense_causal(q, k, v, scale):
    """Causal GQA attention written out: ``(out, logsumexp)``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    length = q.shape[2]
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


# chunks of 4 with a short last one; one chunk; the long chunks (256) from CAUSAL_LONG queries, the last short
@pytest.mark.parametrize("length", [11, 3, 1030])
def test_chunked_causal_flash_attention_equals_dense_causal_attention_with_its_gradients(monkeypatch, length):
    from specforge_core import nn as sf_nn

    monkeypatch.setattr(sf_nn, "CAUSAL_CHUNK", 4)
    assert len(sf_nn._causal_chunks(length)) == {11: 3, 3: 1, 1030: 5}[length]
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, n, length, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2, 4))
    scale = 8 ** -0.5
    out, lse = sf_nn.cpu_causal_attention(q, k, v, scale=scale)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _dense_causal(*leaves, scale)
    want_out.backward(grad)
    assert out.dtype == torch.float64 and lse.shape == (2, 4, length)
    assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
    grads = sf_nn.cpu_causal_attention_backward(grad, q, k, v, out, lse, scale=scale)
    for got, leaf in zip(grads, leaves):
        assert got.dtype == torch.float64 and torch.allclose(got, leaf.grad, atol=1e-12)


def test_causal_attention_takes_longer_chunks_from_a_thousand_queries():
    from specforge_core import nn as sf_nn

    assert sf_nn._causal_chunks(1000) == [(start, min(start + 64, 1000)) for start in range(0, 1000, 64)]
    assert sf_nn._causal_chunks(1024) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert sf_nn._causal_chunks(1100)[-1] == (1024, 1100)


@pytest.mark.parametrize(("query_start", "dtype"), [(5, torch.float64), (1, torch.float64), (4, torch.bfloat16)])
def test_causal_flash_attention_of_queries_from_a_later_position_is_those_rows_of_the_whole(monkeypatch, query_start,
                                                                                             dtype):
    """Queries at positions query_start..10 of 11 keys: the rows of the attention of all 11 queries, with the
    gradients those rows send to q, k and v (float64: chunks of 4, the first one not at a chunk boundary of
    the whole; bf16: one chunk over its own keys merged with the keys before it)."""
    from specforge_core import nn as sf_nn

    monkeypatch.setattr(sf_nn, "CAUSAL_CHUNK", 4)
    gen = torch.Generator().manual_seed(2)
    q, k, v, grad = (torch.randn(2, n, 11, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2, 4))
    scale = 8 ** -0.5
    rows = slice(query_start, 11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _dense_causal(*leaves, scale)
    want_out[:, :, rows].backward(grad[:, :, rows])
    q_part = q[:, :, rows].to(dtype)
    out, lse = sf_nn.cpu_causal_attention(q_part, k.to(dtype), v.to(dtype), scale=scale, query_start=query_start)
    grads = sf_nn.cpu_causal_attention_backward(grad[:, :, rows].to(dtype), q_part, k.to(dtype), v.to(dtype),
                                                out, lse, scale=scale, query_start=query_start)
    tolerance = 1e-12 if dtype == torch.float64 else 3e-2
    assert out.dtype == dtype and out.shape == (2, 4, 11 - query_start, 8)
    assert torch.allclose(out.double(), want_out[:, :, rows], atol=tolerance)
    assert torch.allclose(lse.double(), want_lse[:, :, rows], atol=tolerance)
    assert grads[0].shape == q_part.shape and grads[1].shape == k.shape
    for got, want in zip(grads, (leaves[0].grad[:, :, rows], leaves[1].grad, leaves[2].grad)):
        assert got.dtype == dtype and torch.allclose(got.double(), want, atol=tolerance)


def test_merging_attention_over_two_key_sets_equals_attention_over_both():
    from specforge_core.nn import cpu_flash_attention, merge_attention

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(3))
    both = cpu_flash_attention(q, k, v)
    out, lse = merge_attention(*cpu_flash_attention(q, k[:, :, :2], v[:, :, :2]),
                               *cpu_flash_attention(q, k[:, :, 2:], v[:, :, 2:]))
    assert torch.allclose(out, both[0], atol=1e-6) and torch.allclose(lse, both[1], atol=1e-6)
    nothing = torch.full_like(lse, float("-inf"))  # a side that saw no key adds nothing
    out, lse = merge_attention(*both, torch.zeros_like(both[0]), nothing)
    assert torch.equal(out, both[0]) and torch.equal(lse, both[1])


def _written_out_rms_norm(x, weight, eps):
    x32 = in_float32(x)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _saved_bytes(fn, *inputs):
    """Bytes of the distinct storages autograd keeps for backward while ``fn(*inputs)`` runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def test_rms_norm_has_the_written_out_gradients_in_float64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(8, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-3), (x, weight))
    grad = torch.randn(3, 5, 8, dtype=torch.float64, generator=gen)
    ours = torch.autograd.grad(rms_norm(x, weight, 1e-3), (x, weight), grad)
    written = torch.autograd.grad(_written_out_rms_norm(x, weight, 1e-3), (x, weight), grad)
    for a, b in zip(ours, written):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_like_the_written_out_form(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 32, generator=gen) * 3).to(dtype).requires_grad_()
    weight = (1 + torch.randn(32, generator=gen) / 4).to(dtype).requires_grad_()
    grad = torch.randn(64, 32, generator=gen).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-6), _written_out_rms_norm(x, weight, 1e-6))
    ours = torch.autograd.grad(rms_norm(x, weight, 1e-6), (x, weight), grad)
    written = torch.autograd.grad(_written_out_rms_norm(x, weight, 1e-6), (x, weight), grad)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # a few ulps of the gradient's scale
    for a, b in zip(ours, written):
        assert a.dtype == b.dtype == dtype
        assert float((a.float() - b.float()).abs().max()) <= tolerance * float(b.float().abs().max())


@pytest.mark.parametrize("needs", [(True, False), (False, True)])
def test_rms_norm_gives_each_gradient_alone(needs):
    """A frozen norm weight, or a norm of an input that takes no gradient (a context's features), gets the one
    gradient asked for, the written-out form's."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 7, 16, generator=gen) * 2).requires_grad_(needs[0])
    weight = (1 + torch.randn(16, generator=gen) / 4).requires_grad_(needs[1])
    grad = torch.randn(4, 7, 16, generator=gen)
    wanted = x if needs[0] else weight
    ours = torch.autograd.grad(rms_norm(x, weight, 1e-6), wanted, grad)[0]
    written = torch.autograd.grad(_written_out_rms_norm(x, weight, 1e-6), wanted, grad)[0]
    torch.testing.assert_close(ours, written, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_keeps_only_its_input_for_backward(dtype):
    rows, width = 256, 64
    x = torch.randn(rows, width).to(dtype).requires_grad_()
    weight = torch.ones(width, dtype=dtype, requires_grad=True)
    element = x.element_size()
    # the input and weight, and one float32 1/rms per row
    assert _saved_bytes(rms_norm, x, weight, 1e-6) == rows * width * element + width * element + rows * 4
    # written out: also the normalised rows (and in bf16 a float32 copy of the input)
    assert _saved_bytes(_written_out_rms_norm, x, weight, 1e-6) >= 2 * rows * width * element + rows * 4


def _input_sized_allocations(numel: int, run) -> list[str]:
    """The dtypes of the tensors of ``numel`` elements allocated while ``run()`` runs, in order, as the profiler
    records each op's own allocations (net of what the op frees before it returns)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    sizes = {numel * 2: "half", numel * 4: "float32"}
    return [sizes[e.self_cpu_memory_usage] for e in sorted(prof.events(), key=lambda e: e.time_range.start)
            if e.self_cpu_memory_usage in sizes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rms_norm_makes_each_step_in_a_buffer_nothing_reads_after_it(dtype):
    """A half-precision norm allocates three tensors of its input's size in forward (the float32 copy for the
    statistic, its square, the output) and six in backward, three of them float32: written out step by step it
    made five and eleven (seven float32), each a page-touching allocation of the step's heap."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 4, 32, generator=gen) * 3).to(dtype).requires_grad_()
    weight = (1 + torch.randn(32, generator=gen) / 4).to(dtype).requires_grad_()
    grad = torch.randn(64, 4, 32, generator=gen).to(dtype)
    made = {}

    def forward():
        made["out"] = rms_norm(x, weight, 1e-6)

    assert _input_sized_allocations(x.numel(), forward) == ["float32", "float32", "half"]
    assert _input_sized_allocations(x.numel(), lambda: made["out"].backward(grad)) == [
        "float32", "half", "half", "float32", "float32", "half"]
    # the values are the written-out steps', bit for bit
    x32 = x.detach().float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    y32 = x32 * rstd
    dy = (grad * weight.detach()).float()
    assert torch.equal(made["out"], weight.detach() * y32.to(dtype))
    assert torch.equal(x.grad, (rstd * (dy - y32 * (dy * y32).mean(-1, keepdim=True))).to(dtype))
    assert torch.equal(weight.grad, (grad * y32.to(dtype)).reshape(-1, 32).sum(0))


def test_gated_down_proj_has_the_written_out_gradients_in_float64():
    gen = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(3, 5, 6, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    weight = torch.randn(4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(gated_down_proj, (gate, up, weight))
    only_weight = torch.autograd.grad(gated_down_proj(gate.detach(), up.detach(), weight).sum(), weight)[0]
    torch.testing.assert_close(only_weight, (F.silu(gate) * up).detach().reshape(-1, 6).sum(0).expand(4, 6),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wanted", ["gate", "up", "weight"])
def test_gated_down_proj_gives_one_inputs_gradient_alone_as_the_written_out_form_does(wanted):
    """Backward with only one input wanting a gradient: that gradient, bit for bit the written-out form's."""
    gen = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(2, 16, 24, generator=gen) * 2 for _ in range(2))
    weight = torch.randn(8, 24, generator=gen) / 5
    grad = torch.randn(2, 16, 8, generator=gen)
    got, want = [], []
    for fn, out in ((gated_down_proj, got), (lambda g, u, w: linear(F.silu(g) * u, w), want)):
        leaves = {"gate": gate.clone(), "up": up.clone(), "weight": weight.clone()}
        leaves[wanted].requires_grad_()
        out.append(torch.autograd.grad(fn(leaves["gate"], leaves["up"], leaves["weight"]), leaves[wanted], grad)[0])
    assert got[0].shape == want[0].shape and torch.equal(got[0], want[0])


@pytest.mark.parametrize("route", ["native", "fp32"])  # half precision through torch's kernel / as float32 GEMMs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_down_proj_is_the_written_out_form_bit_for_bit(half_gemm, route, dtype):
    half_gemm(route)
    gen = torch.Generator().manual_seed(3)
    gate, up = ((torch.randn(2, 64, 48, generator=gen) * 2).to(dtype).requires_grad_() for _ in range(2))
    weight = (torch.randn(32, 48, generator=gen) / 7).to(dtype).requires_grad_()
    grad = torch.randn(2, 64, 32, generator=gen).to(dtype)
    ours, written = gated_down_proj(gate, up, weight), linear(F.silu(gate) * up, weight)
    upcast = dtype == torch.bfloat16 and route == "fp32"
    assert torch.equal(ours, written) and ours.dtype == dtype
    for a, b in zip(torch.autograd.grad(ours, (gate, up, weight), grad),
                    torch.autograd.grad(written, (gate, up, weight), grad)):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    assert upcast == ("UpcastLinear" in type(written.grad_fn).__name__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_down_proj_keeps_only_its_inputs_for_backward(dtype):
    rows, width, out = 256, 96, 32
    gate, up = (torch.randn(rows, width).to(dtype).requires_grad_() for _ in range(2))
    weight = torch.randn(out, width).to(dtype).requires_grad_()
    element = gate.element_size()
    assert _saved_bytes(gated_down_proj, gate, up, weight) == (2 * rows + out) * width * element
    # written out: silu(gate) for the product's backward and the product, the down projection's input
    assert _saved_bytes(lambda g, u, w: linear(F.silu(g) * u, w), gate, up, weight) == \
        (4 * rows + out) * width * element


def test_swiglu_runs_its_down_projection_through_gated_down_proj():
    mlp = SwiGLU(8, 12)
    x = torch.randn(3, 8, requires_grad=True)
    assert "GatedDownProj" in type(mlp(x).grad_fn).__name__
    written = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(mlp(x), written)
    grads = torch.autograd.grad(mlp(x).square().sum(), [x, *mlp.parameters()])
    written_grads = torch.autograd.grad(written.square().sum(), [x, *mlp.parameters()])
    for a, b in zip(grads, written_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("route", ["native", "fp32"])  # half precision through torch's kernel / as float32 GEMMs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_recomputing_swiglu_gives_the_kept_ones_values_and_gradients_bit_for_bit(half_gemm, route, dtype):
    half_gemm(route)
    torch.manual_seed(4)
    mlp = SwiGLU(48, 80).to(dtype)
    x = (torch.randn(2, 64, 48) * 2).to(dtype).requires_grad_()
    grad = torch.randn(2, 64, 48).to(dtype)
    kept = mlp(x)
    kept_grads = torch.autograd.grad(kept, [x, *mlp.parameters()], grad)
    assert recompute_mlps(nn.Sequential(mlp, nn.Linear(2, 2), SwiGLU(4, 6))) == 2 and mlp.recompute
    made_again = mlp(x)
    assert "RecomputedGatedMLP" in type(made_again.grad_fn).__name__
    assert made_again.dtype == dtype and torch.equal(made_again, kept)
    for a, b in zip(torch.autograd.grad(made_again, [x, *mlp.parameters()], grad), kept_grads):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    with torch.no_grad():  # nothing to keep: the plain forward
        assert torch.equal(mlp(x), kept)
    assert recompute_mlps(mlp, False) == 1 and "GatedDownProj" in type(mlp(x).grad_fn).__name__


@pytest.mark.parametrize("frozen", ["", "x", "gate_proj", "up_proj", "down_proj", "x,down_proj"])
def test_a_recomputing_swiglu_has_the_written_out_gradients_in_float64(frozen):
    torch.manual_seed(6)
    mlp = SwiGLU(5, 7, recompute=True).double()
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad="x" not in frozen)
    for name in frozen.split(","):
        if name.endswith("proj"):
            getattr(mlp, name).weight.requires_grad_(False)
    wanted = [t for t in (x, *mlp.parameters()) if t.requires_grad]
    out = mlp(x)
    written = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, wanted, grad), torch.autograd.grad(written, wanted, grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if not frozen:
        assert torch.autograd.gradcheck(lambda x, *weights: mlp(x), (x, *mlp.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_recomputing_swiglu_keeps_only_its_input_and_weights(dtype):
    rows, hidden, width = 256, 32, 96
    mlp = SwiGLU(hidden, width).to(dtype)
    x = torch.randn(rows, hidden).to(dtype).requires_grad_()
    element = x.element_size()
    weights = 3 * hidden * width * element
    # kept: the input (the two projections' one input), gate(x) and up(x), and the weights
    assert _saved_bytes(mlp, x) == rows * hidden * element + 2 * rows * width * element + weights
    mlp.recompute = True
    assert _saved_bytes(mlp, x) == rows * hidden * element + weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_last_is_argmax_over_the_last_dimension_the_first_of_equal_maxima(dtype):
    ties = torch.tensor([[0.5, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -2.0, -1.0, -3.0]], dtype=dtype)
    assert argmax_last(ties).tolist() == [1, 0, 0]
    assert argmax_last(ties[0]).item() == 1 and argmax_last(ties[0]).dim() == 0  # one row: a scalar, as argmax()
    logits = (torch.randn(8, 49152, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    assert torch.equal(argmax_last(logits), logits.argmax(-1))
    assert torch.equal(argmax_last(logits.view(2, 4, -1)), logits.view(2, 4, -1).argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("width", [2 * MAX_BLOCK - 1, 2 * MAX_BLOCK, 1000, 4096])  # below the blocks; whole; a tail
def test_max_last_is_max_over_the_last_dimension_values_and_first_index(dtype, width):
    logits = (torch.randn(6, width, generator=torch.Generator().manual_seed(width)) * 3).to(dtype)
    for x in (logits, logits.view(2, 3, width), logits[::2], logits[0]):  # rows, leading dims, strided, one row
        values, indices = max_last(x)
        want = x.max(-1)
        assert torch.equal(values, want.values) and torch.equal(indices, want.indices)
        assert values.shape == indices.shape == x.shape[:-1]


def test_max_last_keeps_the_first_of_equal_maxima_and_nan_across_blocks_and_the_tail():
    width = 3 * MAX_BLOCK + 5  # three blocks and a tail of 5
    x = torch.zeros(7, width)
    x[0, [10, MAX_BLOCK + 3, width - 1]] = 4.0  # equal maxima in a block, a later block and the tail: the first
    x[1, [MAX_BLOCK + 7, MAX_BLOCK + 9]] = 2.0  # two in one block, not the first
    x[2, 5], x[2, width - 2] = 1.0, 1.5  # the tail's is strictly larger
    x[3, [20, width - 3]] = float("nan")  # NaN counts as the largest: the first one
    x[4, width - 4] = float("nan")  # NaN in the tail only
    x[5] = float("-inf")  # nothing but -inf: index 0
    x[6, [2 * MAX_BLOCK, 2 * MAX_BLOCK + 1]] = 9.0
    indices = max_last(x)[1]
    assert indices.tolist() == [10, MAX_BLOCK + 7, width - 2, 20, width - 4, 0, 2 * MAX_BLOCK]
    assert torch.equal(indices, x.max(-1).indices) and torch.equal(argmax_last(x), indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_last_writes_torchs_softmax_into_its_input_bit_for_bit(dtype):
    x = (torch.randn(5, 3000, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    x[0, :100] = float("-inf")
    want = torch.softmax(x, dim=-1)
    inplace = x.clone()
    assert softmax_last_(inplace) is inplace and torch.equal(inplace, want)
    strided = x.clone().t().contiguous().t()  # not contiguous: a new tensor's result, copied back
    assert softmax_last_(strided) is strided and torch.equal(strided, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_logsumexp_gives_logsumexp_and_argmax_and_leaves_the_softmax(dtype):
    z = (torch.randn(6, 1000, generator=torch.Generator().manual_seed(2)) * 5).to(dtype)
    z[1, 10] = z[1, 900] = 40.0  # equal maxima: the first
    z[2, :500] = float("-inf")
    lse, ids = softmax_logsumexp_(work := z.clone())
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    assert torch.equal(ids, z.argmax(-1)) and ids[1].item() == 10
    assert torch.equal(work, torch.softmax(z, -1))
