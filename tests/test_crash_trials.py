"""The crash campaign (bench/crash_trials.py) in small: one SIGKILL trial of each kind.

An online run, a stream's consumer and a stream's producer are each killed at a random moment
and started again; the bench compares every trial with an uninterrupted run of the same plan.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "crash_trials.py"


def test_killed_and_restarted_runs_lose_nothing_and_train_nothing_twice(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--trials", "3", "--time-budget", "240", "--samples", "8",
                           "--pace", "0.2", "--keep", str(tmp_path / "trials")],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    trials = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith('{"trial"')]
    assert result["bench"] == "crash_trials" and result["trials"] == len(trials) >= 1
    assert [t["kind"] for t in trials] == ["online", "consumer", "producer"][:len(trials)]
    assert result["killed"] >= 1, trials  # at least one process really died mid-run
    assert {key: result[key] for key in ("failed", "loss_mismatches", "order_mismatches", "samples_lost",
                                         "trained_twice", "weight_mismatches", "leaked_files")} == {
        "failed": 0, "loss_mismatches": 0, "order_mismatches": 0, "samples_lost": 0, "trained_twice": 0,
        "weight_mismatches": 0, "leaked_files": 0}, trials
