"""The EAGLE3 draft model — read it against docs/algorithms.md § EAGLE3.

Notation: B batch, S sequence, H target hidden, h draft hidden (= H here), V target vocab,
Vd draft vocab, nh / nkv attention / key-value heads, d head dim.

    h_0      = fc(aux)                                   aux = [low; mid; high] target layers, 3H
    h_{k+1}  = layer(embed(ids_k), h_k)                  one Llama decoder layer, attention
                                                         input [norm(embed) ; norm(hidden)] (2h)
    logits_k = lm_head(norm(h_{k+1}))                    Vd draft tokens; d2t maps them to V

ids_k is ids shifted left k places, so the token half of q/k/v, ``norm(embed(ids_k)) W_e``, is
step 0's at position t + k: a training unroll computes it once for every step (and stacks the
q, k and v weights into one GEMM), which is the same arithmetic as the concatenated input.

Module and buffer names are SGLang's ``LlamaForCausalLMEagle3`` names (``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so ``state_dict()`` *is* the
export. The frozen target parts (``embed_tokens``, ``target_lm_head``) are non-persistent
buffers: never trained, never in ``state_dict()`` (so neither in checkpoints nor in the
export), and — unlike parameters — never sharded by FSDP2, so the teacher can read
``target_lm_head`` outside ``forward``.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specforge_core.dtypes import torch_dtype
from specforge_core.nn import (Linear, RMSNorm, SwiGLU, apply_rope, argmax_last, cpu_causal_attention,
                               cpu_causal_attention_backward, in_float32, linear, rope_cos_sin)

from .head_loss import DraftHead


@attrs.frozen(kw_only=True)
class Eagle3Config:
    """The draft's shape. Written to (and read from) the exported ``config.json``."""

    hidden_size: int  # h
    target_hidden_size: int  # H: fc takes 3H
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # V, the target's
    draft_vocab_size: int  # Vd
    aux_layer_ids: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str = "float32"  # of the trainable weights

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..vocab_size ({self.vocab_size}), "
                             f"got {self.draft_vocab_size}")


def shift_left(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]``, zero-filled past the end (dim 1 is the sequence)."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x [B, T, n]`` at ``rows [B, R]`` -> ``[B, R, n]``, ``out[b, r] = x[b, rows[b, r]]``: ``gather`` along dim 1,
    as an ``index_select`` of whole rows of the flattened ``x`` (a row copy each, and in backward a row add,
    where ``gather`` over the expanded index goes element by element): forward and backward of 920 rows of
    a ``[2, 518, 512]`` float32 tensor, 0.43 ms instead of 1.78."""
    offsets = torch.arange(0, rows.shape[0] * x.shape[1], x.shape[1], device=rows.device)[:, None]
    return x.flatten(0, 1).index_select(0, (rows + offsets).flatten()).view(*rows.shape, x.shape[-1])


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, nkv, T, d] -> [B, nkv * groups, T, d]: query head i uses key-value head i // groups."""
    if groups == 1:
        return x
    b, nkv, t, d = x.shape
    return x[:, :, None].expand(b, nkv, groups, t, d).reshape(b, nkv * groups, t, d)


class _StackedHalves(torch.autograd.Function):
    """``(W_e, W_h)`` of :meth:`Eagle3Attention.qkv_weights` from the q, k and v weights ``[n_i, 2h]``: the
    stacked weights' first and second h columns, contiguous. Backward hands each weight its rows of the two
    halves' gradients side by side, instead of the zero-filled full-size gradient per slice that slicing
    the weights under autograd makes."""

    @staticmethod
    def forward(ctx, *weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = weights[0].shape[1] // 2
        ctx.rows = [w.shape[0] for w in weights]
        return torch.cat([w[:, :h] for w in weights]), torch.cat([w[:, h:] for w in weights])

    @staticmethod
    def backward(ctx, grad_e: torch.Tensor, grad_h: torch.Tensor):  # an unused half's gradient comes as zeros
        return tuple(torch.cat([e, h], dim=1) for e, h in zip(grad_e.split(ctx.rows), grad_h.split(ctx.rows)))


class DraftKV:
    """The keys/values the draft attends to.

    ``k0, v0 [B, nkv, T, d]``: the step-0 keys, one per position (causally visible).
    ``diag``: the keys of unroll steps 1..k, each ``[B, nkv, S, d]``; a query sees only the
    entry at its own position. In training both start empty every batch; in speculative
    decoding ``k0`` grows with every accepted token and ``diag`` is emptied after each chain.
    ``tokens`` and ``weight_h``: in a training unroll, the token half of q/k/v for every position any step
    reads and the stacked hidden-half weight, both made at step 0 (:meth:`Eagle3DecoderLayer.forward`).
    """

    def __init__(self) -> None:
        self.k0: torch.Tensor | None = None
        self.v0: torch.Tensor | None = None
        self.diag: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.tokens: torch.Tensor | None = None
        self.weight_h: torch.Tensor | None = None
        self._float32: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        return 0 if self.k0 is None else self.k0.shape[2]

    def add_step0(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k0 = k if self.k0 is None else torch.cat([self.k0, k], dim=2)
        self.v0 = v if self.v0 is None else torch.cat([self.v0, v], dim=2)

    def float32(self) -> Float32Keys:
        """The keys and values as float32 copies without gradient, each made once while this cache holds its
        tensor, unchanged: the CPU causal path (:class:`_CausalPlusDiagonal`) computes in float32, and every
        unroll step reads the step-0 keys and each earlier step's, in forward and again in backward (converted
        at each reading, a 7-step bf16 unroll made 112 conversions; now 14)."""
        held = [self.k0, self.v0, *(t for pair in self.diag for t in pair)]
        copies = {}
        for t in held:
            known = self._float32.get(id(t))
            copies[id(t)] = known if known is not None and known[0] is t and known[1] == t._version \
                else (t, t._version, in_float32(t.detach()))
        self._float32 = copies  # copies of tensors this cache no longer holds go
        k0, v0, *diag = (copies[id(t)][2] for t in held)
        return Float32Keys(k0, v0, tuple(zip(diag[0::2], diag[1::2])))


@attrs.frozen
class Float32Keys:
    """:meth:`DraftKV.float32`: float32 copies of ``k0``, ``v0`` and the diagonal pairs, without gradient."""

    k0: torch.Tensor
    v0: torch.Tensor
    diag: tuple[tuple[torch.Tensor, torch.Tensor], ...]


#: ``mask0`` for right-padded training batches: step-0 keys visible causally (see :func:`ttt_attention`).
CAUSAL = "causal"


class _CausalPlusDiagonal(torch.autograd.Function):
    """:func:`ttt_attention` with causal step-0 keys, on CPU: the flash kernel over ``k0`` a chunk of queries
    at a time (:func:`~specforge_core.nn.cpu_causal_attention`: the masked half is skipped, no S x S
    scores are kept), the diagonal keys as row-wise dot products, merged by their log-sum-exp, all in
    float32 (half-precision inputs are upcast and the output rounded once)::

        L   = log(exp(lse_0) + sum_j exp(s_j))           s_j = scale * q . k_j (query t, key j at t)
        out = exp(lse_0 - L) o_0 + sum_j exp(s_j - L) v_j

    Backward hands the flash kernel's backward the merged ``out`` and ``L``: it recomputes the
    step-0 probabilities as ``exp(scale q.k - L)``, which are the merged softmax's, and its
    ``rowsum(dout * out)`` is the merged one, so its gradients are those of the whole attention;
    the diagonal terms' gradients are written out here.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, scale: float,
                query_start: tuple[int, ...], float32: tuple[torch.Tensor, ...] | None,
                *diag: torch.Tensor) -> torch.Tensor:
        # float32: k0, v0 and the diagonal keys and values (in diag's order) as float32 copies made once for
        # every unroll step (DraftKV.float32), else each is converted here and again in backward
        float32 = (k0, v0, *diag) if float32 is None else float32
        k0_32, v0_32, *diag32 = (in_float32(t) for t in float32)
        groups = q.shape[1] // k0.shape[1]
        q32 = in_float32(q)
        out0, lse0 = _per_sample(cpu_causal_attention, query_start, q32, k0_32, v0_32, scale=scale)
        q32, keys, values = _grouped(q32, groups), diag32[0::2], diag32[1::2]
        scores = [_diagonal_scores(q32, k[:, :, None], scale) for k in keys]  # [B, nh, S] each
        lse = torch.logsumexp(torch.stack([lse0, *scores]), 0) if scores else lse0
        out = out0 * (lse0 - lse).exp_()[..., None]
        for s_j, v in zip(scores, values):
            _grouped(out, groups).addcmul_(_grouped((s_j - lse).exp_()[..., None], groups), v[:, :, None])
        ctx.save_for_backward(q, k0, v0, out, lse, *diag)  # out in float32, as the kernels' backward reads it
        ctx.float32 = (k0_32, v0_32, *diag32)  # what backward computes with (the saved inputs: autograd's guard)
        ctx.scale, ctx.groups, ctx.query_start = scale, groups, query_start
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q_in, k0_in, v0_in, out, lse, *diag_in = ctx.saved_tensors
        k0, v0, *diag = ctx.float32
        q, scale, groups = in_float32(q_in), ctx.scale, ctx.groups
        grad_out = in_float32(grad_out).contiguous()
        grad_q, grad_k0, grad_v0 = _per_sample(cpu_causal_attention_backward, ctx.query_start, grad_out, q, k0, v0,
                                               out, lse, scale=scale)
        grads: list[torch.Tensor] = []
        if diag:
            total = torch.linalg.vecdot(grad_out, out)  # rowsum(dout * out), the softmax backward's shift
            q_g, dout_g = _grouped(q, groups), _grouped(grad_out, groups)
            grad_q_g = _grouped(grad_q, groups)  # the kernel's fresh float32 gradient, accumulated in place
            for k, v in zip(diag[0::2], diag[1::2]):
                k32, v32 = k[:, :, None], v[:, :, None]
                p_j = (_diagonal_scores(q_g, k32, scale) - lse).exp_()  # [B, nh, S]
                d_score = p_j * (torch.linalg.vecdot(dout_g, v32).flatten(1, 2) - total) * scale
                d_score_g = _grouped(d_score[..., None], groups)
                grad_q_g.addcmul_(d_score_g, k32)
                grads += [(d_score_g * q_g).sum(2),  # summed over the heads that share k and v
                          (_grouped(p_j[..., None], groups) * dout_g).sum(2)]
            grads = [grad.to(t.dtype) for grad, t in zip(grads, diag_in)]
        return (grad_q.to(q_in.dtype), grad_k0.to(k0_in.dtype), grad_v0.to(v0_in.dtype), None, None, None, *grads)


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, nkv * groups, ...]`` viewed as ``[B, nkv, groups, ...]``: the query heads that share a key-value head,
    so a ``[B, nkv, 1, ...]`` key or value broadcasts against them instead of being repeated (:func:`repeat_kv`)."""
    return x.unflatten(1, (x.shape[1] // groups, groups))


def _diagonal_scores(q_g: torch.Tensor, k_g: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q . k`` per query and head for one diagonal key per position: ``q_g [B, nkv, groups, S, d]``
    (:func:`_grouped`, float32), ``k_g [B, nkv, 1, S, d]`` (a float32 key, broadcast against the query heads that
    share it) -> ``[B, nkv * groups, S]``, one reduction, no copies."""
    return torch.linalg.vecdot(q_g, k_g).flatten(1, 2).mul_(scale)


def _cut(diag, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Diagonal pairs cut to their first ``length`` positions (those of the queries; see :func:`ttt_attention`)."""
    return [(k[:, :, :length], v[:, :, :length]) if k.shape[2] != length else (k, v) for k, v in diag]


def _per_sample(kernel, query_start: tuple[int, ...], *tensors: torch.Tensor, **kwargs) -> tuple[torch.Tensor, ...]:
    """``kernel(*tensors, query_start=..)`` with sample b's queries from position ``query_start[b]``: one call
    when every sample's start is the same, else one per sample (dim 0), concatenated."""
    if len(set(query_start)) == 1:
        return kernel(*tensors, query_start=query_start[0], **kwargs)
    parts = [kernel(*(t[b:b + 1] for t in tensors), query_start=start, **kwargs) for b, start in enumerate(query_start)]
    return tuple(torch.cat(outputs) for outputs in zip(*parts))


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, mask0: torch.Tensor | str | None,
                  diag: list[tuple[torch.Tensor, torch.Tensor]], query_start: int | Sequence[int] = 0,
                  float32: Float32Keys | None = None) -> torch.Tensor:
    """Attention over step-0 keys (masked by ``mask0``) plus one diagonal key per extra step.

    q [B, nh, S, d]; k0, v0 [B, nkv, T, d]; mask0 [B|1, 1, S, T]: bool (True = visible), a
    float32 additive bias (0 = visible; :func:`additive_mask`, built once per batch and added
    in place, one pass over the scores instead of a masked copy per unroll step), or None
    (all visible); diag: (k, v) pairs [B, nkv, S, d] — query t sees entry t only, so
    its score is a row-wise dot product instead of an S x S block that would be all masked
    but its diagonal. Equivalent to dense attention over ``[k0; k1; ...; kk]`` with the mask
    of :func:`ttt_key_mask`. Returns [B, nh, S, d].

    ``mask0`` :data:`CAUSAL` (training on right-padded rows on CPU, T = S): query t sees step-0
    keys s <= t, which is the bool mask's pattern wherever it matters (a padded key is after
    every real query); it runs as :class:`_CausalPlusDiagonal`.

    ``query_start`` (one for the batch, or one per sample): sample b's queries are positions
    ``query_start[b] .. query_start[b] + S - 1`` of its step-0 keys (a window of a training
    unroll's later steps, :meth:`Eagle3Draft.unroll`); ``mask0`` still covers every position
    (its rows are taken from there on), and each diagonal pair covers the queries' positions
    (longer ones, from an earlier step of the same windows, are cut to S). ``float32``: float32 copies of
    ``k0``, ``v0`` and ``diag`` (:meth:`DraftKV.float32`), which the causal path then reads instead of
    converting them.
    """
    length = q.shape[2]
    starts = (query_start,) * q.shape[0] if isinstance(query_start, int) else tuple(query_start)
    diag = _cut(diag, length)
    if isinstance(mask0, str):
        if q.device.type != "cpu":
            raise ValueError(f"mask0={mask0!r} runs on CPU's flash kernel; on {q.device.type} pass the additive "
                             "mask (additive_mask), built once per batch")
        copies = None if float32 is None else (float32.k0, float32.v0,
                                               *(t for pair in _cut(float32.diag, length) for t in pair))
        return _CausalPlusDiagonal.apply(q, k0, v0, q.shape[-1] ** -0.5, starts, copies,
                                         *(t for pair in diag for t in pair))
    if mask0 is not None and mask0.shape[-2] != length:
        if len(set(starts)) == 1:
            mask0 = mask0[..., starts[0]:starts[0] + length, :]
        else:  # each sample's rows from its own start
            rows = torch.tensor(starts, device=mask0.device)[:, None] + torch.arange(length, device=mask0.device)
            mask0 = mask0.expand(len(starts), *mask0.shape[1:]).gather(
                2, rows[:, None, :, None].expand(-1, mask0.shape[1], -1, mask0.shape[-1]))
    groups = q.shape[1] // k0.shape[1]
    q = q * q.shape[-1] ** -0.5  # scale the queries, not the S x T scores
    scores = torch.matmul(q, repeat_kv(k0, groups).transpose(2, 3)).float()  # [B, nh, S, T]
    if mask0 is not None and mask0.dtype == torch.bool:
        scores = scores.masked_fill(~mask0, torch.finfo(scores.dtype).min)
    elif mask0 is not None:
        scores += mask0  # the matmul's own output (autograd keeps its inputs, not it)
    extra = [(q * repeat_kv(k, groups)).sum(-1, keepdim=True).float() for k, _ in diag]  # [B, nh, S, 1]
    probs = torch.softmax(torch.cat([scores, *extra], dim=-1), dim=-1).to(q.dtype)
    t = k0.shape[2]
    out = torch.matmul(probs[..., :t], repeat_kv(v0, groups))
    for j, (_, v) in enumerate(diag):
        out = out + probs[..., t + j, None] * repeat_kv(v, groups)
    return out


@attrs.frozen
class UnrollWindows:
    """The positions a training unroll computes (:meth:`Eagle3Draft.unroll`): step 0 every position, step
    k >= 1 the ``widths[k]`` positions from ``starts[b]`` on in sample b (``widths[0]`` is the sequence
    length). Built by :func:`~specforge_plugin_eagle3.loss.unroll_windows`."""

    starts: tuple[int, ...] = attrs.field(converter=tuple)
    widths: tuple[int, ...] = attrs.field(converter=tuple)

    def check(self, batch: int, length: int, ttt_length: int) -> None:
        """Raise ValueError unless these windows fit a ``[batch, length]`` batch unrolled ``ttt_length`` steps."""
        problem = None
        if len(self.widths) != ttt_length:
            problem = f"{len(self.widths)} widths for {ttt_length} unroll steps"
        elif len(self.starts) != batch:
            problem = f"{len(self.starts)} starts for {batch} samples"
        elif self.widths[0] != length:
            problem = f"step 0 must be whole: width {length}, not {self.widths[0]}"
        elif any(not 0 < later <= earlier for earlier, later in zip(self.widths, self.widths[1:])):
            problem = "widths must not grow from one step to the next, nor reach 0"
        elif ttt_length > 1 and any(not 0 <= start <= length - self.widths[1] for start in self.starts):
            problem = f"every start must leave step 1's {self.widths[1]} positions inside the sequence"
        if problem:
            raise ValueError(f"unroll windows (starts {list(self.starts)}, widths {list(self.widths)}) for "
                             f"{batch} samples of {length}: {problem}")


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of ``attention_mask [B, S]`` is its real tokens followed by padding only."""
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all()) if mask.shape[1] > 1 else True


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """A bool mask (True = visible) as the float32 bias :func:`ttt_attention` adds to its scores: 0 where
    visible, the float32 minimum elsewhere (a visible score plus it is -inf or below every visible one)."""
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    return bias.masked_fill_(~visible, torch.finfo(torch.float32).min)


def ttt_key_mask(attention_mask: torch.Tensor, step: int) -> torch.Tensor:
    """The dense form of the step-``step`` attention pattern, for reading and testing.

    attention_mask [B, S] (1 = real token) -> [B, S, (step + 1) * S] bool, where key column
    ``j * S + s`` is the key produced at unroll step j for position s. Query t sees the
    step-0 keys s <= t of real tokens, and for each step j in 1..step the key at s == t.
    """
    b, s = attention_mask.shape
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    blocks = [causal[None] & attention_mask.bool()[:, None, :]]
    eye = torch.eye(s, dtype=torch.bool, device=attention_mask.device).expand(b, s, s)
    blocks.extend([eye] * step)
    return torch.cat(blocks, dim=-1)


@torch.compiler.disable
def attend_with_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: DraftKV, mask0: torch.Tensor | str | None,
                      step0: bool, query_start: int | Sequence[int] = 0) -> torch.Tensor:
    """Add this step's keys to ``kv`` (step 0: ``kv.k0``; later steps: ``kv.diag``) and attend over them
    (queries from position ``query_start`` on: see :func:`ttt_attention`).

    Stays eager under ``strategy.compile``: the cache is a Python object that grows every unroll
    step, which a compiled layer would guard on and recompile for.
    """
    if step0:
        kv.add_step0(k, v)
    else:
        kv.diag.append((k, v))
    # the CPU causal path computes in float32: half-precision keys are converted once for every step that reads them
    float32 = kv.float32() if isinstance(mask0, str) and q.dtype in (torch.bfloat16, torch.float16) else None
    return ttt_attention(q, kv.k0, kv.v0, mask0, kv.diag, query_start, float32)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2h-wide ``[norm(embed) ; norm(hidden)]``."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = Linear(self.num_heads * d, h, bias=False)

    def qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_e, W_h)``: ``[q_proj ; k_proj ; v_proj]`` stacked (``[(nh + 2 nkv) d, 2h]``, one GEMM for the three)
        and split into the columns that read the token half and the hidden half of the input, each contiguous
        (copies, made in the caller's forward, while FSDP2 has the weights gathered)."""
        return _StackedHalves.apply(self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: DraftKV,
                mask0: torch.Tensor | str | None, step0: bool, query_start: int | Sequence[int] = 0) -> torch.Tensor:
        """qkv [B, S, (nh + 2 nkv) d] (the input through :meth:`qkv_weights`) -> [B, S, h]. Step 0 appends its
        keys to ``kv.k0``; later steps to ``kv.diag``; ``query_start``: the first position (per sample: a
        later step's window)."""
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, S, d]
        k = k.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, S, d]
        v = v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend_with_cache(q, k, v, kv, mask0, step0, query_start)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class Eagle3DecoderLayer(nn.Module):
    """The one decoder layer: attention over [norm(embed) ; norm(hidden)], residual on the hidden."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)  # normalises the token embedding
        self.hidden_norm = RMSNorm(h, eps)  # normalises the incoming hidden state
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, emb: torch.Tensor | None, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: DraftKV, mask0: torch.Tensor | str | None, step0: bool, query_start: int | Sequence[int] = 0,
                emb_rows: int | torch.Tensor | None = None) -> torch.Tensor:
        """emb, hidden [B, S, h] -> the next hidden [B, S, h] (before the final norm).

        q/k/v read ``[norm(emb) ; norm(hidden)]``. In an unroll (``emb_rows`` given) they are the sum of the
        two halves' GEMMs, the token half ``norm(emb) W_e`` and the hidden half ``norm(hidden) W_h`` (q, k and
        v stacked): the token at position t of step k is the token at t + k of step 0, so the token half is
        computed once. ``emb`` at step 0 then holds the embeddings of every position the unroll reads (``[B,
        S + K - 1, h]``), whose token halves go to ``kv.tokens`` with W_h to ``kv.weight_h``; later steps pass
        ``emb`` None and read theirs from there. ``emb_rows`` says which rows are this step's: an int r
        (positions r .. r + S - 1) or ``[B, S]`` positions (a window). Without it (a drafting step) the three
        projections run on the concatenation as they are, no weights copied.
        """
        if emb_rows is None:  # one step (drafting): the three projections of the concatenation, no weights stacked
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, S, 2h]
            attn = self.self_attn
            qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        else:
            if emb is None:  # a later unroll step: the token half and W_h are step 0's
                tokens, weight_h = kv.tokens, kv.weight_h
            else:
                weight_e, weight_h = self.self_attn.qkv_weights()
                tokens = kv.tokens = linear(self.input_layernorm(emb), weight_e)
                kv.weight_h = weight_h
            if isinstance(emb_rows, int):
                tokens = tokens[:, emb_rows:emb_rows + hidden.shape[1]]
            else:
                tokens = take_rows(tokens, emb_rows)
            qkv = linear(self.hidden_norm(hidden), weight_h) + tokens
        hidden = hidden + self.self_attn(qkv, cos, sin, kv, mask0, step0, query_start)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    """The EAGLE3 draft: frozen target embedding, fc, one decoder layer, final norm, own lm_head.

    ``embed_tokens [V, H]`` and ``target_lm_head [V, H]`` (the teacher; optional when only
    drafting) are the target's tensors, kept as non-persistent buffers without a copy.
    ``d2t [Vd]`` (draft id -> target id offset) and ``t2d [V]`` (target id is in the draft
    vocabulary) are persistent buffers: checkpoints and the export carry them.
    """

    def __init__(self, config: Eagle3Config, embed_tokens: torch.Tensor,
                 target_lm_head: torch.Tensor | None = None) -> None:
        super().__init__()
        v, big_h = config.vocab_size, config.target_hidden_size
        if tuple(embed_tokens.shape) != (v, config.hidden_size):
            raise ValueError(f"embed_tokens has shape {tuple(embed_tokens.shape)}, expected "
                             f"[vocab_size, hidden_size] = [{v}, {config.hidden_size}]")
        if target_lm_head is not None and tuple(target_lm_head.shape) != (v, big_h):
            raise ValueError(f"target lm_head has shape {tuple(target_lm_head.shape)}, expected [{v}, {big_h}]")
        self.config = config
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
        self.register_buffer("target_lm_head", None if target_lm_head is None else target_lm_head.detach(),
                             persistent=False)
        self.fc = Linear(3 * big_h, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = DraftHead(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(v, dtype=torch.bool) if config.draft_vocab_size == v
                             else torch.zeros(v, dtype=torch.bool))
        for module in self.modules():  # Llama's initialisation
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        dtype = torch_dtype(config.dtype)
        for module in (self.fc, self.midlayer, self.norm, self.lm_head):
            module.to(dtype)

    # ------------------------------------------------------------------ pieces
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [S] -> cos, sin [S, head_dim] (float32) on the draft's device."""
        return rope_cos_sin(positions.to(self.fc.weight.device), self.config.head_dim, self.config.rope_theta)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (see :func:`specforge_plugin_eagle3.vocab.build_vocab_mapping`)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not fit "
                             f"the draft (d2t {tuple(self.d2t.shape)}, t2d {tuple(self.t2d.shape)})")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft token ids -> target token ids."""
        return draft_ids + self.d2t[draft_ids]

    def draft_to_target_index(self) -> torch.Tensor:
        """[Vd]: the target id of each draft id (``used`` in docs/algorithms.md)."""
        return self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids [...] -> frozen target embeddings [..., h] in the draft's dtype."""
        return F.embedding(ids, self.embed_tokens).to(self.fc.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden [..., h] (before the final norm) -> draft logits [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------------ training
    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, attention_mask: torch.Tensor,
                ttt_length: int) -> list[torch.Tensor]:
        """The test-time-training unroll's logits: ``ttt_length`` tensors [B, S, Vd];
        ``logits[k][:, t]`` predicts token t+2+k (the target's distribution at t+1+k). See :meth:`unroll`."""
        return [self.logits(hidden) for hidden in self.unroll(input_ids, aux_hidden, attention_mask, ttt_length)]

    def unroll(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, attention_mask: torch.Tensor,
               ttt_length: int, windows: UnrollWindows | None = None) -> list[torch.Tensor]:
        """The test-time-training unroll: ``h_1 .. h_K`` [B, S, h], before the final norm.

        input_ids [B, S]: *aligned* ids (token t+1 at position t); aux_hidden [B, S, 3H];
        attention_mask [B, S] (1 = real token). ``lm_head(norm(h_{k+1}))`` at position t predicts
        token t+2+k; the loss applies the head to the rows it supervises only (:mod:`.head_loss`).

        ``windows`` (:class:`UnrollWindows`, from :func:`~specforge_plugin_eagle3.loss.unroll_windows`):
        step k >= 1 computes, in sample b, the ``widths[k]`` positions from ``starts[b]`` on and
        returns ``[B, widths[k], h]``. A position's later steps depend only on its own earlier
        steps and on the step-0 keys (all computed), so a window's rows are those of the whole
        unroll, and rows outside it (a prompt before the first supervised position, the tail
        past the last) cost nothing.
        """
        b, s = input_ids.shape
        if windows is not None:
            windows.check(b, s, ttt_length)
        mask0: torch.Tensor | str = CAUSAL  # CPU: the causal flash kernel; elsewhere a bias built once per batch
        if input_ids.device.type != "cpu" or not right_padded(attention_mask):
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            mask0 = additive_mask((causal[None] & attention_mask.bool()[:, None, :])[:, None])  # [B, 1, S, S], once
        positions = torch.arange(s, device=input_ids.device)
        hidden = self.fc(aux_hidden.to(self.fc.weight.dtype))  # h_0 [B, S, h]
        kv = DraftKV()
        # step k at position t consumes token t+1+k (ids zero-filled past the end, as shift_left): the
        # embeddings of every token the unroll reads, whose token halves of q/k/v step 0 computes for all steps
        embedded = self.embed(torch.cat([input_ids, input_ids.new_zeros(b, ttt_length - 1)], dim=1))
        out, rows = [], positions
        for k in range(ttt_length):
            query_start, emb_rows = 0, k
            if k and windows is not None:  # sample b's positions starts[b] .. starts[b] + width - 1
                if k == 1:
                    starts = torch.tensor(windows.starts, device=input_ids.device)
                    rows = starts[:, None] + positions[:windows.widths[1]]
                    hidden = take_rows(hidden, rows)
                rows = rows[:, :windows.widths[k]]
                hidden, query_start, emb_rows = hidden[:, :rows.shape[1]], windows.starts, rows + k
            cos, sin = self.rope(rows + k)  # RoPE positions +k at step k
            if rows.dim() == 2:  # [B, W, d] -> [B, 1, W, d]: per sample, the same for every head
                cos, sin = cos[:, None], sin[:, None]
            hidden = self.midlayer(embedded if k == 0 else None, hidden, cos, sin, kv, mask0, step0=k == 0,
                                   query_start=query_start, emb_rows=emb_rows)  # h_{k+1}
            out.append(hidden)
        return out

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def draft(self, kv: DraftKV, aux_hidden: torch.Tensor, next_ids: Any, depth: int) -> list[int]:
        """Extend the step-0 context by m positions, then propose ``depth`` target tokens.

        aux_hidden [m, 3H]: target features of m newly accepted tokens at positions
        ``kv.length ..``; next_ids [m]: the token after each of them (the last one is the
        target's bonus token). The chain starts at the last new position and runs exactly as
        the training unroll does at that position: step k feeds the previous step's hidden
        state and token, at RoPE position +k, attending to every step-0 key and the chain's
        own keys. Returns the proposed tokens as target ids.
        """
        device = self.fc.weight.device
        ids = torch.as_tensor(next_ids, dtype=torch.long, device=device)[None]  # [1, m]
        m, start = ids.shape[1], kv.length
        positions = torch.arange(start, start + m, device=device)
        mask0 = (torch.arange(start + m, device=device)[None, :] <= positions[:, None])[None, None]  # [1,1,m,T+m]
        cos, sin = self.rope(positions)
        hidden = self.fc(aux_hidden.to(device, self.fc.weight.dtype)[None])  # h_0 [1, m, h]
        hidden = self.midlayer(self.embed(ids), hidden, cos, sin, kv, mask0, step0=True)[:, -1:]  # h_1 [1, 1, h]
        last = start + m - 1
        tokens: list[int] = []
        for k in range(1, depth + 1):
            token = self.to_target_ids(argmax_last(self.logits(hidden)))  # [1, 1]
            tokens.append(int(token))
            if k < depth:
                cos, sin = self.rope(torch.tensor([last + k], device=device))
                hidden = self.midlayer(self.embed(token), hidden, cos, sin, kv, None, step0=False)
        kv.diag.clear()  # the chain's keys are speculative; the next round starts from step-0 keys
        return tokens
