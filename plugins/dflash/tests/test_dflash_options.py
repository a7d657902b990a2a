"""Options, defaults (target layers, mask token, draft size) and the registered spec."""

import pytest
import torch

from specforge_core.errors import OptionError
from specforge_core.options import build_options
from specforge_core.protocols import DataStats, TargetInfo

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.config import (DFlashConfig, DFlashConfigError, default_target_layer_ids,
                                            mask_token_for_data, resolve_mask_token_id)
from specforge_plugin_dflash.strategy import DFlashStrategy


def target(layers=8, hidden=32, vocab=97, **extra):
    return TargetInfo(num_layers=layers, hidden_size=hidden, vocab_size=vocab, dtype="bfloat16",
                      extra={"num_attention_heads": 4, "num_key_value_heads": 2, **extra})


def test_default_layer_ids_follow_the_dflash_formula_on_real_targets():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]   # Qwen3-8B
    assert default_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]   # Qwen2.5-0.5B (docs/algorithms.md)
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(6, 3) == [1, 2, 3]             # the formula still fits


def test_default_layer_ids_are_distinct_and_servable_on_small_targets():
    # every id within 0..L-2: a serving engine captures layer inputs, so L-1 does not exist there
    assert default_target_layer_ids(4, 5) == [0, 1, 2]  # the formula would give [1, 1, 1, 1]
    assert default_target_layer_ids(5, 5) == [0, 1, 2, 3]
    assert default_target_layer_ids(2, 5) == [0]
    assert default_target_layer_ids(2, 1) == [0]  # L//2 = 1 would be the last layer
    assert default_target_layer_ids(3, 1) == [1]
    for layers in range(2, 48):
        for n in range(1, 8):
            ids = default_target_layer_ids(layers, n)
            assert len(ids) == min(n, layers - 1) and len(set(ids)) == len(ids), (layers, n, ids)
            assert all(0 <= i <= layers - 2 for i in ids), (layers, n, ids)


def test_a_one_layer_target_has_no_servable_layer_and_is_refused():
    with pytest.raises(DFlashConfigError, match="at least 2, since a serving engine cannot capture the last layer"):
        default_target_layer_ids(1, 5)


@pytest.mark.parametrize("values, message", [
    ({"block_size": 1}, "option 'strategy.block_size' must be >= 2"),
    ({"num_anchors": 0}, "option 'strategy.num_anchors' must be > 0"),
    ({"target_layer_ids": [1, 1]}, "option 'strategy.target_layer_ids' must not repeat a layer id"),
    ({"target_layer_ids": [-1]}, "option 'strategy.target_layer_ids' must hold layer ids >= 0"),
    ({"loss_decay_gamma": 0}, "option 'strategy.loss_decay_gamma' must be > 0"),
    ({"attention": "flash"}, "option 'strategy.attention': expected one of sdpa, eager"),
    ({"attention_group_blocks": -1}, "option 'strategy.attention_group_blocks' must be >= 0"),
    ({"num_anchor": 3}, "unknown option 'strategy.num_anchor'"),
])
def test_bad_options_are_refused_with_a_message_naming_the_key(values, message):
    with pytest.raises(OptionError, match=message.replace(".", r"\.").replace("(", r"\(").replace("[", r"\[")):
        build_options(DFlashOptions, values, section="strategy")


def test_options_parse_from_set_strings():
    options = build_options(DFlashOptions, {"target_layer_ids": "0,2,3", "loss_decay_gamma": "7", "block_size": "8"},
                            section="strategy")
    assert options.target_layer_ids == [0, 2, 3] and options.loss_decay_gamma == 7.0 and options.block_size == 8


def test_explicit_layer_ids_outside_the_target_are_refused_before_capture():
    strategy = DFlashStrategy(DFlashOptions(target_layer_ids=[0, 8]))
    with pytest.raises(DFlashConfigError, match=r"names layer\(s\) \[8\], but a draft for this 8-layer target can use "
                                                r"ids 0\.\.6 only"):
        strategy.capture_plan(target(layers=8))


def test_the_last_layers_output_is_refused_saying_why_no_serving_engine_can_capture_it():
    strategy = DFlashStrategy(DFlashOptions(target_layer_ids=[1, 7]))
    with pytest.raises(DFlashConfigError, match=r"strategy\.target_layer_ids' \[1, 7\] names layer\(s\) \[7\].*ids "
                                                r"0\.\.6 only: SGLang and vLLM capture the hidden state entering each "
                                                r"decoder layer.*id L-1\) does not exist in a serving engine"):
        strategy.capture_plan(target(layers=8))


def test_capture_plan_asks_for_the_layers_and_a_feature_of_n_times_hidden_in_the_target_dtype():
    plan = DFlashStrategy(DFlashOptions(num_target_layers=3)).capture_plan(target(layers=12))
    assert plan.layer_ids == (1, 5, 9) and plan.hidden_feature == "target_hidden" and not plan.last_hidden
    assert plan.features["target_hidden"].shape == (-1, 96) and plan.features["target_hidden"].dtype == "bfloat16"
    assert plan.features["input_ids"].dtype == plan.features["loss_mask"].dtype == "int64"


def test_draft_depth_defaults_to_five_capped_at_the_target_depth():
    assert DFlashConfig.from_target(target(layers=36), DFlashOptions()).num_layers == 5
    assert DFlashConfig.from_target(target(layers=4), DFlashOptions()).num_layers == 4
    assert DFlashConfig.from_target(target(layers=4), DFlashOptions(num_layers=2)).num_layers == 2


def test_mask_token_resolution_order():
    assert resolve_mask_token_id(7, 100, {"mask_token_id": 3}) == 7
    assert resolve_mask_token_id(None, 100, {"mask_token_id": 3, "tokenizer_size": 90, "pad_token_id": 0}) == 3
    assert resolve_mask_token_id(None, 100, {"tokenizer_size": 90, "pad_token_id": 0}) == 90  # unused row
    assert resolve_mask_token_id(None, 100, {"tokenizer_size": 100, "pad_token_id": 0, "unk_token_id": 1}) == 99
    assert resolve_mask_token_id(None, 100, {}) == 99


def test_a_tokenizer_without_a_free_token_never_gets_its_eos_pad_or_specials_as_mask():
    # SmolLM2's tokenizer: every embedding row is a token, no mask token, pad is EOS (<|im_end|>)
    smol = {"tokenizer_size": 100, "eos_token_id": 2, "pad_token_id": 2, "bos_token_id": 1, "unk_token_id": 0,
            "special_token_ids": [0, 1, 2, 97, 98, 99]}
    mask = resolve_mask_token_id(None, 100, smol)
    assert mask == 96 and mask not in {0, 1, 2, 97, 98, 99}
    counts = torch.zeros(100, dtype=torch.long)
    assert mask_token_for_data(mask, counts, smol) == 96  # the data never supervises it: kept
    counts[90:97] = 3  # the data uses 90..96: the highest id neither special nor in the data
    assert mask_token_for_data(mask, counts, smol) == 89
    counts[:] = 1
    with pytest.raises(DFlashConfigError, match="no mask token is free; set strategy.mask_token_id"):
        mask_token_for_data(mask, counts, smol)


def test_build_model_records_the_mask_token_it_chose_from_the_data(capsys):
    target = TargetInfo(num_layers=4, hidden_size=8, vocab_size=100,
                        extra={"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 16,
                               "tokenizer_size": 100, "eos_token_id": 2, "pad_token_id": 2,
                               "special_token_ids": [0, 1, 2]})
    counts = torch.zeros(100, dtype=torch.long)
    counts[95:] = 1
    strategy = DFlashStrategy(DFlashOptions(target_layer_ids=[1, 2]))
    model = strategy.build_model(target, {"embed_tokens": torch.zeros(100, 8), "lm_head": torch.zeros(100, 8)},
                                 DataStats(token_counts=counts, num_samples=2))
    assert model.config.mask_token_id == 94 and strategy.options.mask_token_id == 94
    assert "dflash: mask token 94 (the highest id that is no special token and not in the training data" in \
        capsys.readouterr().err
    with pytest.raises(DFlashConfigError, match="option 'strategy.mask_token_id' is 100, not a token id"):
        resolve_mask_token_id(100, 100, {})


def test_the_strategy_is_registered_with_its_requirements(plugin_manager):
    spec = plugin_manager.get("strategy", "dflash")
    assert spec.provenance.distribution == "specforge-plugin-dflash"
    assert spec.requires == {"aux_hidden_states"}
    assert (spec.best_metric, spec.best_mode) == ("accept_len_sim", "max")
    assert spec.options is DFlashOptions
    assert isinstance(spec.load_factory()(DFlashOptions(), None), DFlashStrategy)
