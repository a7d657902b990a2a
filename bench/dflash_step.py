"""DFlash train-step throughput at fixed shapes: tokens/s and MFU against a matmul peak measured in the same run.

One training step is the strategy's ``forward_loss`` (anchors, blocks, draft forward, chunked
cross-entropy through the frozen lm_head), backward, and the core's AdamW step, on random
weights and synthetic target features. Prints one JSON line.

    python bench/dflash_step.py --preset qwen3-8b                 # CUDA: the Qwen3-8B-shaped draft
    python bench/dflash_step.py --preset qwen3-8b --layers 1 --seq 512 --anchors 16   # CPU-sized

FLOPs are counted analytically per step (forward + backward, without the loss chunks'
recomputation): fc, the K/V projections of the context in every layer, the query tokens'
projections and MLP, dense attention over all ``S + N*bs`` keys (what the kernel executes
with the explicit mask), and the frozen lm_head (forward and input gradient only). MFU is
that rate over the best of a few large matmuls of the step's dtype timed in the same process.
On CPU, a preset without ``--layers/--seq/--anchors`` is shrunk so it finishes (the JSON says so).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from specforge_core.config import TrainOptions
from specforge_core.contracts import StepContext
from specforge_core.protocols import BuildContext, DataStats, TargetInfo
from specforge_core.training.optim import build_optimizer

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.strategy import DFlashStrategy

#: Target-shaped dimensions (docs/algorithms.md, "Reference sizes").
PRESETS = {
    "tiny": dict(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=1024, target_layers=8,
                 layers=2, seq=512, anchors=16, batch=4),
    "qwen2.5-0.5b": dict(hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936,
                         target_layers=24, layers=5, seq=2048, anchors=128, batch=2),
    "qwen3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
                     target_layers=36, layers=5, seq=4096, anchors=256, batch=1),
}
#: What a preset shrinks to on CPU unless the command line sets it.
CPU_SIZE = dict(layers=1, seq=512, anchors=16, batch=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """Best FLOP/s of ``size``-cubed matmuls in ``dtype`` (the reference the MFU is relative to)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def step_flops(dims: dict, batch: int, seq: int, blocks: int, block_size: int, n_ctx: int) -> float:
    """Model FLOPs of one training step (forward + backward), as described in the module docstring."""
    hidden, qd = dims["hidden"], dims["heads"] * dims["head_dim"]
    kvd, inter, vocab = dims["kv_heads"] * dims["head_dim"], dims["intermediate"], dims["vocab"]
    ctx_tokens, q_tokens, keys = batch * seq, batch * blocks * block_size, seq + blocks * block_size
    fc = 4 * ctx_tokens * n_ctx * hidden * hidden  # weight gradient only: the input is data
    ctx_kv = 6 * ctx_tokens * hidden * 2 * kvd
    q_linear = 6 * q_tokens * (2 * hidden * qd + 2 * hidden * kvd + 3 * hidden * inter)
    attention = 12 * q_tokens * keys * qd
    lm_head = 4 * q_tokens * hidden * vocab
    return fc + dims["layers"] * (ctx_kv + q_linear + attention) + lm_head


def build(dims: dict, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    target = TargetInfo(num_layers=dims["target_layers"], hidden_size=dims["hidden"], vocab_size=dims["vocab"],
                        dtype=str(dtype).removeprefix("torch."), model_id="bench-random",
                        extra={"num_attention_heads": dims["heads"], "num_key_value_heads": dims["kv_heads"],
                               "head_dim": dims["head_dim"], "intermediate_size": dims["intermediate"],
                               "max_position_embeddings": 32768, "rope_theta": 1e6})
    frozen = {name: (torch.randn(dims["vocab"], dims["hidden"], generator=gen) * 0.02).to(dtype)
              for name in ("embed_tokens", "lm_head")}
    options = DFlashOptions(num_layers=dims["layers"], block_size=args.block_size, num_anchors=dims["anchors"],
                            loss_decay_gamma=7.0, logit_chunk_size=args.logit_chunk_size,
                            dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    strategy = DFlashStrategy(options, BuildContext())
    plan = strategy.capture_plan(target)
    model = strategy.build_model(target, frozen, DataStats()).to(device)
    width = plan.features["target_hidden"].shape[1]
    samples = []
    for _ in range(dims["batch"]):
        loss_mask = torch.ones(dims["seq"], dtype=torch.long)
        loss_mask[: dims["seq"] // 10] = 0  # a prompt
        samples.append({"input_ids": torch.randint(0, dims["vocab"], (dims["seq"],), generator=gen),
                        "loss_mask": loss_mask,
                        "target_hidden": torch.randn(dims["seq"], width, generator=gen).to(dtype)})
    batch = strategy.collate(samples, [f"s{i}" for i in range(len(samples))]).to(device)
    return strategy, model, batch, len(plan.layer_ids)


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    dims = dict(PRESETS[args.preset])
    overrides = {k: getattr(args, k) for k in ("layers", "seq", "anchors", "batch") if getattr(args, k) is not None}
    reduced = device.type == "cpu" and args.preset != "tiny" and not overrides
    dims.update(CPU_SIZE if reduced else {})
    dims.update(overrides)
    strategy, model, batch, n_ctx = build(dims, args, device, dtype)
    optimizer = build_optimizer(model, TrainOptions(lr=1e-4))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # every sample supervises all but its first tenth, so each keeps min(anchors, valid anchors) blocks
    blocks = min(dims["anchors"], dims["seq"] - dims["seq"] // 10 - 1)
    times = []
    for step in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        strategy.forward_loss(model, batch, StepContext(global_step=step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    flops = step_flops(dims, dims["batch"], dims["seq"], blocks, args.block_size, n_ctx)
    peak = matmul_peak_flops(device, dtype, args.peak_size or (8192 if device.type == "cuda" else 2048))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({torch.get_num_threads()} threads)"
    return {"bench": "dflash_step", "preset": args.preset, "device": device_name,
            "dtype": str(dtype).removeprefix("torch."), "reduced_for_cpu": reduced, "layers": dims["layers"],
            "hidden": dims["hidden"], "vocab": dims["vocab"], "batch": dims["batch"], "seq": dims["seq"],
            "blocks_per_sample": blocks, "block_size": args.block_size, "trainable_params": trainable,
            "step_ms": step_s * 1e3, "tokens_per_s": dims["batch"] * dims["seq"] / step_s,
            "block_tokens_per_s": dims["batch"] * blocks * args.block_size / step_s,
            "model_tflop_per_step": flops / 1e12, "achieved_tflops": flops / step_s / 1e12,
            "matmul_peak_tflops": peak / 1e12, "mfu": flops / step_s / peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--layers", type=int, help="draft layers (default: the preset's)")
    parser.add_argument("--seq", type=int, help="tokens per sample (default: the preset's)")
    parser.add_argument("--anchors", type=int, help="blocks per sample (default: the preset's)")
    parser.add_argument("--batch", type=int, help="samples per step (default: the preset's)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--logit-chunk-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--peak-size", type=int, help="matmul size of the peak reference (default 8192 CUDA, 2048 CPU)")
    print(json.dumps(measure(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()
