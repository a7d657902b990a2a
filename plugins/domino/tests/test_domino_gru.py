"""The prefix GRU's fused CPU path (specforge_plugin_domino.gru) against torch's own nn.GRU."""

import pytest
import torch

from specforge_plugin_domino.gru import FusedGRU, _tanh

M, T, H, G = 6, 5, 7, 4


def _pair(dtype):
    """An nn.GRU in float64 and a FusedGRU with the same weights in ``dtype``."""
    torch.manual_seed(0)
    plain = torch.nn.GRU(H, G, bias=False, batch_first=True).double()
    fused = FusedGRU(H, G).to(dtype)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def _run(module, dtype, x, h0, grad_states, grad_last):
    """States, last state and the gradients of (x, weight_ih, weight_hh[, h0]) under the given output gradients."""
    x = x.to(dtype).requires_grad_()
    h0 = None if h0 is None else h0.to(dtype).requires_grad_()
    states, last = module(x, h0)
    inputs = [x, module.weight_ih_l0, module.weight_hh_l0] + ([h0] if h0 is not None else [])
    loss = (states * grad_states.to(dtype)).sum() + (last * grad_last.to(dtype)).sum()
    return [t.double() for t in (states, last, *torch.autograd.grad(loss, inputs))]


def _inputs(with_state: bool, steps: int = T):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M, steps, H, generator=gen, dtype=torch.float64)
    h0 = torch.randn(1, M, G, generator=gen, dtype=torch.float64) if with_state else None
    return x, h0, torch.randn(M, steps, G, generator=gen, dtype=torch.float64), \
        torch.randn(1, M, G, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("with_state", [False, True], ids=["from-zeros", "from-a-state"])
@pytest.mark.parametrize("steps", [T, 1])
def test_fused_gru_equals_nn_gru_in_states_and_every_gradient(with_state, steps):
    plain, fused = _pair(torch.float64)
    x, h0, grad_states, grad_last = _inputs(with_state, steps)
    assert fused.fused(x)
    want = _run(plain, torch.float64, x, h0, grad_states, grad_last)
    got = _run(fused, torch.float64, x, h0, grad_states, grad_last)
    assert len(got) == (6 if with_state else 5)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12)


def test_fused_gru_in_float32_matches_float64_to_float32_rounding():
    plain, fused = _pair(torch.float32)
    x, h0, grad_states, grad_last = _inputs(True)
    want = _run(plain, torch.float64, x, h0, grad_states, grad_last)
    got = _run(fused, torch.float32, x, h0, grad_states, grad_last)
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()


@pytest.mark.parametrize("dtype, ulp", [(torch.float32, 2.5e-7), (torch.float64, 5e-16)])
def test_the_gates_tanh_is_torchs_to_a_unit_in_the_last_place_of_one(dtype, ulp):
    x = torch.cat([torch.linspace(-30, 30, 20001, dtype=dtype), torch.tensor([0.0, -0.0, 1e-30, float("inf"),
                                                                                 -float("inf")], dtype=dtype)])
    out = torch.empty_like(x)
    _tanh(x, out, torch.tensor(-1.0, dtype=dtype))
    assert (out - torch.tanh(x)).abs().max() <= ulp
    assert out[-2:].tolist() == [1.0, -1.0] and out.abs().max() == 1.0  # saturates at exactly +-1, never past
    copy = x.clone()
    _tanh(copy, copy, torch.tensor(-1.0, dtype=dtype))  # in place, as the forward calls it
    assert torch.equal(copy, out)
    nan = torch.tensor([float("nan")], dtype=dtype)
    _tanh(nan, nan, torch.tensor(-1.0, dtype=dtype))
    assert torch.isnan(nan).all()


def test_half_precision_runs_float32_gemms_where_the_cpu_lacks_bf16_ones_and_stays_nearer_float64(half_gemm):
    """Upcast (no bf16 GEMM instructions): float32 GEMMs and gates, rounded once, so no further from the
    float64 result than torch's own bf16 GRU, which rounds every step. Native: nn.GRU as it is."""
    x, h0, grad_states, grad_last = _inputs(True)
    plain, fused = _pair(torch.bfloat16)
    want = _run(plain, torch.float64, x, h0, grad_states, grad_last)
    half_gemm("native")
    assert not fused.fused(x.to(torch.bfloat16))
    torch_bf16 = _run(fused, torch.bfloat16, x, h0, grad_states, grad_last)  # nn.GRU's own kernels
    half_gemm("fp32")
    assert fused.fused(x.to(torch.bfloat16))
    upcast = _run(fused, torch.bfloat16, x, h0, grad_states, grad_last)
    assert all(t.dtype == torch.float64 for t in upcast)  # (_run returns float64 copies)
    for name, u, n, w in zip(("states", "last", "x", "w_ih", "w_hh", "h0"), upcast, torch_bf16, want):
        scale = w.abs().max()
        assert (u - w).abs().max() <= max((n - w).abs().max(), 2 ** -8 * scale), name


def test_where_bf16_gemms_run_at_half_the_float32_rate_the_gru_stays_nn_grus(half_gemm, monkeypatch):
    """An Intel CPU with AVX512-BF16 but no AMX upcasts linears of 64 rows or more, but keeps torch's bf16 GRU,
    whose bf16 activations take less memory than the fused path's float32 ones; float32 stays fused."""
    from specforge_core import nn as sf_nn

    half_gemm("")
    monkeypatch.setattr(sf_nn, "_half_gemm_choice", lambda: sf_nn.HALF_RATE_ROUTE)
    fused = FusedGRU(H, G)
    x = torch.zeros(64, T, H)
    assert sf_nn.upcasts(64 * T, fused.weight_hh_l0.bfloat16())  # its linears would be upcast...
    assert not fused.to(torch.bfloat16).fused(x.bfloat16())  # ...its GRU is nn.GRU's
    assert fused.float().fused(x)


def test_a_gru_on_another_input_shape_is_nn_grus():
    fused = FusedGRU(H, G)
    assert not fused.fused(torch.zeros(T, H))  # unbatched
    assert not fused.fused(torch.zeros(M, 0, H))  # no steps
    states, last = fused(torch.ones(T, H))
    assert states.shape == (T, G) and last.shape == (1, G)


def test_the_module_keeps_nn_grus_parameter_names_and_shapes():
    fused = FusedGRU(H, G)
    assert {n: tuple(p.shape) for n, p in fused.named_parameters()} == {"weight_ih_l0": (3 * G, H),
                                                                        "weight_hh_l0": (3 * G, G)}


def test_bad_inputs_get_nn_grus_own_errors_on_the_fused_path():
    fused = FusedGRU(H, G)
    with pytest.raises(RuntimeError, match=r"Expected hidden size \(1, 6, 4\), got \[1, 3, 4\]"):
        fused(torch.zeros(M, T, H), torch.zeros(1, 3, G))
    with pytest.raises(RuntimeError, match="input.size\\(-1\\) must be equal to input_size. Expected 7, got 8"):
        fused(torch.zeros(M, T, H + 1))


@pytest.mark.parametrize("route", ["onednn", "torch"])
def test_the_float32_gru_takes_its_per_step_products_from_one_copy_of_w_hh_packed_for_onednn_where_routed(
        float32_gemm, route):
    """Where float32 GEMMs go to oneDNN (AMD's Zen 4), the state GEMMs of every step share one copy of each part
    of W_hh packed for it, in forward (r|z and n) and backward (W_hh itself), and the input GEMM runs there too;
    the gradients of the input and the weights, whose left operands are strided views, stay torch's. The values
    are nn.GRU's to float32 rounding on either route."""
    import platform

    if route == "onednn" and not (platform.machine().lower() in ("x86_64", "amd64")
                                  and torch.backends.mkldnn.is_available()):
        pytest.skip("needs an x86-64 torch with oneDNN")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.called = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith(("aten.mm.", "aten.addmm", "mkldnn._linear_pointwise", "mkldnn._reorder")):
                self.called.append(name.split(".")[1])
            return func(*args, **(kwargs or {}))

    float32_gemm(route)
    rows, steps, width, hidden = 64, 4, 32, 512  # each state GEMM at least 2^23 multiply-adds
    torch.manual_seed(0)
    plain = torch.nn.GRU(width, hidden, bias=False, batch_first=True).double()
    fused = FusedGRU(width, hidden)
    fused.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, steps, width, generator=gen, dtype=torch.float64)
    grad_states = torch.randn(rows, steps, hidden, generator=gen, dtype=torch.float64)
    xf = x.float().requires_grad_()
    with Products() as forward:
        states, _ = fused(xf)
    with Products() as backward:
        grads = torch.autograd.grad((states * grad_states.float()).sum(), (xf, fused.weight_ih_l0, fused.weight_hh_l0))
    if route == "onednn":  # the input GEMM, then two packed copies and the two products of every later step
        assert forward.called == ["_linear_pointwise", "_reorder_linear_weight", "_reorder_linear_weight"] + \
            ["_linear_pointwise"] * 2 * (steps - 1)
        assert backward.called.count("_reorder_linear_weight") == 1  # W_hh, once for every step
        assert backward.called.count("_linear_pointwise") == steps - 1  # the states' gradients
        assert backward.called.count("mm") == 3  # the input's and both weights' gradients: strided operands
    else:
        assert "_linear_pointwise" not in forward.called + backward.called
    xd = x.clone().requires_grad_()
    want_states, _ = plain(xd)
    want = torch.autograd.grad((want_states * grad_states).sum(), (xd, plain.weight_ih_l0, plain.weight_hh_l0))
    assert (states.double() - want_states).abs().max() <= 1e-5 * want_states.abs().max()
    for got, expected in zip(grads, want):
        assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
