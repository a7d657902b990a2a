"""bench/control_plane.py, cut short, against the session's server: every postgres measurement moves refs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[4] / "bench" / "control_plane.py"


def test_each_postgres_measurement_moves_refs(postgres, tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--seconds", "0.3", "--pool", "2000", "--sizes", "500",
                           "--repeats", "2", "--dir", str(tmp_path), "--postgres-dsn", postgres.dsn],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    measured = {(line["bench"], line.get("batch"), line.get("channel")): line for line in lines
                if "postgres" in line["bench"] or line.get("channel") == "postgres"}
    assert sorted(measured) == sorted([("postgres_commit_ack", 1, None), ("postgres_commit_ack", 64, None),
                                       ("postgres_stream_commit_ack", 64, None), ("channel_publish", 64, "postgres"),
                                       ("channel_poll", 64, "postgres"), ("postgres_poll_wakeup", None, None)])
    for key, line in measured.items():
        if key[0] == "postgres_poll_wakeup":
            assert line["waits"] == 30 and 0 < line["median_ms"] < 1000 * line["poll_interval_s"], line
        else:  # a producer thread that died would show as 0 refs
            assert line["refs"] > 0 and line["refs_per_s"] > 0, line
    assert all(line["server"] == "given by --postgres-dsn" for line in measured.values() if "server" in line)
