"""Each strategy's train step against a plain textbook reference of the same step, at equal shapes.

The reference is the algorithm as docs/algorithms.md writes it, with the same weights and
batch: dense boolean masks (EAGLE3: an S x S causal mask filled into the scores at every
unroll step, plus the diagonal keys; the DFlash family: one ``[N*bs, S + N*bs]`` mask for
SDPA over ``[context ; blocks]``), full-vocabulary logits materialised at once, a full
``log_softmax`` in the loss and the per-step metrics over whole distributions. The path
under test is the strategy's own ``forward_loss``. Both run backward and an AdamW step: ours on
torch's fused AdamW kernel, as the trainer builds it, the reference with AdamW's defaults. Ours
keeps its process's C heap between steps as the trainer does (``train.keep_heap``), the reference
runs on glibc's defaults (``--system-heap`` leaves ours on them too).

The two paths run in two worker processes (one torch thread each, both on one CPU: ``--cpu``)
that step in turn, alternating which goes first, so load from other processes hits both
alike and a pair's two steps run on the same core; each pair gives a ratio ``reference
seconds / ours`` (> 1: ours is faster). One JSON line per strategy and dtype:

    tokens_per_s_ours / _reference   B*S tokens per second, medians over the pairs
    ratio, ratio_p25, ratio_p75      median and quartiles of the per-pair ratios
    peak_mb_ours / _reference        resident memory above each worker's baseline (the
                                     model, batch and optimizer state after a first step);
                                     with ``--in-use``, the bytes in use at the step's peak
    memory                           which of the two: resident or in use
    kernels                          what each path runs on CPU, and would run on CUDA
    load_before / load_after         the machine's 1-minute load average
    ours / reference                 eager or compiled (``--compile``); textbook or ours eager
                                     (``--reference eager``)
    recompute_mlp                    ours with ``train.recompute_mlp`` (``--recompute-mlp``)
    first_step_s_ours / _reference   the untimed first step (with ``--compile``: the compile time)

    python bench/versus_reference.py                                # every strategy, fp32 and bf16
    python bench/versus_reference.py --strategies eagle3 --dtypes float32 --pairs 9
    python bench/versus_reference.py --compile --reference eager    # what strategy.compile changes
    python bench/versus_reference.py --system-heap                  # ours on glibc's default heap too
    python bench/versus_reference.py --recompute-mlp                # ours with train.recompute_mlp
    python bench/versus_reference.py --in-use --pairs 2             # bytes in use at the peak, not pages
    python bench/versus_reference.py --shapes smollm2               # at a real small model's dimensions

Resident memory counts the pages a step touches, and so the C heap's fragmentation: the blocks the
step frees leave holes that later blocks of other sizes fit only in part, and over many steps the
blocks settle into more pages than the step ever has in use at once. ``--in-use`` measures the bytes
in use instead: both workers run with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 4 KiB, so every block
of 4 KiB or more is mapped on its own and unmapped when freed, and the resident high-water mark is
the peak of the bytes in use (page by page), with no heap around them: the figure a GPU's caching
allocator reports as its peak allocated. The step then pays a page fault for every page of every
block, so its times and ratios in that mode measure the faults, not the step.

Shapes (``--shapes tiny``, the default): EAGLE3 H 256, V = Vd 4096, B 2, S 512, TTT 7; the DFlash
family H 128, 2 layers, block 16, 16 anchors, S 512, B 4, V 1024 (bench/dflash_step.py's ``tiny``).
``--shapes smollm2``: the same batches and unroll at SmolLM2-135M-Instruct's dimensions (:data:`SHAPES`).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

STRATEGIES = ("eagle3", "dflash", "domino", "dspark")

#: What each path executes, per strategy: {path: {"cpu": ..., "cuda": ...}}.
#: ours' bfloat16 linears on CPU, by whether they are upcast here (kernels() picks the line)
_HALF = {True: "; bfloat16 linears as float32 GEMMs of upcast operands (torch's own bf16 GEMM is the slower on this "
               "CPU: no bf16 GEMM instructions, or AVX512-BF16 without AMX on Intel; specforge_core.nn.linear)",
         False: "; bfloat16 linears on torch's native bf16 GEMM (faster here than float32: AMX, or AVX512-BF16 on AMD)"}
#: the reference's bfloat16 GEMMs on CPU, likewise
_HALF_REFERENCE = {True: " (torch's bf16 GEMM, the slower on this CPU)", False: " (native bf16 GEMM)"}
KERNELS = {
    "linears": {"ours": {"cpu": "float32: MKL sgemm", "cuda": "cuBLAS, native bf16 tensor cores"},
                "reference": {"cpu": "torch's own kernels in the step's dtype", "cuda": "cuBLAS, native bf16"},
                "heads": "Domino's correction and DSpark's Markov/confidence heads are the model's modules in "
                         "both paths",
                "domino_gru": {"ours": {"cpu": "specforge_plugin_domino.gru.FusedGRU: all steps' input GEMM at once, "
                                               "one state GEMM per step, backward by hand with each weight "
                                               "gradient as one GEMM over all steps (float32, and half precision "
                                               "on CPUs without bf16 GEMM instructions; torch's nn.GRU on those "
                                               "with them); the per-step state GEMMs from one copy of W_hh's parts "
                                               "a call, packed for oneDNN on AMD CPUs with AVX-512, transposed for "
                                               "MKL elsewhere (specforge_core.nn.ReusedWeight)",
                                        "cuda": "nn.GRU (cuDNN)"},
                               "reference": {"cpu": "nn.GRU (aten's GRU cells, autograd through every step)",
                                             "cuda": "nn.GRU (cuDNN)"}}},
    "eagle3": {
        "ours_unroll": {"cpu": "steps 1..K-1 over the positions the loss reads only (specforge_plugin_eagle3.loss."
                               "unroll_windows: a prompt before the first supervised position costs step 0 only); "
                               "q/k/v as one GEMM of the stacked weights, whose token half (norm(embed) W_e: step k "
                               "reads step 0's token t+k) is computed once for every step at step 0",
                        "cuda": "the same"},
        "ours_attention": {"cpu": "step-0 keys by the flash kernel for CPU, 64 queries at a time over their own keys "
                                  "(causal) and the keys before them, merged by log-sum-exp (masked half skipped, no "
                                  "S x S scores kept; half precision computed in float32), diagonal keys as row-wise "
                                  "dot products merged the same way, its backward the flash backward given the "
                                  "merged output and log-sum-exp",
                           "cuda": "step-0 scores by cuBLAS matmul plus an additive causal bias built once per batch, "
                                   "diagonal keys as row-wise dot products"},
        "ours_loss": {"cpu": "the vocabulary head fused with the soft cross-entropy (specforge_plugin_eagle3."
                             "head_loss): supervised rows only, in chunks whose logits stay in cache (the maximum and "
                             "argmax by a vectorised search over blocks, specforge_core.nn.max_last; torch's softmax "
                             "kernel in place, one exp per logit), gradients by two GEMMs in forward, the head's weight "
                             "gradient accumulated in place over the unroll steps into one [Vd, h] sum; no [B, S, Vd] "
                             "tensor kept for backward; a float32 head of 8192 rows or more: its logits GEMM in blocks "
                             "of 1024 columns (specforge_core.nn.mm_wide)",
                      "cuda": "the same ops (cuBLAS GEMMs, elementwise kernels per chunk)"},
        "reference_attention": {"cpu": "matmul scores, masked_fill with the dense S x S mask every step",
                                "cuda": "the same"},
        "reference_loss": {"cpu": "full log_softmax per step, materialised", "cuda": "the same"},
    },
    "dflash_family": {
        "ours_attention": {"cpu": "flash attention for CPU (native GQA, float32), merged by log-sum-exp: per group "
                                  "of 4 blocks over a view of the context up to the group's last anchor, and every "
                                  "block over its own keys in one call; backward through the flash backward given "
                                  "the merged output",
                           "cuda": "SDPA memory-efficient kernel per group (boolean mask)"},
        "ours_loss": {"cpu": "the frozen lm_head fused with the cross-entropy (DSpark: with the L1 distillation "
                             "term, Domino: with the correction head's), a tile of whole blocks at a time (about "
                             "256K logits, in cache; at least 128 rows): logits, logsumexp, argmax and the input "
                             "gradients in one pass, gradients by GEMMs in forward; no logits kept for backward "
                             "(DFlash: block positions 1.., position 0 being the never-supervised anchor). A "
                             "vocabulary-wide head (8192 rows or more) in float32, or in bf16 where the CPU has "
                             "bf16 GEMMs: its two products from copies of the frozen head packed once and kept "
                             "(specforge_core.nn.frozen_head: two more copies of it in memory, made in the untimed "
                             "first step), on oneDNN, except on an Intel CPU in float32 (a bf16 head converted "
                             "to float32 only when narrower than 1024): there on MKL's packed GEMM (packed for a "
                             "tile's rows; a tile with fewer, MKL's plain GEMM over the head), "
                             "and a head narrower than 1024 takes its input gradient from MKL's plain GEMM over "
                             "the head itself (one copy fewer); a float32 one not packed: the logits GEMM in "
                             "blocks of 1024 columns (specforge_core.nn.mm_wide)",
                      "cuda": "the same ops (cuBLAS GEMMs, elementwise kernels per tile)"},
        "reference_attention": {"cpu": "SDPA (flash attention for CPU) with the dense [N*bs, S+N*bs] mask, K/V "
                                       "heads repeated for GQA",
                                "cuda": "SDPA memory-efficient kernel with the dense mask"},
        "reference_loss": {"cpu": "cross-entropy over all blocks' logits at once", "cuda": "the same"},
    },
}

#: The optimizer step of each path (both AdamW, lr 1e-4, on the same parameters).
OPTIMIZER = {"ours": {"cpu": "AdamW on torch's fused kernel, one call per parameter, as the trainer builds it "
                             "(specforge_core.training.optim.fused_adamw)", "cuda": "the same"},
             "reference": {"cpu": "torch.optim.AdamW with its defaults: the for-loop form, about ten elementwise ops "
                                  "per parameter", "cuda": "torch.optim.AdamW with its defaults: foreach kernels"}}
#: How each path's process keeps its C heap between steps (on CPU and CUDA hosts alike: host memory).
HEAP = {"ours": "kept between steps, as the trainer keeps it (train.keep_heap: specforge_core.heap.keep_heap)",
        "reference": "glibc's defaults: the heap's free top handed back to the system as a step ends"}

#: The dimensions each comparison runs at (``--shapes``), per family. ``tiny``: small ones (EAGLE3's H 256 and
#: Vd 4096; the DFlash family's, bench/dflash_step.py's ``tiny`` preset). ``smollm2``: SmolLM2-135M-Instruct's own
#: (H 576, 9 query heads of 64 over 3 key-value heads, MLP 1536, 30 layers, vocabulary 49152; EAGLE3's draft
#: vocabulary at its 32000 cap) at the same tokens per step.
SHAPES = {
    "tiny": {
        "eagle3": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, target_layers=16, vocab=4096,
                       draft_vocab=4096, rope_theta=10000.0, batch=2, seq=512),
        "dflash_family": dict(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384, target_layers=8,
                              vocab=1024, rope_theta=1e6, layers=2, batch=4, seq=512),
    },
    "smollm2": {
        "eagle3": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, target_layers=30,
                       vocab=49152, draft_vocab=32000, rope_theta=100000.0, batch=2, seq=512),
        "dflash_family": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, target_layers=30,
                              vocab=49152, rope_theta=100000.0, layers=2, batch=4, seq=512),
    },
}

# -- building the same model and batch in each worker ------------------------------------------------------------


def build(name: str, dtype_name: str, args: argparse.Namespace, compile: bool = False):
    """``(strategy, model, batch, tokens)`` for ``name``, seeded: both workers build identical ones
    (``compile``: the strategy's ``compile`` option, its layers under torch.compile)."""
    import torch

    from specforge_core.protocols import BuildContext, DataStats, TargetInfo

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dtype_name)
    if name == "eagle3":
        from specforge_plugin_eagle3 import Eagle3Options
        from specforge_plugin_eagle3.strategy import Eagle3Strategy

        dims = SHAPES[args.shapes]["eagle3"]
        hidden, vocab = dims["hidden"], dims["vocab"]
        target = TargetInfo(num_layers=dims["target_layers"], hidden_size=hidden, vocab_size=vocab, dtype=dtype_name,
                            model_id="random",
                            extra={"num_attention_heads": dims["heads"], "num_key_value_heads": dims["kv_heads"],
                                   "head_dim": dims["head_dim"], "intermediate_size": dims["intermediate"],
                                   "rms_norm_eps": 1e-6, "rope_theta": dims["rope_theta"],
                                   "max_position_embeddings": 32768})
        strategy = Eagle3Strategy(Eagle3Options(ttt_length=args.ttt_length, draft_vocab_size=dims["draft_vocab"],
                                                dtype=dtype_name, compile=compile))
        frozen = {"embed_tokens": torch.randn(vocab, hidden, generator=gen).to(dtype),
                  "lm_head": (torch.randn(vocab, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)}
        model = strategy.build_model(target, frozen, DataStats(token_counts=torch.randint(0, 1000, (vocab,),
                                                                                         generator=gen)))
        batch_size, seq = dims["batch"], dims["seq"]
        samples = [{"input_ids": torch.randint(0, vocab, (seq,), generator=gen),
                    "loss_mask": (torch.arange(seq) >= seq // 10).long(),
                    "aux_hidden": torch.randn(seq, 3 * hidden, generator=gen).to(dtype),
                    "last_hidden": torch.randn(seq, hidden, generator=gen).to(dtype)} for _ in range(batch_size)]
    else:
        strategy_class, options_class, extra = _dflash_family(name)
        dims = SHAPES[args.shapes]["dflash_family"]
        hidden, vocab, batch_size, seq = dims["hidden"], dims["vocab"], dims["batch"], dims["seq"]
        target = TargetInfo(num_layers=dims["target_layers"], hidden_size=hidden, vocab_size=vocab, dtype=dtype_name,
                            model_id="random",
                            extra={"num_attention_heads": dims["heads"], "num_key_value_heads": dims["kv_heads"],
                                   "head_dim": dims["head_dim"], "intermediate_size": dims["intermediate"],
                                   "max_position_embeddings": 32768, "rope_theta": dims["rope_theta"],
                                   "mask_token_id": vocab - 1})
        frozen = {part: (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype)
                  for part in ("embed_tokens", "lm_head")}
        strategy = strategy_class(options_class(num_layers=dims["layers"], block_size=16, num_anchors=16,
                                                dtype=dtype_name, compile=compile, **extra), BuildContext())
        model = strategy.build_model(target, frozen, DataStats())
        width = strategy.capture_plan(target).features["target_hidden"].shape[1]
        samples = []
        for _ in range(batch_size):
            sample = {"input_ids": torch.randint(0, vocab - 1, (seq,), generator=gen),
                      "loss_mask": (torch.arange(seq) >= seq // 10).long(),
                      "target_hidden": torch.randn(seq, width, generator=gen).to(dtype)}
            if name == "dspark":
                sample["last_hidden"] = torch.randn(seq, hidden, generator=gen).to(dtype)
            samples.append(sample)
    batch = strategy.collate(samples, [f"s{i}" for i in range(len(samples))])
    return strategy, model, batch, batch_size * seq


def _dflash_family(name: str) -> tuple[type, type, dict]:
    if name == "dflash":
        from specforge_plugin_dflash import DFlashOptions
        from specforge_plugin_dflash.strategy import DFlashStrategy

        return DFlashStrategy, DFlashOptions, {"loss_decay_gamma": 7.0}
    if name == "domino":
        from specforge_plugin_domino import DominoOptions
        from specforge_plugin_domino.strategy import DominoStrategy

        return DominoStrategy, DominoOptions, {"loss_decay_gamma": 7.0}
    from specforge_plugin_dspark import DSparkOptions
    from specforge_plugin_dspark.strategy import DSparkStrategy

    return DSparkStrategy, DSparkOptions, {"loss_decay_gamma": 7.0}


# -- the textbook references ---------------------------------------------------------------------------------------


def _linear(module, x):
    """A linear layer as torch runs it (the reference does not take the draft's CPU half-precision route)."""
    import torch.nn.functional as F

    return F.linear(x, module.weight, module.bias)


def _rope(x, cos, sin):
    """The rotary embedding written out (rotate-half, in float32), autograd through every op."""
    import torch

    half = x.shape[-1] // 2
    xf = x.float()
    return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)


def _mlp(mlp, x):
    import torch.nn.functional as F

    return _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


def eagle3_reference_loss(strategy, model, batch):
    """docs/algorithms.md § EAGLE3 written out: per step a dense causal mask filled into the S x S scores, the
    diagonal keys of earlier steps, a full log_softmax loss and full-distribution metrics."""
    import torch
    import torch.nn.functional as F

    from specforge_core.nn import rope_cos_sin
    from specforge_plugin_eagle3.model import repeat_kv, shift_left

    input_ids, loss_mask, attention_mask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    ids, last_hidden = shift_left(input_ids), shift_left(batch["last_hidden"])
    loss_mask = loss_mask * shift_left(attention_mask)
    with torch.no_grad():  # the teacher
        target_logits = last_hidden.to(model.target_lm_head.dtype) @ model.target_lm_head.t()
        target_ids = target_logits.argmax(-1)
        p_t = torch.softmax(target_logits.index_select(-1, model.draft_to_target_index()).float(), -1)
        position_mask = (model.t2d[target_ids] & loss_mask.bool()).float()
    b, s = ids.shape
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]  # [B, S, S]
    layer, attn, c = model.midlayer, model.midlayer.self_attn, model.config
    groups = c.num_attention_heads // c.num_key_value_heads
    hidden = _linear(model.fc, batch["aux_hidden"].to(model.fc.weight.dtype))
    k0 = v0 = None
    diag: list[tuple[Any, Any]] = []
    loss, correct = 0.0, []
    for k in range(strategy.options.ttt_length):
        cos, sin = rope_cos_sin(torch.arange(s) + k, c.head_dim, c.rope_theta)
        x = torch.cat([layer.input_layernorm(model.embed(ids)), layer.hidden_norm(hidden)], -1)
        q = _rope(_linear(attn.q_proj, x).view(b, s, -1, c.head_dim).transpose(1, 2), cos, sin)
        key = _rope(_linear(attn.k_proj, x).view(b, s, -1, c.head_dim).transpose(1, 2), cos, sin)
        value = _linear(attn.v_proj, x).view(b, s, -1, c.head_dim).transpose(1, 2)
        if k == 0:
            k0, v0 = key, value
        else:
            diag.append((key, value))
        scores = (q @ repeat_kv(k0, groups).transpose(2, 3)) / math.sqrt(c.head_dim)  # [B, nh, S, S]
        scores = scores.masked_fill(~causal[:, None], torch.finfo(scores.dtype).min)
        extra = [(q * repeat_kv(dk, groups)).sum(-1, keepdim=True) / math.sqrt(c.head_dim) for dk, _ in diag]
        probs = torch.softmax(torch.cat([scores, *extra], -1).float(), -1).to(q.dtype)
        out = probs[..., :s] @ repeat_kv(v0, groups)
        for j, (_, dv) in enumerate(diag):
            out = out + probs[..., s + j, None] * repeat_kv(dv, groups)
        hidden = hidden + _linear(attn.o_proj, out.transpose(1, 2).reshape(b, s, -1))
        hidden = hidden + _mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        logits = _linear(model.lm_head, model.norm(hidden)).float()
        log_probs = F.log_softmax(logits, -1)  # [B, S, Vd], materialised
        loss = loss + 0.8 ** k * -(p_t * log_probs * position_mask[..., None]).sum() / (b * s)
        with torch.no_grad():  # the step's accuracy, over the full distributions
            correct.append(((log_probs.argmax(-1) == p_t.argmax(-1)) * position_mask).sum())
        ids, p_t, position_mask = shift_left(ids), shift_left(p_t), shift_left(position_mask)
    return loss


def _dense_backbone(model, batch, blocks):
    """The DFlash backbone as docs/algorithms.md writes it: every layer attends over [context ; all blocks] with the
    dense block mask."""
    import torch
    import torch.nn.functional as F

    from specforge_core.nn import rope_cos_sin
    from specforge_plugin_dflash.blocks import block_attention_mask

    b, n, bs = blocks.ids.shape
    seq = batch["input_ids"].shape[1]
    mask = block_attention_mask(blocks.anchors, batch["lengths"], seq, bs)[:, None]  # [B, 1, Q, S+Q]
    ctx = model.hidden_norm(_linear(model.fc, batch["target_hidden"].to(model.dtype)))
    x = model.embed(blocks.ids.flatten(1))
    positions = blocks.positions.flatten(1)
    c = model.config
    rope_q = [t[:, :, None] for t in rope_cos_sin(positions, c.head_dim, c.rope_theta)]
    rope_k = [t[:, :, None] for t in rope_cos_sin(torch.cat([torch.arange(seq).expand(b, -1), positions], 1),
                                                 c.head_dim, c.rope_theta)]
    for layer in model.layers:
        attn, h = layer.self_attn, layer.input_layernorm(x)
        kv = torch.cat([ctx, h], 1)
        q = _rope(attn.q_norm(_linear(attn.q_proj, h).view(b, h.shape[1], -1, c.head_dim)), *rope_q)
        k = _rope(attn.k_norm(_linear(attn.k_proj, kv).view(b, kv.shape[1], -1, c.head_dim)), *rope_k)
        v = _linear(attn.v_proj, kv).view(b, kv.shape[1], -1, c.head_dim).transpose(1, 2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                             attn_mask=mask)
        x = x + _linear(attn.o_proj, out.transpose(1, 2).reshape(b, h.shape[1], -1))
        x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
    return model.norm(x).view(b, n, bs, -1)


def dflash_family_reference_loss(name: str, strategy, model, batch, step: int, textbook=None):
    """DFlash / Domino / DSpark written out: the dense backbone, all blocks' logits at once, full cross-entropy.

    The blocks are drawn as ours draws them (which blocks a step trains is data); the rest is
    :func:`dflash_family_textbook_loss`, or ``textbook`` (that function under torch.compile).
    """
    import torch

    from specforge_core.contracts import StepContext

    ctx = StepContext(global_step=step, total_steps=1000)
    shift = {"dflash": 0, "domino": getattr(getattr(model, "head_config", None), "label_shift", 0), "dspark": 1}[name]
    blocks = strategy.draw_blocks(model, batch, ctx, label_shift=shift)
    lam = torch.tensor(strategy.base_loss_weight(ctx) if name == "domino" else 0.0)  # a tensor: no recompiles
    return (textbook or dflash_family_textbook_loss)(name, strategy, model, batch, blocks, lam)


def dflash_family_textbook_loss(name: str, strategy, model, batch, blocks, lam):
    """The step's loss from its ``blocks`` (see :func:`dflash_family_reference_loss`); ``lam`` is Domino's λ."""
    import torch
    import torch.nn.functional as F

    hidden = _dense_backbone(model, batch, blocks)  # [B, N, bs, H]
    w, labels = blocks.weights, blocks.labels
    base = F.linear(hidden.to(model.lm_head.dtype), model.lm_head).float()  # [B, N, bs, V], all at once

    def ce(logits):
        return F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)

    if name == "dflash":
        loss = (w * ce(base)).sum() / w.sum()
    elif name == "domino":
        final = model.final_logits(base, hidden, model.block_states(blocks.tokens))
        loss = ((1 - lam) * (w * ce(final)).sum() + lam * (w * ce(base)).sum()) / w.sum()
    else:
        from specforge_plugin_dspark.strategy import gather_positions

        embedding, bias = model.markov_head(blocks.tokens)
        logits = base + bias
        with torch.no_grad():
            teacher = torch.softmax(model.logits(gather_positions(batch["last_hidden"], blocks.positions)), -1)
        l1 = (torch.softmax(logits, -1) - teacher).abs().sum(-1)
        accept = (1 - l1.detach() / 2).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(model.confidence(hidden, blocks.tokens, embedding), accept,
                                                 reduction="none")
        o = strategy.options
        loss = (w * (o.ce_loss_alpha * ce(logits) + o.l1_loss_alpha * l1 + o.confidence_loss_alpha * bce)).sum() \
            / w.sum()
    with torch.no_grad():
        float(((base.argmax(-1) == labels) & blocks.label_mask).sum())  # the accuracy metric
    return loss


# -- the worker processes ------------------------------------------------------------------------------------------


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def worker(conn, name: str, dtype_name: str, path: str, args: argparse.Namespace) -> None:
    """Build, take one untimed step, then step whenever the parent asks; report the peak memory at the end."""
    import torch

    from specforge_core.contracts import StepContext
    from specforge_core.heap import keep_heap
    from specforge_core.training.optim import fused_adamw

    torch.set_num_threads(1)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # both workers on one CPU: a pair's two steps run on the same core
    as_trainer = path == "ours" or args.reference == "eager"
    if as_trainer and not args.system_heap:
        keep_heap()  # as the trainer does (train.keep_heap)
    strategy, model, batch, tokens = build(name, dtype_name, args, compile=args.compile and path == "ours")
    if args.recompute_mlp and path == "ours":
        from specforge_core.nn import recompute_mlps

        recompute_mlps(model)  # as train.recompute_mlp does
    params = [p for p in model.parameters() if p.requires_grad]
    # ours steps with the optimizer the trainer builds (the fused AdamW kernel); the textbook with AdamW's defaults
    optimizer = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if as_trainer and fused_adamw(params)
                                                      else {}))
    if as_trainer:
        def loss_of(step: int):
            return strategy.forward_loss(model, batch, StepContext(global_step=step, total_steps=1000)).loss
    else:
        if name == "domino":  # the textbook GRU is torch's own (ours runs specforge_plugin_domino.gru's on CPU)
            model.prefix_gru.forward = functools.partial(torch.nn.GRU.forward, model.prefix_gru)
        # compiled: the same textbook step through torch.compile (inductor)
        compiled = args.reference == "compiled"
        if name == "eagle3":
            textbook = torch.compile(eagle3_reference_loss) if compiled else eagle3_reference_loss

            def loss_of(step: int):
                return textbook(strategy, model, batch)
        else:
            textbook = torch.compile(dflash_family_textbook_loss) if compiled else None

            def loss_of(step: int):
                return dflash_family_reference_loss(name, strategy, model, batch, step, textbook)

    def step(index: int) -> float:
        start = time.perf_counter()
        loss = loss_of(index)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    first = step(0)  # with --compile, ours compiles here
    _trim_heap()
    with open("/proc/self/clear_refs", "w") as fh:  # restart the resident-memory high-water mark here
        fh.write("5")
    baseline = _rss_kb("VmRSS")
    conn.send(("ready", tokens, first))
    index = 1
    while conn.recv() == "step":
        conn.send(step(index))
        index += 1
    conn.send((_rss_kb("VmHWM") - baseline) / 1024)


def _trim_heap() -> None:
    """Give freed heap pages back to the system, so the baseline is what the step keeps, not what it left."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def kernels(family: str, args: argparse.Namespace) -> dict:
    """:data:`KERNELS` for ``family`` as this comparison runs them (compiled layers, an eager reference)."""
    from specforge_core.nn import upcast_half_gemm_on_cpu

    upcast = upcast_half_gemm_on_cpu()
    linears = KERNELS["linears"]
    linears = {**linears, "ours": {**linears["ours"], "cpu": linears["ours"]["cpu"] + _HALF[upcast]},
               "reference": {**linears["reference"], "cpu": linears["reference"]["cpu"] + _HALF_REFERENCE[upcast]}}
    heap = {"ours": "glibc's defaults (--system-heap)" if args.system_heap else HEAP["ours"],
            "reference": HEAP["reference"]}
    if args.in_use:
        heap = {path: "every block of 4 KiB or more mapped on its own (--in-use)" for path in heap}
    described = {**KERNELS[family], "linears": linears, "optimizer": OPTIMIZER, "heap": heap}
    if args.compile:
        described["ours_layers"] = {"cpu": "torch.compile (inductor C++ kernels) around the eager attention",
                                    "cuda": "torch.compile (inductor Triton kernels) around the eager attention"}
    if args.reference == "eager":
        described = {key: value for key, value in described.items() if not key.startswith("reference")}
        described["optimizer"] = {"ours": OPTIMIZER["ours"], "reference": OPTIMIZER["ours"]}
        described["heap"] = {"ours": heap["ours"], "reference": heap["ours"]}
        described["reference"] = "ours, every layer eager"
    elif args.reference == "compiled":
        described["reference_compiled"] = {"cpu": "the whole textbook step under torch.compile: inductor C++ kernels "
                                                  "fuse its elementwise work, GEMMs and SDPA stay library calls",
                                           "cuda": "the same through Triton kernels"}
    return described


#: ``--in-use``: the workers' environment, read by glibc as they start (every block of 4 KiB or more mapped alone)
IN_USE_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "4096"}


def compare(name: str, dtype_name: str, args: argparse.Namespace) -> dict:
    spawn = multiprocessing.get_context("spawn")
    paths = ("ours", "reference")
    pipes, procs = {}, []
    saved = {key: os.environ.get(key) for key in IN_USE_ENVIRONMENT}
    if args.in_use:
        os.environ.update(IN_USE_ENVIRONMENT)
    try:
        for path in paths:
            parent, child = spawn.Pipe()
            proc = spawn.Process(target=worker, args=(child, name, dtype_name, path, args), daemon=True)
            proc.start()
            pipes[path] = parent
            procs.append(proc)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    ready = {path: pipes[path].recv() for path in paths}
    tokens = ready["ours"][1]
    load_before = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    for pair in range(args.pairs):
        for path in (paths if pair % 2 == 0 else paths[::-1]):
            pipes[path].send("step")
            seconds[path].append(pipes[path].recv())
    peaks = {}
    for path in paths:
        pipes[path].send("stop")
        peaks[path] = pipes[path].recv()
    for proc in procs:
        proc.join(timeout=60)
    ratios = sorted(r / o for o, r in zip(seconds["ours"], seconds["reference"]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    ours, ref = statistics.median(seconds["ours"]), statistics.median(seconds["reference"])
    family = "eagle3" if name == "eagle3" else "dflash_family"
    return {"bench": "versus_reference", "strategy": name, "dtype": dtype_name, "shapes": args.shapes,
            "threads": 1, "pairs": args.pairs, "cpu": args.cpu,
            "ours": "compiled" if args.compile else "eager", "recompute_mlp": args.recompute_mlp,
            "reference": {"textbook": "textbook", "compiled": "textbook, compiled", "eager": "ours, eager"}[
                args.reference],
            "first_step_s_ours": ready["ours"][2], "first_step_s_reference": ready["reference"][2],
            "tokens_per_step": tokens, "tokens_per_s_ours": tokens / ours, "tokens_per_s_reference": tokens / ref,
            "ratio": statistics.median(ratios), "ratio_p25": quartiles[0], "ratio_p75": quartiles[2],
            "ratio_min": ratios[0], "ratio_max": ratios[-1],
            "peak_mb_ours": peaks["ours"], "peak_mb_reference": peaks["reference"],
            "memory": "in use (every block mapped on its own)" if args.in_use else "resident",
            "kernels": kernels(family, args), "load_before": load_before, "load_after": os.getloadavg()[0]}


#: ``--cpu``'s help (``versus_commit.py`` takes the option too).
CPU_HELP = ("the CPU both workers run on (default: the first this process may use; -1: wherever the scheduler puts "
            "them). They step in turn, never at once, so one CPU serves both, and a pair's two steps then run on the "
            "same core: on a virtual machine two cores' speeds can differ by 10-20%% from one minute to the next")


def resolve_cpu(requested: int | None) -> int | None:
    """``--cpu`` as given -> the CPU to run the workers on, or None for wherever the scheduler puts them; exits
    with a message for a CPU this process may not use."""
    if requested is None and hasattr(os, "sched_getaffinity"):
        return min(os.sched_getaffinity(0))
    if requested == -1 or not hasattr(os, "sched_setaffinity"):
        return None
    if requested not in os.sched_getaffinity(0):
        sys.exit(f"--cpu {requested}: this process may run on CPUs {sorted(os.sched_getaffinity(0))} only")
    return requested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma separated (default: all)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma separated (default: float32,bfloat16)")
    parser.add_argument("--pairs", type=int, default=7, help="timed step pairs per comparison (default 7)")
    parser.add_argument("--ttt-length", type=int, default=7, help="EAGLE3 unroll steps (default 7)")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="tiny",
                        help="the dimensions: tiny (default: EAGLE3 H 256, Vd 4096, the DFlash family H 128, "
                             "V 1024) or smollm2 (SmolLM2-135M's H 576, 9/3 heads of 64, MLP 1536, V 49152; "
                             "EAGLE3's Vd 32000), both at the same tokens a step: EAGLE3 1024 (B x S), the DFlash "
                             "family 2048 context tokens and 1024 block rows")
    parser.add_argument("--compile", action="store_true",
                        help="run ours with the strategy's compile option (its layers under torch.compile; the "
                             "untimed first step compiles, first_step_s_ours says how long)")
    parser.add_argument("--reference", choices=("textbook", "compiled", "eager"), default="textbook",
                        help="what ours is compared with: the textbook step (default), the textbook step under "
                             "torch.compile (compiled; its untimed first step compiles), or ours without compile "
                             "(eager; with --compile: what compiling changes)")
    parser.add_argument("--cpu", type=int, default=None, help=CPU_HELP)
    parser.add_argument("--system-heap", action="store_true",
                        help="leave ours on the C library's default heap policy too, instead of keeping the heap "
                             "between steps as the trainer does (train.keep_heap): what that setting is worth")
    parser.add_argument("--recompute-mlp", action="store_true",
                        help="ours with train.recompute_mlp: its gated MLPs make their gate and up projections again "
                             "in backward instead of keeping them (less memory, a second forward of those two)")
    parser.add_argument("--in-use", action="store_true",
                        help="measure the bytes in use at each step's peak instead of its resident memory: both "
                             "workers map every block of 4 KiB or more on its own (glibc), so no heap fragmentation "
                             "is counted; the step's times then include a page fault for every page it allocates")
    args = parser.parse_args()
    args.cpu = resolve_cpu(args.cpu)
    for name in args.strategies.split(","):
        if name not in STRATEGIES:
            sys.exit(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        for dtype_name in args.dtypes.split(","):
            record = compare(name, dtype_name, args)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}), flush=True)


if __name__ == "__main__":
    main()
