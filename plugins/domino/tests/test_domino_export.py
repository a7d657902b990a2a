"""The SGLang export: DFlash's keys plus the head's, the Domino config fields; reload is exact."""

import json
import re

import pytest
import torch
from safetensors import safe_open

from specforge_core.protocols import BuildContext
from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.blocks import block_attention_mask
from specforge_plugin_dflash.export import DFlashExportError
from specforge_plugin_dflash.strategy import DFlashStrategy

from specforge_plugin_domino import DominoOptions
from specforge_plugin_domino.config import DominoConfigError
from specforge_plugin_domino.export import DominoExportError
from specforge_plugin_domino.strategy import DominoStrategy

HEAD_KEYS = {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"}


def read(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_holds_exactly_the_dflash_keys_plus_the_head_keys(tmp_path, random_target, make_draft, dtype):
    info, frozen = random_target()
    strategy, model = make_draft(info, frozen, dtype=dtype, gru_hidden_dim=24, emb_dim=16)
    strategy.export(model, str(tmp_path / "domino"))
    dflash = DFlashStrategy(DFlashOptions(block_size=4, num_layers=2, num_target_layers=3, dtype=dtype))
    dflash.export(dflash.build_model(info, frozen, None), str(tmp_path / "dflash"))
    tensors, _config = read(tmp_path / "domino")
    dflash_tensors, _config = read(tmp_path / "dflash")
    assert set(tensors) == set(dflash_tensors) | HEAD_KEYS  # no embed_tokens, no lm_head
    assert all(tensors[k].shape == v.shape for k, v in dflash_tensors.items())
    assert {k: tuple(tensors[k].shape) for k in HEAD_KEYS} == {
        "prefix_gru.weight_ih_l0": (72, 32), "prefix_gru.weight_hh_l0": (72, 24),
        "embed_proj.0.weight": (16, 56), "embed_proj.2.weight": (97, 16)}
    assert tuple(tensors["fc.weight"].shape) == (32, 96)
    # whatever the training dtype: SGLang's Domino runtime serves bf16 projector weights only
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_export_config_is_dflashs_with_the_domino_projector(tmp_path, make_draft):
    strategy, model = make_draft(gru_hidden_dim=24, emb_dim=16, shift_label=False, pure_draft_prefix_len=1)
    strategy.export(model, str(tmp_path))
    _tensors, config = read(tmp_path)
    assert config["architectures"] == ["DFlashDraftModel"] and config["specforge_strategy"] == "domino"
    assert config["dflash_config"] == {"block_size": 4, "mask_token_id": 96, "target_layer_ids": [1, 3, 5],
                                       "num_target_layers": 8, "projector_type": "domino", "emb_dim": 16,
                                       "gru_hidden_dim": 24, "pure_draft_prefix_len": 1, "shift_label": False}
    assert config["emb_dim"] == 16  # repeated at the top level: one SGLang version reads it only there
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"], config["dtype"],
            config["torch_dtype"]) == (32, 2, 97, "bfloat16", "bfloat16")


@pytest.mark.parametrize("dtype, shift_label", [("float32", True), ("bfloat16", False)])
def test_reloaded_export_gives_identical_final_logits(tmp_path, random_target, make_draft, dtype, shift_label):
    info, frozen = random_target()
    strategy, model = make_draft(info, frozen, dtype=dtype, shift_label=shift_label)
    strategy.export(model, str(tmp_path))
    # A strategy with default options: the head's shape and alignment come from config.json.
    reloaded = DominoStrategy(DominoOptions(), BuildContext()).load_export(str(tmp_path), info, frozen)
    assert reloaded.config == model.config and reloaded.head_config == model.head_config
    with torch.no_grad():  # the draft as served: its trainable weights rounded to the export's bf16
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.bfloat16()
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 12, 96, generator=gen)
    ids = torch.randint(0, 97, (1, 8), generator=gen)
    positions = torch.cat([torch.arange(4, 8), torch.arange(7, 11)])[None]
    mask = block_attention_mask(torch.tensor([[4, 7]]), torch.tensor([12]), 12, 4)
    tokens = torch.randint(0, 97, (1, 2, 4), generator=gen)

    def final(m):
        hidden = m(feats, ids, positions, mask).view(1, 2, 4, -1)
        return m.final_logits(m.logits(hidden), hidden, m.block_states(tokens))

    with torch.no_grad():
        assert torch.equal(final(model), final(reloaded))
    assert reloaded.embed_tokens.data_ptr() == frozen["embed_tokens"].data_ptr()  # shared, not copied


def test_domino_and_dflash_refuse_each_others_exports(tmp_path, random_target, make_draft):
    info, frozen = random_target()
    strategy, model = make_draft(info, frozen)
    strategy.export(model, str(tmp_path / "domino"))
    with pytest.raises(DFlashExportError, match="holds an export of strategy 'domino' .*not 'dflash'"):
        DFlashStrategy(DFlashOptions()).load_export(str(tmp_path / "domino"), info, frozen)
    dflash = DFlashStrategy(DFlashOptions(block_size=4, num_layers=2, num_target_layers=3))
    dflash.export(dflash.build_model(info, frozen, None), str(tmp_path / "dflash"))
    with pytest.raises(DFlashExportError, match="holds an export of strategy 'dflash' .*not 'domino'"):
        strategy.load_export(str(tmp_path / "dflash"), info, frozen)
    config = json.loads((tmp_path / "domino" / "config.json").read_text())
    del config["dflash_config"]["gru_hidden_dim"]
    (tmp_path / "domino" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DominoConfigError, match="has no 'dflash_config.gru_hidden_dim' field; a Domino draft needs it as an integer"):
        strategy.load_export(str(tmp_path / "domino"), info, frozen)


def snapshot(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def exported(tmp_path, make_draft, edit=None):
    """(strategy, config.json path) of a Domino export whose config.json was changed by ``edit``."""
    strategy, model = make_draft()
    strategy.export(model, str(tmp_path))
    if edit is not None:
        config = json.loads((tmp_path / "config.json").read_text())
        edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    return strategy, tmp_path / "config.json"


def test_loading_against_another_target_names_both_sides(tmp_path, random_target, make_draft):
    strategy, config_file = exported(tmp_path, make_draft)
    info, frozen = random_target(vocab=101)
    with pytest.raises(DominoExportError, match=rf"^{re.escape(str(config_file))} describes a draft for a target with "
                                                r"vocabulary 97 and hidden size 32, but this target's embed_tokens is "
                                                r"\[101, 32\] \(vocabulary 101, hidden size 32\); load the export "
                                                "against the target it was trained for$"):
        strategy.load_export(str(tmp_path), info, frozen)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["dflash_config"].update(projector_type="mlp"),
     "has 'dflash_config.projector_type' = 'mlp', not 'domino': it is not a Domino draft"),
    (lambda c: c["dflash_config"].update(shift_label="yes"),
     "has 'dflash_config.shift_label' = 'yes'; a Domino draft needs it as true or false"),
    (lambda c: c["dflash_config"].update(emb_dim=16.5), ("has 'dflash_config.emb_dim' = 16.5; a Domino draft needs it as "
                                                        "an integer")),
    (lambda c: c["dflash_config"].update(pure_draft_prefix_len=3),
     ("does not describe a valid Domino draft: option 'strategy.pure_draft_prefix_len' is 3, but a block of 4 drafts 3 "
     "tokens")),
])
def test_a_damaged_head_config_names_the_file_field_and_expected_form(tmp_path, random_target, make_draft, edit,
                                                                      message):
    info, frozen = random_target()
    strategy, config_file = exported(tmp_path, make_draft, edit)
    with pytest.raises(DominoExportError, match=rf"^{re.escape(str(config_file))} {re.escape(message)}"):
        strategy.load_export(str(tmp_path), info, frozen)


def test_a_failed_export_leaves_the_existing_export_intact(tmp_path, make_draft):
    strategy, model = make_draft(dtype="bfloat16")  # the export dtype itself: no copies made
    strategy.export(model, str(tmp_path))
    before = snapshot(tmp_path)
    model.norm.weight = model.hidden_norm.weight  # tied weights: safetensors refuses tensors sharing memory
    with pytest.raises(DominoExportError, match=rf"^could not write the export to {re.escape(str(tmp_path))} "
                                                r"\(RuntimeError: Some tensors share memory.*\); the folder was left as "
                                                "it was$"):
        strategy.export(model, str(tmp_path))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_an_export_sglang_cannot_serve_in_another_dtype_is_refused_before_anything_is_written(tmp_path, make_draft,
                                                                                             dtype):
    strategy, model = make_draft()
    with pytest.raises(DominoExportError, match=rf"^SGLang's Domino runtime requires bfloat16 projector weights \(and "
                                                rf"a bfloat16 target\); export with --dtype bfloat16, not {dtype}$"):
        strategy.export(model, str(tmp_path / "out"), dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_a_head_with_another_pure_prefix_than_sglang_serves_is_refused_for_export(tmp_path, make_draft):
    strategy, model = make_draft(pure_draft_prefix_len=0)
    with pytest.raises(DominoExportError, match=r"^SGLang's Domino runtime serves pure_draft_prefix_len 1 only; this "
                                                r"draft was trained with 0, so it cannot be served; train with "
                                                r"strategy.pure_draft_prefix_len=1"):
        strategy.export(model, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_domino_exports_for_sglang_only(tmp_path, make_draft, fmt):
    strategy, model = make_draft()
    with pytest.raises(DominoExportError, match=rf"strategy 'domino' exports as sglang, not '{fmt}'"):
        strategy.export(model, str(tmp_path / "out"), fmt=fmt)
    assert not (tmp_path / "out").exists()
