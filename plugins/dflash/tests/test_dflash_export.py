"""The SGLang export: exact keys, shapes, dtypes and config; reload gives identical logits."""

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from specforge_core.protocols import BuildContext, DataStats, TargetInfo

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.blocks import block_attention_mask
from specforge_plugin_dflash.export import DFlashExportError
from specforge_plugin_dflash.strategy import DFlashStrategy

HIDDEN, VOCAB, LAYERS = 32, 97, 8


def make(dtype="float32", **options):
    gen = torch.Generator().manual_seed(0)
    info = TargetInfo(num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB, dtype="bfloat16", model_id="tiny",
                      extra={"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                             "head_dim": 8, "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 5e5},
                             "max_position_embeddings": 512, "tokenizer_size": 90})
    frozen = {"embed_tokens": torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16(),
              "lm_head": torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16()}
    strategy = DFlashStrategy(DFlashOptions(num_layers=2, num_target_layers=3, dtype=dtype, **options), BuildContext())
    return strategy, info, frozen, strategy.build_model(info, frozen, DataStats())


def sglang_keys(layers):
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(layers):
        keys |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        keys |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        keys |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        keys |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    return keys


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_holds_exactly_the_sglang_dflash_keys_with_shapes_and_dtypes(tmp_path, dtype):
    strategy, info, _frozen, model = make(dtype)
    strategy.export(model, str(tmp_path), info, dtype=dtype)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert set(tensors) == sglang_keys(2)  # no embed_tokens, no lm_head
    shapes = {"fc.weight": (32, 96), "layers.0.self_attn.q_proj.weight": (32, 32),
              "layers.0.self_attn.k_proj.weight": (16, 32), "layers.0.self_attn.o_proj.weight": (32, 32),
              "layers.1.self_attn.q_norm.weight": (8,), "layers.1.mlp.gate_proj.weight": (64, 32),
              "layers.1.mlp.down_proj.weight": (32, 64), "norm.weight": (32,), "hidden_norm.weight": (32,)}
    for key, shape in shapes.items():
        assert tuple(tensors[key].shape) == shape, key
    assert {t.dtype for t in tensors.values()} == {getattr(torch, dtype)}


def test_export_config_is_what_sglang_dflash_reads(tmp_path):
    strategy, info, _frozen, model = make()
    strategy.export(model, str(tmp_path), info)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["specforge_strategy"] == "dflash"
    assert config["dflash_config"] == {"block_size": 16, "mask_token_id": 90, "target_layer_ids": [1, 3, 5],
                                       "num_target_layers": 8}
    expected = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 8, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
                "max_position_embeddings": 512, "vocab_size": 97, "block_size": 16, "num_target_layers": 8,
                "model_type": "qwen3", "hidden_act": "silu", "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    assert {k: config[k] for k in expected} == expected
    # vLLM's runner reads the captured layers at the top level in its numbering (our id + 1)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6] and config["norm_before_residual"] is False
    assert config["specforge_strategy_options"]["num_target_layers"] == 3
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reloaded_export_gives_identical_logits(tmp_path, dtype):
    strategy, info, frozen, model = make(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)  # not the initial values
    strategy.export(model, str(tmp_path), info, dtype=dtype)
    reloaded = strategy.load_export(str(tmp_path), info, frozen)
    assert reloaded.config == model.config
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 12, 96, generator=gen)
    ids = torch.randint(0, VOCAB, (1, 2 * 16), generator=gen)
    positions = torch.cat([torch.arange(4, 20), torch.arange(7, 23)])[None]
    mask = block_attention_mask(torch.tensor([[4, 7]]), torch.tensor([12]), 12, 16)
    with torch.no_grad():
        a = model.logits(model(feats, ids, positions, mask))
        b = reloaded.logits(reloaded(feats, ids, positions, mask))
    assert torch.equal(a, b)
    assert reloaded.embed_tokens.data_ptr() == frozen["embed_tokens"].data_ptr()  # shared, not copied


def test_load_export_refuses_other_exports_and_mismatched_drafts(tmp_path):
    strategy, info, frozen, model = make()
    strategy.export(model, str(tmp_path / "ok"), info)
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    with pytest.raises(DFlashExportError, match=r"missing is not a dflash draft \(no config.json\)"):
        strategy.load_export(str(tmp_path / "missing"), info, frozen)
    config["specforge_strategy"] = "eagle3"
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashExportError, match="holds an export of strategy 'eagle3' .*not 'dflash'; load it with --strategy eagle3"):
        strategy.load_export(str(tmp_path / "ok"), info, frozen)
    config["specforge_strategy"] = "dflash"
    config["num_hidden_layers"] = 3
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashExportError, match=r"missing \['layers.2"):
        strategy.load_export(str(tmp_path / "ok"), info, frozen)


def test_the_hook_module_does_not_import_torch():
    code = "import sys, specforge_plugin_dflash, specforge_plugin_dflash.config; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def snapshot(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def exported(tmp_path, edit=None):
    """(strategy, info, frozen, config.json path) of an export whose config.json was changed by ``edit``."""
    strategy, info, frozen, model = make()
    strategy.export(model, str(tmp_path), info)
    if edit is not None:
        config = json.loads((tmp_path / "config.json").read_text())
        edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    return strategy, info, frozen, tmp_path / "config.json"


@pytest.mark.parametrize("vocab, hidden, shape", [(VOCAB + 1, HIDDEN, [98, 32]), (VOCAB, 48, [97, 48])])
def test_loading_against_another_target_names_both_sides(tmp_path, vocab, hidden, shape):
    strategy, info, _frozen, config_file = exported(tmp_path)
    other = {"embed_tokens": torch.zeros(vocab, hidden), "lm_head": torch.zeros(vocab, hidden)}
    with pytest.raises(DFlashExportError, match=rf"^{re.escape(str(config_file))} describes a draft for a target with "
                                                rf"vocabulary 97 and hidden size 32, but this target's embed_tokens is "
                                                rf"{re.escape(str(shape))} \(vocabulary {vocab}, hidden size {hidden}\); "
                                                "load the export against the target it was trained for$"):
        strategy.load_export(str(tmp_path), info, other)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["dflash_config"].pop("mask_token_id"),
     "has no 'dflash_config.mask_token_id' field; a dflash draft needs it as an integer"),
    (lambda c: c.pop("hidden_size"), "has no 'hidden_size' field; a dflash draft needs it as an integer"),
    (lambda c: c.update(num_hidden_layers="2"), "has 'num_hidden_layers' = '2'; a dflash draft needs it as an integer"),
    (lambda c: c["dflash_config"].pop("target_layer_ids"),
     "has no 'dflash_config.target_layer_ids' field; a dflash draft needs it as a list of integers"),
    (lambda c: c["dflash_config"].update(target_layer_ids="1,3,5"),
     "has 'dflash_config.target_layer_ids' = '1,3,5'; a dflash draft needs it as a list of integers"),
    (lambda c: c.pop("specforge_strategy"), "has no 'specforge_strategy' field; a dflash draft needs it as a string"),
    (lambda c: c.update(architectures=["LlamaForCausalLMEagle3"]),
     "names architectures ['LlamaForCausalLMEagle3'], not ['DFlashDraftModel']: it is not a dflash draft"),
    (lambda c: c.update(head_dim=7), ("does not describe a valid dflash draft: head_dim must be even for rotary "
                                     "embeddings, got 7")),
    (lambda c: c.update(torch_dtype="float8"), "does not describe a valid dflash draft: unknown dtype 'float8'"),
    (lambda c: (c.pop("torch_dtype"), c.update(dtype="float8")),  # an older export names only `dtype`
     "does not describe a valid dflash draft: unknown dtype 'float8'"),
    (lambda c: c.update(num_key_value_heads=0), ("does not describe a valid dflash draft: num_attention_heads (4) and "
                                                 "num_key_value_heads (0) must be at least 1")),
])
def test_a_foreign_or_damaged_config_names_the_file_field_and_expected_form(tmp_path, edit, message):
    strategy, info, frozen, config_file = exported(tmp_path, edit)
    with pytest.raises(DFlashExportError, match=rf"^{re.escape(str(config_file))} {re.escape(message)}"):
        strategy.load_export(str(tmp_path), info, frozen)


def test_the_top_level_target_layer_ids_of_older_exports_still_load(tmp_path):
    strategy, info, frozen, _config_file = exported(tmp_path, lambda c: (c["dflash_config"].pop("target_layer_ids"),
                                                                  c.update(target_layer_ids=[1, 3, 5])))
    assert strategy.load_export(str(tmp_path), info, frozen).config.target_layer_ids == (1, 3, 5)


def test_unreadable_json_or_weights_are_named(tmp_path):
    strategy, info, frozen, config_file = exported(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(DFlashExportError, match=rf"^{re.escape(str(tmp_path / 'model.safetensors'))} is not a "
                                                "readable safetensors file: "):
        strategy.load_export(str(tmp_path), info, frozen)
    config_file.write_text('{"architectures": ')
    with pytest.raises(DFlashExportError, match=rf"^{re.escape(str(config_file))} is not valid JSON \(Expecting value"):
        strategy.load_export(str(tmp_path), info, frozen)


def test_a_failed_export_leaves_the_existing_export_intact(tmp_path):
    strategy, info, _frozen, model = make()
    strategy.export(model, str(tmp_path), info)
    before = snapshot(tmp_path)
    model.norm.weight = model.hidden_norm.weight  # tied weights: safetensors refuses tensors sharing memory
    with pytest.raises(DFlashExportError, match=rf"^could not write the export to {re.escape(str(tmp_path))} "
                                                r"\(RuntimeError: Some tensors share memory.*\); the folder was left as "
                                                "it was$"):
        strategy.export(model, str(tmp_path), info, dtype="float32")  # the draft's own dtype: no copies
    assert snapshot(tmp_path) == before  # both files unchanged, no temporary left behind
    (tmp_path / "file").write_text("keep")
    with pytest.raises(DFlashExportError, match="it exists and is not a folder; choose another --output"):
        strategy.export(model, str(tmp_path / "file"), info)
    assert (tmp_path / "file").read_text() == "keep"
