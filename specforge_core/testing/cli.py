"""Running ``specforge`` the way a user does, for plugin tests: a real subprocess, and a crash on cue.

* :func:`run_specforge` — ``specforge ARGS`` in a subprocess (under ``torchrun`` with gloo for
  several ranks), strict plugin loading, one torch thread, offline hub; asserts the exit status;
* :data:`CRASH_HOOK` / :func:`install_crash_hook` — a plugin whose ``specforge_step_end`` kills
  the process (``os._exit(17)``: no cleanup, no final checkpoint) after the optimizer step
  named by ``SPECFORGE_TEST_CRASH_AT``, like a lost node; then ``--resume latest`` must train
  exactly like the run that never crashed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

#: The environment variable :data:`CRASH_HOOK` reads: the optimizer step after which the process dies.
CRASH_AT = "SPECFORGE_TEST_CRASH_AT"
#: The exit status of a crash the hook caused.
CRASH_STATUS = 17

CRASH_HOOK = f'''
import os

from specforge_core import hookimpl


@hookimpl
def specforge_step_end(global_step, metrics):
    if os.environ.get("{CRASH_AT}") == str(global_step):
        os._exit({CRASH_STATUS})  # a hard crash: no cleanup, no final checkpoint
'''


def install_crash_hook(site: Any) -> None:
    """Add the crash-hook plugin to a :class:`~specforge_core.testing.FakeSite` (then run with ``site=site``)."""
    site.add("specforge-plugin-crashhook", "0.0.1", entry_points={"crashhook": "sf_test_crash_hook"},
             modules={"sf_test_crash_hook": CRASH_HOOK})


def run_specforge(*args: str, site: Any = None, env: Mapping[str, str] | None = None,
                  env_extra: Mapping[str, Any] | None = None, ranks: int = 1, expect: int | None = 0,
                  timeout: float = 600) -> subprocess.CompletedProcess:
    """``specforge ARGS`` in a subprocess; ``expect`` is the exit status to assert (None: don't check).

    ``site`` (a :class:`~specforge_core.testing.FakeSite`) puts its fake distributions first
    on the path; ``env`` replaces the environment, ``env_extra`` adds to it. Strict plugin
    loading (unless ``env`` says otherwise), one intra-op thread, offline hub.
    """
    environ = dict(site.env() if site is not None else (os.environ if env is None else env))
    environ.setdefault("SPECFORGE_STRICT_PLUGINS", "1")
    environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **{k: str(v) for k, v in (env_extra or {}).items()})
    cmd = [str(Path(sys.executable).parent / "specforge"), *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        "-m", "specforge_core.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=timeout)
    if expect is not None and proc.returncode != expect:
        raise AssertionError(f"specforge {' '.join(args)} exited {proc.returncode}, not {expect}\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc
