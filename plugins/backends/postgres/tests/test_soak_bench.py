"""bench/soak_disaggregated.py, cut to two trials: a PostgreSQL crash and a killed producer cost nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[4] / "bench" / "soak_disaggregated.py"


def test_two_random_fault_trials_lose_repeat_and_leave_nothing(needs_postgres, needs_mooncake):
    done = subprocess.run([sys.executable, str(SOAK), "--trials", "2", "--samples", "16", "--seed", "7",
                           "--faults", "postgres_crash,producer", "--trial-deadline-s", "400"],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    trials, summary = lines[:-1], lines[-1]
    assert [trial["fault"] for trial in trials] == ["postgres_crash", "producer"]
    assert all(trial["landed"] for trial in trials), trials
    assert {key: summary[key] for key in ("bench", "trials", "lost", "trained_twice", "leaked_objects", "hung",
                                          "failed", "losses_equal_reference")} == {
        "bench": "soak_disaggregated", "trials": 2, "lost": 0, "trained_twice": 0, "leaked_objects": 0, "hung": 0,
        "failed": 0, "losses_equal_reference": 2}
