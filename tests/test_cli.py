"""The command line, run as a real subprocess."""

import json
import subprocess
import sys

import pytest

from sf_helpers import SPECFORGE, plugins_json, run_cli, strategy_source

import specforge_core

ENTRY_KEYS = {"name", "distribution", "version", "entry_point", "status", "error", "provides"}
KINDS = {"strategy", "target_engine", "feature_store", "control_plane"}

EXAMPLE_STRATEGY = """
import attrs
from specforge_core import hookimpl
from specforge_core.options import option
from specforge_core.specs import StrategySpec

@attrs.frozen
class Opts:
    depth: int = option(2, "How deep.")

@hookimpl
def specforge_strategies():
    return [StrategySpec(name="toyalgo", factory="sf_cli_toyalgo:Strategy", options=Opts, requires={"last_hidden"})]


@hookimpl
def specforge_add_commands(cli):
    import click

    @cli.command(name="toyalgo-hello")
    def hello():
        "Say hello from a plugin command."
        click.echo("hello from toyalgo")
"""


@pytest.fixture
def toy_env(fake_site):
    fake_site.add("specforge-plugin-toyalgo", "0.4.2", entry_points={"toyalgo": "sf_cli_toyalgo"},
                  modules={"sf_cli_toyalgo": EXAMPLE_STRATEGY + strategy_source()})
    fake_site.add("specforge-plugin-crashy", "0.0.1", entry_points={"crashy": "sf_cli_crashy"},
                  modules={"sf_cli_crashy": "raise ImportError('needs libfoo')\n"})
    return fake_site.env(SPECFORGE_STRICT_PLUGINS="0")


def test_plugins_json_schema_lists_every_plugin_with_status(toy_env):
    entries = plugins_json(toy_env)
    for entry in entries:
        assert set(entry) == ENTRY_KEYS
        assert set(entry["provides"]) == KINDS
        assert entry["status"] in {"active", "failed", "disabled"}
    by_name = {e["name"]: e for e in entries}
    assert by_name["builtin"]["distribution"] == "specforge-core"
    assert by_name["builtin"]["version"] == specforge_core.__version__
    assert by_name["toyalgo"] == {
        "name": "toyalgo", "distribution": "specforge-plugin-toyalgo", "version": "0.4.2",
        "entry_point": "toyalgo = sf_cli_toyalgo", "status": "active", "error": None,
        "provides": {"strategy": ["toyalgo"], "target_engine": [], "feature_store": [], "control_plane": []}}
    assert by_name["crashy"]["status"] == "failed"
    assert by_name["crashy"]["error"] == "import failed: ImportError: needs libfoo"


def test_failed_plugin_warns_in_one_line_and_the_command_still_works(toy_env):
    proc = run_cli("plugins", env=toy_env)
    assert proc.returncode == 0
    warnings = [line for line in proc.stderr.splitlines() if "skipping plugin" in line]
    assert warnings == ["specforge: skipping plugin 'crashy' (specforge-plugin-crashy 0.0.1): "
                        "import failed: ImportError: needs libfoo"]


def test_strict_plugins_env_makes_a_broken_plugin_fatal(toy_env):
    proc = run_cli("plugins", env=dict(toy_env, SPECFORGE_STRICT_PLUGINS="1"))
    assert proc.returncode != 0
    assert "needs libfoo" in proc.stderr


def test_version_lists_core_and_plugins(toy_env):
    out = run_cli("--version", env=toy_env, check=True).stdout.splitlines()
    assert out[0] == f"specforge-core {specforge_core.__version__}"
    assert "  toyalgo: specforge-plugin-toyalgo 0.4.2" in out
    assert "  crashy: specforge-plugin-crashy 0.0.1 (failed)" in out


def test_plugin_subcommands_are_added_through_the_hook(toy_env):
    assert "toyalgo-hello" in run_cli("--help", env=toy_env, check=True).stdout
    assert run_cli("toyalgo-hello", env=toy_env, check=True).stdout == "hello from toyalgo\n"


def test_dry_run_prints_the_resolved_plan(toy_env):
    out = run_cli("run", "--strategy", "toyalgo", "--set", "strategy.depth=5", "--set", "train.lr=3e-4",
                  "--output", "o", "--dry-run", env=toy_env, check=True).stdout
    plan = json.loads(out)
    assert plan["strategy"]["name"] == "toyalgo"
    assert plan["strategy"]["distribution"] == "specforge-plugin-toyalgo"
    assert plan["strategy"]["options"] == {"depth": 5}
    assert plan["target_engine"]["name"] == "hf"
    assert plan["feature_store"]["name"] == "memory"
    assert plan["control_plane"]["name"] == "local"
    assert plan["train"]["lr"] == 3e-4
    assert plan["output"] == "o"


def test_dry_run_reads_a_config_file_and_flags_override_it(toy_env, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("strategy: {name: toyalgo, depth: 3}\nfeature_store: disk\ntrain: {batch_size: 8}\n")
    plan = json.loads(run_cli("run", "--config", str(config), "--set", "train.batch_size=2", "--feature-store",
                              "memory", "--dry-run", env=toy_env, check=True).stdout)
    assert plan["strategy"]["options"] == {"depth": 3}
    assert plan["train"]["batch_size"] == 2
    assert plan["feature_store"]["name"] == "memory"


@pytest.mark.parametrize("args, message", [
    (["--strategy", "toyalgo", "--set", "strategy.dept=1"],
     "error: unknown option 'strategy.dept'; strategy accepts: depth"),
    (["--strategy", "toyalgo", "--set", "train.batch_size=zero"],
     "error: option 'train.batch_size': expected an integer, got 'zero'"),
    (["--strategy", "toyalgp"], "error: unknown strategy 'toyalgp'. Available: "),
    (["--strategy", "toyalgo", "--feature-store", "memroy"], "error: unknown feature store 'memroy'. Available: "),
    (["--strategy", "toyalgo", "--set", "bogus"], "error: --set 'bogus': expected the form section.key=value"),
])
def test_bad_run_arguments_exit_2_with_a_message_naming_the_key(toy_env, args, message):
    proc = run_cli("run", *args, "--dry-run", env=toy_env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(message)
    assert proc.stdout == ""


def test_unknown_name_suggests_the_closest_one(toy_env):
    proc = run_cli("run", "--strategy", "toyalgp", "--dry-run", env=toy_env)
    assert "Did you mean 'toyalgo'?" in proc.stderr


def test_missing_config_file_is_a_clear_error(toy_env, tmp_path):
    proc = run_cli("run", "--config", str(tmp_path / "nope.yaml"), "--dry-run", env=toy_env)
    assert proc.returncode == 2
    assert f"config file '{tmp_path / 'nope.yaml'}' does not exist" in proc.stderr


def test_options_command_documents_a_component(toy_env):
    out = run_cli("options", "control_plane", "sqlite", env=toy_env, check=True).stdout
    assert "control_plane.high_watermark (int, default 1024)" in out
    assert "Producer pauses when this many published refs are not yet consumed." in out


@pytest.mark.parametrize("name", ["recompute_mlp", "train.recompute_mlp"])
def test_options_command_describes_one_option_of_a_section(toy_env, name):
    out = run_cli("options", "train", name, env=toy_env, check=True).stdout
    lines = out.splitlines()
    assert lines[:2] == ["train: How the training loop runs (the `train` section).",
                         "  train.recompute_mlp (bool, default False)"]
    assert len(lines) == 3 and lines[2].startswith("      Make each gated MLP's gate and up projections again")


@pytest.mark.parametrize(("section", "name", "message"), [
    ("train", "recompute_mpl", "error: section 'train' has no option 'recompute_mpl' (did you mean 'recompute_mlp'?); "
                               "`specforge options train` lists its"),
    ("data", "zzz", "error: section 'data' has no option 'zzz'; `specforge options data` lists its"),
])
def test_options_command_names_an_unknown_option_of_a_section(toy_env, section, name, message):
    proc = run_cli("options", section, name, env=toy_env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


LIGHT_PROBE = """
import runpy, sys
sys.argv = {argv!r}
try:
    runpy.run_module("specforge_core.cli", run_name="__main__")
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {{"torch", "transformers", "safetensors", "numpy"}})
sys.stderr.write("HEAVY=" + ",".join(heavy) + "\\n")
"""


@pytest.mark.parametrize("argv", [["specforge", "--help"], ["specforge", "--version"],
                                  ["specforge", "plugins"], ["specforge", "plugins", "--json"]])
def test_light_commands_do_not_import_torch(argv):
    proc = subprocess.run([sys.executable, "-c", LIGHT_PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=60)
    assert "HEAVY=\n" in proc.stderr, proc.stderr


def test_importing_the_core_does_not_import_torch():
    code = "import sys, specforge_core, specforge_core.plugins, specforge_core.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"


def test_console_script_is_installed():
    assert run_cli("--help", check=True).stdout.startswith("Usage: specforge")
    assert SPECFORGE.endswith("specforge")


def test_options_of_a_strategy_lists_the_formats_it_exports():
    from sf_helpers import run_specforge

    out = run_specforge("options", "strategy", "eagle3").stdout
    assert "  export formats: sglang, vllm, speculators" in out
    assert "  export formats: sglang\n" in run_specforge("options", "strategy", "domino").stdout
