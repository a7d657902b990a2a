"""bench/versus_commit.py in small: this checkout's DFlash step against HEAD's, two pairs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "versus_commit.py"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


pytestmark = pytest.mark.skipif(_git("rev-parse", "HEAD").returncode != 0, reason="not a git checkout")


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})


def test_a_step_against_a_commit_in_pairs_leaves_no_worktree_behind():
    worktrees = _git("worktree", "list").stdout
    proc = _bench("--commit", "HEAD", "--strategies", "dflash", "--pairs", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = proc.stdout.strip().splitlines()
    record = json.loads(line)
    assert (record["bench"], record["strategy"], record["dtype"], record["pairs"], record["shapes"]) == (
        "versus_commit", "dflash", "float32", 2, "tiny")
    assert record["cpu"] == min(os.sched_getaffinity(0))  # both workers on the first CPU this process may use
    assert record["commit"] == _git("rev-parse", "HEAD").stdout.strip()
    assert record["ms_here"] > 0 and record["ms_commit"] > 0
    assert record["speedup_p25"] <= record["speedup"] <= record["speedup_p75"]
    assert 0.2 < record["speedup"] < 5  # the same code on both sides
    assert _git("worktree", "list").stdout == worktrees


def test_an_unknown_commit_or_strategy_is_refused_naming_it():
    proc = _bench("--commit", "no-such-commit-here")
    assert proc.returncode != 0 and "no commit 'no-such-commit-here'" in proc.stderr
    proc = _bench("--commit", "HEAD", "--strategies", "medusa")
    assert proc.returncode != 0
    assert "unknown strategy 'medusa'; choose from eagle3, dflash, domino, dspark" in proc.stderr


def test_a_cpu_this_process_may_not_use_is_refused_before_any_worktree_is_made():
    worktrees = _git("worktree", "list").stdout
    allowed = sorted(os.sched_getaffinity(0))
    proc = _bench("--commit", "HEAD", "--strategies", "dflash", "--cpu", str(max(allowed) + 1))
    assert proc.returncode != 0 and proc.stdout == ""
    assert f"--cpu {max(allowed) + 1}: this process may run on CPUs {allowed} only" in proc.stderr
    assert _git("worktree", "list").stdout == worktrees
