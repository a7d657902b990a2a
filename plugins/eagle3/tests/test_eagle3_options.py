"""Options of the eagle3 strategy: defaults, the choice of aux layers, validation messages."""

import pytest
import torch

from specforge_core.errors import OptionError
from specforge_core.options import build_options, parse_set_value
from specforge_core.protocols import TargetInfo

from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.options import default_aux_layer_ids


def target(num_layers, vocab=97, hidden=32):
    return TargetInfo(num_layers=num_layers, hidden_size=hidden, vocab_size=vocab,
                      extra={"num_attention_heads": 4, "num_key_value_heads": 2})


def strategy(**values):
    from specforge_plugin_eagle3.strategy import Eagle3Strategy

    return Eagle3Strategy(build_options(Eagle3Options, values, section="strategy"))


def test_defaults_match_the_algorithm_card():
    options = Eagle3Options()
    assert options.ttt_length == 7 and options.loss_decay == 0.8
    assert options.draft_vocab_size is None and options.aux_layer_ids is None and options.intermediate_size is None


@pytest.mark.parametrize("num_layers", [8, 12, 24, 28, 32, 36, 80])
def test_default_aux_layers_for_targets_with_at_least_8_layers_are_low_middle_high(num_layers):
    assert default_aux_layer_ids(num_layers) == (1, num_layers // 2 - 1, num_layers - 4)


@pytest.mark.parametrize("num_layers", range(4, 9))
def test_default_aux_layers_of_small_targets_are_distinct_and_servable(num_layers):
    ids = default_aux_layer_ids(num_layers)
    # at most L-2: serving engines capture layer inputs, so the last layer's output does not exist there
    assert len(set(ids)) == 3 and all(0 <= i <= num_layers - 2 for i in ids)
    assert list(ids) == sorted(ids)
    if num_layers < 8:
        assert ids == (0, num_layers // 2 - 1, num_layers - 2)
    assert default_aux_layer_ids(4) == (0, 1, 2)  # the toy target


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_a_target_with_fewer_than_four_layers_is_refused_with_a_reason(num_layers):
    with pytest.raises(OptionError, match=f"3 distinct target layers among the ids a serving engine can capture "
                                          rf"\(0\.\.L-2\), but the target has only {num_layers} decoder layer"):
        default_aux_layer_ids(num_layers)


def test_capture_plan_uses_the_default_layers_and_declares_the_features():
    plan = strategy().capture_plan(target(28))
    assert plan.layer_ids == (1, 13, 24)
    assert plan.hidden_feature == "aux_hidden" and plan.last_hidden
    assert {k: (v.shape, v.dtype) for k, v in plan.features.items()} == {
        "input_ids": ((-1,), "int64"), "loss_mask": ((-1,), "int64"),
        "aux_hidden": ((-1, 96), "float32"), "last_hidden": ((-1, 32), "float32")}


def test_explicit_aux_layers_from_the_command_line_are_used():
    plan = strategy(aux_layer_ids=parse_set_value("[0, 2, 4]")).capture_plan(target(6))
    assert plan.layer_ids == (0, 2, 4)
    assert strategy(aux_layer_ids="2,0,4").capture_plan(target(6)).layer_ids == (2, 0, 4)


@pytest.mark.parametrize("value, message", [
    ([1, 2], "exactly 3 layer ids"),
    ([1, 2, 3, 4], "exactly 3 layer ids"),
    ([1, 1, 3], "distinct"),
    ([-1, 2, 3], "non-negative"),
])
def test_malformed_aux_layers_are_rejected_when_options_are_read(value, message):
    with pytest.raises(OptionError, match=f"strategy.aux_layer_ids.*{message}"):
        build_options(Eagle3Options, {"aux_layer_ids": value}, section="strategy")


def test_aux_layers_beyond_the_target_are_rejected_naming_the_valid_range():
    with pytest.raises(OptionError, match=r"names layer\(s\) \[4\], but a draft for this 4-layer target can use ids "
                                          r"0\.\.2 only"):
        strategy(aux_layer_ids=[0, 2, 4]).capture_plan(target(4))


def test_an_explicit_last_layer_is_refused_saying_why_no_serving_engine_can_capture_it():
    with pytest.raises(OptionError, match=r"strategy\.aux_layer_ids \[0, 2, 5\] names layer\(s\) \[5\].*ids 0\.\.4 "
                                          r"only: SGLang and vLLM capture the hidden state entering each decoder "
                                          r"layer, and layer id i is the input of layer i\+1"):
        strategy(aux_layer_ids=[0, 2, 5]).capture_plan(target(6))


def test_a_draft_vocabulary_larger_than_the_target_is_rejected():
    with pytest.raises(OptionError, match="draft_vocab_size.*larger than the target vocabulary \\(97\\)"):
        strategy(draft_vocab_size=98).draft_config(target(8))


def test_draft_vocabulary_defaults_to_min_of_target_vocab_and_32000():
    assert strategy().draft_config(target(8, vocab=97)).draft_vocab_size == 97
    assert strategy().draft_config(target(8, vocab=151936)).draft_vocab_size == 32000


@pytest.mark.parametrize("values, message", [
    ({"ttt_length": 0}, "strategy.ttt_length' must be > 0"),
    ({"loss_decay": 0.0}, "strategy.loss_decay' must be in \\(0, 1\\]"),
    ({"loss_decay": 1.5}, "strategy.loss_decay' must be in \\(0, 1\\]"),
    ({"draft_vocab_size": 0}, "strategy.draft_vocab_size' must be > 0"),
    ({"dtype": "float16"}, "strategy.dtype': expected one of float32, bfloat16"),
    ({"ttt_lenght": 3}, "unknown option 'strategy.ttt_lenght'"),
])
def test_bad_option_values_name_the_option(values, message):
    with pytest.raises(OptionError, match=message):
        build_options(Eagle3Options, values, section="strategy")


def test_draft_shape_follows_the_target_and_the_intermediate_size_option():
    info = TargetInfo(num_layers=8, hidden_size=64, vocab_size=97, extra={
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 176,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "max_position_embeddings": 1024})
    config = strategy().draft_config(info)
    assert (config.hidden_size, config.target_hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.rms_norm_eps, config.rope_theta,
            config.max_position_embeddings) == (64, 64, 8, 2, 16, 176, 1e-5, 5e5, 1024)
    assert strategy(intermediate_size=32).draft_config(info).intermediate_size == 32


def test_the_plugin_registers_the_strategy_without_importing_torch(plugin_manager):
    spec = plugin_manager.get("strategy", "eagle3")
    assert spec.provenance.distribution == "specforge-plugin-eagle3"
    assert spec.requires == {"aux_hidden_states", "last_hidden"}
    assert (spec.best_metric, spec.best_mode) == ("accept_len_sim", "max")
    import subprocess
    import sys

    code = "import sys, specforge_plugin_eagle3; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_draft_vocabulary_is_sized_from_the_data_to_cover_the_supervised_tokens():
    from specforge_plugin_eagle3.options import data_sized_vocab

    counts = torch.zeros(1000, dtype=torch.long)
    counts[:100] = 100  # 100 frequent tokens: 10000 occurrences
    counts[100:200] = 1  # 100 rare ones: 100 occurrences (1% of 10100)
    assert data_sized_vocab(counts, 0.99, 1000) == 128  # 100 tokens cover 99.0%: rounded up to 64s
    assert data_sized_vocab(counts, 1.0, 1000) == 256  # all 200 seen tokens
    assert data_sized_vocab(counts, 1.0, 150) == 150  # never above the target vocabulary
    big = torch.ones(100_000, dtype=torch.long)
    assert data_sized_vocab(big, 0.99, 100_000) == 32000  # capped at the recipes' size
    assert data_sized_vocab(torch.zeros(500, dtype=torch.long), 0.99, 500) == 500  # nothing counted


def test_build_model_fixes_the_data_sized_vocabulary_in_the_strategy_options(capsys):
    from specforge_core.protocols import DataStats, TargetInfo
    from specforge_plugin_eagle3.strategy import Eagle3Strategy

    target = TargetInfo(num_layers=4, hidden_size=8, vocab_size=300,
                        extra={"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 16})
    counts = torch.zeros(300, dtype=torch.long)
    counts[:70] = 5
    strategy = Eagle3Strategy(Eagle3Options(aux_layer_ids=(0, 1, 2)))
    model = strategy.build_model(target, {"embed_tokens": torch.zeros(300, 8), "lm_head": torch.zeros(300, 8)},
                                 DataStats(token_counts=counts, num_samples=3))
    assert strategy.options.draft_vocab_size == 128 and model.config.draft_vocab_size == 128
    assert int(model.t2d.sum()) == 128 and bool(model.t2d[:70].all())
    assert "eagle3: draft vocabulary of 128 of the target's 300 tokens, covering 100.0%" in capsys.readouterr().err
