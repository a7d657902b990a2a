"""Training-loop overhead: the Trainer against a bare forward/backward/step of the same model.

Both run in the same process on the same batches: the reference iterates pre-collated
batches in a plain loop (forward, backward, clip, AdamW, schedule); the Trainer gets them
through the FeatureDataLoader from a memory store and does its logging, metric reduction
and acks. Prints one JSON line per world size with both step times and the overhead ratio
(target: <= 1.05). Run ``python bench/train_loop.py`` (it relaunches itself under torchrun
for the 2-rank gloo measurement; ``--ranks 1`` skips that).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from specforge_core.builtin import MemoryStoreOptions
from specforge_core.config import TrainOptions
from specforge_core.contracts import StepContext, StepOutput, TrainBatch
from specforge_core.data.loader import FeatureDataLoader
from specforge_core.feature_stores.memory import MemoryFeatureStore
from specforge_core.protocols import BuildContext
from specforge_core.training.distributed import init_distributed, set_gradient_sync, shard_model, shutdown
from specforge_core.training.optim import build_optimizer, build_scheduler
from specforge_core.training.trainer import Trainer


class MLPStrategy:
    """A token classifier big enough that a step costs milliseconds, like a small draft."""

    def __init__(self, dim: int, classes: int) -> None:
        self.dim, self.classes = dim, classes

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.dim, 4 * self.dim), nn.GELU(), nn.Linear(4 * self.dim, 4 * self.dim),
                             nn.GELU(), nn.Linear(4 * self.dim, self.classes))

    def collate(self, samples, sample_ids):
        return TrainBatch(tensors={"x": torch.stack([s["x"] for s in samples]),
                                   "y": torch.stack([s["y"] for s in samples])},
                          sample_ids=sample_ids, num_tokens=sum(int(s["y"].numel()) for s in samples))

    def forward_loss(self, model, batch, ctx):
        logits = model(batch["x"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
        correct = (logits.argmax(-1) == batch["y"]).sum()
        return StepOutput(loss=loss, ratio_metrics={"acc": (float(correct), float(batch["y"].numel()))})


class StepClock:
    """Lifecycle-hook observer timing optimizer steps (what a tracker plugin would see)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def specforge_step_end(self, run_id, global_step, metrics):
        self.times.append(time.perf_counter())

    def specforge_checkpoint_saved(self, **_kw):
        pass


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _reference_steps(strategy, batches, train, info) -> list[float]:
    """Per-step seconds of a bare loop over pre-collated batches (same model, optimizer, schedule)."""
    torch.manual_seed(0)
    model = shard_model(strategy.build_model(), info)
    optimizer = build_optimizer(model, train)
    scheduler = build_scheduler(optimizer, train, train.max_steps)
    stamps = [time.perf_counter()]
    for step, batch in enumerate(batches):
        set_gradient_sync(model, True)
        out = strategy.forward_loss(model, batch, StepContext(global_step=step))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _trainer_steps(strategy, store, refs, train, info, batch_size) -> list[float]:
    """Per-step seconds of the Trainer (loader, metrics, hooks, acks) on the same samples."""
    torch.manual_seed(0)
    clock = StepClock()
    loader = FeatureDataLoader(store, strategy.collate, refs=refs, batch_size=batch_size, shuffle=False)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = Trainer(strategy=strategy, model=strategy.build_model(), loader=loader, train=train, info=info,
                          output_dir=out_dir, run_id="bench", total_steps=train.max_steps, contract={},
                          hooks=clock, ack=lambda ids, step: None)
        trainer.save = lambda **_kw: None  # measure the loop, not checkpoint I/O
        trainer._finish = lambda *a: {}
        trainer._progress = lambda: None
        trainer.fit()
    return [b - a for a, b in zip(clock.times, clock.times[1:])]


def measure(args: argparse.Namespace) -> dict:
    info = init_distributed("cpu")
    strategy = MLPStrategy(args.dim, args.classes)
    store = MemoryFeatureStore(MemoryStoreOptions(consume_once=False), BuildContext())
    gen = torch.Generator().manual_seed(info.rank)
    refs = [store.put(f"s{i}", {"x": torch.randn(args.seq, args.dim, generator=gen),
                                "y": torch.randint(0, args.classes, (args.seq,), generator=gen)})
            for i in range(args.batch * args.steps)]
    train = TrainOptions(batch_size=args.batch, max_steps=args.steps, lr=1e-3, save_every=0)
    batches = [strategy.collate([store.get(r) for r in refs[i:i + args.batch]],
                                [r.sample_id for r in refs[i:i + args.batch]])
               for i in range(0, len(refs), args.batch)]
    # Alternate the two a few times and keep each one's best median: this machine's noise
    # (other processes, frequency changes) hits both the same way.
    reference, looped = [], []
    for _ in range(args.rounds):
        reference.append(_median(_reference_steps(strategy, batches, train, info)[args.warmup:]))
        steps = _trainer_steps(strategy, store, refs, train, info, args.batch)[args.warmup:]
        looped.append(_median(steps) if steps else float("nan"))  # hooks (the clock) run on rank 0 only
    ref_s, loop_s = min(reference), min(looped)
    result = {"bench": "train_loop", "world_size": info.world_size, "batch": args.batch, "seq": args.seq,
              "dim": args.dim, "steps": args.steps, "rounds": args.rounds, "reference_step_ms": ref_s * 1e3,
              "trainer_step_ms": loop_s * 1e3, "overhead_ratio": loop_s / ref_s, "target_ratio": 1.05}
    shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--classes", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="also measure under torchrun with this many gloo ranks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = measure(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(measure(args)), flush=True)
    if args.ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               __file__, "--worker", *sys.argv[1:]]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
