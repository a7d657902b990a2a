"""Each hook, exercised through a fake installed plugin, plus the docs meta-test."""

import inspect
import pathlib
import re

import click

from specforge_core import hookspecs

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOOK_NAMES = sorted(name for name in dir(hookspecs) if name.startswith("specforge_"))

SPECS_MODULE = """
from specforge_core import hookimpl
from specforge_core.specs import ControlPlaneSpec, FeatureStoreSpec, StrategySpec, TargetEngineSpec

@hookimpl
def specforge_strategies():
    yield StrategySpec(name="s1", factory="m:S")

@hookimpl
def specforge_target_engines():
    return (TargetEngineSpec(name="e1", factory="m:E", capabilities={"last_hidden"}),)

@hookimpl
def specforge_feature_stores():
    return [FeatureStoreSpec(name="f1", factory="m:F")]

@hookimpl
def specforge_control_planes():
    return [ControlPlaneSpec(name="c1", factory="m:C")]
"""

OBSERVER_MODULE = """
from specforge_core import hookimpl

CALLS = []

@hookimpl
def specforge_run_started(run_id, output_dir, config):
    CALLS.append(("started", run_id, output_dir, config))

@hookimpl
def specforge_step_end(global_step, metrics):  # fewer arguments than the spec: allowed
    CALLS.append(("step", global_step, metrics))

@hookimpl
def specforge_checkpoint_saved(path):
    CALLS.append(("ckpt", path))

@hookimpl
def specforge_eval_end(global_step, metrics):
    CALLS.append(("eval", global_step, metrics))

@hookimpl
def specforge_run_finished(run_id, summary):
    CALLS.append(("finished", run_id, summary))

@hookimpl
def specforge_add_commands(cli):
    import click

    @cli.command(name="observer-ping")
    def ping():
        click.echo("pong")
"""


def _manager(fake_site):
    fake_site.add("specforge-plugin-specs", "1.0", entry_points={"specs": "sf_hooks_specs"},
                  modules={"sf_hooks_specs": SPECS_MODULE})
    fake_site.add("specforge-plugin-observer", "1.0", entry_points={"observer": "sf_hooks_observer"},
                  modules={"sf_hooks_observer": OBSERVER_MODULE})
    return fake_site.manager(strict=True)


def test_hook_specforge_strategies(fake_site):
    spec = _manager(fake_site).get("strategy", "s1")
    assert (spec.factory, spec.provenance.plugin) == ("m:S", "specs")


def test_hook_specforge_target_engines(fake_site):
    assert _manager(fake_site).get("target_engine", "e1").capabilities == frozenset({"last_hidden"})


def test_hook_specforge_feature_stores(fake_site):
    assert sorted(_manager(fake_site).specs("feature_store")) == ["disk", "f1", "memory"]


def test_hook_specforge_control_planes(fake_site):
    assert sorted(_manager(fake_site).specs("control_plane")) == ["c1", "local", "noop", "sqlite"]


def _observer_calls(manager):
    return manager.records["observer"].module.CALLS


def test_hook_specforge_run_started(fake_site):
    manager = _manager(fake_site)
    manager.hook.specforge_run_started(run_id="r1", output_dir="/o", config={"a": 1})
    assert _observer_calls(manager) == [("started", "r1", "/o", {"a": 1})]


def test_hook_specforge_step_end(fake_site):
    manager = _manager(fake_site)
    manager.hook.specforge_step_end(run_id="r1", global_step=3, metrics={"loss": 0.5})
    assert _observer_calls(manager) == [("step", 3, {"loss": 0.5})]


def test_hook_specforge_eval_end(fake_site):
    manager = _manager(fake_site)
    manager.hook.specforge_eval_end(run_id="r1", global_step=4, metrics={"accept_len_sim": 2.5})
    assert _observer_calls(manager) == [("eval", 4, {"accept_len_sim": 2.5})]


def test_hook_specforge_checkpoint_saved(fake_site):
    manager = _manager(fake_site)
    manager.hook.specforge_checkpoint_saved(run_id="r1", global_step=3, path="/o/r1-step3")
    assert _observer_calls(manager) == [("ckpt", "/o/r1-step3")]


def test_hook_specforge_run_finished(fake_site):
    manager = _manager(fake_site)
    manager.hook.specforge_run_finished(run_id="r1", output_dir="/o", summary={"steps": 3})
    assert _observer_calls(manager) == [("finished", "r1", {"steps": 3})]


def test_hook_specforge_add_commands(fake_site):
    manager = _manager(fake_site)
    group = click.Group(name="specforge")
    manager.hook.specforge_add_commands(cli=group)
    assert "observer-ping" in group.commands


def _signature(name):
    return name + str(inspect.signature(getattr(hookspecs, name))).replace("'", "")


def test_every_hookspec_is_documented_with_its_exact_signature():
    docs = (ROOT / "docs" / "hooks.md").read_text()
    for name in HOOK_NAMES:
        assert f"### {name}\n" in docs, f"docs/hooks.md has no section for {name}"
        assert _signature(name) in docs, f"docs/hooks.md does not show {_signature(name)}"


def test_every_hookspec_has_a_docstring_with_an_example():
    for name in HOOK_NAMES:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert "Example::" in doc and "@hookimpl" in doc, name


def test_every_hookspec_has_a_test():
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    tested = set(re.findall(r"^def test_hook_(specforge_\w+)\(", sources, flags=re.M))
    assert sorted(set(HOOK_NAMES) - tested) == []
