"""Small helpers shared by the cross-package tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SPECFORGE = str(Path(sys.executable).parent / "specforge")


def run_cli(*args: str, env: dict[str, str] | None = None, check: bool = False, timeout: float = 120,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run the installed ``specforge`` console script in a subprocess."""
    environ = dict(os.environ if env is None else env)
    environ.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run([SPECFORGE, *args], capture_output=True, text=True, env=environ, timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"specforge {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def plugins_json(env: dict[str, str] | None = None) -> list[dict]:
    return json.loads(run_cli("plugins", "--json", env=env, check=True).stdout)
