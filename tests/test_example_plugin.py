"""The out-of-tree example plugin: built as a wheel, installed, found, then removed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sf_helpers import plugins_json, run_cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "specforge-plugin-example"


def _pip(*args):
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    work = tmp_path_factory.mktemp("example")
    # Build from a copy so the source tree stays clean.
    source = shutil.copytree(EXAMPLE, work / "src", ignore=shutil.ignore_patterns("build", "dist", "*.egg-info"))
    _pip("wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(work / "wheels"), str(source))
    wheels = list((work / "wheels").glob("specforge_plugin_example-0.1.0-*.whl"))
    assert len(wheels) == 1
    site = work / "site"
    _pip("install", "--no-deps", "--quiet", "--target", str(site), str(wheels[0]))
    env = dict(os.environ, PYTHONPATH=str(site), SPECFORGE_STRICT_PLUGINS="1")
    yield env
    shutil.rmtree(site, ignore_errors=True)


def test_example_is_not_part_of_the_dev_install():
    names = {entry["name"] for entry in plugins_json(dict(os.environ, SPECFORGE_STRICT_PLUGINS="1"))}
    assert "example" not in names


def test_installed_example_wheel_is_listed_active(installed_example):
    by_name = {entry["name"]: entry for entry in plugins_json(installed_example)}
    assert by_name["example"]["status"] == "active"
    assert by_name["example"]["distribution"] == "specforge-plugin-example"
    assert by_name["example"]["version"] == "0.1.0"
    assert by_name["example"]["provides"]["strategy"] == ["example"]


def test_installed_example_resolves_in_a_dry_run(installed_example):
    plan = json.loads(run_cli("run", "--strategy", "example", "--set", "strategy.init_std=0.05", "--dry-run",
                              env=installed_example, check=True).stdout)
    assert plan["strategy"] == {"name": "example", "plugin": "example", "distribution": "specforge-plugin-example",
                                "version": "0.1.0", "options": {"init_std": 0.05}}


def test_uninstalled_example_is_no_longer_listed(installed_example):
    shutil.rmtree(installed_example["PYTHONPATH"])  # uninstall: the distribution and its module go away
    assert "example" not in {entry["name"] for entry in plugins_json(installed_example)}
    proc = run_cli("run", "--strategy", "example", "--dry-run", env=installed_example)
    assert proc.returncode == 2 and "unknown strategy 'example'" in proc.stderr
