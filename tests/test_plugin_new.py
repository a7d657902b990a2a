"""``specforge plugin new``: every kind's skeleton installs, is found, imports, and passes its own tests."""

import json
import os
import subprocess
import sys

import pytest

from sf_helpers import run_cli

KINDS = ("strategy", "target-engine", "feature-store", "control-plane", "tracker")
PROVIDES = {"strategy": "strategy", "target-engine": "target_engine", "feature-store": "feature_store",
            "control-plane": "control_plane", "tracker": None}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One skeleton of each kind (named my-KIND), installed as a user would (a wheel build) into a site folder."""
    work = tmp_path_factory.mktemp("new")
    for kind in KINDS:
        run_cli("plugin", "new", f"my-{kind}", "--kind", kind, "--output", str(work / "src"), check=True)
    site = work / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(site), *sorted(str(p) for p in (work / "src").iterdir())],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(os.environ, PYTHONPATH=str(site), SPECFORGE_STRICT_PLUGINS="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return {"src": work / "src", "env": env}


def test_a_skeleton_is_a_complete_distribution_with_no_placeholder_left(generated):
    folder = generated["src"] / "specforge-plugin-my-strategy"
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", "src/specforge_plugin_my_strategy/__init__.py",
                     "src/specforge_plugin_my_strategy/strategy.py", "tests/test_my_strategy.py"]
    for kind in KINDS:
        for path in (generated["src"] / f"specforge-plugin-my-{kind}").rglob("*"):
            assert not path.is_file() or "{{" not in path.read_text(), path
    pyproject = (folder / "pyproject.toml").read_text()
    assert '[project.entry-points.specforge]\nmy-strategy = "specforge_plugin_my_strategy"' in pyproject
    assert "class MyStrategyStrategy:" in (folder / "src" / "specforge_plugin_my_strategy" / "strategy.py").read_text()


def test_every_skeleton_is_listed_active_and_its_implementation_imports(generated):
    proc = run_cli("plugins", "--json", "--check", env=generated["env"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entries = {entry["name"]: entry for entry in json.loads(proc.stdout)}
    for kind in KINDS:
        entry = entries[f"my-{kind}"]
        assert (entry["status"], entry["distribution"], entry["factory_errors"]) == (
            "active", f"specforge-plugin-my-{kind}", [])
        provided = {k: v for k, v in entry["provides"].items() if v}
        assert provided == ({PROVIDES[kind]: [f"my-{kind}"]} if PROVIDES[kind] else {})


def test_every_skeleton_passes_its_own_tests(generated):
    folders = [str(generated["src"] / f"specforge-plugin-my-{kind}" / "tests") for kind in KINDS]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *folders],
                          capture_output=True, text=True, env=generated["env"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "failed" not in proc.stdout and " passed" in proc.stdout


def test_the_skeletons_resolve_in_a_dry_run(generated):
    proc = run_cli("run", "--strategy", "my-strategy", "--target-engine", "my-target-engine", "--feature-store",
                   "my-feature-store", "--control-plane", "my-control-plane", "--dry-run", env=generated["env"])
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [plan[kind]["distribution"] for kind in ("strategy", "target_engine", "feature_store", "control_plane")] == [
        "specforge-plugin-my-strategy", "specforge-plugin-my-target-engine", "specforge-plugin-my-feature-store",
        "specforge-plugin-my-control-plane"]


def test_a_folder_in_the_way_or_a_bad_name_is_refused_and_nothing_is_written(tmp_path):
    (tmp_path / "specforge-plugin-taken").mkdir()
    (tmp_path / "specforge-plugin-taken" / "notes.txt").write_text("mine")
    proc = run_cli("plugin", "new", "taken", "--kind", "strategy", "--output", str(tmp_path))
    assert proc.returncode == 2
    assert f"{tmp_path / 'specforge-plugin-taken'} already exists and is not an empty folder" in proc.stderr
    assert [p.name for p in (tmp_path / "specforge-plugin-taken").iterdir()] == ["notes.txt"]
    proc = run_cli("plugin", "new", "Medusa", "--kind", "strategy", "--output", str(tmp_path))
    assert proc.returncode == 2 and "plugin name 'Medusa' is not usable: use lowercase letters" in proc.stderr
    proc = run_cli("plugin", "new", "x", "--kind", "stategy", "--output", str(tmp_path))
    assert proc.returncode == 2 and "'stategy' is not one of 'strategy', 'target-engine'" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specforge-plugin-taken"]  # no staging folder left


def test_a_name_an_installed_plugin_provides_is_written_with_a_warning(tmp_path):
    proc = run_cli("plugin", "new", "dflash", "--kind", "strategy", "--output", str(tmp_path),
                   env=dict(os.environ, SPECFORGE_STRICT_PLUGINS="1"))
    assert proc.returncode == 0
    assert "note: strategy 'dflash' (specforge-plugin-dflash" in proc.stderr and "ambiguous" in proc.stderr
    assert (tmp_path / "specforge-plugin-dflash" / "pyproject.toml").is_file()
