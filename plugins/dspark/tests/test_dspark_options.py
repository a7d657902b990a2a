"""Options (DFlash's, extended), the capture plan, the registered spec, and a light hook module."""

import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from specforge_core.errors import OptionError
from specforge_core.options import build_options
from specforge_plugin_dflash import DFlashOptions

from specforge_plugin_dspark import DSparkOptions, specforge_strategies
from specforge_plugin_dspark.config import DSparkConfigError, DSparkHeadConfig


def test_dspark_options_are_dflash_options_plus_the_heads_the_loss_mix_and_decoding():
    assert issubclass(DSparkOptions, DFlashOptions)
    dflash = {f.name for f in attrs.fields(DFlashOptions)}
    dspark = {f.name: f.default for f in attrs.fields(DSparkOptions)}
    assert dflash < set(dspark)
    assert {k: v for k, v in dspark.items() if k not in dflash} == {
        "markov_rank": 256, "markov_head_type": "vanilla", "confidence_with_markov": True, "ce_loss_alpha": 0.1,
        "l1_loss_alpha": 0.9, "confidence_loss_alpha": 1.0, "confidence_threshold": 0.0}
    assert DSparkOptions().block_size == 7 and DFlashOptions().block_size == 16  # the recipes' sizes


def test_options_parse_from_set_strings_including_the_inherited_ones():
    options = build_options(DSparkOptions, {"block_size": "5", "markov_rank": "64", "confidence_with_markov": "false",
                                            "confidence_threshold": "0.4", "loss_type": "dpace"}, section="strategy")
    assert (options.block_size, options.markov_rank, options.confidence_with_markov, options.confidence_threshold,
            options.loss_type) == (5, 64, False, 0.4, "dpace")


@pytest.mark.parametrize("values, message", [
    ({"markov_rank": 0}, "option 'strategy.markov_rank' must be > 0"),
    ({"markov_head_type": "gated"}, "option 'strategy.markov_head_type': expected one of vanilla; got 'gated'"),
    ({"confidence_threshold": 1.5}, "option 'strategy.confidence_threshold' must be between 0 and 1"),
    ({"l1_loss_alpha": -1}, "option 'strategy.l1_loss_alpha' must be >= 0"),
    ({"block_size": 0}, "option 'strategy.block_size' must be > 0"),
    ({"loss_type": "dpace", "loss_decay_gamma": 7}, "loss_decay_gamma' (7.0) weights positions for loss_type=dflash"),
])
def test_bad_options_are_refused_with_a_message_naming_the_key(values, message):
    with pytest.raises(OptionError) as excinfo:
        build_options(DSparkOptions, values, section="strategy")
    assert message in str(excinfo.value)


def test_a_head_config_refuses_a_rank_of_zero_and_an_untrained_variant():
    with pytest.raises(DSparkConfigError, match="markov_rank must be at least 1"):
        DSparkHeadConfig(markov_rank=0)
    with pytest.raises(DSparkConfigError, match="markov_head_type 'rnn' is not trained by this plugin"):
        DSparkHeadConfig(markov_rank=8, markov_head_type="rnn")
    assert DSparkHeadConfig(markov_rank=8).confidence_inputs(32) == 40
    assert DSparkHeadConfig(markov_rank=8, confidence_with_markov=False).confidence_inputs(32) == 32


def test_the_capture_plan_is_dflashs_plus_the_last_hidden_state(make_draft, random_target):
    info, _frozen = random_target()
    strategy, _model = make_draft()
    plan = strategy.capture_plan(info)
    assert plan.layer_ids == (1, 3, 5) and plan.hidden_feature == "target_hidden" and plan.last_hidden
    assert {name: (spec.shape, spec.dtype) for name, spec in plan.features.items()} == {
        "input_ids": ((-1,), "int64"), "loss_mask": ((-1,), "int64"), "target_hidden": ((-1, 96), "float32"),
        "last_hidden": ((-1, 32), "float32")}


def test_the_spec_asks_for_the_hidden_states_and_the_last_hidden_state(plugin_manager):
    (spec,) = specforge_strategies()
    assert spec.name == "dspark" and spec.requires == {"aux_hidden_states", "last_hidden"}
    assert (spec.best_metric, spec.best_mode) == ("accept_len_sim", "max")
    installed = plugin_manager.get("strategy", "dspark")
    assert installed.provenance.distribution == "specforge-plugin-dspark"
    assert installed.factory == "specforge_plugin_dspark.strategy:DSparkStrategy"


def test_the_hook_module_imports_no_torch():
    code = "import sys, specforge_plugin_dspark; specforge_plugin_dspark.specforge_strategies(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"


def test_specforge_options_documents_every_option_and_the_engine_needs():
    out = subprocess.run([str(Path(sys.executable).parent / "specforge"), "options", "strategy", "dspark"],
                         capture_output=True, text=True, check=True).stdout
    assert "strategy.markov_rank (int, default 256)" in out
    assert "strategy.confidence_threshold (float, default 0.0)" in out
    assert "strategy.loss_type (str, default 'dflash')" in out
    assert "requires: aux_hidden_states, last_hidden" in out
    assert "last_hidden: capture() returns last_hidden [S, H], the lm_head input" in out
