"""Checks before anything heavy: implementations import, strategies have their methods, required options are set."""

import pytest

from sf_helpers import run_cli, strategy_source

from specforge_core.config import resolve_plan
from specforge_core.errors import OptionError, PluginError
from specforge_core.runtime import execute

HOOKS = """
import attrs
from specforge_core import hookimpl
from specforge_core.options import option
from specforge_core.specs import StrategySpec, TargetEngineSpec

@attrs.frozen
class Opts:
    depth: int = option(doc="How deep the draft is.")
    width: int = option(4, "How wide.")

@attrs.frozen
class NoOpts:
    pass

@hookimpl
def specforge_strategies():
    return [StrategySpec(name=name, factory=f"sf_pre_impl:{cls}", options=Opts if name == "needy" else NoOpts)
            for name, cls in (("typo", "Typo"), ("halfserved", "HalfServed"), ("needy", "Fine"),
                              ("fine", "Fine"), ("notcallable", "CONSTANT"), ("shortloss", "ShortLoss"),
                              ("narrowexport", "NarrowExport"), ("servedwell", "ServedWell"),
                              ("oneargfactory", "OneArgFactory"))]

@hookimpl
def specforge_target_engines():
    return [TargetEngineSpec(name="tripwire", factory="sf_pre_impl:Tripwire")]
"""

BROKEN_HOOKS = """
from specforge_core import hookimpl
from specforge_core.specs import StrategySpec

@hookimpl
def specforge_strategies():
    return [StrategySpec(name="broken", factory="sf_pre_missing_impl:Strategy")]
"""

IMPLEMENTATION = strategy_source("Fine") + strategy_source("Typo", loss_method="forward_los") + """

class HalfServed(Fine):
    def export(self, model, out_dir, target): ...


class ShortLoss(Fine):
    def forward_loss(self, model, batch): ...


class ServedWell(Fine):
    def export(self, model, out_dir, target=None, *, fmt, dtype="bfloat16"): ...

    def load_export(self, path, target, frozen_parts): ...

    def speculate(self, model, session, prompt, *, max_new_tokens, eos_token_id=None): ...


class NarrowExport(ServedWell):
    def export(self, model, out_dir): ...


class OneArgFactory(Fine):
    def __init__(self, options):
        self.options = options


class Tripwire:
    def __init__(self, options, context):
        raise RuntimeError("the target engine was built")


CONSTANT = 3
"""


@pytest.fixture
def site(fake_site):
    fake_site.add("specforge-plugin-pre", "0.3.0", entry_points={"pre": "sf_pre_hooks"},
                  modules={"sf_pre_hooks": HOOKS, "sf_pre_impl": IMPLEMENTATION})
    fake_site.add("specforge-plugin-broken", "0.0.2", entry_points={"brokenimpl": "sf_pre_broken_hooks"},
                  modules={"sf_pre_broken_hooks": BROKEN_HOOKS,
                           "sf_pre_missing_impl": "import sf_a_module_nobody_installed\n"})
    return fake_site


def dry_run(site, strategy, *extra):
    return run_cli("run", "--strategy", strategy, *extra, "--dry-run", env=site.env(SPECFORGE_STRICT_PLUGINS="1"))


def test_an_import_error_in_the_implementation_fails_the_dry_run_naming_plugin_and_factory(site):
    proc = dry_run(site, "broken")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "error: strategy 'broken' from specforge-plugin-broken 0.0.2: cannot load factory 'sf_pre_missing_impl:Strategy': "
        "ModuleNotFoundError: No module named 'sf_a_module_nobody_installed'")


def test_plugins_lists_the_broken_plugin_as_active_and_check_reports_it(site):
    env = site.env(SPECFORGE_STRICT_PLUGINS="1")
    assert run_cli("plugins", env=env).returncode == 0  # listing imports only the hook modules
    proc = run_cli("plugins", "--check", env=env)
    assert proc.returncode == 1
    assert "error: strategy 'broken' from specforge-plugin-broken 0.0.2: cannot load factory" in proc.stdout
    assert "error: strategy 'notcallable' (specforge-plugin-pre 0.3.0): factory 'sf_pre_impl:CONSTANT' is a int" \
           in proc.stdout
    # the strategies' classes are checked as a dry run checks their instances, without building them
    assert ("error: strategy 'typo' (specforge-plugin-pre 0.3.0): Typo does not implement 'forward_loss' (it has "
            "'forward_los'; a typo?)") in proc.stdout
    assert ("error: strategy 'shortloss' (specforge-plugin-pre 0.3.0): ShortLoss.forward_loss(model, batch) cannot be "
            "called as specforge calls it, forward_loss(model, batch, ctx)") in proc.stdout
    assert "HalfServed implements export but not 'load_export', 'speculate'" in proc.stdout
    for good in ("fine", "servedwell", "needy"):
        assert f"strategy '{good}' (specforge-plugin-pre" not in proc.stdout


def test_a_misspelled_required_method_is_named_with_the_typo(site):
    proc = dry_run(site, "typo")
    assert proc.returncode == 2
    assert ("error: strategy 'typo' (specforge-plugin-pre 0.3.0): Typo does not implement 'forward_loss' (it has "
            "'forward_los'; a typo?); a strategy implements capture_plan, build_model, collate, forward_loss") \
        in proc.stderr


def test_half_of_the_serving_methods_is_refused(site):
    proc = dry_run(site, "halfserved")
    assert proc.returncode == 2
    assert ("HalfServed implements export but not 'load_export', 'speculate'; a strategy that can be served "
            "implements all of export, load_export, speculate") in proc.stderr


def test_a_factory_that_is_not_callable_is_refused(site):
    proc = dry_run(site, "notcallable")
    assert proc.returncode == 2 and "factory 'sf_pre_impl:CONSTANT' is a int, not a class or function" in proc.stderr


@pytest.mark.parametrize("strategy, message", [
    ("shortloss", "error: strategy 'shortloss' (specforge-plugin-pre 0.3.0): ShortLoss.forward_loss(model, batch) "
                  "cannot be called as specforge calls it, forward_loss(model, batch, ctx): too many positional "
                  "arguments; see specforge_core.protocols.Strategy"),
    ("narrowexport", "error: strategy 'narrowexport' (specforge-plugin-pre 0.3.0): NarrowExport.export(model, "
                     "out_dir) cannot be called as specforge calls it, export(model, out_dir, target): too many "
                     "positional arguments"),
    ("oneargfactory", "error: strategy 'oneargfactory' (specforge-plugin-pre 0.3.0): factory "
                      "'sf_pre_impl:OneArgFactory'(options) cannot be called as specforge calls it, factory(options, "
                      "context): too many positional arguments"),
])
def test_a_method_or_factory_that_cannot_take_specforges_call_is_refused_at_the_dry_run(site, strategy, message):
    proc = dry_run(site, strategy)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().startswith(message), proc.stderr


def test_signatures_with_defaults_and_the_keywords_specforge_passes_are_accepted(site):
    proc = dry_run(site, "servedwell")
    assert proc.returncode == 0, proc.stderr


def test_a_required_option_without_a_value_names_the_plugin_and_the_set_flag(site):
    proc = dry_run(site, "needy")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: strategy 'needy' (specforge-plugin-pre 0.3.0) needs option 'strategy.depth' (How deep the draft is.), "
        "which has no default: set it with --set strategy.depth=VALUE or in the config file's strategy section")
    assert dry_run(site, "needy", "--set", "strategy.depth=2").returncode == 0


def test_a_good_strategy_passes(site):
    proc = dry_run(site, "fine")
    assert proc.returncode == 0, proc.stderr


def test_the_runtime_checks_the_strategy_before_it_builds_the_target_engine(site, tmp_path):
    manager = site.manager(strict=True)
    plan = resolve_plan(manager, {"strategy": "typo", "target_engine": "tripwire", "output": str(tmp_path / "o")})
    with pytest.raises(PluginError, match="Typo does not implement 'forward_loss'"):
        execute(plan, manager)  # a RuntimeError 'the target engine was built' would mean the check came too late


def test_options_without_default_fail_in_python_too(site):
    spec = site.manager(strict=True).get("strategy", "needy")
    with pytest.raises(OptionError, match=r"needs option 'strategy.depth'"):
        spec.build_options({})
