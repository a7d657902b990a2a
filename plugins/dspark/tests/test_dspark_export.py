"""The SGLang export: DFlash's keys plus the heads' keys, the fields SGLang's DSpark reads; reload is exact."""

import json

import pytest
import torch
from safetensors import safe_open

from specforge_core.contracts import StepContext
from specforge_core.protocols import BuildContext
from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.export import DFlashExportError
from specforge_plugin_dflash.strategy import DFlashStrategy

from specforge_plugin_dspark.config import DSparkConfigError
from specforge_plugin_dspark.export import DSparkExportError

HEAD_KEYS = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
             "confidence_head.proj.bias"}


def read(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_markov", [True, False])
def test_export_holds_exactly_the_dflash_keys_plus_the_head_keys(tmp_path, random_target, make_draft, dtype,
                                                               with_markov):
    info, frozen = random_target()
    strategy, model = make_draft(info, frozen, dtype=dtype, markov_rank=12, confidence_with_markov=with_markov)
    strategy.export(model, str(tmp_path / "dspark"), dtype=dtype)
    dflash = DFlashStrategy(DFlashOptions(block_size=4, num_layers=2, num_target_layers=3, dtype=dtype))
    dflash.export(dflash.build_model(info, frozen, None), str(tmp_path / "dflash"), dtype=dtype)
    tensors, _config = read(tmp_path / "dspark")
    dflash_tensors, _config = read(tmp_path / "dflash")
    assert set(tensors) == set(dflash_tensors) | HEAD_KEYS  # no embed_tokens, no lm_head
    assert all(tensors[k].shape == v.shape for k, v in dflash_tensors.items())
    assert {k: tuple(tensors[k].shape) for k in HEAD_KEYS} == {
        "markov_head.markov_w1.weight": (97, 12), "markov_head.markov_w2.weight": (97, 12),
        "confidence_head.proj.weight": (1, 32 + (12 if with_markov else 0)), "confidence_head.proj.bias": (1,)}
    assert {t.dtype for t in tensors.values()} == {getattr(torch, dtype)}


def test_export_config_names_the_dspark_class_and_the_heads_for_sglang_and_vllm(tmp_path, make_draft):
    strategy, model = make_draft(markov_rank=12, confidence_with_markov=False, confidence_threshold=0.4)
    strategy.export(model, str(tmp_path))
    tensors, config = read(tmp_path)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}  # the served dtype by default
    assert config["torch_dtype"] == "bfloat16"
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM's numbering of layers [1, 3, 5]
    assert config["specforge_strategy_options"]["confidence_threshold"] == 0.4  # `specforge eval` rebuilds with it
    assert config["specforge_strategy"] == "dspark" and "speculators_model_type" not in config
    assert config["dspark_config"] == {"markov_rank": 12, "markov_head_type": "vanilla", "mask_token_id": 96}
    assert (config["markov_rank"], config["markov_head_type"]) == (12, "vanilla")
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is False
    assert config["block_size"] == 4  # SGLang's gamma: slots per block, each drafting a token
    assert config["dflash_config"] == {"block_size": 4, "mask_token_id": 96, "target_layer_ids": [1, 3, 5],
                                       "num_target_layers": 8}


@pytest.mark.parametrize("with_markov", [True, False])
def test_load_export_gives_the_same_draft(tmp_path, random_target, make_draft, with_markov):
    info, frozen = random_target()
    strategy, model = make_draft(info, frozen, confidence_with_markov=with_markov)
    strategy.export(model, str(tmp_path), dtype="float32")
    # A strategy with other head options still loads the export as written: the heads come from config.json.
    other, _ = make_draft(info, frozen, markov_rank=4, confidence_with_markov=not with_markov, perturb=False)
    reloaded = other.load_export(str(tmp_path), info, frozen)
    assert reloaded.head_config == model.head_config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name
    gen = torch.Generator().manual_seed(2)
    sample = {"input_ids": torch.randint(3, 90, (15,), generator=gen), "loss_mask": torch.ones(15, dtype=torch.long),
              "target_hidden": torch.randn(15, 96, generator=gen), "last_hidden": torch.randn(15, 32, generator=gen)}
    batch = strategy.collate([sample], ["x"])
    with torch.no_grad():
        a = strategy.forward_loss(model, batch, StepContext(global_step=0, total_steps=1, training=False))
        b = strategy.forward_loss(reloaded, batch, StepContext(global_step=0, total_steps=1, training=False))
    assert torch.equal(a.loss, b.loss) and a.ratio_metrics == b.ratio_metrics


def edit_config(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change, message", [
    (lambda c: [c["dspark_config"].pop("markov_rank"), c.pop("markov_rank")],
     "has no 'dspark_config.markov_rank' (nor 'markov_rank') field; a DSpark draft needs it as an integer"),
    (lambda c: c["dspark_config"].update(markov_head_type="gated"),
     "markov_head_type 'gated' is not trained by this plugin; supported: vanilla"),
    (lambda c: c.update(enable_confidence_head=False), "has 'enable_confidence_head' = false"),
    (lambda c: c.update(confidence_head_with_markov="yes"),
     "has 'confidence_head_with_markov' = 'yes'; a DSpark draft needs it as true or false"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]),
     "names architectures ['DFlashDraftModel'], not ['Qwen3DSparkModel']"),
    (lambda c: c.update(specforge_strategy="domino"), "holds an export of strategy 'domino'"),
])
def test_a_damaged_or_foreign_config_is_refused_naming_the_file_and_field(tmp_path, random_target, make_draft,
                                                                         change, message):
    info, frozen = random_target()
    strategy, model = make_draft(info, frozen)
    strategy.export(model, str(tmp_path))
    edit_config(tmp_path, change)
    with pytest.raises(DSparkExportError) as excinfo:
        strategy.load_export(str(tmp_path), info, frozen)
    assert str(tmp_path / "config.json") in str(excinfo.value) and message in str(excinfo.value)
    assert isinstance(excinfo.value, DFlashExportError) and isinstance(excinfo.value, DSparkConfigError)


def test_only_the_formats_sglang_and_vllm_serve_are_written(tmp_path, make_draft):
    strategy, model = make_draft()
    strategy.export(model, str(tmp_path / "vllm"), fmt="vllm")
    assert read(tmp_path / "vllm")[1]["architectures"] == ["Qwen3DSparkModel"]  # the same folder serves both
    with pytest.raises(DSparkExportError, match="strategy 'dspark' exports as sglang, vllm, not 'speculators'"):
        strategy.export(model, str(tmp_path / "spec"), fmt="speculators")
    assert not (tmp_path / "spec").exists()


def test_an_export_for_another_target_is_refused_naming_both_shapes(tmp_path, random_target, make_draft):
    info, frozen = random_target()
    strategy, model = make_draft(info, frozen)
    strategy.export(model, str(tmp_path))
    other_info, other_frozen = random_target(vocab=50)
    with pytest.raises(DSparkExportError, match=r"vocabulary 97 and hidden size 32, but this target's embed_tokens "
                                                r"is \[50, 32\]"):
        strategy.load_export(str(tmp_path), other_info, other_frozen)


def test_a_dflash_export_is_not_a_dspark_draft(tmp_path, random_target, make_draft):
    info, frozen = random_target()
    dflash = DFlashStrategy(DFlashOptions(block_size=4, num_layers=2, num_target_layers=3), BuildContext())
    dflash.export(dflash.build_model(info, frozen, None), str(tmp_path))
    strategy, _model = make_draft(info, frozen)
    with pytest.raises(DSparkExportError, match="holds an export of strategy 'dflash' .*load it with --strategy dflash"):
        strategy.load_export(str(tmp_path), info, frozen)
