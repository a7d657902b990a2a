"""What EAGLE3's unroll windows save: the training step with ``trim_unroll`` on and off, at equal batches.

With ``strategy.trim_unroll`` (the default) steps 1..K-1 of the unroll compute only the
positions the loss reads, in each sample from K-1 before its first supervised position to its
last; off, every position of every step, as the algorithm is written. Loss and gradients are
the same either way (the bench checks the losses agree). Both run in one process, in turns,
forward + backward per batch; one JSON line per scenario:

    ms_trimmed / ms_whole   median milliseconds of a pass over the scenario's batches
    ratio                   ms_whole / ms_trimmed (> 1: the windows save time)
    windows                 each batch's per-sample starts and per-step widths
    load_before / _after    the machine's 1-minute load average

Scenarios (``[prompt, total]`` tokens per sample, right-padded):

    uniform     the bench/versus_reference.py batch: 2 samples of 512, the first 10% prompt
    chat_pair   prompts of 60 and 380 tokens with replies of 100 and 132 (S 512)
    smollm2     the lengths of SmolLM2-135M-Instruct's own replies (up to 96 new tokens) to the
                real-model tier's 12 prompts (tests/data/real_prompts.jsonl), batches of 4

    python bench/eagle3_windows.py                       # H 256, V = Vd 4096, float32, K 7
    python bench/eagle3_windows.py --shape smollm2       # H 576, V 49152, Vd 8192 (SmolLM2's shape)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from specforge_core.contracts import StepContext
from specforge_core.protocols import DataStats, TargetInfo

from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.loss import align, unroll_windows
from specforge_plugin_eagle3.strategy import Eagle3Strategy

SCENARIOS = {
    "uniform": [[(51, 512), (51, 512)]],
    "chat_pair": [[(60, 160), (380, 512)]],
    # (prompt, prompt + reply) in SmolLM2's tokens, chat template included, in the tier's prompt order
    "smollm2": [[(37, 46), (37, 54), (35, 133), (38, 48)], [(39, 75), (38, 136), (36, 134), (35, 132)],
                [(37, 135), (37, 56), (36, 134), (38, 136)]],
}

#: name -> (H, heads, kv heads, intermediate, V, Vd)
SHAPES = {"small": (256, 4, 2, 768, 4096, 4096), "smollm2": (576, 9, 3, 1536, 49152, 8192)}


def build(shape: str, dtype: str, ttt_length: int, gen: torch.Generator):
    hidden, heads, kv, inter, vocab, vd = SHAPES[shape]
    info = TargetInfo(num_layers=16, hidden_size=hidden, vocab_size=vocab, dtype=dtype, extra={
        "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048})
    frozen = {"embed_tokens": (torch.randn(vocab, hidden, generator=gen) * 0.02).to(getattr(torch, dtype)),
              "lm_head": (torch.randn(vocab, hidden, generator=gen) / math.sqrt(hidden)).to(getattr(torch, dtype))}
    counts = DataStats(token_counts=torch.randint(0, 1000, (vocab,), generator=gen))
    strategies = {trim: Eagle3Strategy(Eagle3Options(ttt_length=ttt_length, draft_vocab_size=vd, dtype=dtype,
                                                     trim_unroll=trim)) for trim in (True, False)}
    model = strategies[True].build_model(info, frozen, counts)
    return info, strategies, model


def batches_for(scenario: str, strategy: Eagle3Strategy, info: TargetInfo, dtype: str, gen: torch.Generator):
    out = []
    for group in SCENARIOS[scenario]:
        samples = []
        for prompt, total in group:
            mask = torch.zeros(total, dtype=torch.long)
            mask[prompt:] = 1
            samples.append({"input_ids": torch.randint(0, info.vocab_size, (total,), generator=gen), "loss_mask": mask,
                            "aux_hidden": torch.randn(total, 3 * info.hidden_size, generator=gen).to(getattr(torch,
                                                                                                            dtype)),
                            "last_hidden": torch.randn(total, info.hidden_size, generator=gen).to(getattr(torch,
                                                                                                         dtype))})
        out.append(strategy.collate(samples, [str(i) for i in range(len(samples))]))
    return out


def windows_of(strategy: Eagle3Strategy, batch) -> dict | None:
    _ids, loss_mask, _last = align(batch["input_ids"], batch["loss_mask"], batch["last_hidden"],
                                   batch["attention_mask"], strategy.options.loss_positions)
    # as if every target token were in the draft vocabulary (one outside it would narrow the windows)
    windows = unroll_windows(loss_mask.bool(), strategy.options.ttt_length)
    return None if windows is None else {"starts": list(windows.starts), "widths": list(windows.widths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma separated, of " + ", ".join(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per side (median reported)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    info, strategies, model = build(args.shape, args.dtype, args.ttt_length, gen)
    for scenario in [s for s in args.scenarios.split(",") if s]:
        batches = batches_for(scenario, strategies[True], info, args.dtype, gen)
        load_before = os.getloadavg()[0]
        times: dict[bool, list[float]] = {True: [], False: []}
        losses: dict[bool, list[float]] = {True: [], False: []}
        for repeat in range(args.repeats + 1):  # the first pass of each side is untimed
            for trim in ((True, False) if repeat % 2 else (False, True)):
                start = time.perf_counter()
                for batch in batches:
                    out = strategies[trim].forward_loss(model, batch, StepContext())
                    out.loss.backward()
                    losses[trim].append(float(out.loss.detach()))
                model.zero_grad(set_to_none=True)
                if repeat:
                    times[trim].append(time.perf_counter() - start)
        if not all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(losses[True], losses[False])):
            raise SystemExit(f"{scenario}: the trimmed and whole unrolls disagree on the loss")
        trimmed, whole = statistics.median(times[True]), statistics.median(times[False])
        print(json.dumps({"bench": "eagle3_windows", "scenario": scenario, "shape": args.shape, "dtype": args.dtype,
                          "ttt_length": args.ttt_length, "threads": args.threads,
                          "ms_trimmed": round(trimmed * 1e3, 1), "ms_whole": round(whole * 1e3, 1),
                          "ratio": round(whole / trimmed, 3),
                          "windows": [windows_of(strategies[True], batch) for batch in batches],
                          "load_before": load_before, "load_after": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
