"""Soak test of a stream across hosts: random faults, and what they cost; prints JSON lines.

Each trial runs one networked stream on loopback — PostgreSQL, a mooncake_master and a
segment holder shared by all trials, a schema (and Mooncake namespace) per trial — where
two producers and a two-rank consumer (torchrun, gloo) train the eagle3 strategy on a tiny
toy target, while one fault, chosen at random, strikes after a random optimizer step:

* ``producer`` — SIGKILL of one producer (its claims expire; the other captures them again);
* ``consumer`` — SIGKILL of one consumer rank (torchrun ends the group); the consumer is
  started again, with ``--resume latest`` when a checkpoint exists;
* ``postgres`` — ``pg_ctl restart`` (every connection is cut);
* ``postgres_crash`` — an immediate shutdown, then a start (crash recovery).

Then it counts, from the ack ledger in PostgreSQL: samples **lost** (stream positions never
acked), samples **trained twice** (a position acked under two ids), **objects left** in
Mooncake, and whether the run's per-step losses equal those of an online colocated run of
the same data (they do exactly when every sample was trained once, in order). A trial whose
processes outlive its deadline is killed and counted as **hung**; one that ends in an error
is counted as **failed**, with the last line of that error.

    python bench/soak_disaggregated.py [--trials 20] [--budget-s 3600] [--seed 0] [--samples 24]

One JSON line per trial, then the totals: ``{"bench": "soak_disaggregated", "trials": 20,
"lost": 0, "trained_twice": 0, "leaked_objects": 0, "hung": 0, "failed": 0, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from specforge_core.testing.netns import LOOPBACK
from specforge_plugin_postgres.cluster import LocalStreamCluster, losses, output, rank_pids, reference_losses

FAULTS = ("producer", "consumer", "postgres", "postgres_crash")
BATCH, RANKS, PRODUCERS = 2, 2, 2


def emit(**record) -> None:
    print(json.dumps({**record, "load_average_1m": round(os.getloadavg()[0], 2)}), flush=True)


def error_line(text: str) -> str:
    """The last line of ``text`` that names an error (torchrun ends its report with a banner), else its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error:" in line]
    return (named or lines or [""])[-1][-300:]


class Soak:
    """The trials of one soak run over one cluster (see the module docstring)."""

    def __init__(self, cluster: LocalStreamCluster, tiny: Path, samples: int, work: Path,
                 trial_deadline_s: float) -> None:
        self.cluster, self.tiny, self.samples, self.work = cluster, tiny, samples, work
        self.steps = samples // (BATCH * RANKS)
        self.deadline_s = trial_deadline_s
        self.reference = reference_losses(tiny, samples, work / "reference", RANKS)

    def trial(self, index: int, fault: str, after_step: int, jitter_s: float, rng: random.Random) -> dict:
        cluster, schema = self.cluster, f"soak_{os.getpid()}_{index}"
        home = self.work / f"trial{index}"
        producers = [cluster.launch(cluster.producer_args(schema, LOOPBACK, self.tiny, self.samples), host=LOOPBACK,
                                    cwd=home / f"producer{i}", name=f"producer{i}") for i in range(PRODUCERS)]
        consumer = cluster.launch(cluster.consumer_args(schema, LOOPBACK, self.samples), host=LOOPBACK,
                                  cwd=home / "consumer", ranks=RANKS, name="consumer")
        objects_before = cluster.master.key_count()
        started, landed, final_out, failure = time.monotonic(), False, home / "consumer" / "out", None
        deadline = started + self.deadline_s
        try:
            while cluster.durable_step(schema) < after_step and consumer.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("waiting for the step to strike at")
                time.sleep(0.1)
            time.sleep(jitter_s)
            if consumer.poll() is None:
                landed = True
                consumer, final_out = self._strike(fault, schema, producers, consumer, home, rng, deadline)
            for process in (consumer, *producers):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{process.name} still running")
                try:
                    code = process.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"{process.name} still running") from None
                if code != 0 and code != -signal.SIGKILL and failure is None:
                    failure = f"{process.name} exited {code}: {error_line(output(process))}"
        except TimeoutError as exc:
            self.cluster.kill_processes()
            return {"trial": index, "fault": fault, "after_step": after_step, "landed": landed, "hung": True,
                    "why": str(exc), "seconds": round(time.monotonic() - started, 1)}
        finally:
            self.cluster.kill_processes()
        audit = cluster.audit(schema)
        acked_positions = {sample_id.split("#")[0] for sample_id in cluster.acked_ids(schema)}
        return {"trial": index, "fault": fault, "after_step": after_step, "landed": landed, "hung": False,
                "failed": failure, "lost": self.samples - len(acked_positions),
                "trained_twice": audit["acked_ids"] - len(acked_positions),
                "leaked_objects": audit["mooncake_objects"] - objects_before, "recaptured": audit["recaptured"],
                "losses_equal_reference": (final_out / "metrics.jsonl").exists()
                and losses(final_out) == self.reference,
                "seconds": round(time.monotonic() - started, 1)}

    def _strike(self, fault: str, schema: str, producers: list, consumer, home: Path, rng: random.Random,
                deadline: float):
        """Inject ``fault``; the consumer that finishes the run and its output directory."""
        cluster = self.cluster
        out = home / "consumer" / "out"
        if fault == "producer":
            os.kill(rng.choice(producers).pid, signal.SIGKILL)
        elif fault == "consumer":
            ranks = rank_pids(consumer)
            if ranks:
                os.kill(ranks[rng.choice(sorted(ranks))], signal.SIGKILL)
            try:
                consumer.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError("the consumer group outlived its killed rank") from None
            if consumer.returncode != 0:
                resume = ["--resume", "latest"] if (out / "latest").exists() else []
                if not resume:  # nothing to resume from: a fresh start, in an output directory of its own
                    out = home / "consumer" / "fresh"
                consumer = cluster.launch(cluster.consumer_args(schema, LOOPBACK, self.samples, out.name, *resume),
                                          host=LOOPBACK, cwd=home / "consumer", ranks=RANKS, name="restarted")
        elif fault == "postgres":
            cluster.postgres.restart()
        elif fault == "postgres_crash":
            cluster.postgres.kill()
            cluster.postgres.start_again()
        return consumer, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="random-fault trials to run (default 20)")
    parser.add_argument("--budget-s", type=float, default=3600.0, help="start no trial after this many seconds")
    parser.add_argument("--trial-deadline-s", type=float, default=600.0, help="a trial still running after this "
                                                                              "is killed and counted as hung")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faults, steps and delays")
    parser.add_argument("--samples", type=int, default=24, help="training samples per stream")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"faults to draw from ({','.join(FAULTS)})")
    args = parser.parse_args()
    faults = [fault.strip() for fault in args.faults.split(",") if fault.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown or not faults:
        parser.error(f"unknown faults {unknown}; choose from {','.join(FAULTS)}")
    from specforge_plugin_hf.toy import build_toy_target

    rng = random.Random(args.seed)
    start = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="sf-soak-") as work, LocalStreamCluster() as cluster:
        tiny = build_toy_target(Path(work) / "tiny", "tiny", progress=False)
        soak = Soak(cluster, tiny, args.samples, Path(work), args.trial_deadline_s)
        for index in range(args.trials):
            if time.monotonic() - start > args.budget_s:
                break
            fault = faults[index % len(faults)] if index < len(faults) else rng.choice(faults)
            result = soak.trial(index, fault, rng.randrange(0, max(1, soak.steps - 1)), rng.uniform(0.0, 1.0), rng)
            results.append(result)
            emit(bench="soak_disaggregated_trial", **result)
    finished = [r for r in results if not r["hung"]]
    emit(bench="soak_disaggregated", trials=len(results), faults_landed=sum(r["landed"] for r in results),
         lost=sum(r["lost"] for r in finished), trained_twice=sum(r["trained_twice"] for r in finished),
         leaked_objects=sum(r["leaked_objects"] for r in finished), hung=len(results) - len(finished),
         failed=sum(r["failed"] is not None for r in finished),
         losses_equal_reference=sum(bool(r["losses_equal_reference"]) for r in finished),
         seconds=round(time.monotonic() - start, 1), seed=args.seed, samples=args.samples,
         faults=sorted({r["fault"] for r in results}))


if __name__ == "__main__":
    main()
