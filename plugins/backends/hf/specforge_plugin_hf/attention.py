"""A batch-invariant attention for CPU float32: padded and unpadded forwards agree bit for bit.

Why it exists: capture runs samples through the target in right-padded batches, and the
features of a sample should not depend on which other samples share its batch (so a
resumed or re-batched run captures identical features, and tests can compare exactly).
transformers' ``eager`` attention almost gives that on CPU, but not quite:

* its softmax takes a scalar path for rows shorter than one SIMD vector (16 floats with
  AVX-512), so a 9-token sample alone and the same sample padded to 40 tokens round
  differently;
* ``attn @ V`` reduces over the key length, and MKL blocks that reduction by the key
  length, so beyond roughly 200 keys a longer padded row sums in a different order;
* ``sdpa`` on CPU (a flash kernel with key blocks and online softmax) differs for any length.

This implementation is eager attention with the two shape-dependent reductions pinned:
scores are padded with masked entries to a multiple of :data:`KEY_BLOCK` keys before the
softmax, and ``attn @ V`` is summed block by block over fixed :data:`KEY_BLOCK`-key
blocks, in order. Padding only ever adds exact zeros at the end of each reduction, which
leaves every sum unchanged.

What it cannot fix: MKL's matrix multiply uses small-matrix kernels for very few rows
(<= 5 rows at the toy targets' widths, more for wide models or several threads), so a
sample of a handful of tokens run *alone* can still differ in the last bit from the same
sample inside a batch. The conversations a chat template produces are longer than that.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: Name under which the attention (and its mask) is registered with transformers.
BATCH_INVARIANT = "specforge_batch_invariant"

#: Keys per reduction block: a multiple of the widest SIMD vector, and small enough that
#: MKL never splits the reduction over one block.
KEY_BLOCK = 64


def batch_invariant_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                              **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with block-pinned reductions. Shapes: query [B, h, q, d], key/value [B, kv_h, k, d]."""
    for unsupported in ("softcap", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(
                f"attention '{BATCH_INVARIANT}' does not implement {unsupported!r}, which this model uses; "
                "set the engine option attn_implementation to 'eager'"
            )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: share each kv head among `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    k_len = key.shape[-2]
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, h, q, k]
    if attention_mask is not None:
        scores = scores + attention_mask[..., :k_len]
    pad = (-k_len) % KEY_BLOCK
    if pad:
        scores = F.pad(scores, (0, pad), value=torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = None
    for start in range(0, k_len, KEY_BLOCK):
        block = value[:, :, start:start + KEY_BLOCK]
        if block.shape[-2] < KEY_BLOCK:
            block = F.pad(block, (0, 0, 0, KEY_BLOCK - block.shape[-2]))
        part = torch.matmul(probs[..., start:start + KEY_BLOCK], block)  # [B, h, q, d]
        out = part if out is None else out.add_(part)
    return out.transpose(1, 2).contiguous(), probs[..., :k_len]


def register_batch_invariant_attention() -> str:
    """Register the attention and its (eager, additive) mask with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(BATCH_INVARIANT, batch_invariant_attention)
    AttentionMaskInterface.register(BATCH_INVARIANT, eager_mask)
    return BATCH_INVARIANT
