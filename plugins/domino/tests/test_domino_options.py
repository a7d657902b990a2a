"""Options (DFlash's, extended), the head's defaults and limits, and the registered spec."""

import subprocess
import sys

import attrs
import pytest

from specforge_core.errors import OptionError
from specforge_core.options import build_options
from specforge_core.protocols import BuildContext, DataStats
from specforge_plugin_dflash import DFlashOptions

from specforge_plugin_domino import DominoOptions, specforge_strategies
from specforge_plugin_domino.config import DominoConfigError, DominoHeadConfig
from specforge_plugin_domino.strategy import DominoStrategy


def test_domino_options_are_dflash_options_plus_the_head_and_the_schedule():
    assert issubclass(DominoOptions, DFlashOptions)
    dflash = {f.name for f in attrs.fields(DFlashOptions)}
    domino = {f.name: f.default for f in attrs.fields(DominoOptions)}
    assert dflash < set(domino)
    assert {k: v for k, v in domino.items() if k not in dflash} == {
        "emb_dim": 256, "gru_hidden_dim": None, "pure_draft_prefix_len": 1, "shift_label": True,
        "lambda_start": 1.0, "lambda_decay_ratio": 0.5}
    assert DominoOptions().block_size == DFlashOptions().block_size == 16


def test_options_parse_from_set_strings_including_the_inherited_ones():
    options = build_options(DominoOptions, {"block_size": "4", "shift_label": "false", "lambda_decay_ratio": "1",
                                            "gru_hidden_dim": "64", "loss_decay_gamma": "7"}, section="strategy")
    assert (options.block_size, options.shift_label, options.lambda_decay_ratio, options.gru_hidden_dim,
            options.loss_decay_gamma) == (4, False, 1.0, 64, 7.0)


@pytest.mark.parametrize("values, message", [
    ({"emb_dim": 0}, "option 'strategy.emb_dim' must be > 0"),
    ({"gru_hidden_dim": -1}, "option 'strategy.gru_hidden_dim' must be > 0"),
    ({"pure_draft_prefix_len": -1}, "option 'strategy.pure_draft_prefix_len' must be >= 0"),
    ({"lambda_start": -0.5}, "option 'strategy.lambda_start' must be >= 0"),
    ({"block_size": 1}, "option 'strategy.block_size' must be >= 2"),
    ({"shift_labels": True}, "unknown option 'strategy.shift_labels'"),
])
def test_bad_options_are_refused_with_a_message_naming_the_key(values, message):
    with pytest.raises(OptionError, match=message.replace(".", r"\.")):
        build_options(DominoOptions, values, section="strategy")


def test_the_gru_width_defaults_to_min_1024_4h():
    assert DominoHeadConfig.from_options(DominoOptions(), 4096).gru_hidden_dim == 1024  # Qwen3-8B: the recipe
    assert DominoHeadConfig.from_options(DominoOptions(), 256).gru_hidden_dim == 1024
    assert DominoHeadConfig.from_options(DominoOptions(), 32).gru_hidden_dim == 128
    assert DominoHeadConfig.from_options(DominoOptions(gru_hidden_dim=48), 4096).gru_hidden_dim == 48


def test_a_block_with_no_corrected_drafted_position_is_refused_before_the_model_is_built(random_target):
    info, frozen = random_target()
    for shift_label in (True, False):
        strategy = DominoStrategy(DominoOptions(block_size=4, pure_draft_prefix_len=3, shift_label=shift_label),
                                  BuildContext())
        with pytest.raises(DominoConfigError, match="at most 2 of them can stay uncorrected"):
            strategy.build_model(info, frozen, DataStats())
    DominoStrategy(DominoOptions(block_size=4, pure_draft_prefix_len=2, emb_dim=8), BuildContext()).build_model(
        info, frozen, DataStats())


def test_the_spec_is_domino_with_dflash_requirements_and_the_final_heads_acceptance_as_best():
    (spec,) = specforge_strategies()
    assert (spec.name, spec.options, spec.requires, spec.best_metric, spec.best_mode) == (
        "domino", DominoOptions, {"aux_hidden_states"}, "accept_len_sim", "max")
    assert spec.factory == "specforge_plugin_domino.strategy:DominoStrategy"


def test_the_hook_module_does_not_import_torch():
    code = "import sys, specforge_plugin_domino, specforge_plugin_domino.config, specforge_plugin_domino.schedule; " \
           "print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_head_is_checked_against_the_block_once_per_model_built_or_loaded(tmp_path, random_target, monkeypatch):
    info, frozen = random_target()
    strategy = DominoStrategy(DominoOptions(block_size=4, num_layers=1, num_target_layers=3, emb_dim=8),
                              BuildContext())
    model = strategy.build_model(info, frozen, DataStats())
    strategy.export(model, str(tmp_path / "draft"))
    checked = []
    original = DominoHeadConfig.check
    monkeypatch.setattr(DominoHeadConfig, "check", lambda head, block_size: checked.append(block_size) or
                        original(head, block_size))
    strategy.build_model(info, frozen, DataStats())
    assert checked == [4]
    strategy.load_export(str(tmp_path / "draft"), info, frozen)
    assert checked == [4, 4]


def test_an_export_whose_head_corrects_no_drafted_position_is_refused_when_loaded(tmp_path, random_target):
    import json

    info, frozen = random_target()
    strategy = DominoStrategy(DominoOptions(block_size=4, num_layers=1, num_target_layers=3, emb_dim=8),
                              BuildContext())
    strategy.export(strategy.build_model(info, frozen, DataStats()), str(tmp_path / "draft"))
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    config["dflash_config"]["pure_draft_prefix_len"] = 3
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DominoConfigError, match="is 3, but a block of 4 drafts 3 tokens, so at most 2 of them can "
                                                "stay uncorrected"):
        strategy.load_export(str(tmp_path / "draft"), info, frozen)
