"""EAGLE3 train-step throughput at fixed shapes, and its MFU against a measured matmul peak.

One training step is what the Trainer runs per batch: ``strategy.forward_loss`` (teacher
logits from the frozen target lm_head, the K-step test-time-training unroll, the loss) +
backward + AdamW. Weights and features are random (synthetic, fully valid sequences), so
nothing is downloaded. Prints one JSON line:

    tokens_per_s       trained tokens per second (B * S per step)
    flops_per_token    model FLOPs of one training token (see :func:`flops_per_token`)
    mfu                achieved FLOP/s / the matmul peak measured in the same run, before
                       and after the timed steps (the best of the two: the physical limit
                       on this device and dtype; a shared CPU's load moves both numbers).
                       Model FLOPs count every position of every unroll step, as the
                       algorithm defines the step; the strategy skips some (the vocabulary
                       head of unsupervised rows, positions outside the loss's windows in
                       steps 1..K-1), so on batches with a prompt part ``mfu`` can exceed 1

    python bench/eagle3_step.py --threads 1                     # H=256, V=4096, S=512, B=2, K=7 on CPU
    python bench/eagle3_step.py --preset qwen2.5-0.5b           # docs/algorithms.md's 33M-param draft
    python bench/eagle3_step.py --preset qwen3-8b --device cuda --seq-len 2048 --batch 1
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time

import torch

from specforge_core.contracts import StepContext
from specforge_core.protocols import DataStats, TargetInfo

from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.strategy import Eagle3Strategy

#: name -> (target layers, H, heads, kv heads, intermediate, V, Vd or None, rope theta)
PRESETS = {
    "small": (16, 256, 4, 2, 768, 4096, None, 10000.0),
    "qwen2.5-0.5b": (24, 896, 14, 2, 4864, 151936, 16000, 1e6),
    "qwen3-8b": (36, 4096, 32, 8, 12288, 151936, 32000, 1e6),
}


def target_for(preset: str, dtype: str) -> TargetInfo:
    layers, hidden, heads, kv, inter, vocab, _vd, theta = PRESETS[preset]
    return TargetInfo(num_layers=layers, hidden_size=hidden, vocab_size=vocab, dtype=dtype, model_id=f"random-{preset}",
                      extra={"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hidden // heads,
                             "intermediate_size": inter, "rms_norm_eps": 1e-6, "rope_theta": theta,
                             "max_position_embeddings": 32768})


def flops_per_token(model, seq_len: int, ttt_length: int) -> float:
    """Model FLOPs of one trained token: 3x the draft's forward (forward + backward) plus the teacher.

    Draft forward: fc (2*3H*h) once, then per unroll step q/k/v/o, SwiGLU and lm_head
    matmuls (2 * weights) and attention (2 * 2 * nh * d FLOPs per visible key: on average
    (S + 1) / 2 causal keys plus one diagonal key per earlier step). Teacher: the frozen
    target lm_head forward (2 * H * V), no backward. Embedding lookups are free.
    """
    c = model.config
    d, nh, nkv, h = c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.hidden_size
    per_step = 2 * (2 * h * (nh + 2 * nkv) * d + nh * d * h + 3 * h * c.intermediate_size + h * c.draft_vocab_size)
    attention = sum(2 * 2 * nh * d * ((seq_len + 1) / 2 + k) for k in range(ttt_length))
    draft_forward = 2 * 3 * c.target_hidden_size * h + ttt_length * per_step + attention
    return 3 * draft_forward + 2 * c.target_hidden_size * c.vocab_size


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of large square matmuls in ``dtype`` on ``device``: the reference physical limit."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
        if device.type == "cuda" and count % 10:
            continue
        sync(device)
    sync(device)
    return 2 * n ** 3 * count / (time.perf_counter() - start)


def synthetic_batch(strategy: Eagle3Strategy, target: TargetInfo, batch: int, seq_len: int, dtype: torch.dtype,
                    gen: torch.Generator):
    hidden = target.hidden_size
    samples = []
    for _ in range(batch):
        loss_mask = torch.ones(seq_len, dtype=torch.long)
        loss_mask[: seq_len // 10] = 0  # a prompt part
        samples.append({"input_ids": torch.randint(0, target.vocab_size, (seq_len,), generator=gen),
                        "loss_mask": loss_mask,
                        "aux_hidden": torch.randn(seq_len, 3 * hidden, generator=gen).to(dtype),
                        # the lm_head input is final-normed: unit RMS
                        "last_hidden": torch.randn(seq_len, hidden, generator=gen).to(dtype)})
    return strategy.collate(samples, [f"s{i}" for i in range(batch)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="draft weights and features (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 3 on CPU, 20 on CUDA)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 1 CPU, 3 CUDA)")
    parser.add_argument("--peak-seconds", type=float, default=2.0, help="how long to measure the matmul peak")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU intra-op threads (default: torch's; on a shared machine 1 is the steadiest)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    steps = args.steps or (20 if device.type == "cuda" else 3)
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    target = target_for(args.preset, dtype_name)
    vd = PRESETS[args.preset][6]
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=args.ttt_length, draft_vocab_size=vd, dtype=dtype_name))
    vocab, hidden = target.vocab_size, target.hidden_size
    frozen = {"embed_tokens": torch.randn(vocab, hidden, generator=gen).to(device, dtype),
              "lm_head": (torch.randn(vocab, hidden, generator=gen) / math.sqrt(hidden)).to(device, dtype)}
    counts = torch.randint(0, 1000, (vocab,), generator=gen)
    model = strategy.build_model(target, frozen, DataStats(token_counts=counts)).to(device)
    batch = synthetic_batch(strategy, target, args.batch, args.seq_len, dtype, gen).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> float:
        out = strategy.forward_loss(model, batch, StepContext())
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    peak_before = matmul_peak(device, dtype, args.peak_seconds)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync(device)
    elapsed = time.perf_counter() - start

    tokens = args.batch * args.seq_len * steps
    per_token = flops_per_token(model, args.seq_len, args.ttt_length)
    achieved = per_token * tokens / elapsed
    peak_after = matmul_peak(device, dtype, args.peak_seconds)
    peak = max(peak_before, peak_after)
    record = {
        "bench": "eagle3_step", "preset": args.preset, "device": torch.cuda.get_device_name(device)
        if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads",
        "dtype": dtype_name, "batch": args.batch, "seq_len": args.seq_len, "ttt_length": args.ttt_length,
        "hidden": model.config.hidden_size, "heads": model.config.num_attention_heads,
        "kv_heads": model.config.num_key_value_heads, "intermediate": model.config.intermediate_size,
        "vocab": vocab, "draft_vocab": model.config.draft_vocab_size,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "steps": steps, "step_s": elapsed / steps, "tokens_per_s": tokens / elapsed,
        "flops_per_token": per_token, "achieved_tflops": achieved / 1e12,
        "matmul_peak_tflops": peak / 1e12, "matmul_peak_before_after_tflops": [peak_before / 1e12, peak_after / 1e12],
        "mfu": achieved / peak, "loss": loss,
        "peak_memory_gb": (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
