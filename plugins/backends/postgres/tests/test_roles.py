"""Run options of a stream across hosts, checked before anything runs; the plugin stays optional."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SPECFORGE = str(Path(sys.executable).parent / "specforge")


@pytest.mark.parametrize("args, message", [
    (["--role", "producer", "--control-plane", "postgres", "--features", "x", "--feature-store", "mooncake"],
     "--role producer with control_plane='postgres' keeps the stream in the control plane and the feature store, "
     "on no shared directory; drop --features"),
    (["--role", "consumer", "--control-plane", "postgres", "--feature-store", "disk"],
     "--role consumer with control_plane='postgres' shares no directory between the hosts, so the disk feature "
     "store cannot carry the samples; use a network store such as --feature-store mooncake"),
    (["--role", "consumer"], "or a networked control plane (--control-plane postgres) and feature store"),
])
def test_stream_options_that_cannot_work_are_refused_before_anything_runs(args, message, tmp_path):
    proc = subprocess.run([SPECFORGE, "run", "--strategy", "eagle3", *args, "--output", str(tmp_path / "out"),
                           "--dry-run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # the CLI's exit status for bad options
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_importing_the_core_and_listing_plugins_never_imports_psycopg():
    code = ("import sys, specforge_core; from specforge_core.plugins import get_plugin_manager; "
            "get_plugin_manager().get('control_plane', 'postgres'); print('psycopg' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
