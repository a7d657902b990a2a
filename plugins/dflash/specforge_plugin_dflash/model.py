"""The DFlash draft network (docs/algorithms.md, "DFlash"), one class per concept.

    ctx    = hidden_norm(fc(target_hidden))                 [B, S, H]   fc: n*H -> H, no bias
    x      = embed_tokens(block_ids)                        [B, Q, H]   frozen target embedding
    for each layer (Qwen3-style, pre-norm):
        q  = q_norm(q_proj(norm(x)))                        queries from the draft tokens only
        k  = k_norm([k_proj(ctx) ; k_proj(norm(x))])         the target context is extra K/V
        v  =        [v_proj(ctx) ; v_proj(norm(x))]          in every layer
        x  = x + o_proj(attention(q, k, v, mask))           non-causal, masked per block
        x  = x + down(silu(gate(norm(x))) * up(norm(x)))
    hidden = norm(x)                                        [B, Q, H]
    logits = lm_head(hidden)                                frozen target lm_head, vocab V

RoPE puts context keys at their sequence positions and block tokens at ``anchor + k``.
Parameter names follow Qwen3 / SGLang's ``DFlashDraftModel`` (``layers.{i}.self_attn.q_proj``
...), so the SGLang export is the state dict minus the two frozen target parts.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specforge_core.nn import (Linear, RMSNorm, SwiGLU, apply_rope, apply_rope_split, cpu_flash_attention,
                               cpu_flash_attention_backward, in_float32, linear, merge_attention, rope_cos_sin)

from .blocks import GroupedBlockAttention
from .config import DFlashConfig

#: What :meth:`DFlashBackbone.run_layers` takes as the attention pattern: the dense ``[B, Q, S+Q]`` bool
#: mask, or the same pattern cut into groups of blocks (training).
BlockPattern = torch.Tensor | GroupedBlockAttention


# Both attention entry points stay eager under ``strategy.compile``: the grouped pattern's structure
# changes from batch to batch, and would recompile the layer each time.
@torch.compiler.disable
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, kernel: str) -> torch.Tensor:
    """Masked attention. q ``[B, h, Q, d]``, k/v ``[B, kv, K, d]``, mask ``[B, 1, Q, K]`` (True = attend).

    Every query row must see at least one key (the block mask always lets a block see itself).
    On CUDA, K/V heads are repeated for GQA up front: SDPA's ``enable_gqa`` would push it off
    the memory-efficient kernel (the only fused one taking an arbitrary mask) onto the math
    one. CPU's flash kernel takes GQA as it is, so there no repeated copies are made (or kept
    for backward).
    """
    groups = q.shape[1] // k.shape[1]
    if kernel == "sdpa" and q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, h, Q, K]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v


@torch.compiler.disable
def attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: GroupedBlockAttention,
                   kernel: str) -> torch.Tensor:
    """:func:`attend` over ``pattern``'s groups: each group's queries against its context prefix and its own
    blocks' keys only. q ``[B, h, Q, d]``, k/v ``[B, kv, S+Q, d]`` (context keys first) -> ``[B, h, Q, d]``."""
    if kernel == "sdpa" and q.device.type == "cpu":
        return _ContextPlusOwnBlock.apply(q, k, v, pattern)
    s = pattern.seq_len
    outputs = []
    for group in pattern.groups:
        keys = torch.cat([k[:, :, :group.context], k[:, :, s + group.start:s + group.end]], dim=2)
        values = torch.cat([v[:, :, :group.context], v[:, :, s + group.start:s + group.end]], dim=2)
        outputs.append(attend(q[:, :, group.start:group.end], keys, values, group.mask, kernel))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _blockwise(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, h, N*bs, ...]`` -> ``[B*N, h, bs, ...]``: each block its own batch row (a view of a tensor laid out
    as ``[B, N*bs, h, ...]``, as the layer's are; else a copy)."""
    b, h, q = x.shape[:3]
    n = q // block_size
    return x.reshape(b, h, n, block_size, *x.shape[3:]).transpose(1, 2).reshape(b * n, h, block_size, *x.shape[3:])


def _unblockwise(x: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of :func:`_blockwise`: ``[B*N, h, bs, ...]`` -> ``[B, h, N*bs, ...]``."""
    bn, h, bs = x.shape[:3]
    n = bn // batch
    return x.reshape(batch, n, h, bs, *x.shape[3:]).transpose(1, 2).reshape(batch, h, n * bs, *x.shape[3:])


def _kv_head_parts(q: torch.Tensor, k: torch.Tensor) -> list[tuple[slice, slice]] | None:
    """The ``(query heads, kv head)`` slices :class:`_ContextPlusOwnBlock`'s backward runs half-precision inputs in,
    one KV head and its query heads at a time, so that their float32 copies and gradients are made for one KV head
    at a time, not for all at once; ``None``: all heads at once (float32 and float64 inputs, which are not copied,
    or a single KV head)."""
    kv = k.shape[1]
    if q.dtype not in (torch.bfloat16, torch.float16) or kv == 1:
        return None
    group = q.shape[1] // kv
    return [(slice(j * group, (j + 1) * group), slice(j, j + 1)) for j in range(kv)]


def _float32_copy(x: torch.Tensor) -> torch.Tensor:
    """``x [B, h, S, d]`` (some of a layer's heads) in float32, laid out ``[B, S, h, d]`` as a layer's own
    tensors are, so that :func:`_blockwise` views it instead of copying it."""
    b, h, s, d = x.shape
    return torch.empty((b, s, h, d), dtype=torch.float32, device=x.device).transpose(1, 2).copy_(x)


def _context_biases(pattern: GroupedBlockAttention,
                    dtype: torch.dtype) -> Iterable[tuple[torch.Tensor, torch.Tensor] | None]:
    """The group biases :class:`_ContextPlusOwnBlock` runs inputs of ``dtype`` with. Half precision takes them
    made afresh at each call (:meth:`~GroupedBlockAttention.context_biases`): one group's alive at a time,
    1.45 MB less at the tiny bf16 DFlash step's peak, for about 1% of its time (each layer makes them again,
    forward and backward, and each KV head's backward). Float32 and float64 steps, whose memory has more room
    against the reference's, keep them for the batch (:attr:`~GroupedBlockAttention.context_bias`), made
    once and shared by every layer and pass."""
    if dtype in (torch.bfloat16, torch.float16):
        return pattern.context_biases()
    return pattern.context_bias


def _context_plus_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: GroupedBlockAttention,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`_ContextPlusOwnBlock`'s forward over inputs in float32 (or float64) that were ``dtype``:
    ``(out, lse)``."""
    s, bs, batch = pattern.seq_len, pattern.block_size, q.shape[0]
    own_q, own_k, own_v = _blockwise(q, bs), _blockwise(k[:, :, s:], bs), _blockwise(v[:, :, s:], bs)
    own_out, own_lse = cpu_flash_attention(own_q, own_k, own_v)
    out, lse = _unblockwise(own_out, batch).float(), _unblockwise(own_lse, batch)
    del own_q, own_k, own_v, own_out, own_lse  # block-major copies: not kept through the context calls
    for group, bias in zip(pattern.groups, _context_biases(pattern, dtype)):
        if bias is None:
            continue
        rows = slice(group.start, group.end)
        part_out, part_lse = cpu_flash_attention(q[:, :, rows], k[:, :, :group.context],
                                                 v[:, :, :group.context], bias=bias[0])
        part_lse = part_lse.masked_fill(bias[1], float("-inf"))  # the kernel says 0 for a row with no key
        out[:, :, rows], lse[:, :, rows] = merge_attention(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
    return out, lse


def _context_plus_own_grads(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, pattern: GroupedBlockAttention,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`_ContextPlusOwnBlock`'s backward over inputs in float32 (or float64) that were ``dtype``: the
    float32 gradients of q, k and v. Every tensor here keeps the layer's ``[B, S, h, d]`` layout (the kernel
    takes strided views), and so do the gradients: the layer's transposes and views then pass them on without
    a copy."""
    s, bs, batch = pattern.seq_len, pattern.block_size, q.shape[0]
    own = cpu_flash_attention_backward(_blockwise(grad_out, bs), _blockwise(q, bs), _blockwise(k[:, :, s:], bs),
                                       _blockwise(v[:, :, s:], bs), _blockwise(out, bs), _blockwise(lse, bs))
    grad_q = _unblockwise(own[0], batch)
    grad_k = torch.zeros_like(k, dtype=torch.float32)
    grad_v = torch.zeros_like(v, dtype=torch.float32)
    grad_k[:, :, s:], grad_v[:, :, s:] = _unblockwise(own[1], batch), _unblockwise(own[2], batch)
    del own  # the block-major gradients, copied out: not kept through the context calls
    for group, bias in zip(pattern.groups, _context_biases(pattern, dtype)):
        if bias is None:
            continue
        rows, keys = slice(group.start, group.end), slice(0, group.context)
        part = cpu_flash_attention_backward(grad_out[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                            out[:, :, rows], lse[:, :, rows], bias=bias[0])
        grad_q[:, :, rows].add_(part[0])
        grad_k[:, :, keys].add_(part[1])
        grad_v[:, :, keys].add_(part[2])
        del part  # not kept through the next group's call
    return grad_q, grad_k, grad_v


class _ContextPlusOwnBlock(torch.autograd.Function):
    """:func:`attend_grouped` on CPU without copying keys or attending other blocks' keys.

    Two kinds of flash-kernel calls, merged by their log-sum-exp:

    - every block's queries over its own block's keys, all blocks in one call (no mask);
    - each group's queries over its context prefix, a view of the keys (no copy), with the
      group's context mask as an additive bias (a row that sees no context key gets
      log-sum-exp -inf, so it adds nothing).

    Backward hands each call's flash backward the merged output and log-sum-exp: it then
    recomputes the merged softmax's probabilities over its keys, and its ``rowsum(dout *
    out)`` is the merged one, so the gradients are those of the attention over all keys.

    Half-precision inputs are computed in float32 and rounded once. For their memory (the tiny
    bf16 DFlash step of ``bench/versus_reference.py`` had 17.8 MB in use at its peak, 14.5 with
    all three, for about 4% of its time):

    - backward runs one KV head (and its query heads) at a time (:func:`_kv_head_parts`): heads
      never mix, so the gradients are those of all heads at once, bit for bit, while the float32
      copies and gradients alive at any moment are one KV head's (the forward, whose memory is
      below the loss's, runs all heads at once);
    - backward reads the output as returned, rounded, as a half-precision kernel's backward
      does: that tensor is kept anyway (the layer's ``o_proj`` keeps it), a float32 copy was
      twice its size more in every layer;
    - the groups' biases are made at each call (:func:`_context_biases`).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pattern: GroupedBlockAttention) -> torch.Tensor:
        out, lse = _context_plus_own(in_float32(q), in_float32(k), in_float32(v), pattern, q.dtype)
        result = out.to(q.dtype)
        # the output as returned (the layer's o_proj keeps that very tensor for its own backward) and lse in float32
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.pattern = pattern
        return result

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        parts = _kv_head_parts(q, k)
        if parts is None:
            grads = _context_plus_own_grads(in_float32(grad_out), in_float32(q), in_float32(k), in_float32(v),
                                            in_float32(out), lse, ctx.pattern, q.dtype)
            return *(grad.to(given.dtype) for grad, given in zip(grads, (q, k, v))), None
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # their layouts
        for heads, kv in parts:
            grad_q[:, heads], grad_k[:, kv], grad_v[:, kv] = _context_plus_own_grads(
                _float32_copy(grad_out[:, heads]), _float32_copy(q[:, heads]), _float32_copy(k[:, kv]),
                _float32_copy(v[:, kv]), _float32_copy(out[:, heads]), lse[:, heads], ctx.pattern, q.dtype)
        return grad_q, grad_k, grad_v, None


class DFlashAttention(nn.Module):
    """GQA attention whose keys/values are the context's followed by the block's own."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.q_proj = Linear(hidden, config.num_heads * d, bias=False)
        self.k_proj = Linear(hidden, config.num_kv_heads * d, bias=False)
        self.v_proj = Linear(hidden, config.num_kv_heads * d, bias=False)
        self.o_proj = Linear(config.num_heads * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)  # per head
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_ctx: tuple[torch.Tensor, torch.Tensor], mask: BlockPattern, kernel: str) -> torch.Tensor:
        """x ``[B, Q, H]`` (normed block tokens), ctx ``[B, S, H]``, mask ``[B, Q, S+Q]`` or grouped ->
        ``[B, Q, H]``. ``rope_q``: the rotary tables of the block positions ``[B, Q, 1, d]``, which the block's
        keys take too; ``rope_ctx``: the context positions' ``[1 or B, S, 1, d]``."""
        batch, queries, _ = x.shape
        seq, d = ctx.shape[1], self.head_dim
        # [k_proj(ctx) ; k_proj(x)] and the same for v as two matmuls joined: a matmul of the joined inputs would
        # keep that join for backward, in every layer a copy of the context the layers share, which is kept anyway.
        # The keys rotate in two parts: the context's by tables the batch shares, the block's by the queries' own.
        q = apply_rope(self.q_norm(self.q_proj(x).view(batch, queries, -1, d)), *rope_q)
        k = self.k_norm(torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1).view(batch, seq + queries, -1, d))
        k = apply_rope_split(k, seq, rope_ctx, rope_q)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1).view(batch, seq + queries, -1, d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if isinstance(mask, GroupedBlockAttention):
            out = attend_grouped(q, k, v, mask, kernel)
        else:
            out = attend(q, k, v, mask[:, None], kernel)
        return self.o_proj(out.transpose(1, 2).reshape(batch, queries, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual block: attention over [context ; block], then the MLP."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_ctx: tuple[torch.Tensor, torch.Tensor], mask: BlockPattern, kernel: str) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_ctx, mask, kernel)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashBackbone(nn.Module):
    """The DFlash draft: context projection, decoder layers, final norm, frozen target embedding and lm_head.

    ``embed_tokens`` and ``lm_head`` are the target's ``[V, H]`` weights, held as frozen
    parameters (``requires_grad=False``, kept in the target's dtype, never saved in
    checkpoints or exports). Trainable weights are created in ``dtype``.

    Plugins that extend DFlash (Domino) subclass this and add their heads as attributes, so
    the DFlash parameter names, and with them the SGLang export keys, stay the same:

    * :meth:`context` — ``target_hidden [B, S, n*H]`` -> ``ctx [B, S, H]``;
    * :meth:`embed` — token ids -> embeddings in the draft dtype;
    * :meth:`run_layers` — ``ctx`` and block embeddings -> final (normed) hidden states;
    * :meth:`forward` — the three above for token ids;
    * :meth:`logits` — hidden states -> float32 logits through the frozen lm_head.
    """

    def __init__(self, config: DFlashConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor, *,
                 attention: str = "sdpa", dtype: torch.dtype = torch.float32, init_std: float = 0.02) -> None:
        super().__init__()
        for name, part in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(part.shape) != (config.vocab_size, config.hidden_size):
                raise ValueError(f"frozen target part {name} has shape {tuple(part.shape)}; the draft expects "
                                 f"[vocab_size, hidden_size] = [{config.vocab_size}, {config.hidden_size}]")
        self.config = config
        self.attention = attention
        hidden = config.hidden_size
        self.fc = Linear(config.num_context_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=init_std)
        self.to(dtype)
        # Attached after the dtype cast: frozen parts keep the target's dtype and storage.
        self.embed_tokens = nn.Parameter(embed_tokens.detach(), requires_grad=False)  # [V, H]
        self.lm_head = nn.Parameter(lm_head.detach(), requires_grad=False)  # [V, H]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``ctx = hidden_norm(fc(target_hidden))``: ``[B, S, n*H]`` -> ``[B, S, H]``."""
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Frozen target embedding of ``token_ids [...]`` -> ``[..., H]`` in the draft dtype."""
        return F.embedding(token_ids, self.embed_tokens).to(self.dtype)

    def run_layers(self, ctx: torch.Tensor, x: torch.Tensor, block_positions: torch.Tensor,
                   attention_mask: BlockPattern, context_positions: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder stack and final norm.

        ctx ``[B, S, H]``; x ``[B, Q, H]`` block-token embeddings; block_positions ``[B, Q]``
        (``anchor + k``); attention_mask ``[B, Q, S+Q]`` bool (True = attend; see
        :func:`~specforge_plugin_dflash.blocks.block_attention_mask`) or the same pattern in
        groups (:func:`~specforge_plugin_dflash.blocks.grouped_block_attention`); context_positions
        ``[B, S]`` (default ``0..S-1``, one row of tables the batch shares). Returns ``[B, Q, H]``.
        """
        if context_positions is None:
            context_positions = torch.arange(ctx.shape[1], device=ctx.device)[None]
        d, theta = self.config.head_dim, self.config.rope_theta
        # [B, T, 1, d]: broadcast over heads; for the context's default positions one row, a view over the batch.
        # Every layer keeps them for backward: the shared context row kept 0.4 MB fewer than one per sample, and
        # the block keys' taking the queries' tables 0.26 MB fewer (the bench's tiny DFlash step).
        rope_q = [t[:, :, None] for t in rope_cos_sin(block_positions, d, theta)]
        rope_ctx = [t[:, :, None].expand(ctx.shape[0], -1, -1, -1) for t in rope_cos_sin(context_positions, d, theta)]
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_ctx, attention_mask, self.attention)
        return self.norm(x)

    def forward(self, target_hidden: torch.Tensor, block_ids: torch.Tensor, block_positions: torch.Tensor,
                attention_mask: BlockPattern) -> torch.Tensor:
        """Final hidden states ``[B, Q, H]`` of ``block_ids [B, Q]`` given ``target_hidden [B, S, n*H]``."""
        return self.run_layers(self.context(target_hidden), self.embed(block_ids), block_positions, attention_mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Frozen target lm_head: ``[..., H]`` -> ``[..., V]``, in float32 (float64 for a float64 head)."""
        logits = linear(hidden.to(self.lm_head.dtype), self.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()
