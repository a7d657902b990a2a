"""Small helpers shared by the cross-package tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SPECFORGE = str(Path(sys.executable).parent / "specforge")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "specforge-plugin-example" / "src" / "specforge_plugin_example"
LINEAR = (Path(__file__).parent / "fixtures" / "linear_plugin.py").read_text()


def example_site(path: Path, linear_module: str):
    """A fake site with the ``example`` strategy and the ``linear`` test plugin (under ``linear_module``:
    each test module imports its own copy). Call ``cleanup()`` on it when done."""
    from specforge_core.testing import FakeSite

    site = FakeSite(path)
    site.add("specforge-plugin-example", "0.2.0", entry_points={"example": "specforge_plugin_example"},
             modules={f"specforge_plugin_example.{path.stem}": path.read_text() for path in EXAMPLE.glob("*.py")})
    site.add("specforge-plugin-linear", "0.0.7", entry_points={"linear": linear_module},
             modules={linear_module: LINEAR})
    return site


def strategy_source(name: str = "Strategy", *, loss_method: str = "forward_loss") -> str:
    """Source of a strategy class with the protocol's four methods (which do nothing), for fake plugins
    whose runs stop at a dry run; ``loss_method`` renames the fourth (a misspelling)."""
    return f"""
class {name}:
    def __init__(self, options, context):
        self.options = options

    def capture_plan(self, target): ...

    def build_model(self, target, frozen_parts, stats): ...

    def collate(self, samples, sample_ids): ...

    def {loss_method}(self, model, batch, ctx): ...
"""


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


def run_specforge(*args: str, env: dict[str, str] | None = None, ranks: int = 1, expect: int | None = 0,
                  timeout: float = 600) -> subprocess.CompletedProcess:
    """``specforge ARGS`` in a subprocess (the plugin kit's :func:`specforge_core.testing.cli.run_specforge`)."""
    from specforge_core.testing.cli import run_specforge as run

    return run(*args, env=env, ranks=ranks, expect=expect, timeout=timeout)


def interrupt_when(args: list[str], env: dict[str, str], ready, timeout: float = 120) -> tuple[int, str]:
    """Start ``specforge ARGS``, send it SIGINT (Ctrl-C) once ``ready()`` is true (or it ended, or ``timeout``
    passed); its exit status and stderr. SIGINT has its default disposition in the child, as a terminal's Ctrl-C
    finds it: a suite started in the background of a shell without job control hands its children SIGINT
    ignored, and Python then never raises KeyboardInterrupt."""
    import signal
    import time

    proc = subprocess.Popen([SPECFORGE, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + timeout
        while not ready() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, stderr
