"""The out-of-tree example plugin as a stranger meets it: a wheel installed into a fresh virtual environment.

The environment gets what a user's would: torch (the pinned CPU build, through the repository's
constraints), specforge-core and the hf engine plugin built as wheels, and the example's
wheel. In it the example is listed and its implementation imports, its own tests (the core's
conformance suite, lossless decoding included) pass, it trains on the tiny toy target,
exports, is measured by ``specforge eval``, and is gone again once uninstalled.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sf_helpers import plugins_json

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "specforge-plugin-example"
VERSION = "0.2.0"


def run(*cmd, env=None, cwd=None, timeout=900, expect=0):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    if expect is not None:
        assert proc.returncode == expect, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A new virtual environment with torch, specforge-core, specforge-plugin-hf and the example's wheel."""
    work = tmp_path_factory.mktemp("example")
    source = shutil.copytree(EXAMPLE, work / "example", ignore=shutil.ignore_patterns("build", "dist", "*.egg-info"))
    wheels = work / "wheels"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", wheels,
        source, ROOT, ROOT / "plugins" / "backends" / "hf")
    assert len(list(wheels.glob(f"specforge_plugin_example-{VERSION}-*.whl"))) == 1
    venv = work / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    # torch pinned through the repository's constraints (as scripts/install-dev.sh does): pip must never choose a
    # CUDA build; no byte-compiling (a fresh environment for one test run gains nothing from it)
    run(python, "-m", "pip", "install", "--quiet", "--no-compile", "-c", ROOT / "constraints.txt", "torch==2.13.0",
        "pytest", *sorted(wheels.glob("*.whl")))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", SPECFORGE_STRICT_PLUGINS="1",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return {"bin": venv / "bin", "env": env, "source": source, "work": work}


def specforge(fresh, *args, expect=0):
    return run(fresh["bin"] / "specforge", *args, env=fresh["env"], cwd=fresh["work"], expect=expect)


def test_example_is_not_part_of_the_dev_install():
    names = {entry["name"] for entry in plugins_json(dict(os.environ, SPECFORGE_STRICT_PLUGINS="1"))}
    assert "example" not in names


def test_the_fresh_environment_lists_the_example_and_imports_its_implementation(fresh):
    entries = {e["name"]: e for e in json.loads(specforge(fresh, "plugins", "--json", "--check").stdout)}
    assert set(entries) == {"builtin", "hf", "example"}  # nothing of the development install leaks in
    example = entries["example"]
    assert (example["status"], example["distribution"], example["version"]) == ("active", "specforge-plugin-example",
                                                                               VERSION)
    assert example["provides"]["strategy"] == ["example"] and example["factory_errors"] == []
    plan = json.loads(specforge(fresh, "run", "--strategy", "example", "--set", "strategy.num_heads=2",
                                "--dry-run").stdout)
    assert plan["strategy"] == {"name": "example", "plugin": "example", "distribution": "specforge-plugin-example",
                                "version": VERSION, "options": {"num_heads": 2, "init_std": 0.02}}


def test_the_examples_own_tests_pass_against_the_installed_wheel(fresh):
    proc = run(fresh["bin"] / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", fresh["source"] / "tests",
               env=fresh["env"], cwd=fresh["work"])
    assert " passed" in proc.stdout and "failed" not in proc.stdout and "skipped" not in proc.stdout


def test_the_example_trains_exports_and_decodes_losslessly(fresh, tiny):
    out = fresh["work"] / "run"
    specforge(fresh, "run", "--strategy", "example", "--output", out, "--set", f"target_engine.model={tiny}",
              "--set", "data.max_samples=16", "--set", "train.max_steps=4", "--set", "train.batch_size=4",
              "--set", "train.real_eval_prompts=3", "--set", "train.real_eval_max_new_tokens=16")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["best"]["metric"] == "tau_sim"
    assert summary["tau_sim"] == summary["final_eval"]["eval/tau_sim"] >= 0  # the strategy's derived metric
    assert summary["real_eval"]["identical_to_target_greedy"] is True and summary["tau_real"] >= 1.0
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["specforge_strategy"] == "example" and config["architectures"] == ["SpecforgeExampleHeads"]
    result = json.loads(specforge(fresh, "eval", "--draft", out / "export", "--target-model", tiny, "--num-prompts",
                                  "3", "--max-new-tokens", "16", "--json").stdout)
    assert result["identical_to_target_greedy"] is True and result["tau_real"] == pytest.approx(summary["tau_real"])


def test_uninstalled_example_is_no_longer_listed(fresh):
    run(fresh["bin"] / "python", "-m", "pip", "uninstall", "--yes", "--quiet", "specforge-plugin-example",
        env=fresh["env"])
    assert "example" not in {e["name"] for e in json.loads(specforge(fresh, "plugins", "--json").stdout)}
    proc = specforge(fresh, "run", "--strategy", "example", "--dry-run", expect=2)
    assert "unknown strategy 'example'" in proc.stderr
