"""Crash campaign: random SIGKILL trials of resumable runs, checked against an uninterrupted run.

    python bench/crash_trials.py                          # 20 trials, at most 30 minutes
    python bench/crash_trials.py --trials 3 --time-budget 100 --samples 8
    python bench/crash_trials.py --kinds consumer,producer --seed 7 --keep DIR

Each trial starts a real ``specforge run`` (the tiny toy target, a strategy that logs the
sample ids of every trained batch), kills one process with SIGKILL at a random moment, and
starts it again the way a user would (``--resume latest``; ``--overwrite`` when it died
before its first checkpoint; a producer with its own command). Kinds, in turn:

* ``online`` — an online colocated run is killed and resumed;
* ``consumer`` — the consumer of a disaggregated run is killed and resumed while its
  producer keeps streaming;
* ``producer`` — the producer is killed and restarted while its consumer keeps training.

Kills are placed by progress, not wall time (a start's duration varies far more than a
step's): each trial draws how far the victim gets first — 0 (during startup), a number of
trained steps, or of refs a producer published, up to all of them (the final checkpoint and
evaluation, the end of the stream) — then a random part of a step (``--pace`` paces each
training step). ``progress_at_kill`` is where it really died.

Every trial is compared with a reference run of the same plan that was never interrupted
(measured once at the start): the loss of every step (``loss_mismatches``), the samples each
step trained, taking for every step the last process that trained it (``samples_lost``,
``trained_twice``), the final weights byte for byte (``weight_mismatches``), and what a crash
may leave behind (``leaked_files``: a stream's training sample files once its consumer
finished, temporary files of interrupted writes, half-written checkpoints). Prints one JSON
line; ``trial_s_over_reference`` is the mean trial time over the reference run's.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "specforge-plugin-example" / "src" / "specforge_plugin_example"
SPECFORGE = str(Path(sys.executable).parent / "specforge")
KINDS = ("online", "consumer", "producer")

TRACED_HOOKS = '''
"""The ``traced`` strategy: the example strategy, logging the sample ids of each trained batch."""
from specforge_core import hookimpl
from specforge_core.specs import StrategySpec
from specforge_plugin_example import ExampleOptions


@hookimpl
def specforge_strategies():
    return [StrategySpec(name="traced", factory="sf_crash_traced.strategy:TracedStrategy", options=ExampleOptions,
                         description="the example strategy, logging trained sample ids to $SF_TRACE",
                         requires={"last_hidden"}, best_metric="acc", best_mode="max")]
'''

TRACED_STRATEGY = '''
import json
import os
import time

from specforge_plugin_example.strategy import ExampleStrategy


class TracedStrategy(ExampleStrategy):
    def forward_loss(self, model, batch, ctx):
        out = super().forward_loss(model, batch, ctx)
        path = os.environ.get("SF_TRACE")
        if path and model.training:  # evaluation batches are not training
            # A paced step: training then lasts long enough for a random kill to land inside it.
            time.sleep(float(os.environ.get("SF_TRACE_PACE", "0")))
            with open(path, "a") as handle:  # one write per batch: a kill leaves whole lines
                handle.write(json.dumps({"pid": os.getpid(), "step": ctx.global_step, "t": time.time(),
                                         "ids": list(batch.sample_ids)}) + "\\n")
        return out
'''


class Campaign:
    """The shared parts of every trial: the site, the tiny target, the plan and the reference run."""

    def __init__(self, root: Path, samples: int, batch: int, pace: float) -> None:
        from specforge_core.testing import FakeSite
        from specforge_plugin_hf.toy import build_toy_target

        self.root = root
        self.pace = pace
        self.site = FakeSite(root / "site")
        self.site.add("specforge-plugin-example", "0.2.0", entry_points={"example": "specforge_plugin_example"},
                      modules={f"specforge_plugin_example.{path.stem}": path.read_text()
                               for path in EXAMPLE.glob("*.py")})
        self.site.add("specforge-plugin-traced", "0.1.0", entry_points={"traced": "sf_crash_traced"},
                      modules={"sf_crash_traced.__init__": TRACED_HOOKS,
                               "sf_crash_traced.strategy": TRACED_STRATEGY})
        self.tiny = build_toy_target(root / "tiny", "tiny", progress=False)
        # Just the rows a run uses: preparing the toy target's whole data set would dominate each start.
        data = {}
        for split, rows in (("train", samples), ("eval", 4)):
            data[split] = root / f"{split}.jsonl"
            lines = (self.tiny / f"{split}.jsonl").read_text().splitlines(keepends=True)
            data[split].write_text("".join(lines[:rows]))
        # Checkpoints every other step, so that a kill between two loses trained steps to redo;
        # the producer is paced by its consumer (high watermark), so that it lives as long.
        self.args = ["--strategy", "traced", "--set", f"target_engine.model={self.tiny}", "--set",
                     f"data.path={data['train']}", "--set", f"data.eval_path={data['eval']}", "--set",
                     f"data.max_samples={samples}", "--set", f"train.batch_size={batch}", "--set",
                     "train.save_every=2", "--set", "train.real_eval_prompts=0", "--set", "train.export=false",
                     "--set", "target_engine.capture_batch_size=2"]
        self.stream_args = ["--set", f"control_plane.high_watermark={2 * batch}", "--set",
                            f"control_plane.low_watermark={batch}"]
        started, launched = time.monotonic(), time.time()
        self.reference = root / "reference"
        if self._finish(self.start(["run", "--output", str(self.reference / "out")], self.reference)) != 0:
            raise SystemExit(f"the reference run failed; see {self.reference / 'log.txt'} (run with --keep DIR)")
        self.reference_s = time.monotonic() - started
        self.expected = Outcome.of(self.reference, self.reference / "out")
        times = [json.loads(line)["t"] for line in (self.reference / "trace.jsonl").read_text().splitlines()]
        self.startup_s = min(times) - pace - launched  # until the reference's first training step
        self.steps, self.samples = len(times), samples

    def kill_plan(self, kind: str, rng: random.Random) -> tuple[int, float]:
        """(progress to wait for, then seconds more) before the kill: anywhere from startup to the end.

        Progress, not wall time: how long a start takes varies far more than a training step.
        0 kills during startup; the last value kills after the last step (final checkpoint,
        evaluation, the end of the stream).
        """
        total = self.samples if kind == "producer" else self.steps
        target = rng.randint(0, total)
        return target, rng.uniform(0.2, 1.0) * self.startup_s if target == 0 else rng.uniform(0, self.pace)

    def start(self, argv: list[str], trial: Path, *, trace: bool = True) -> subprocess.Popen:
        env = self.site.env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", SPECFORGE_STRICT_PLUGINS="1",
                            SF_TRACE_PACE=str(self.pace))
        if trace:
            env["SF_TRACE"] = str(trial / "trace.jsonl")
        else:
            env.pop("SF_TRACE", None)
        trial.mkdir(parents=True, exist_ok=True)
        with open(trial / "log.txt", "a") as log:  # the child keeps its own copy of the descriptor
            log.write(f"$ specforge {' '.join(argv)}\n")
            log.flush()
            extra = self.stream_args if "--role" in argv else []
            return subprocess.Popen([SPECFORGE, *argv, *self.args, *extra], env=env, stdout=log,
                                    stderr=subprocess.STDOUT)

    @staticmethod
    def _finish(proc: subprocess.Popen, timeout: float = 900) -> int:
        return proc.wait(timeout=timeout)

    def trial(self, kind: str, trial: Path, target: int, delay: float) -> dict[str, Any]:
        """One trial of ``kind``: start, SIGKILL one process once it made ``target`` progress and
        ``delay`` seconds more, start it again."""
        out, shared = trial / "out", trial / "shared"
        train = ["run", "--output", str(out)]
        if kind != "online":
            train = ["run", "--role", "consumer", "--features", str(shared), "--output", str(out)]
        produce = ["run", "--role", "producer", "--features", str(shared), "--output", str(trial / "producer")]
        producer = self.start(produce, trial, trace=False) if kind != "online" else None
        trainer = self.start(train, trial)
        victim = producer if kind == "producer" else trainer
        # How far the victim got: steps the trainer logged, or refs the producer published.
        progress = ((lambda: _lines(trial / "trace.jsonl")) if victim is trainer
                    else (lambda: _lines(shared / "control" / "refs.jsonl")))
        killed = _kill_when(victim, progress, target, delay)
        at_kill = progress()
        codes = []
        if killed and kind == "producer":
            producer = self.start(produce, trial, trace=False)
        elif killed:
            again = ["--resume", "latest"] if (out / "latest").exists() else ["--overwrite"]
            codes.append(self._finish(self.start([*train, *again], trial)))
            trainer = None
        for proc in (trainer, producer):
            if proc is not None:
                codes.append(self._finish(proc))
        outcome = Outcome.of(trial, out)
        return {"kind": kind, "killed": killed, "kill_at_progress": target, "progress_at_kill": at_kill,
                "failed": sum(c != 0 for c in codes),
                **outcome.compare(self.expected), "leaked_files": _leaked(out, shared)}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _kill_when(proc: subprocess.Popen, progress: Any, target: int, delay: float) -> bool:
    """SIGKILL ``proc`` ``delay`` seconds after ``progress()`` reached ``target``, unless it exited first."""
    deadline = time.monotonic() + 900  # a victim that stalls is killed all the same
    while progress() < target and time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


class Outcome:
    """What a run trained: per-step losses, per-step sample ids (last process wins), final weights."""

    def __init__(self, losses: dict[int, float], steps: dict[int, list[str]], weights: bytes | None) -> None:
        self.losses, self.steps, self.weights = losses, steps, weights

    @classmethod
    def of(cls, trial: Path, out: Path) -> Outcome:
        losses: dict[int, float] = {}
        metrics = out / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if "loss" in record:
                    losses[record["step"]] = record["loss"]
        steps: dict[int, list[str]] = {}
        trace = trial / "trace.jsonl"
        if trace.exists():  # processes write in turn: a later process's step replaces a crashed one's
            for line in trace.read_text().splitlines():
                record = json.loads(line)
                steps[record["step"]] = record["ids"]
        latest = out / "latest"
        weights = (out / latest.read_text().strip() / "model.safetensors").read_bytes() if latest.exists() else None
        return cls(losses, steps, weights)

    def compare(self, expected: Outcome) -> dict[str, int]:
        trained = collections.Counter(sid for ids in self.steps.values() for sid in ids)
        wanted = collections.Counter(sid for ids in expected.steps.values() for sid in ids)
        return {
            "loss_mismatches": sum(self.losses.get(step) != loss for step, loss in expected.losses.items())
                               + len(set(self.losses) - set(expected.losses)),
            "order_mismatches": sum(self.steps.get(step) != ids for step, ids in expected.steps.items()),
            "samples_lost": sum((wanted - trained).values()),
            "trained_twice": sum((trained - wanted).values()),
            "weight_mismatches": int(self.weights != expected.weights),
        }


def _leaked(out: Path, shared: Path) -> int:
    """Files a finished run should not hold: streamed training samples, temporaries, half checkpoints."""
    leaked = [p for p in out.glob(".tmp-*")] if out.exists() else []
    store = shared / "store"
    if store.exists():
        manifest = json.loads((shared / "manifest.json").read_text())
        eval_samples = manifest.get("stream", {}).get("eval_samples", 0)
        files = [p for p in store.rglob("*") if p.is_file() and p.name != "STORE.json"]  # the store's identity
        samples = [p for p in files if p.name.endswith(".safetensors")]
        leaked += [p for p in files if not p.name.endswith(".safetensors")]  # puts a kill interrupted
        leaked += samples[eval_samples:]  # training samples: deleted once a checkpoint covers them
    return len(leaked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="How many trials (kinds in turn).")
    parser.add_argument("--time-budget", type=float, default=1800.0,
                        help="Stop starting trials once the next would end after this many seconds.")
    parser.add_argument("--kinds", default=",".join(KINDS), help="Which trials: online, consumer, producer.")
    parser.add_argument("--samples", type=int, default=16, help="Training samples per run.")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="Seed of the kill times.")
    parser.add_argument("--pace", type=float, default=0.25,
                        help="Seconds each training step lasts at least, so that kills land mid-training.")
    parser.add_argument("--keep", default=None, help="Keep every trial's directory here (default: a temp dir, deleted).")
    args = parser.parse_args()
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        parser.error(f"unknown kind(s) {unknown}; choose from {', '.join(KINDS)}")
    started = time.monotonic()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="sf-crash-trials-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    results: list[dict[str, Any]] = []
    try:
        campaign = Campaign(root, args.samples, args.batch_size, args.pace)
        durations: list[float] = []
        for index in range(args.trials):
            estimate = max(durations) if durations else 2 * campaign.reference_s
            if time.monotonic() - started + estimate > args.time_budget:
                break
            kind = kinds[index % len(kinds)]
            target, delay = campaign.kill_plan(kind, rng)
            trial_started = time.monotonic()
            result = campaign.trial(kind, root / f"trial{index:03d}-{kind}", target, delay)
            durations.append(time.monotonic() - trial_started)
            results.append(result)
            print(json.dumps({"trial": index, **result}), file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    totals = {key: sum(r[key] for r in results) for key in
              ("loss_mismatches", "order_mismatches", "samples_lost", "trained_twice", "weight_mismatches",
               "leaked_files", "failed")}
    print(json.dumps({
        "bench": "crash_trials", "trials": len(results), "killed": sum(r["killed"] for r in results),
        "by_kind": dict(collections.Counter(r["kind"] for r in results)), **totals,
        "reference_s": round(campaign.reference_s, 2),
        "trial_s_over_reference": round(sum(durations) / len(durations) / campaign.reference_s, 2) if durations else None,
        "elapsed_s": round(time.monotonic() - started, 1), "time_budget_s": args.time_budget, "seed": args.seed,
    }))


if __name__ == "__main__":
    main()
