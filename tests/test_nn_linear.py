"""specforge_core.nn.linear: half precision on CPUs whose own bf16 GEMM is the slower runs as float32 GEMMs; mm_wide:
a vocabulary-wide float32 head in blocks of columns; frozen_head: a frozen one packed for oneDNN or MKL."""

import platform

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from specforge_core import nn as sf_nn
from specforge_core.nn import (WIDE_COLUMNS, WIDE_MAX_ROWS, Linear, frozen_head, linear, mm_wide,
                               upcast_half_gemm_on_cpu)


def test_the_environment_chooses_the_route_and_auto_follows_the_cpu_flags(half_gemm):
    half_gemm("fp32")
    assert upcast_half_gemm_on_cpu() is True and sf_nn.upcast_min_rows() == sf_nn.UPCAST_ROWS
    assert sf_nn.upcast_min_rows(torch.float16) == sf_nn.UPCAST_ROWS and sf_nn.half_gemm_far_slower()
    half_gemm("native")
    assert upcast_half_gemm_on_cpu() is False
    half_gemm("")
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        lines = fh.readlines()
    flags = set(next(line for line in lines if line.startswith("flags")).split(":", 1)[1].split())
    vendor = next(line for line in lines if line.startswith("vendor_id")).split(":", 1)[1].strip()
    route = sf_nn.half_gemm_route(flags, vendor)
    assert upcast_half_gemm_on_cpu() is (route.bf16_rows is not None)
    assert (sf_nn.upcast_min_rows(), sf_nn.upcast_min_rows(torch.float16)) == (route.bf16_rows, route.float16_rows)


@pytest.mark.parametrize(("flags", "vendor", "route"), [
    ({"avx2", "fma"}, "AuthenticAMD", (4, 4, True)),  # no bf16 GEMM instructions (Zen 3): 10-40x slower
    ({"avx512f", "avx512_bf16"}, "AuthenticAMD", (None, None, False)),  # Zen 4: bf16 twice float32's rate
    ({"avx512f", "avx512_bf16"}, "GenuineIntel", (64, None, False)),  # no AMX: bf16 at half float32's rate
    ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "GenuineIntel", (None, None, False)),
    ({"avx2", "fma"}, "GenuineIntel", (4, 4, True)),
    (set(), "", (None, None, False)),  # no x86 flags (ARM's /proc/cpuinfo says "Features"): torch's kernels
])
def test_the_route_follows_the_cpu_kind(flags, vendor, route):
    got = sf_nn.half_gemm_route(flags, vendor)
    assert (got.bf16_rows, got.float16_rows, got.far_slower) == route


def test_where_bf16_gemms_run_at_half_the_float32_rate_only_many_rows_are_upcast(half_gemm, monkeypatch):
    half_gemm("")
    monkeypatch.setattr(sf_nn, "_half_gemm_choice", lambda: sf_nn.HALF_RATE_ROUTE)
    assert upcast_half_gemm_on_cpu() is True and sf_nn.upcast_min_rows() == 64
    assert [sf_nn.upcast_pays(rows, 576 * 1536) for rows in (4, 63, 64)] == [False, False, True]
    assert sf_nn.upcast_pays(64, 1 << 23) is True  # a large weight: 64 rows are past its own 24 too
    assert not sf_nn.upcasts(1024, torch.zeros(8, 16, dtype=torch.float16))  # float16 runs at float32's rate there
    assert sf_nn.upcasts(1024, torch.zeros(8, 16, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=gen).bfloat16()
    for rows, upcast in ((63, False), (64, True)):
        x = torch.randn(rows, 16, generator=gen).bfloat16().requires_grad_()
        result = linear(x, w)
        assert ("UpcastLinear" in type(result.grad_fn).__name__) is upcast
        torch.testing.assert_close(result.float(), F.linear(x.float(), w.float()), rtol=0.02, atol=0.05)


def test_an_upcast_chunk_is_never_fewer_rows_than_the_floor_however_wide_the_weight():
    """A vocabulary-wide weight's element budget alone would give chunks of one row, each a GEMV over the whole
    weight; every chunk but the last has UPCAST_MIN_CHUNK_ROWS rows at least."""
    assert sf_nn._row_chunks(1000, 49152) == [slice(start, min(start + 128, 1000)) for start in range(0, 1000, 128)]
    assert sf_nn._row_chunks(1000, 64) == [slice(0, 1000)]  # narrow: 1024 rows a chunk by the element budget
    assert sf_nn._row_chunks(5000, 64) == [slice(0, 1024), slice(1024, 2048), slice(2048, 3072), slice(3072, 4096),
                                          slice(4096, 5000)]


@pytest.mark.parametrize("route", ["", "fp32", "native"])
def test_a_compiled_linear_takes_the_route_as_a_constant_in_one_graph(half_gemm, route):
    """Under torch.compile the route is decided outside the graph: tracing the decision (it reads
    /proc/cpuinfo) broke a compiled bf16 layer's graph at every linear."""
    half_gemm(route)  # forgotten: the compiled call below is the first to ask
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((8, 16), (4, 16)))
    torch._dynamo.reset()
    got = torch.compile(linear, fullgraph=True, backend="eager")(x, w)  # fullgraph: a graph break raises
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), x.float() @ w.float().t(), rtol=1e-2, atol=1e-2)
    if route:
        assert upcast_half_gemm_on_cpu() is (route == "fp32")


@pytest.mark.parametrize("chunk_elements", [1 << 18, 64])  # all 15 rows at once; 4 rows a chunk, the last 3
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_linear_matches_float64_to_half_precision_rounding_in_output_and_gradients(half_gemm, monkeypatch,
                                                                                          dtype, chunk_elements):
    half_gemm("fp32")
    monkeypatch.setattr(sf_nn, "UPCAST_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(sf_nn, "UPCAST_MIN_CHUNK_ROWS", 1)
    assert len(sf_nn._row_chunks(15, 16)) == (1 if chunk_elements > 64 else 4)
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64)
    w64, b64 = torch.randn(8, 16, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64)
    x, w, b = (t.to(dtype).requires_grad_() for t in (x64, w64, b64))
    ref = [t.to(dtype).double().requires_grad_() for t in (x64, w64, b64)]
    out = linear(x, w, b)
    want = F.linear(*ref)
    assert out.dtype == dtype and out.grad_fn is not None and "UpcastLinear" in type(out.grad_fn).__name__
    eps = torch.finfo(dtype).eps
    assert (out.double() - want).abs().max() <= eps * want.abs().max()
    upstream = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    (out.double() * upstream).sum().backward()
    (want * upstream).sum().backward()
    for got, grad in zip((x.grad, w.grad, b.grad), (ref[0].grad, ref[1].grad, ref[2].grad)):
        assert got.dtype == dtype
        assert (got.double() - grad).abs().max() <= 2 * eps * grad.abs().max()


def test_float32_and_the_native_choice_keep_torchs_own_kernel(half_gemm):
    half_gemm("fp32")
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(3, 6)
    assert "UpcastLinear" not in type(linear(x, w).grad_fn).__name__  # float32: F.linear itself
    assert torch.equal(linear(x, w), F.linear(x, w))
    half_gemm("native")
    xb = x.detach().bfloat16().requires_grad_()
    assert "UpcastLinear" not in type(linear(xb, w.bfloat16()).grad_fn).__name__


def test_the_linear_module_keeps_nn_linear_parameters_and_state_dict_names():
    layer = Linear(6, 3, bias=False)
    assert isinstance(layer, torch.nn.Linear)
    assert list(layer.state_dict()) == ["weight"]
    x = torch.randn(2, 6)
    assert torch.equal(layer(x), x @ layer.weight.t())


@pytest.mark.parametrize(("rows", "width", "out", "upcast"), [
    (1, 16, 8, False),  # a decode step: converting the weight costs more than torch's own kernel
    (3, 16, 8, False),
    (4, 16, 8, True),  # small weights pay from 4 rows
    (16, 512, 1 << 14, False),  # 8M elements: a large weight pays from 24 rows only
    (24, 512, 1 << 14, True),
])
def test_the_upcast_runs_only_where_enough_rows_share_the_weight(half_gemm, rows, width, out, upcast):
    half_gemm("fp32")
    assert sf_nn.upcast_pays(rows, width * out) is upcast
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(out, width, generator=gen).bfloat16()
    result = linear(x, w)
    assert ("UpcastLinear" in type(result.grad_fn).__name__) is upcast
    assert result.dtype == torch.bfloat16 and result.shape == (rows, out)
    torch.testing.assert_close(result.float(), F.linear(x.float(), w.float()), rtol=0.02, atol=0.05)


def _gemms(fn) -> tuple[object, int]:
    """``fn()``'s result and how many matrix products it ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.mm:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        result = fn()
    return result, Count.calls


def test_mm_wide_takes_a_vocabulary_wide_float32_weight_in_blocks_of_columns_with_the_same_values():
    torch.manual_seed(0)
    x, weight = torch.randn(37, 24), torch.randn(8 * WIDE_COLUMNS + 300, 24)  # a last block of 300 rows
    out = torch.full((37, weight.shape[0]), float("nan"))
    result, gemms = _gemms(lambda: mm_wide(x, weight, out=out))
    assert result is out and gemms == 9
    blocks = [x @ weight[s:s + WIDE_COLUMNS].t() for s in range(0, weight.shape[0], WIDE_COLUMNS)]
    assert torch.equal(out, torch.cat(blocks, dim=1))  # every column written, each block one GEMM's product
    torch.testing.assert_close(out, (x.double() @ weight.double().t()).float(), rtol=1e-5, atol=1e-5)
    fresh = mm_wide(x, weight)
    assert fresh.shape == (37, weight.shape[0]) and torch.equal(fresh, out)


@pytest.mark.parametrize("dtype, inputs, rows", [(torch.float32, 16, 8 * WIDE_COLUMNS - 1),
                                                 (torch.float32, WIDE_MAX_ROWS + 1, 8 * WIDE_COLUMNS),
                                                 (torch.float64, 16, 8 * WIDE_COLUMNS),
                                                 (torch.bfloat16, 16, 8 * WIDE_COLUMNS)])
def test_mm_wide_leaves_narrower_weights_more_rows_and_other_dtypes_as_one_gemm(dtype, inputs, rows):
    torch.manual_seed(0)
    x, weight = torch.randn(inputs, 8, dtype=dtype), torch.randn(rows, 8, dtype=dtype)
    result, gemms = _gemms(lambda: mm_wide(x, weight))
    assert gemms == 1 and torch.equal(result, torch.mm(x, weight.t()))
    out = torch.empty(inputs, rows, dtype=dtype)
    assert mm_wide(x, weight, out=out) is out and torch.equal(out, torch.mm(x, weight.t()))


PACKS_HERE = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()


@pytest.mark.skipif(not PACKS_HERE, reason="oneDNN's packed heads run on x86-64 CPUs with oneDNN only")
def test_a_wide_float32_frozen_head_is_packed_once_and_packed_again_when_it_changes():
    torch.manual_seed(0)
    head = torch.nn.Parameter(torch.randn(8 * WIDE_COLUMNS + 5, 24), requires_grad=False)
    x, dz = torch.randn(37, 24), torch.randn(37, head.shape[0])
    frozen = frozen_head(head, torch.float32)
    assert frozen.packed and frozen_head(head, torch.float32) is frozen  # kept for the next step
    torch.testing.assert_close(frozen.logits(x), x @ head.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(frozen.input_grad(dz), dz @ head, rtol=1e-5, atol=1e-3)  # sums of 8197 terms
    with torch.no_grad():
        head.mul_(-2.0)  # a head that changes after all (its version moves): packed again, from the new values
    again = frozen_head(head, torch.float32)
    assert again is not frozen and again.packed
    torch.testing.assert_close(again.logits(x), x @ head.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(again.input_grad(dz), dz @ head, rtol=1e-5, atol=2e-3)
    kept = len(sf_nn._FROZEN_HEADS)
    del head, frozen, again
    assert len(sf_nn._FROZEN_HEADS) == kept - 1  # the packed copies go with their head


@pytest.mark.skipif(not PACKS_HERE, reason="oneDNN's packed heads run on x86-64 CPUs with oneDNN only")
@pytest.mark.parametrize("vendor, width, plain", [("GenuineIntel", 576, True), ("GenuineIntel", 1023, True),
                                                  ("GenuineIntel", 1024, False), ("AuthenticAMD", 576, False)])
def test_a_narrow_float32_heads_input_gradient_comes_from_mkl_over_the_head_on_intel_cpus(monkeypatch, vendor,
                                                                                          width, plain):
    """Where MKL's ``dz W`` outran oneDNN's packed one (float32 heads narrower than 1024 on an Intel CPU) the input
    gradient is MKL's over the head itself, and no second packed copy is made; elsewhere it is oneDNN's. The CPU
    vendor is faked (this machine has one vendor)."""
    monkeypatch.setattr(sf_nn, "_cpu_identity", lambda: (set(), vendor))
    torch.manual_seed(0)
    head = torch.nn.Parameter(torch.randn(8 * WIDE_COLUMNS, width), requires_grad=False)
    dz = torch.randn(12, head.shape[0])
    frozen = frozen_head(head, torch.float32)
    assert frozen.packed and sf_nn.plain_head_grad(head) is plain
    grad = frozen.input_grad(dz)
    assert (frozen._packed[1] is None) is plain  # the second packed copy exists only where oneDNN computes it
    if plain:
        assert torch.equal(grad, dz @ head)
    else:
        torch.testing.assert_close(grad, dz @ head, rtol=1e-5, atol=2e-3)
    assert not sf_nn.plain_head_grad(head.detach().to(torch.bfloat16))  # MKL has no bf16 GEMM: oneDNN's then


MKL_PACKS_HERE = PACKS_HERE and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class _Kernels(TorchDispatchMode):
    """The GEMM kernels called under it, by name: MKL's and oneDNN's packed ones (``mkl``, ``mkldnn``) and torch's
    own (``mm``, ``addmm``, ``addmm_``)."""

    NAMES = {"mkl._mkl_linear.default": "mkl", "mkldnn._linear_pointwise.default": "mkldnn",
             "aten.mm.default": "mm", "aten.addmm.default": "addmm", "aten.addmm_.default": "addmm_"}

    def __init__(self) -> None:
        super().__init__()
        self.called: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.NAMES:
            self.called.append(self.NAMES[str(func)])
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not MKL_PACKS_HERE, reason="needs an x86-64 torch with oneDNN and MKL")
@pytest.mark.parametrize("vendor, head_dtype, kernel", [("GenuineIntel", torch.float32, "mkl"),
                                                        ("AuthenticAMD", torch.float32, "mkldnn"),
                                                        ("GenuineIntel", torch.bfloat16, "mkldnn")])
def test_a_float32_frozen_head_runs_on_mkls_packed_gemm_on_intel_cpus_and_on_onednn_elsewhere(monkeypatch, vendor,
                                                                                              head_dtype, kernel):
    """On an Intel CPU both products of a wide float32 head run on MKL's packed GEMM (the faster there at every
    width), packed for the rows of its first call and again for a call with more; a call with fewer rows runs
    MKL's plain GEMM over the head itself, keeping the copies. Elsewhere both run on oneDNN, and so does a
    wide bf16 head taken in float32 (the upcast route), whose float32 copy MKL would keep as a third copy
    and oneDNN lets go. The CPU vendor is faked (this machine has one vendor)."""
    monkeypatch.setattr(sf_nn, "_cpu_identity", lambda: (set(), vendor))
    torch.manual_seed(0)
    head = torch.nn.Parameter(torch.randn(8 * WIDE_COLUMNS + 5, sf_nn.PLAIN_GRAD_MAX_WIDTH).to(head_dtype),
                              requires_grad=False)
    x, dz = torch.randn(64, head.shape[1]), torch.randn(64, head.shape[0]) * 0.01
    frozen = frozen_head(head, torch.float32)
    assert frozen.packed
    assert frozen.logits(x[:0]).shape == (0, head.shape[0]) and frozen.input_grad(dz[:0]).shape == (0, head.shape[1])
    with _Kernels() as kernels:
        logits, grad = frozen.logits(x[:40]), frozen.input_grad(dz[:40])
    assert kernels.called == [kernel, kernel]
    torch.testing.assert_close(logits, x[:40] @ head.float().t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, dz[:40] @ head.float(), rtol=1e-5, atol=1e-4)
    if kernel != "mkl":
        assert frozen._source is None  # oneDNN's two copies, and not the head itself
        return
    assert sf_nn.mkl_packed_head(head) and frozen._rows == [40, 40]
    kept = list(frozen._packed)
    # fewer rows: the copies stay as they are, and MKL's plain GEMM over the head gives torch's own values
    assert torch.equal(frozen.logits(x[:25]), x[:25] @ head.t())
    assert torch.equal(frozen.input_grad(dz[:7]), dz[:7] @ head)
    assert frozen._rows == [40, 40] and all(now is then for now, then in zip(frozen._packed, kept))
    # more rows: that product's copy is packed again, for them
    torch.testing.assert_close(frozen.logits(x), x @ head.t(), rtol=1e-5, atol=1e-4)
    assert frozen._rows == [64, 40] and frozen._packed[0] is not kept[0] and frozen._packed[1] is kept[1]


@pytest.mark.parametrize("rows, dtype, head_dtype", [(8 * WIDE_COLUMNS - 1, torch.float32, torch.float32),
                                                     (8 * WIDE_COLUMNS - 1, torch.bfloat16, torch.bfloat16),
                                                     (8 * WIDE_COLUMNS, torch.float64, torch.float64),
                                                     (8 * WIDE_COLUMNS, torch.float16, torch.float16),
                                                     (8 * WIDE_COLUMNS, torch.bfloat16, torch.bfloat16)])
def test_other_frozen_heads_run_torchs_own_products_on_the_head_itself(half_gemm, rows, dtype, head_dtype):
    """Narrower heads, float64 and float16, and bf16 where the CPU's bf16 linears run as float32 GEMMs (the
    upcast route: the losses then ask for the head in float32, not bf16)."""
    half_gemm("fp32")
    torch.manual_seed(0)
    head = torch.randn(rows, 8, dtype=head_dtype)
    x, dz = torch.randn(16, 8, dtype=dtype), torch.randn(16, rows, dtype=dtype)
    frozen = frozen_head(head, dtype)
    assert not frozen.packed and frozen_head(head, dtype) is not frozen  # nothing kept
    assert torch.equal(frozen.logits(x), x @ head.t()) and torch.equal(frozen.input_grad(dz), dz @ head)


BF16_PACKS_HERE = PACKS_HERE and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(not BF16_PACKS_HERE, reason="oneDNN's packed bf16 heads need an x86-64 CPU with oneDNN's bf16")
def test_a_wide_bf16_frozen_head_is_packed_where_bf16_gemms_run_natively(half_gemm):
    """On the native route a bf16 head is packed as a float32 one is, and its products are the float32 ones
    rounded to bf16; on the upcast route it is not packed."""
    half_gemm("native")
    torch.manual_seed(0)
    head = torch.nn.Parameter(torch.randn(8 * WIDE_COLUMNS + 3, 32).to(torch.bfloat16), requires_grad=False)
    x, dz = torch.randn(40, 32).to(torch.bfloat16), torch.randn(40, head.shape[0]).to(torch.bfloat16)
    frozen = frozen_head(head, torch.bfloat16)
    assert frozen.packed and frozen_head(head, torch.bfloat16) is frozen
    logits, grad = frozen.logits(x), frozen.input_grad(dz)
    assert logits.dtype == grad.dtype == torch.bfloat16
    # sums of products accumulated in float32 and rounded once to bf16 (8 significant bits)
    torch.testing.assert_close(logits.float(), x.float() @ head.float().t(), rtol=2 ** -8, atol=1e-3)
    torch.testing.assert_close(grad.float(), dz.float() @ head.float(), rtol=2 ** -8, atol=1e-2)
    half_gemm("fp32")
    assert not frozen_head(head, torch.bfloat16).packed


@pytest.mark.skipif(not PACKS_HERE, reason="oneDNN's packed heads run on x86-64 CPUs with oneDNN only")
@pytest.mark.parametrize("value, packs", [("off", False), (" OFF ", False), ("on", True), ("", True)])
def test_the_environment_turns_packing_off(monkeypatch, value, packs):
    """SPECFORGE_CPU_PACK_HEAD=off: no packed copies of the head (the memory they cost, 2 x V x H x 4 bytes in
    float32, stays free); the products are then torch's over the head itself, the same values."""
    monkeypatch.setenv(sf_nn.PACK_HEAD_ENV, value)
    torch.manual_seed(0)
    head = torch.randn(8 * WIDE_COLUMNS, 8)
    x = torch.randn(4, 8)
    frozen = frozen_head(head, torch.float32)
    assert frozen.packed is packs
    torch.testing.assert_close(frozen.logits(x), x @ head.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, value, expected, reads", [
    ("SPECFORGE_CPU_PACK_HEAD", "0", "on or off", lambda: frozen_head(torch.randn(8 * WIDE_COLUMNS, 8), torch.float32)),
    ("SPECFORGE_CPU_HALF_GEMM", "bf16", "fp32 or native", upcast_half_gemm_on_cpu)])
def test_a_misspelt_switch_is_refused_by_name(half_gemm, monkeypatch, name, value, expected, reads):
    """A value neither switch takes raises, naming the variable, the value and the choices, rather than
    falling back to the default the user meant to change."""
    half_gemm("")  # forgets the cached route when the test ends, as it does now
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name}='{value}': expected {expected}, or unset$"):
        reads()


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, on toggling oneDNN
def test_a_frozen_head_is_not_packed_with_onednn_turned_off_or_in_an_upcast_it_would_not_keep():
    head = torch.randn(8 * WIDE_COLUMNS, 8)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not frozen_head(head, torch.float32).packed
    x = torch.randn(4, 8)
    assert torch.equal(frozen_head(head, torch.float64).logits(x.double()), x.double() @ head.double().t())


@pytest.mark.skipif(not PACKS_HERE, reason="oneDNN's packed heads run on x86-64 CPUs with oneDNN only")
def test_a_frozen_head_is_packed_in_a_process_group_of_one_rank_and_not_of_several(tmp_path, monkeypatch):
    import torch.distributed as dist

    head = torch.randn(8 * WIDE_COLUMNS, 8)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert frozen_head(head, torch.float32).packed  # one rank: the head is the process's own
        monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)  # as a rank of two sees it
        assert not frozen_head(head, torch.float32).packed  # FSDP2 gathers the head into storage it reuses
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_product_accumulates_a_product_in_place(dtype):
    """float32: one GEMM into the accumulator (addmm_); a half-precision product is added to a float32 one."""
    torch.manual_seed(0)
    out = torch.randn(40, 6)
    a, b = torch.randn(40, 9).to(dtype), torch.randn(9, 6).to(dtype)
    want = out + (a @ b).float()
    got = sf_nn.add_product_(out, a, b)
    assert got is out and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-6)


def test_a_half_product_added_to_a_float32_sum_is_made_a_block_of_rows_at_a_time(monkeypatch):
    """A bf16 product added to a float32 sum (a strided ``a``, as the losses pass ``dz.t()``) is made and added a
    block of rows at a time, the last one short: no tensor as large as the sum is made (the whole product and the
    float32 copy ``add_`` promotes it to were each as large; at SmolLM2's sizes each mapped and faulted in anew),
    and every row gets the product the whole GEMM gives."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(sf_nn, "ADD_PRODUCT_BLOCK", 8 * 16)  # blocks of 8 rows of 16
    gen = torch.Generator().manual_seed(4)
    out = torch.randn(100, 16, generator=gen)
    a, b = torch.randn(24, 100, generator=gen).to(torch.bfloat16).t(), torch.randn(24, 16, generator=gen).to(
        torch.bfloat16)
    want = out + (a @ b).float()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = sf_nn.add_product_(out, a, b)
    assert got is out
    torch.testing.assert_close(got, want, rtol=2.0 ** -8, atol=0)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert 0 < largest <= 8 * 16 * 4  # a block's float32 copy; the whole product was 100 x 16


ONEDNN_HERE = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()


@pytest.mark.skipif(not ONEDNN_HERE, reason="needs an x86-64 torch with oneDNN")
@pytest.mark.parametrize("env, flags, vendor, onednn", [
    ("", {"avx2", "avx512f"}, "AuthenticAMD", True),  # Zen 4: oneDNN 5-17% faster than MKL
    ("", {"avx2", "fma"}, "AuthenticAMD", False),  # no AVX-512 (Zen 3): not measured, torch's kernel
    ("", {"avx2", "avx512f", "amx_bf16"}, "GenuineIntel", False),  # MKL the faster on Intel
    ("", set(), "", False),  # no x86 flags to go by
    ("onednn", set(), "GenuineIntel", True),
    ("torch", {"avx2", "avx512f"}, "AuthenticAMD", False),
])
def test_the_float32_gemm_route_follows_the_cpu_and_the_environment(float32_gemm, monkeypatch, env, flags, vendor,
                                                                    onednn):
    monkeypatch.setattr(sf_nn, "_cpu_identity", lambda: (flags, vendor))
    float32_gemm(env)
    assert sf_nn.onednn_float32() is onednn


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, on toggling oneDNN
def test_the_float32_gemm_route_needs_onednn_and_refuses_a_misspelt_choice(float32_gemm):
    float32_gemm("onednn")
    with torch.backends.mkldnn.flags(enabled=False):
        sf_nn.onednn_float32.cache_clear()
        assert sf_nn.onednn_float32() is False
    float32_gemm("mkl")
    with pytest.raises(ValueError, match="^SPECFORGE_CPU_FP32_GEMM='mkl': expected onednn or torch, or unset$"):
        sf_nn.onednn_float32()


@pytest.mark.skipif(not ONEDNN_HERE, reason="needs an x86-64 torch with oneDNN")
def test_mm_takes_large_row_major_float32_products_to_onednn_and_leaves_the_rest_to_torch(float32_gemm):
    """Routed: a product of at least ONEDNN_MIN_MACS multiply-adds with a row-major left operand runs on oneDNN,
    with torch's values to float32 rounding; a smaller one, a transposed left operand (which oneDNN would copy),
    float64, one autograd records and the torch route stay torch's own product, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 256, generator=gen), torch.randn(256, 256, generator=gen)  # exactly 2^23 MACs
    assert a.shape[0] * a.shape[1] * b.shape[1] == sf_nn.ONEDNN_MIN_MACS
    float32_gemm("onednn")
    cases = [(a, b, "mkldnn"), (a[:127], b, "mm"), (a.t().contiguous().t(), b, "mm"), (a.double(), b.double(), "mm")]
    for left, right, kernel in cases:
        with _Kernels() as products:
            got = sf_nn.mm(left, right)
        assert products.called == [kernel]
        if kernel == "mm":
            assert torch.equal(got, left @ right)
        else:
            assert got.shape == (128, 256) and got.is_contiguous()
            torch.testing.assert_close(got, (left.double() @ right.double()).float(), rtol=1e-5, atol=1e-4)
    # a product autograd records stays torch's, differentiable (oneDNN's has no gradient)
    leaf = a.clone().requires_grad_()
    with _Kernels() as products:
        recorded = sf_nn.mm(leaf, b)
    assert products.called == ["mm"] and recorded.grad_fn is not None
    torch.testing.assert_close(torch.autograd.grad(recorded.sum(), leaf)[0], b.sum(1).expand(128, -1))
    with torch.no_grad(), _Kernels() as products:
        sf_nn.mm(leaf, b)
    assert products.called == ["mkldnn"]
    float32_gemm("torch")
    with _Kernels() as products:
        got = sf_nn.mm(a, b)
    assert products.called == ["mm"] and torch.equal(got, a @ b)


@pytest.mark.parametrize("route", ["onednn", "torch"])
def test_a_reused_weight_gives_its_products_and_sums_from_one_packed_or_transposed_copy(float32_gemm, route):
    """A weight many products of one call share is held once as their kernel wants it: packed for oneDNN where
    the float32 route is oneDNN's and each product is large enough, else transposed for torch's GEMM, whose
    products and in-place sums are then torch's bit for bit. A strided view (a transposed weight) is taken
    as it is."""
    if route == "onednn" and not ONEDNN_HERE:
        pytest.skip("needs an x86-64 torch with oneDNN")
    float32_gemm(route)
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(512, 256, generator=gen) * 0.05
    x, add = torch.randn(64, 512, generator=gen), torch.randn(64, 256, generator=gen)
    weight = base.t()  # [N 256, K 512], strided
    kernel = "mkldnn" if route == "onednn" else "mm"
    reused = sf_nn.ReusedWeight(weight, rows=64)
    small = sf_nn.ReusedWeight(weight, rows=63)  # 63 x 512 x 256 < 2^23: torch's kernel on either route
    with _Kernels() as products:
        plain, summed = reused.product(x), reused.product(x, add=add)
        accumulated = reused.add_product_(add.clone(), x)
        small_product = small.product(x[:63])
    assert products.called == ([kernel] if route == "onednn" else ["mm"]) + \
        ([kernel] if route == "onednn" else ["addmm"]) + ([kernel] if route == "onednn" else ["addmm_"]) + ["mm"]
    want = (x.double() @ base.double()).float()
    for got in (plain, summed - add, accumulated - add):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(small_product, x[:63] @ base)
    if route == "torch":
        assert torch.equal(plain, x @ base) and torch.equal(summed, torch.addmm(add, x, base))
        assert torch.equal(accumulated, add.clone().addmm_(x, base))
