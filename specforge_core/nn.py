"""Layers every draft model shares, so plugins do not re-type them.

Parameter names follow the Llama/Qwen checkpoints (``weight``; ``gate_proj``, ``up_proj``,
``down_proj``), so a draft's ``state_dict`` keys are already the names serving engines load.
"""

from __future__ import annotations

import functools
import platform
import weakref

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from .switches import env_choice


#: ``SPECFORGE_CPU_HALF_GEMM``: ``fp32`` (bf16/fp16 linears on CPU run as float32 GEMMs), ``native``
#: (as torch runs them), or unset (``fp32`` where torch's bf16 GEMM is slower than its float32 one here).
HALF_GEMM_ENV = "SPECFORGE_CPU_HALF_GEMM"

#: The fewest rows sharing a weight for which a float32 GEMM of upcast operands beats torch's half-precision
#: one, on a CPU without bf16 GEMM instructions (see :func:`upcast_pays`).
UPCAST_ROWS = 4
#: The same on an Intel CPU with AVX512-BF16 but no AMX, where torch's bf16 GEMM ran at half its float32 rate.
UPCAST_ROWS_BF16_DOT = 64


@attrs.frozen
class HalfGemmRoute:
    """How half-precision linears run on a CPU: from how many rows sharing a weight bf16 and float16 ones run as
    float32 GEMMs of upcast operands (None: never; torch's own kernels), and whether torch's half-precision
    kernels there are many times slower than float32 (``far_slower``: no bf16 GEMM instructions, or
    ``SPECFORGE_CPU_HALF_GEMM=fp32``), so that even work whose float32 form keeps more memory takes it."""

    bf16_rows: int | None = None
    float16_rows: int | None = None
    far_slower: bool = False

    def rows(self, dtype: torch.dtype) -> int | None:
        """The fewest rows at which a linear of this half-precision ``dtype`` is upcast; None: never."""
        return self.bf16_rows if dtype == torch.bfloat16 else self.float16_rows


#: torch's kernels as they are: AMX, AMD's AVX512-BF16, or no x86 flags to go by (ARM)
NATIVE_ROUTE = HalfGemmRoute()
#: no bf16 GEMM instructions (or ``fp32`` asked for): torch's bf16 GEMM 10-40x slower than float32
UPCAST_ROUTE = HalfGemmRoute(UPCAST_ROWS, UPCAST_ROWS, far_slower=True)
#: Intel's AVX512-BF16 without AMX: bf16 at half the float32 rate; its AVX512-FP16 runs float16 at the float32 rate
HALF_RATE_ROUTE = HalfGemmRoute(UPCAST_ROWS_BF16_DOT, None)


@torch.compiler.assume_constant_result
def upcast_half_gemm_on_cpu() -> bool:
    """Whether :func:`linear` runs bf16/fp16 matmuls on CPU as float32 GEMMs of upcast operands (where enough
    rows share the weight: :func:`upcast_pays`).

    Where torch's bf16 GEMM is slower than its float32 one, by the CPU's ``/proc/cpuinfo``
    (:func:`half_gemm_route`): on a CPU without AVX512-BF16 or AMX it ran 10-40x slower on the same
    shapes, and on an Intel CPU with AVX512-BF16 but no AMX (a virtual machine that hides AMX, or one
    that predates it) at half the float32 rate (oneDNN's bf16 kernel: 81 GF/s against 153-160 for
    float32, one Xeon core). The float32 GEMM accumulates in float32 as a native bf16 GEMM does, so
    results differ by summation order only. CUDA, AMX and AVX512-BF16 elsewhere (AMD's Zen 4: 210 GF/s
    in bf16 against 94 in float32) keep the native kernels. ``SPECFORGE_CPU_HALF_GEMM=fp32|native``
    overrides.

    Decided once per process (``upcast_half_gemm_on_cpu.cache_clear()`` forgets it). A layer under
    ``torch.compile`` takes the answer as a constant of its graph: traced, the reading of
    ``/proc/cpuinfo`` broke a bf16 layer's graph at every linear (24 graph breaks a DFlash step).
    """
    return _half_gemm_choice().bf16_rows is not None


@torch.compiler.assume_constant_result
def upcast_min_rows(dtype: torch.dtype = torch.bfloat16) -> int | None:
    """The fewest rows sharing a weight for which :func:`upcast_pays` may hold for ``dtype`` here (None: torch's
    kernels always): :data:`UPCAST_ROWS` where torch's half-precision GEMMs are many times slower,
    :data:`UPCAST_ROWS_BF16_DOT` for bf16 where they run at half the float32 rate (:class:`HalfGemmRoute`)."""
    return _half_gemm_choice().rows(dtype)


@torch.compiler.assume_constant_result
def half_gemm_far_slower() -> bool:
    """Whether torch's half-precision kernels here are many times slower than float32 (no bf16 GEMM
    instructions, or ``SPECFORGE_CPU_HALF_GEMM=fp32``): where float32 pays even at a memory cost."""
    return _half_gemm_choice().far_slower


@functools.lru_cache(maxsize=1)
def _half_gemm_choice() -> HalfGemmRoute:
    choice = env_choice(HALF_GEMM_ENV, ("fp32", "native"))
    if choice:
        return UPCAST_ROUTE if choice == "fp32" else NATIVE_ROUTE
    cpu = _cpu_identity()
    if cpu is None:  # not Linux: leave torch's kernels alone
        return NATIVE_ROUTE
    return half_gemm_route(*cpu)


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> tuple[set[str], str] | None:
    """``(flags, vendor_id)`` of the first CPU in ``/proc/cpuinfo``; None where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            lines = [line for line in fh if line.startswith(("flags", "vendor_id"))]
    except OSError:
        return None
    flags = next((line for line in lines if line.startswith("flags")), ":").split(":", 1)[1].split()
    vendor = next((line for line in lines if line.startswith("vendor_id")), ":").split(":", 1)[1].strip()
    return set(flags), vendor


def half_gemm_route(flags: set[str], vendor: str) -> HalfGemmRoute:
    """The :class:`HalfGemmRoute` of an x86 CPU with these ``/proc/cpuinfo`` ``flags`` and ``vendor_id``: torch's
    kernels with AMX, with AVX512-BF16 on CPUs other than Intel's and without x86 flags at all (as on ARM)."""
    if not flags or "amx_bf16" in flags:
        return NATIVE_ROUTE
    if "avx512_bf16" not in flags:
        return UPCAST_ROUTE
    return HALF_RATE_ROUTE if vendor == "GenuineIntel" else NATIVE_ROUTE


upcast_half_gemm_on_cpu.cache_clear = _half_gemm_choice.cache_clear  # type: ignore[attr-defined]


#: ``SPECFORGE_CPU_FP32_GEMM``: ``onednn`` (the float32 GEMMs :func:`mm` and :class:`ReusedWeight` take, from
#: :data:`ONEDNN_MIN_MACS` multiply-adds, run on oneDNN), ``torch`` (torch's own kernel, MKL where torch has it),
#: or unset (oneDNN on AMD CPUs with AVX-512, see :func:`onednn_float32`).
FP32_GEMM_ENV = "SPECFORGE_CPU_FP32_GEMM"
#: The fewest multiply-adds (rows x K x N) of a float32 GEMM that :func:`mm` and :class:`ReusedWeight` run on
#: oneDNN: oneDNN's fixed cost per call lost to MKL below about this many.
ONEDNN_MIN_MACS = 1 << 23


@torch.compiler.assume_constant_result
def onednn_float32() -> bool:
    """Whether the float32 GEMMs that :func:`mm` and :class:`ReusedWeight` take run on oneDNN instead of torch's
    own kernel (MKL).

    On AMD's Zen 4 (one core), oneDNN's GEMM ran 5-17% faster than MKL's alone on the train steps' shapes from
    about :data:`ONEDNN_MIN_MACS` multiply-adds on, with a row-major left operand (1024 x 128 x 1536: 95 GF/s
    against 81; 64 rows through a packed 1024 x 512: 111 against 88); smaller ones lost to its fixed cost
    (one row through 576 x 576: 0.78 of MKL's speed), and a transposed left operand to the copy oneDNN
    makes of it. Only the GRU's products take it: routing every float32 linear layer there as well moved
    the bench's DFlash, DSpark and EAGLE3 steps by -0.6% to +0.9%. On Intel CPUs MKL was the faster
    (:class:`FrozenHead`), so they, other CPUs, CUDA and a torch without oneDNN keep torch's kernel.
    ``SPECFORGE_CPU_FP32_GEMM=onednn|torch`` overrides. Decided once per process
    (``onednn_float32.cache_clear()`` forgets it), and a constant of a compiled graph.
    """
    return _onednn_float32_choice()


@functools.lru_cache(maxsize=1)
def _onednn_float32_choice() -> bool:
    choice = env_choice(FP32_GEMM_ENV, ("onednn", "torch"))
    if not (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled):
        return False
    if choice:
        return choice == "onednn"
    cpu = _cpu_identity()
    return cpu is not None and cpu[1] == "AuthenticAMD" and "avx512f" in cpu[0]


onednn_float32.cache_clear = _onednn_float32_choice.cache_clear  # type: ignore[attr-defined]


def _onednn_pays(a: torch.Tensor, b: torch.Tensor, macs: int) -> bool:
    """Whether a float32 product of ``a`` and ``b`` of ``macs`` multiply-adds runs on oneDNN: not one autograd would
    have to differentiate (oneDNN's product has no gradient), nor one being compiled."""
    return a.dtype == torch.float32 and b.dtype == torch.float32 and a.device.type == "cpu" \
        and macs >= ONEDNN_MIN_MACS and onednn_float32() and not torch.compiler.is_compiling() \
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 2-D ``a [M, K]`` and ``b [K, N]``, on oneDNN where :func:`onednn_float32` holds, it is large
    enough and ``a`` is row-major (a transposed one would cost oneDNN a copy); torch's own product otherwise,
    and wherever autograd records it."""
    if a.is_contiguous() and _onednn_pays(a, b, a.shape[0] * a.shape[1] * b.shape[1]):
        return torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")
    return a @ b


class ReusedWeight:
    """A weight ``W [N, K]`` that many products ``x @ W.T`` of one call share (a recurrent weight, over a
    sequence's steps), held as each product's kernel wants it: packed once for oneDNN where it is float32,
    :func:`onednn_float32` holds and the products are large enough, else ``W.T`` contiguous for torch's GEMM
    (MKL took an M-row GEMM against the transposed view at 122 GF/s and against the copy at 168, M 64, 512 x
    1024, one Xeon core). On one Zen 4 core, 64 rows through 1024 x 512 ran at 111 GF/s from oneDNN's packed
    copy against MKL's 88; packing cost 0.27 ms, about what one product saves. Not differentiable: for
    autograd functions' own GEMMs."""

    def __init__(self, weight: torch.Tensor, rows: int) -> None:
        """``rows``: the rows of each product, which decide whether it is large enough for oneDNN."""
        self._packed = None
        if _onednn_pays(weight, weight, rows * weight.shape[0] * weight.shape[1]):  # a strided view as it is
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self._t = weight.t().contiguous()

    def product(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """``add + x @ W.T`` (``add`` broadcast to the product's shape), a new tensor."""
        if self._packed is None:
            return torch.mm(x, self._t) if add is None else torch.addmm(add, x, self._t)
        out = torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        return out if add is None else out.add_(add)

    def add_product_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out += x @ W.T`` in place (torch's GEMM accumulates into ``out`` itself)."""
        if self._packed is None:
            return out.addmm_(x, self._t)
        return out.add_(torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], ""))


#: Rows of an upcast linear are converted a chunk at a time, about this many float32 elements per chunk
#: (256 KiB), so the float32 copies an upcast GEMM makes stay that small, not the size of its input...
UPCAST_CHUNK_ELEMENTS = 1 << 16
#: ... but never fewer rows than this a chunk: each chunk is a GEMM against the whole weight, and at a
#: vocabulary's width the element budget alone made chunks of one row, a GEMV each (an EAGLE3 teacher's 1024
#: rows through SmolLM2's 49152 x 576 head: 6.2 s as 1024 GEMVs, 0.4 s in chunks of 128 rows).
UPCAST_MIN_CHUNK_ROWS = 128


def _row_chunks(rows: int, width: int) -> list[slice]:
    step = max(UPCAST_MIN_CHUNK_ROWS, UPCAST_CHUNK_ELEMENTS // max(1, width))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class _UpcastLinear(torch.autograd.Function):
    """``x @ w.T (+ b)`` with half-precision operands, computed as float32 GEMMs and rounded back.

    Keeps only the half-precision inputs for backward (no float32 copies outlive the call), and
    converts the rows a chunk at a time (:data:`UPCAST_CHUNK_ELEMENTS`, at least
    :data:`UPCAST_MIN_CHUNK_ROWS` rows), so the transient float32 copy of a large input is one chunk's, not
    the whole input's.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        weight32, bias32 = weight.float(), None if bias is None else bias.float()
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        for part in _row_chunks(rows.shape[0], max(rows.shape[1], weight.shape[0])):
            out[part] = F.linear(rows[part].float(), weight32, bias32)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_bias = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        grad_x, grad_w, grad_b = _upcast_linear_grads(grad, x, weight, ctx.needs_input_grad[0],
                                                      ctx.needs_input_grad[1], need_bias)
        return grad_x, grad_w, None if grad_b is None else grad_b.to(ctx.bias_dtype)


def _upcast_linear_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool,
                         need_b: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                        torch.Tensor | None]:
    """The input, weight and (float32) bias gradients of ``x @ weight.T (+ b)`` for half-precision
    operands, as float32 GEMMs over a chunk of rows at a time (see :class:`_UpcastLinear`)."""
    grad_rows, rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    weight32 = weight.float()
    grad_x = torch.empty_like(rows) if need_x else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
    for part in _row_chunks(rows.shape[0], max(rows.shape[1], weight.shape[0])):
        grad32 = grad_rows[part].float()
        if grad_x is not None:
            grad_x[part] = grad32 @ weight32
        if grad_w is not None:
            grad_w.addmm_(grad32.t(), rows[part].float())
        if grad_b is not None:
            grad_b += grad32.sum(0)
    return (None if grad_x is None else grad_x.view(x.shape),
            None if grad_w is None else grad_w.to(weight.dtype), grad_b)


def linear_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool = True,
                 need_w: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input and weight gradients of :func:`linear` (no bias) given its output's gradient ``grad``,
    computed as its backward computes them (float32 GEMMs where it upcasts), for autograd functions
    that recompute a linear's input in backward instead of keeping it. Without ``need_w`` only ``x``'s shape
    and dtype are read: any tensor of those stands in for an input not made yet."""
    if x.dtype == weight.dtype and upcasts(x.numel() // max(1, x.shape[-1]), weight):
        return _upcast_linear_grads(grad, x, weight, need_x, need_w)[:2]
    grad_rows, rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return ((grad_rows @ weight).view(x.shape) if need_x else None,
            grad_rows.t() @ rows if need_w else None)


#: A weight of at least this many elements is "large" for :func:`upcast_pays`.
LARGE_WEIGHT = 1 << 23


def upcast_pays(rows: int, weight_numel: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a half-precision linear of ``rows`` input rows is faster as a float32 GEMM of upcast operands.

    The upcast converts the whole weight on every call, which only pays when enough rows share
    it. Measured on a CPU without bf16 instructions, one thread (native time / upcast time):
    one row, 0.05-0.7 for every weight (a 49152 x 640 vocabulary head: 7 ms native, 98 ms
    upcast); weights up to 4M elements break even at about 4 rows (2-5x faster upcast from 8),
    weights from 8M elements at about 24 rows. So: at least 4 rows, and at least 24 for a
    weight of :data:`LARGE_WEIGHT` elements or more. Where torch's bf16 GEMM runs at half the
    float32 rate instead (:func:`upcast_min_rows`), forward and backward of 576-wide weights broke
    even at about 64 rows (1536 x 576: 0.95 at 64 rows, 1.31 at 256; 4096 x 576: 1.02 and 1.39),
    so there at least 64, which a fused loss's tiles of a frozen head, converted once, pass (a
    threshold of 128 left DFlash's 120-row tiles of SmolLM2's head on torch's bf16 GEMM: 2.2-2.3 s
    a step instead of 1.9-2.0). Training batches are far above these; speculative decoding's
    draft steps of one row or one block stay on torch's kernel.
    """
    first = upcast_min_rows(dtype)
    return first is not None and rows >= first and (rows >= 24 or weight_numel < LARGE_WEIGHT)


def upcasts(rows: int, weight: torch.Tensor) -> bool:
    """Whether ``rows`` rows through half-precision ``weight`` run as float32 GEMMs here: a CPU whose own GEMM in
    the weight's dtype is the slower one, and enough rows to pay for it (:func:`upcast_pays`). float16 follows
    bf16, except on Intel CPUs with AVX512-BF16 but no AMX, whose AVX512-FP16 runs torch's float16 GEMM at the
    float32 rate (158 GF/s against 159 on one Xeon core): converting would only add work there."""
    return weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu" \
        and upcast_pays(rows, weight.numel(), weight.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except that bf16/fp16 on a CPU whose own bf16 GEMM is slower than float32 runs in
    float32 when enough rows share the weight (:func:`upcasts`); the result has ``x``'s dtype either way."""
    if x.dtype == weight.dtype and upcasts(x.numel() // max(1, x.shape[-1]), weight):
        return _UpcastLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


#: Output columns per GEMM of :func:`mm_wide` on CPU.
WIDE_COLUMNS = 1024
#: The most rows :func:`mm_wide` takes in blocks of columns (a block of the result, rows x WIDE_COLUMNS, is
#: then at most 2 MiB of float32).
WIDE_MAX_ROWS = 512


def mm_wide(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (into ``out`` if given) for a ``weight [N, K]`` that may be a vocabulary head.

    On CPU in float32, up to :data:`WIDE_MAX_ROWS` rows of ``x`` against a weight of at least ``8 *
    WIDE_COLUMNS`` rows run as one GEMM per :data:`WIDE_COLUMNS` rows of the weight, each writing its own
    columns of the result, whose block then stays in cache through the GEMM's passes over ``K``. Measured
    on one Zen 4 core (MKL) at SmolLM2's head (K 576, N 49152), into a preallocated result: 64 rows 64
    GF/s as one GEMM and 78 in blocks, 128 rows 75 and 87, 256 rows 83 and 91, 512 rows 89 and 93, 1024
    rows 90 and 88 (so more rows stay one GEMM); at N 4096 and fewer blocks gained nothing. Half
    precision stays one GEMM (native bf16 GEMMs ran 2-4% slower in blocks), as does every other device.
    """
    rows, vocab = x.shape[0], weight.shape[0]
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 \
            or vocab < 8 * WIDE_COLUMNS or rows > WIDE_MAX_ROWS:
        return torch.mm(x, weight.t(), out=out)
    if out is None:
        out = x.new_empty(rows, vocab)
    for start in range(0, vocab, WIDE_COLUMNS):
        torch.mm(x, weight[start:start + WIDE_COLUMNS].t(), out=out[:, start:start + WIDE_COLUMNS])
    return out


#: Elements of each block of :func:`add_product_`'s product where it is made apart from ``out`` (1 MiB of float32).
ADD_PRODUCT_BLOCK = 1 << 18


def add_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out += a @ b`` in place, as one GEMM accumulating into ``out`` where the three dtypes agree. A loss
    accumulating a vocabulary-wide weight gradient a tile at a time (Domino's and DSpark's ``w2``: 49152 x 256 at
    SmolLM2's) otherwise makes a product as large as the gradient at every tile, freshly mapped and faulted in:
    with its add that ran at 58 GF/s on one Xeon core (120-row tiles), accumulated in place at 119.

    Where they differ (a float32 sum of bf16 products, as on a CPU whose bf16 GEMMs run natively) the product is
    made in ``a``'s dtype and added, on CPU a block of about :data:`ADD_PRODUCT_BLOCK` elements of ``out``'s rows at
    a time, while the block is in cache: the whole product and its float32 copy (which ``add_`` makes to promote
    it) were each as large as the gradient, above glibc's mapping threshold at SmolLM2's sizes. On one Zen 4 core:
    49152 x 256 over 128 rows 21 ms instead of 46, EAGLE3's 32000 x 576 over 920 rows 177 instead of 226."""
    if out.dtype == a.dtype == b.dtype:
        return out.addmm_(a, b)
    if out.device.type != "cpu":
        return out.add_(a @ b)
    rows = max(1, ADD_PRODUCT_BLOCK // max(1, out.shape[-1]))
    for start in range(0, out.shape[0], rows):
        out[start:start + rows].add_(a[start:start + rows] @ b)
    return out


#: ``SPECFORGE_CPU_PACK_HEAD``: ``off`` keeps :class:`FrozenHead` from packing a head (no extra copies of it;
#: torch's GEMMs over the head itself); ``on`` or unset lets it pack where that pays.
PACK_HEAD_ENV = "SPECFORGE_CPU_PACK_HEAD"


def _packs_head(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :class:`FrozenHead` keeps ``weight`` in ``dtype`` packed (for oneDNN, or MKL where
    :func:`mkl_packed_head` holds): a vocabulary-wide head (at
    least ``8 * WIDE_COLUMNS`` rows) in float32, or in bf16 on a CPU whose bf16 GEMMs run natively
    (where :func:`upcast_half_gemm_on_cpu` does not hold), on x86-64 with oneDNN, enabled, outside a process group of
    several ranks (there the head is FSDP2's to gather, into storage it reuses), unless :data:`PACK_HEAD_ENV`
    turns it off."""
    if env_choice(PACK_HEAD_ENV, ("on", "off")) == "off":
        return False
    if not (weight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and weight.shape[0] >= 8 * WIDE_COLUMNS and platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if dtype == torch.bfloat16 and (upcast_half_gemm_on_cpu() or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1)


#: A float32 head narrower than this takes its input gradient ``dz W`` from MKL over the head itself on an Intel
#: CPU (see :class:`FrozenHead`)
PLAIN_GRAD_MAX_WIDTH = 1024


def _intel_float32(weight: torch.Tensor) -> bool:
    cpu = _cpu_identity()
    return weight.dtype == torch.float32 and cpu is not None and cpu[1] == "GenuineIntel"


def plain_head_grad(weight: torch.Tensor) -> bool:
    """Whether a packed :class:`FrozenHead` takes its input gradient from MKL over the head itself instead of a
    second packed copy: float32, narrower than :data:`PLAIN_GRAD_MAX_WIDTH`, on an Intel CPU."""
    return _intel_float32(weight) and weight.shape[-1] < PLAIN_GRAD_MAX_WIDTH


@functools.lru_cache(maxsize=1)
def _has_mkl_packed_gemm() -> bool:
    """Whether this torch runs MKL's packed float32 GEMM (``torch.ops.mkl._mkl_linear``: built with MKL)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear") \
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def mkl_packed_head(weight: torch.Tensor) -> bool:
    """Whether a packed :class:`FrozenHead` is packed for MKL's packed GEMM instead of oneDNN's: float32 on an
    Intel CPU, with a torch built with MKL."""
    return _intel_float32(weight) and _has_mkl_packed_gemm()


class FrozenHead:
    """A frozen head ``W [V, H]`` (a target's lm_head, whose values never change while a draft trains) in the
    dtype its GEMMs run in, with the two products a fused loss takes of it a tile at a time:
    :meth:`logits` ``x W^T`` and :meth:`input_grad` ``dz W``.

    Where :func:`_packs_head` holds (float32, or bf16 on a CPU whose bf16 GEMMs run natively; a vocabulary-wide
    head, x86-64 with oneDNN, one process), the head is kept packed for its products' GEMM kernel, once for each
    product: on oneDNN, SmolLM2's head (49152 x 576) at 128-row tiles took 105-107 GF/s for either in float32,
    against MKL's 87 (:func:`mm_wide`) and 91, and 210 and 221 GF/s in bf16 against torch's 188 and 181, on
    one Zen 4 core; a DFlash step at SmolLM2's dimensions took 1.97 s instead of 2.15 in float32, 1.08-1.12 s
    instead of 1.18 in bf16. The cost is memory: two more copies of the head (2 x V x H x 4 bytes in float32,
    226 MB for SmolLM2's, half that in bf16; the input gradient's only once one is asked for), kept as long
    as the head: packing both at every step (70 ms each at SmolLM2's in float32) would take most of what
    they save, so :func:`frozen_head` keeps them. oneDNN builds a kernel for each new number of rows, once (a
    loss's tiles have one or two). Elsewhere the products are :func:`mm_wide` and ``@`` on the head itself.

    On an Intel CPU a float32 head is packed for MKL's packed GEMM instead (:func:`mkl_packed_head`), which
    outran oneDNN's at every width: on one Xeon core, 49152 rows, 120-128-row tiles, the logits at 149-156
    GF/s against oneDNN's 127-142 (widths 576-4096), and ``dz W`` at 150-158 against 137-142. MKL packs for
    one number of rows: the logits' copy is packed at the first tile, and again for a tile with more rows
    than that; a tile with fewer (a loss's last) runs MKL's plain GEMM over the head itself, which is
    therefore kept, so a wide head converted to float32 for its GEMMs (bf16 upcast) stays on oneDNN, whose
    copies need no third. A head narrower than :data:`PLAIN_GRAD_MAX_WIDTH` (:func:`plain_head_grad`) takes
    its input gradient from MKL's plain GEMM over the head itself, with no second copy: 153-160 GF/s at
    widths 576-960 (packed: 150-152), falling to 106-131 from 1024 on, where its second copy is packed for
    MKL too.
    """

    def __init__(self, weight: torch.Tensor, *, copied: bool = False) -> None:
        """``copied``: ``weight`` is a copy made for this head (the model's head in another dtype), not the
        model's own tensor, so keeping it costs memory of its own."""
        if _packs_head(weight, weight.dtype):
            # the input gradient's copy is packed at its first use: a loss without gradients never needs it;
            # MKL's copies are packed for a number of rows, so at their first use too
            self.weight, self._source = None, weight
            self._plain_grad = plain_head_grad(weight)
            # MKL's products keep the head itself beside their copies, for the rows those were not packed for:
            # free where it is the model's own tensor or where the input gradient keeps it anyway
            self._mkl, self._rows = mkl_packed_head(weight) and (self._plain_grad or not copied), [0, 0]
            self._packed = [None if self._mkl else torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None),
                            None]
        else:
            self.weight, self._source, self._packed, self._plain_grad, self._mkl = weight, None, None, False, False

    @property
    def packed(self) -> bool:
        """Whether the products run from packed copies (on MKL or oneDNN)."""
        return self._packed is not None

    def logits(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T`` for rows ``x [R, H]``, in ``out`` where it can be written there: use the returned tensor."""
        if self._packed is None:
            return mm_wide(x, self.weight, out=out)
        if self._mkl:
            return self._mkl_product(0, x, self._source)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed[0], None, "none", [], "")

    def input_grad(self, dz: torch.Tensor) -> torch.Tensor:
        """``dz W`` for the logits' gradient ``dz [R, V]``: the rows' gradient ``[R, H]``."""
        if self._packed is None:
            return dz @ self.weight
        if self._plain_grad:
            return dz @ self._source
        if self._mkl:
            return self._mkl_product(1, dz, self._source.t())
        if self._packed[1] is None:
            self._packed[1] = torch.ops.mkldnn._reorder_linear_weight(self._source.t().contiguous(), None)
            self._source = None
        return torch.ops.mkldnn._linear_pointwise(dz.contiguous(), self._packed[1], None, "none", [], "")

    def _mkl_product(self, which: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x weight^T`` on MKL from packed copy ``which`` of ``weight``, packed for ``x``'s rows where it has none
        yet or was packed for fewer (the old copy goes first); fewer rows run MKL's plain GEMM over ``weight``."""
        rows = x.shape[0]
        if not rows:  # nothing to pack for
            return x @ weight.t()
        if rows > self._rows[which]:
            self._packed[which] = None
            self._packed[which] = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), rows)
            self._rows[which] = rows
        return torch.ops.mkl._mkl_linear(x, self._packed[which], weight, None, self._rows[which])


#: id(head) -> (a weak reference to the head, what it was packed from, its FrozenHead), for packed heads: an
#: entry goes when its head does (tensors compare elementwise, so a WeakKeyDictionary cannot hold them).
_FROZEN_HEADS: dict[int, tuple[weakref.ref, tuple, FrozenHead]] = {}


def frozen_head(head: torch.Tensor, dtype: torch.dtype) -> FrozenHead:
    """``head`` in ``dtype`` as a :class:`FrozenHead`. A packed one is made once and kept while ``head`` lives
    with the same storage, version, shape and dtype (made again after any change); pass the module's own
    parameter or buffer, the same object at every step, not a ``detach()`` of it. Unpacked ones are made
    at each call (a cast to ``dtype`` where it differs), as the losses did before."""
    if not _packs_head(head, dtype):
        return FrozenHead(head.detach().to(dtype))
    key = (head.data_ptr(), head._version, tuple(head.shape), head.dtype, dtype)
    kept = _FROZEN_HEADS.get(id(head))
    if kept is None or kept[0]() is not head or kept[1] != key:
        if kept is None or kept[0]() is not head:
            weakref.finalize(head, _FROZEN_HEADS.pop, id(head), None)
        kept = (weakref.ref(head), key, FrozenHead(head.detach().to(dtype), copied=head.dtype != dtype))
        _FROZEN_HEADS[id(head)] = kept
    return kept[2]


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                        bias: torch.Tensor | None = None, scale: float | None = None) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """The flash attention kernel for CPU: ``(out [B, h, Q, d], logsumexp [B, h, Q] float32)``.

    q ``[B, h, Q, d]``, k/v ``[B, kv, K, d]`` (GQA taken as it is, strided views too); ``bias`` an
    additive mask in q's dtype. A query row that sees no key gets output 0 and logsumexp 0, not -inf.
    The logsumexp is what lets several calls over disjoint keys be merged, and what
    :func:`cpu_flash_attention_backward` is given for the merged result.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                      scale=scale)


def cpu_flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool = False,
                                 bias: torch.Tensor | None = None,
                                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_q, grad_k, grad_v)`` of :func:`cpu_flash_attention`'s call over these keys. Given the output
    and logsumexp of an attention merged over more keys, the kernel recomputes this call's share of the
    merged softmax and uses the merged ``rowsum(grad_out * out)``: the gradients are the merged attention's."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


#: Entries per block of :func:`max_last`'s search.
MAX_BLOCK = 64


def max_last(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the maximum along the last dimension, the first of equal maxima, as
    ``x.max(-1)`` gives them (NaN counts as the largest).

    On CPU, ``max`` with indices runs a scalar loop over the row, while ``amax`` is vectorised:
    for float32 and float64 rows of at least ``2 * MAX_BLOCK`` the maximum of each block of
    :data:`MAX_BLOCK` entries comes from ``amax``, and only the first block holding the row's
    maximum is searched for its index (256 rows of 4096 float32 logits: 0.20 ms instead of 0.87;
    128 rows of 49152: 0.99 instead of 5.2). Half precision, whose ``amax`` is not vectorised,
    short rows and other devices take ``max`` as it is.
    """
    n = x.shape[-1]
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or n < 2 * MAX_BLOCK:
        found = x.max(-1)
        return found.values, found.indices
    rows = x.reshape(-1, n)
    whole = n - n % MAX_BLOCK
    blocks = rows[:, :whole].unflatten(-1, (whole // MAX_BLOCK, MAX_BLOCK))  # [R, n // MAX_BLOCK, MAX_BLOCK]
    best = blocks.amax(-1).max(-1)  # the row's maximum and the first block that holds it
    inner = blocks.gather(1, best.indices[:, None, None].expand(-1, 1, MAX_BLOCK)).squeeze(1).max(-1).indices
    values, indices = best.values, best.indices * MAX_BLOCK + inner
    if whole < n:  # the last n % MAX_BLOCK entries: they win only when strictly larger (or the first NaN)
        tail = rows[:, whole:].max(-1)
        later = (tail.values > values) | (tail.values.isnan() & ~values.isnan())
        values = torch.where(later, tail.values, values)
        indices = torch.where(later, tail.indices + whole, indices)
    return values.view(x.shape[:-1]), indices.view(x.shape[:-1])


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """The index of the largest entry along the last dimension (the first of equal maxima), as
    ``x.argmax(-1)`` gives it: :func:`max_last`'s indices. ``max``'s indices, which it falls back to, come
    several times faster than ``argmax`` on CPU in half precision (one bf16 row of 49152 logits: 0.05 ms
    instead of 0.18; eight rows 0.34 instead of 1.42)."""
    return max_last(x)[1]


def softmax_last_(x: torch.Tensor) -> torch.Tensor:
    """``x`` overwritten with its softmax over the last dimension; returns ``x``.

    One pass of torch's softmax kernel, which on CPU is faster than the written-out ``exp(x - max) / sum``
    (256 rows of 4096 float32: 0.60 ms instead of 1.0): on CPU it writes into ``x`` itself, as its
    kernel reads each row before writing it (the result is ``torch.softmax``'s bit for bit; tested); on
    other devices, or for a non-contiguous ``x``, into a new tensor copied back.
    """
    if x.device.type == "cpu" and x.is_contiguous():
        return torch.ops.aten._softmax.out(x, -1, False, out=x)
    return x.copy_(torch.softmax(x, dim=-1))


def softmax_logsumexp_(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp, argmax)`` over the last dimension of ``z``, leaving ``z`` holding its softmax
    (:func:`softmax_last_`): the maximum and argmax from :func:`max_last`, one softmax pass (one exp per
    entry), and ``logsumexp = max - log softmax[argmax]``, since the softmax there is ``exp(max - logsumexp)``
    (at least ``1 / n``, so its log is finite). What the fused cross-entropies take from their logits."""
    peak, ids = max_last(z)
    softmax = softmax_last_(z)
    return peak - softmax.gather(-1, ids[..., None]).squeeze(-1).log(), ids


def in_float32(x: torch.Tensor) -> torch.Tensor:
    """Half precision as a float32 copy, float32 and float64 as they are: where a computation made of several
    steps (attention merged from several kernel calls, a norm's statistic) runs in float32 and rounds its
    result once, as one half-precision kernel would, instead of once per step."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same queries over disjoint keys (``out [.., Q, d]``, ``lse [.., Q]``) merged into the
    attention over both keys: ``(out, lse)``, the output in float32 (float64 kept). A side whose ``lse`` is -inf
    adds nothing."""
    acc = torch.promote_types(out_a.dtype, torch.float32)
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a.to(acc) * (lse_a - lse).exp_()[..., None] + out_b.to(acc) * (lse_b - lse).exp_()[..., None], lse


#: Queries per chunk of :func:`cpu_causal_attention` ...
CAUSAL_CHUNK = 64
#: ... and from :data:`CAUSAL_LONG` queries on, per chunk of :data:`CAUSAL_CHUNK_LONG`: the kernel runs a call of
#: fewer than 192 queries as GEMMs of 32 query rows, whose fixed costs grow with the prefix each chunk reads.
#: One Xeon core (one sample, 4 heads of 64, float32, forward + backward, in turn): 1024 queries 24 ms in chunks
#: of 256 instead of 28 in chunks of 64, 2048 queries 86 instead of 104, 4096 queries 333 instead of 418 (one
#: causal call took 83-96 and 279-313 ms at 2048 and 4096, faster still there, but on a Zen 4 core it was the
#: slower at 2048: 263 ms against 224 in chunks of 64).
CAUSAL_CHUNK_LONG = 256
CAUSAL_LONG = 1024


def _causal_chunks(length: int) -> list[tuple[int, int]]:
    size = CAUSAL_CHUNK if length < CAUSAL_LONG else CAUSAL_CHUNK_LONG
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def _chunks_causal(q: torch.Tensor) -> bool:
    """Whether :func:`cpu_causal_attention` splits ``q``'s queries: more than one chunk, in float32 or float64.
    In half precision the kernel's fixed cost per call outweighed the skipped half (one causal call at S 512,
    d 64, bf16: 24 ms fwd + bwd; in chunks of 64: 31)."""
    return q.shape[2] > CAUSAL_CHUNK and q.dtype in (torch.float32, torch.float64)


def _query_chunks(q: torch.Tensor, query_start: int) -> list[tuple[int, int]] | None:
    """The query chunks :func:`cpu_causal_attention` runs ``q`` in (``None``: one aligned causal call)."""
    if _chunks_causal(q):
        return _causal_chunks(q.shape[2])
    return [(0, q.shape[2])] if query_start else None


def cpu_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                         query_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by the CPU flash kernel: query i sits at position ``query_start + i`` and sees
    the keys at positions ``<= query_start + i`` (k and v span at least ``query_start + Q`` positions);
    ``(out [B, h, Q, d] in q's dtype, logsumexp [B, h, Q] float32, float64 kept)``, as
    :func:`cpu_flash_attention` with ``causal=True`` returns them.

    The kernel walks keys in blocks of up to 512 and can skip only whole blocks, so below about
    a thousand positions one causal call computes the masked half too (at S = 512 it costs what
    a call without the mask does). Here each chunk of :data:`CAUSAL_CHUNK` queries (from
    :data:`CAUSAL_LONG` queries on, :data:`CAUSAL_CHUNK_LONG`) attends its own keys (causal, aligned)
    and the keys before them (no mask) in two calls, merged by log-sum-exp: the masked half is never
    computed (float32 fwd + bwd at S 512, d 64, on a Zen 4 core: 16 ms instead of 26; at S 2048: 224
    instead of 263, in chunks of 64). Half precision from position 0 stays one causal call
    (:func:`_chunks_causal`). Backward: :func:`cpu_causal_attention_backward`.
    """
    chunks = _query_chunks(q, query_start)
    if chunks is None:
        return cpu_flash_attention(q, k, v, causal=True, scale=scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    for start, end in chunks:
        rows, first = slice(start, end), query_start + start
        keys = slice(first, query_start + end)
        own = cpu_flash_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=True, scale=scale)
        if first:
            own = merge_attention(*own, *cpu_flash_attention(q[:, :, rows], k[:, :, :first], v[:, :, :first],
                                                              scale=scale))
        out[:, :, rows], lse[:, :, rows] = own
    return out.to(q.dtype), lse


def cpu_causal_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, *, scale: float | None = None,
                                  query_start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_q, grad_k, grad_v)`` of :func:`cpu_causal_attention`, by the same chunks; ``out`` and ``lse``
    may be those of an attention merged over more keys (see :func:`cpu_flash_attention_backward`)."""
    chunks = _query_chunks(q, query_start)
    if chunks is None:
        return cpu_flash_attention_backward(grad_out, q, k, v, out, lse, causal=True, scale=scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    grad_q = torch.empty(q.shape, dtype=acc, device=q.device)
    grad_k = torch.zeros(k.shape, dtype=acc, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=acc, device=v.device)
    for start, end in chunks:
        rows, first = slice(start, end), query_start + start
        keys = slice(first, query_start + end)
        part = (grad_out[:, :, rows], q[:, :, rows])
        merged = (out[:, :, rows], lse[:, :, rows])
        dq, dk, dv = cpu_flash_attention_backward(*part, k[:, :, keys], v[:, :, keys], *merged, causal=True,
                                                  scale=scale)
        grad_q[:, :, rows] = dq
        grad_k[:, :, keys] += dk
        grad_v[:, :, keys] += dv
        if first:
            dq, dk, dv = cpu_flash_attention_backward(*part, k[:, :, :first], v[:, :, :first], *merged, scale=scale)
            grad_q[:, :, rows] += dq
            grad_k[:, :, :first] += dk
            grad_v[:, :, :first] += dv
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`linear`: the same parameters and state-dict names, a float32 GEMM for
    half precision on CPUs without bf16 instructions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class _RMSNorm(torch.autograd.Function):
    """:func:`rms_norm` with only its input and the per-row ``1/rms`` kept for backward.

    Written out, autograd keeps the normalised rows as well (and in half precision a float32
    copy of the input): two or three ``[.., H]`` tensors where this keeps one. In half precision
    backward recomputes the normalised rows and rounds as the written-out form does, and both passes
    take each step in the buffer of a tensor nothing reads after it (:func:`_half_rms_norm_grads`):
    fewer short-lived tensors interleaved with the ones a step keeps, which left the heap's pages
    touched by the DSpark bf16 step of ``bench/versus_reference.py`` (tiny shapes) at 33.4-36.6 MB
    above its baseline against the compiled textbook's 34.9-38.2 (before: 36.3-38.5 against
    34.9-36.1). In float32 and
    float64, where nothing rounds between the steps, it never forms them: from one product ``g * x``
    come the weight's gradient and each row's ``mean(dy * y)`` as two GEMVs, and the input's
    gradient takes three more passes; forward scales the normalised rows by the weight in their own
    buffer. Against recomputing the rows (one Xeon core, float32, in turn 500 times): a DFlash
    layer's per-head q norm ``[4, 256, 4, 32]`` backward 0.33 ms instead of 0.41, the k norm over
    ``[4, 768, 2, 32]`` 0.57 instead of 0.67; the DFlash step 1.02x as fast.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = in_float32(x)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))  # [.., 1], float32 (float64 for float64)
        ctx.save_for_backward(x, weight, rstd)
        half = x32 is not x  # then x32 is a copy of x's, which nothing else reads
        if x.dtype == weight.dtype and not half:  # nothing to round: scale the normalised rows in their buffer
            return (x * rstd).mul_(weight)
        rows = (x32.mul_(rstd) if half else x32 * rstd).to(x.dtype)
        return rows.mul_(weight) if weight.dtype == rows.dtype else weight * rows

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_x = grad_weight = None
        if x.dtype in (torch.float32, torch.float64) and grad.dtype == x.dtype and weight.dtype == x.dtype:
            # no rounding between the steps, so y = x r (r = 1/rms per row) is never formed: with gx = g * x,
            # the weight's gradient sum(g * y) over rows is the GEMV r @ gx, mean(dy * y) = r (gx @ w) / width,
            # and dx = r (dy - y mean(dy * y)) = r g w - x r^3 (gx @ w) / width
            width = grad.shape[-1]
            gx = (grad * x).reshape(-1, width)
            rows = rstd.reshape(-1)
            if ctx.needs_input_grad[1]:
                grad_weight = rows @ gx
            if ctx.needs_input_grad[0]:
                shift = (gx @ weight).mul_(rows.pow(3)).div_(width).view(rstd.shape)
                grad_x = (grad * weight).mul_(rstd).addcmul_(x, shift, value=-1)
            return grad_x, grad_weight, None
        if grad.dtype == weight.dtype == x.dtype:  # half precision throughout
            return (*_half_rms_norm_grads(grad, x, weight, rstd, *ctx.needs_input_grad[:2]), None)
        y32 = in_float32(x) * rstd  # mixed dtypes: the written-out form's backward
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * y32.to(x.dtype)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            dy = in_float32(grad * weight)
            grad_x = (rstd * (dy - y32 * (dy * y32).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


def _half_rms_norm_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                         need_x: bool, need_weight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:class:`_RMSNorm`'s gradients for a half-precision input, weight and gradient: the written-out form's
    backward with its values (the same products, sums and differences, rounded where it rounds), each step
    in the buffer of a tensor nothing reads after it: six ``[.., H]`` tensors, three of them float32, where
    each step in a tensor of its own took eleven, seven of them float32."""
    y32 = in_float32(x).mul_(rstd)  # the normalised rows in float32 (x * rstd would make one more float32 copy)
    grad_x = grad_weight = None
    if need_weight:
        grad_weight = y32.to(x.dtype).mul_(grad).reshape(-1, grad.shape[-1]).sum(0)
    if need_x:
        dy = (grad * weight).float()
        mean = (dy * y32).mean(-1, keepdim=True)
        grad_x = dy.sub_(y32.mul_(mean)).mul_(rstd).to(x.dtype)
    return grad_x, grad_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dimension, the statistic in float32 (float64 for float64)
    and the normalised rows rounded to ``x``'s dtype before the scale (as Llama and Qwen compute it)."""
    return _RMSNorm.apply(x, weight, eps)


class _GatedDownProj(torch.autograd.Function):
    """:func:`gated_down_proj`, keeping ``gate`` and ``up`` (and the weight) for backward and recomputing
    ``silu(gate) * up`` there. Written out (``linear(F.silu(gate) * up, weight)``), autograd keeps
    ``silu(gate)`` and the product (the down projection's input) too: two more ``[.., I]`` tensors,
    the widest a decoder layer keeps but for the attention's. Backward computes ``silu(gate)`` once,
    for the product and, in its buffer, ``up``'s gradient, and ``gate``'s gradient in the buffer of the
    product's gradient; the product goes (once the weight's gradient is made) before its gradient is made:
    at most two ``[.., I]`` tensors at once besides the two it keeps."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        return linear(F.silu(gate).mul_(up), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gated_down_proj_grads(grad, *ctx.saved_tensors, *ctx.needs_input_grad)


def _gated_down_proj_grads(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                           need_gate: bool, need_up: bool,
                           need_weight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_gate, grad_up, grad_weight)`` of :func:`gated_down_proj` given its output's gradient (see
    :class:`_GatedDownProj`); ``gate`` and ``up`` are the kept, or recomputed, inputs."""
    activated = F.silu(gate)
    grad_weight = None
    if need_weight:  # the product is made for this alone, and goes before its gradient is made
        grad_weight = linear_grads(grad, activated * up, weight, need_x=False)[1]
    if not (need_gate or need_up):
        return None, None, grad_weight
    grad_product = linear_grads(grad, gate, weight, need_w=False)[0]  # gate: the product's shape and dtype
    grad_up = activated.mul_(grad_product) if need_up else None  # silu(gate) is not needed after this
    del activated
    grad_gate = None
    if need_gate:  # in grad_product's buffer, which nothing reads after this
        grad_gate = torch.ops.aten.silu_backward.grad_input(grad_product.mul_(up), gate, grad_input=grad_product)
    return grad_gate, grad_up, grad_weight


def gated_down_proj(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear(silu(gate) * up, weight)``: the gated MLP's product and down projection in one step, with
    the written-out form's values and gradients, keeping only its inputs for backward."""
    return _GatedDownProj.apply(gate, up, weight)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, the statistic in float32 (as Llama and Qwen compute it); see :func:`rms_norm`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _RecomputedGatedMLP(torch.autograd.Function):
    """:class:`SwiGLU` keeping only its input (and the weights) for backward: ``gate(x)`` and ``up(x)`` are
    made again there, as the forward made them, and go once the gradients are made. One more forward of
    the two projections, and two ``[.., I]`` tensors fewer kept through the rest of the step."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        return linear(F.silu(linear(x, w_gate)).mul_(linear(x, w_up)), w_down)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad
        gate, up = linear(x, w_gate), linear(x, w_up)
        grad_gate, grad_up, grad_down = _gated_down_proj_grads(grad, gate, up, w_down, need_x or need_gate,
                                                               need_x or need_up, need_down)
        del gate, up
        grad_x = grad_w_gate = grad_w_up = None
        if grad_gate is not None:
            grad_x, grad_w_gate = linear_grads(grad_gate, x, w_gate, need_x=need_x, need_w=need_gate)
            del grad_gate
        if grad_up is not None:
            more_x, grad_w_up = linear_grads(grad_up, x, w_up, need_x=need_x, need_w=need_up)
            grad_x = more_x if grad_x is None else grad_x.add_(more_x)
        return grad_x, grad_w_gate, grad_w_up, grad_down


class SwiGLU(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``, no biases.

    With ``recompute`` (``train.recompute_mlp``, :func:`recompute_mlps`) backward makes ``gate(x)`` and
    ``up(x)`` again instead of keeping them from forward (:class:`_RecomputedGatedMLP`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, recompute: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        if self.recompute and torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            return _RecomputedGatedMLP.apply(x, *weights)
        return gated_down_proj(self.gate_proj(x), self.up_proj(x), weights[2])


def recompute_mlps(model: nn.Module, enabled: bool = True) -> int:
    """Set ``recompute`` on every :class:`SwiGLU` of ``model`` (``train.recompute_mlp``); returns how many."""
    found = [module for module in model.modules() if isinstance(module, SwiGLU)]
    for module in found:
        module.recompute = enabled
    return len(found)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) rotary tables: ``positions [...]`` -> cos, sin ``[..., head_dim]`` in float32.

    A draft needs only to agree with itself between training and serving, and exports write
    no ``rope_scaling``, so a target's scaling is not copied.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., head_dim/2]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> None:
    """``out = x cos + rotate_half(x) sin`` (``rotate_half(x) = [-x2, x1]`` for the halves ``x1, x2`` of the last
    dim), or with ``inverse`` the transposed rotation ``x cos + rotate_half^T(x sin)`` (``rotate_half^T(u) = [u2,
    -u1]``), which backward applies to the gradient: ``x cos`` and then each half's sine term added into it in
    place, three passes and one tensor where forming ``rotate_half(x)`` took five and four (33-38% faster alone
    at the bench's shapes)."""
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    if inverse:
        out[..., :half].addcmul_(x[..., half:], sin[..., half:])
        out[..., half:].addcmul_(x[..., :half], sin[..., :half], value=-1)
    else:
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])


def _rotate(x: torch.Tensor, split: int | None, tables: tuple[torch.Tensor, ...], inverse: bool) -> torch.Tensor:
    """``x`` rotated in float32 (float64 kept) and returned in its dtype: by ``tables = (cos, sin)``, or, with
    ``split``, its rows ``[:, :split]`` by ``tables[:2]`` and ``[:, split:]`` by ``tables[2:]``, into one tensor."""
    x32 = x if x.dtype == torch.float64 else x.float()
    out = torch.empty_like(x32)
    if split is None:
        _rotate_into(out, x32, *tables, inverse)
    else:
        _rotate_into(out[:, :split], x32[:, :split], *tables[:2], inverse)
        _rotate_into(out[:, split:], x32[:, split:], *tables[2:], inverse)
    return out.to(x.dtype)


class _Rope(torch.autograd.Function):
    """:func:`apply_rope` and :func:`apply_rope_split` with their backward written out: ``dx = g cos +
    rotate_half^T(g sin)``; four ops where autograd through the forward runs about ten, two of them zero-filled
    slice gradients the size of ``x`` (the step bench's q and k, forward and backward: a DFlash layer's 1.17-1.35
    ms instead of 1.35-1.58, an EAGLE3 unroll step's 1.15 instead of 1.35)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, split: int | None, *tables: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tables)
        ctx.split = split
        return _rotate(x, split, tables, inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tables = ctx.saved_tensors
        return _rotate(grad, ctx.split, tables, inverse=True), None, *(None for _ in tables)


def _rope(x: torch.Tensor, split: int | None, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        if any(table.requires_grad for table in tables):
            raise ValueError("apply_rope's cos and sin are position tables and take no gradient")
        return _Rope.apply(x, split, *tables)
    return _rotate(x, split, tables, inverse=False)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by per-position angles (rotate-half convention, as Llama and Qwen3), in
    float32 (float64 for a float64 ``x``), back in ``x``'s dtype. ``cos``/``sin`` broadcast
    against ``x`` (last dim head_dim); they take no gradient (tables of positions)."""
    return _rope(x, None, (cos, sin))


def apply_rope_split(x: torch.Tensor, split: int, first: tuple[torch.Tensor, torch.Tensor],
                     rest: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """:func:`apply_rope` of ``x [B, T, ...]`` whose rows ``[:, :split]`` take the tables ``first = (cos, sin)`` and
    rows ``[:, split:]`` the tables ``rest``: one result, as :func:`apply_rope` of the two joined tables gives, without
    making the joined tables (the DFlash family's keys: the context's tables one row the batch shares, the block's
    the queries' own)."""
    return _rope(x, split, (*first, *rest))


def compile_layers(layers: "list[nn.Module] | nn.ModuleList") -> None:
    """``torch.compile`` each of ``layers`` in place (``nn.Module.compile``, so parameter and state-dict names,
    and with them checkpoints and exports, stay the same), with dynamic shapes: sequence lengths and block
    counts change from batch to batch and must not recompile each time.

    Code a layer calls that should stay eager (attention over a pattern whose structure varies per batch)
    is wrapped in ``torch.compiler.disable`` by its plugin: the compiled graphs then cover the norms,
    projections, rotary embedding and MLP around it. The first steps pay for compiling. A ``compile``
    option checked with :func:`specforge_core.options.compilable` refuses a CPU without a C++ compiler
    before the run starts.
    """
    for layer in layers:
        layer.compile(dynamic=True)
