"""The plugin manager: discovery, failures, conflicts, allow/deny lists, unknown names."""

import logging

import pytest

from specforge_core.errors import CapabilityError, PluginConflictError, PluginError, UnknownComponentError
from specforge_core.specs import check_capabilities

STRATEGY_MODULE = """
import attrs
from specforge_core import hookimpl
from specforge_core.options import option
from specforge_core.specs import StrategySpec, TargetEngineSpec

@attrs.frozen
class Opts:
    depth: int = option(2, "How deep.")

@hookimpl
def specforge_strategies():
    return [StrategySpec(name={name!r}, factory="{module}:Strategy", options=Opts,
                         description="test strategy", requires={requires!r})]
"""

ENGINE_MODULE = """
from specforge_core import hookimpl
from specforge_core.specs import TargetEngineSpec

@hookimpl
def specforge_target_engines():
    return [TargetEngineSpec(name={name!r}, factory="{module}:Engine", capabilities={caps!r})]
"""


def add_strategy(site, dist, module, name, version="1.0", requires=(), ep=None):
    source = STRATEGY_MODULE.format(name=name, module=module, requires=set(requires))
    site.add(dist, version, entry_points={ep or module: module}, modules={module: source})


def test_good_plugin_is_active_and_its_spec_carries_provenance(fake_site):
    add_strategy(fake_site, "specforge-plugin-alpha", "sf_alpha_good", "alpha", version="1.2.3", ep="alpha")
    manager = fake_site.manager()
    spec = manager.get("strategy", "alpha")
    assert spec.factory == "sf_alpha_good:Strategy"
    assert spec.provenance.distribution == "specforge-plugin-alpha"
    assert spec.provenance.version == "1.2.3"
    assert spec.provenance.entry_point == "alpha = sf_alpha_good"
    record = {r["name"]: r for r in manager.plugin_list()}["alpha"]
    assert record["status"] == "active"
    assert record["error"] is None
    assert record["provides"]["strategy"] == ["alpha"]


def test_builtin_plugin_is_listed_like_any_other(fake_site):
    records = {r["name"]: r for r in fake_site.manager().plugin_list()}
    assert records["builtin"]["distribution"] == "specforge-core"
    assert records["builtin"]["provides"]["feature_store"] == ["disk", "memory"]
    assert records["builtin"]["provides"]["control_plane"] == ["local", "noop", "sqlite"]


def test_plugin_whose_import_raises_is_skipped_with_one_warning_and_listed_failed(fake_site, caplog):
    fake_site.add("specforge-plugin-broken", "0.3", entry_points={"broken": "sf_broken_mod"},
                  modules={"sf_broken_mod": "raise RuntimeError('no GPU driver here')\n"})
    add_strategy(fake_site, "specforge-plugin-fine", "sf_fine_mod", "fine", ep="fine")
    with caplog.at_level(logging.WARNING, logger="specforge.plugins"):
        manager = fake_site.manager()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "skipping plugin 'broken' (specforge-plugin-broken 0.3)" in warnings[0]
    assert "\n" not in warnings[0]
    record = {r["name"]: r for r in manager.plugin_list()}["broken"]
    assert record["status"] == "failed"
    assert record["error"] == "import failed: RuntimeError: no GPU driver here"
    assert manager.get("strategy", "fine").name == "fine"  # the others still load


def test_strict_mode_reraises_the_import_error(fake_site):
    fake_site.add("specforge-plugin-broken", "0.3", entry_points={"broken": "sf_broken_strict"},
                  modules={"sf_broken_strict": "raise RuntimeError('boom at import')\n"})
    with pytest.raises(RuntimeError, match="boom at import"):
        fake_site.manager(strict=True)
    with pytest.raises(RuntimeError, match="boom at import"):
        fake_site.manager(environ={"SPECFORGE_STRICT_PLUGINS": "1"})


def test_two_plugins_claiming_one_strategy_name_is_an_error_naming_both(fake_site):
    add_strategy(fake_site, "specforge-plugin-one", "sf_clash_one", "same", version="1.0", ep="one")
    add_strategy(fake_site, "specforge-plugin-two", "sf_clash_two", "same", version="2.5", ep="two")
    manager = fake_site.manager()
    with pytest.raises(PluginConflictError) as info:
        manager.get("strategy", "same")
    message = str(info.value)
    assert "strategy 'same' is provided by both" in message
    assert "specforge-plugin-one 1.0" in message and "specforge-plugin-two 2.5" in message
    with pytest.raises(PluginConflictError, match="specforge-plugin-two 2.5"):
        manager.specs("strategy")
    assert len(manager.conflicts()) == 1


def test_a_clash_over_one_name_leaves_the_other_names_of_its_kind_usable(fake_site):
    add_strategy(fake_site, "specforge-plugin-one", "sf_clash_one", "same", version="1.0", ep="one")
    add_strategy(fake_site, "specforge-plugin-two", "sf_clash_two", "same", version="2.5", ep="two")
    add_strategy(fake_site, "specforge-plugin-bystander", "sf_bystander", "other", version="0.3", ep="bystander")
    manager = fake_site.manager()
    assert manager.get("strategy", "other").provenance.distribution == "specforge-plugin-bystander"
    with pytest.raises(UnknownComponentError, match=r"unknown strategy 'nothing'\. Available: other\."):
        manager.get("strategy", "nothing")
    with pytest.raises(PluginConflictError, match="strategy 'same' is provided by both"):
        manager.get("strategy", "same")


def test_entry_point_name_clash_across_distributions_fails_the_second(fake_site):
    add_strategy(fake_site, "specforge-plugin-aaa", "sf_ep_a", "from_a", version="1.0", ep="shared")
    add_strategy(fake_site, "specforge-plugin-bbb", "sf_ep_b", "from_b", version="3.0", ep="shared")
    manager = fake_site.manager()
    records = manager.plugin_list()
    failed = [r for r in records if r["status"] == "failed"]
    assert len(failed) == 1
    assert "entry point name 'shared' is claimed by both" in failed[0]["error"]
    assert "specforge-plugin-aaa 1.0" in failed[0]["error"] and "specforge-plugin-bbb 3.0" in failed[0]["error"]
    with pytest.raises(PluginConflictError, match="claimed by both"):
        fake_site.manager(strict=True)


def test_disable_list_skips_plugins_without_importing_them(fake_site):
    fake_site.add("specforge-plugin-noisy", entry_points={"noisy": "sf_noisy_mod"},
                  modules={"sf_noisy_mod": "raise SystemError('must not be imported')\n"})
    add_strategy(fake_site, "specforge-plugin-kept", "sf_kept_mod", "kept", ep="kept")
    manager = fake_site.manager(environ={"SPECFORGE_DISABLE_PLUGINS": "noisy"})
    records = {r["name"]: r for r in manager.plugin_list()}
    assert records["noisy"]["status"] == "disabled"
    assert records["noisy"]["error"] is None
    assert records["kept"]["status"] == "active"


def test_disable_list_matches_distribution_names_and_builtin(fake_site):
    add_strategy(fake_site, "specforge-plugin-kept", "sf_kept_two", "kept", ep="kept")
    manager = fake_site.manager(environ={"SPECFORGE_DISABLE_PLUGINS": "specforge_plugin_kept, builtin"})
    statuses = {r["name"]: r["status"] for r in manager.plugin_list()}
    assert statuses == {"builtin": "disabled", "kept": "disabled"}
    with pytest.raises(UnknownComponentError, match="is disabled by SPECFORGE_DISABLE_PLUGINS"):
        manager.get("strategy", "kept")


def test_allow_list_loads_only_the_named_plugins(fake_site):
    add_strategy(fake_site, "specforge-plugin-in", "sf_allow_in", "inside", ep="inside")
    add_strategy(fake_site, "specforge-plugin-out", "sf_allow_out", "outside", ep="outside")
    manager = fake_site.manager(environ={"SPECFORGE_ALLOW_PLUGINS": "inside,builtin"})
    statuses = {r["name"]: r["status"] for r in manager.plugin_list()}
    assert statuses == {"builtin": "active", "inside": "active", "outside": "disabled"}
    assert sorted(manager.specs("strategy")) == ["inside"]


def test_unknown_name_lists_choices_and_the_install_hint_for_first_party_names(fake_site):
    add_strategy(fake_site, "specforge-plugin-alpha", "sf_unknown_alpha", "alpha", ep="alpha")
    manager = fake_site.manager()
    with pytest.raises(UnknownComponentError) as info:
        manager.get("strategy", "dflash")
    assert str(info.value) == ("unknown strategy 'dflash'. Available: alpha. "
                               "It is provided by specforge-plugin-dflash: pip install specforge-plugin-dflash")
    with pytest.raises(UnknownComponentError, match=r"unknown strategy 'alpah'\. Available: alpha\. "
                                                     r"Did you mean 'alpha'\?"):
        manager.get("strategy", "alpah")


def test_unknown_name_reports_the_load_error_of_the_plugin_that_provides_it(fake_site):
    fake_site.add("specforge-plugin-dflash", "0.9", entry_points={"dflash": "sf_dflash_broken"},
                  modules={"sf_dflash_broken": "import not_a_module_anywhere\n"})
    manager = fake_site.manager()
    with pytest.raises(UnknownComponentError) as info:
        manager.get("strategy", "dflash")
    assert "The plugin 'dflash' (specforge-plugin-dflash 0.9) failed to load: import failed: " \
           "ModuleNotFoundError: No module named 'not_a_module_anywhere' (a module that 'sf_dflash_broken' imports; " \
           "is a dependency missing or misspelled?)" in str(info.value)


def test_an_entry_point_naming_a_missing_module_says_so_and_options_must_be_attrs(fake_site):
    fake_site.add("specforge-plugin-ghost", "0.1", entry_points={"ghost": "sf_ghost_nowhere"}, modules={})
    fake_site.add("specforge-plugin-plain", "0.1", entry_points={"plain": "sf_plain_opts"}, modules={"sf_plain_opts": """
from specforge_core import hookimpl
from specforge_core.specs import StrategySpec

class Opts:
    width = 4

@hookimpl
def specforge_strategies():
    return [StrategySpec(name="plain", factory="sf_plain_opts:Nothing", options=Opts)]
"""})
    records = {r["name"]: r for r in fake_site.manager().plugin_list()}
    assert records["ghost"]["error"] == ("import failed: ModuleNotFoundError: No module named 'sf_ghost_nowhere' (the "
                                         "entry point 'ghost = sf_ghost_nowhere' names a module that is not installed)")
    assert records["plain"]["error"] == ("specforge_strategies() returned strategy 'plain' whose options class Opts is "
                                         "not an attrs class: decorate it with @attrs.frozen and declare its fields "
                                         "with specforge_core.options.option")


def test_misspelled_hook_fails_naming_the_plugin_and_the_hook(fake_site):
    source = """
from specforge_core import hookimpl

@hookimpl
def specforge_strategy():
    return []
"""
    fake_site.add("specforge-plugin-typo", "0.1", entry_points={"typo": "sf_typo_mod"}, modules={"sf_typo_mod": source})
    manager = fake_site.manager()
    record = {r["name"]: r for r in manager.plugin_list()}["typo"]
    assert record["status"] == "failed"
    assert record["error"] == ("implements unknown hook 'specforge_strategy' "
                               "(did you mean 'specforge_strategies'?)")
    with pytest.raises(PluginError, match=r"plugin 'typo' \(specforge-plugin-typo 0.1\): implements unknown hook"):
        fake_site.manager(strict=True)


def test_hook_with_an_argument_the_spec_does_not_have_is_rejected(fake_site):
    source = """
from specforge_core import hookimpl

@hookimpl
def specforge_step_end(global_step, loss_scale):
    pass
"""
    fake_site.add("specforge-plugin-badarg", "0.1", entry_points={"badarg": "sf_badarg_mod"},
                  modules={"sf_badarg_mod": source})
    record = {r["name"]: r for r in fake_site.manager().plugin_list()}["badarg"]
    assert record["status"] == "failed"
    assert record["error"] == (  # one line, ending with what the hook passes
        "invalid hook implementation: Plugin 'badarg' for hook 'specforge_step_end'; hookimpl definition: "
        "specforge_step_end(global_step, loss_scale); Argument(s) {'loss_scale'} are declared in the hookimpl but "
        "can not be found in the hookspec; specforge_step_end passes (run_id, global_step, metrics), and an "
        "implementation takes any of those by name")


def test_a_hook_function_without_hookimpl_fails_the_plugin_instead_of_being_ignored(fake_site):
    source = """
from specforge_core import hookimpl
from specforge_core.specs import StrategySpec

def specforge_strategies():
    return [StrategySpec(name="forgotten", factory="sf_nomark_mod:Nothing")]

@hookimpl
def specforge_step_end(global_step):
    pass
"""
    fake_site.add("specforge-plugin-nomark", "0.1", entry_points={"nomark": "sf_nomark_mod"},
                  modules={"sf_nomark_mod": source})
    manager = fake_site.manager()
    record = {r["name"]: r for r in manager.plugin_list()}["nomark"]
    assert record["status"] == "failed"
    assert record["error"] == ("defines 'specforge_strategies' without @hookimpl (from specforge_core import "
                               "hookimpl), so specforge would never call it")
    with pytest.raises(UnknownComponentError, match=r"unknown strategy 'forgotten'\. Available: \(none\)\. Plugins "
                                                    r"that failed to load: 'nomark' \(specforge-plugin-nomark 0\.1\): "
                                                    r"defines 'specforge_strategies' without @hookimpl"):
        manager.get("strategy", "forgotten")


def test_hook_returning_the_wrong_spec_type_fails_the_plugin(fake_site):
    source = """
from specforge_core import hookimpl
from specforge_core.specs import TargetEngineSpec

@hookimpl
def specforge_strategies():
    return [TargetEngineSpec(name="oops", factory="x:y")]
"""
    fake_site.add("specforge-plugin-wrongtype", entry_points={"wrongtype": "sf_wrongtype_mod"},
                  modules={"sf_wrongtype_mod": source})
    record = {r["name"]: r for r in fake_site.manager().plugin_list()}["wrongtype"]
    assert record["error"] == "specforge_strategies() returned TargetEngineSpec; expected StrategySpec"


def test_loading_is_idempotent(fake_site):
    add_strategy(fake_site, "specforge-plugin-once", "sf_once_mod", "once", ep="once")
    manager = fake_site.manager()
    before = manager.plugin_list()
    assert manager.load() is manager
    assert manager.plugin_list() == before
    assert len(manager.pm.get_plugins()) == 2  # builtin + once, registered once


@pytest.mark.parametrize("requires, message", [
    (("aux_hidden_states", "verify"),
     "strategy 'needy' (specforge-plugin-needy 1.0) requires aux_hidden_states, verify, which target_engine 'weak' "
     "(specforge-plugin-weak 0.2) does not provide (it provides: last_hidden). Choose another --target-engine or "
     "strategy."),
    (("last_hiden",),  # a near miss of a known capability is the strategy's typo, not the engine's lack
     "strategy 'needy' (specforge-plugin-needy 1.0) requires last_hiden, which target_engine 'weak' "
     "(specforge-plugin-weak 0.2) does not provide (it provides: last_hidden). A misspelled requirement in the "
     "strategy's spec: 'last_hiden' (did you mean 'last_hidden'?)."),
])
def test_capability_mismatch_names_both_plugins(fake_site, requires, message):
    add_strategy(fake_site, "specforge-plugin-needy", "sf_needy_mod", "needy", requires=requires, ep="needy")
    fake_site.add("specforge-plugin-weak", "0.2", entry_points={"weak": "sf_weak_mod"},
                  modules={"sf_weak_mod": ENGINE_MODULE.format(name="weak", module="sf_weak_mod",
                                                               caps={"last_hidden"})})
    manager = fake_site.manager()
    with pytest.raises(CapabilityError) as info:
        check_capabilities(manager.get("strategy", "needy"), manager.get("target_engine", "weak"))
    assert str(info.value) == message


def test_plugin_set_is_the_same_for_two_managers_over_the_same_site(fake_site):
    add_strategy(fake_site, "specforge-plugin-same", "sf_same_mod", "same", ep="same")
    assert fake_site.manager().plugin_set() == fake_site.manager().plugin_set() == [
        ("builtin", "specforge-core", "0.1.0", "active"), ("same", "specforge-plugin-same", "1.0", "active")]


def test_lazy_factory_is_not_imported_until_loaded(fake_site):
    add_strategy(fake_site, "specforge-plugin-lazy", "sf_lazy_mod", "lazy", ep="lazy")
    spec = fake_site.manager().get("strategy", "lazy")
    with pytest.raises(PluginError, match=r"strategy 'lazy' from specforge-plugin-lazy 1.0: cannot load factory "
                                          r"'sf_lazy_mod:Strategy': AttributeError"):
        spec.load_factory()
