"""Export to SGLang's EAGLE3 layout and back."""

import json
import re

import pytest
import torch
from safetensors import safe_open

from specforge_core.contracts import StepContext
from specforge_core.protocols import DataStats, TargetInfo

from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.export import EXPORT_KEYS, Eagle3ExportError
from specforge_plugin_eagle3.strategy import Eagle3Strategy

V, H, VD = 50, 32, 20


def target(vocab=V, hidden=H):
    info = TargetInfo(num_layers=6, hidden_size=hidden, vocab_size=vocab, dtype="float32", model_id="random-6l",
                      extra={"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                             "intermediate_size": 48, "rms_norm_eps": 1e-5,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                             "max_position_embeddings": 128, "eos_token_id": 1, "bos_token_id": 2,
                             "pad_token_id": None})
    gen = torch.Generator().manual_seed(3)
    return info, {"embed_tokens": torch.randn(vocab, hidden, generator=gen),
                  "lm_head": torch.randn(vocab, hidden, generator=gen), "norm": torch.ones(hidden)}


def build(dtype="float32"):
    info, frozen = target()
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=3, draft_vocab_size=VD, dtype=dtype))
    counts = torch.arange(V).flip(0)  # token 0 most frequent ... used = 0..19
    counts[45] = 1000  # so the mapping is not the identity prefix
    model = strategy.build_model(info, frozen, DataStats(token_counts=counts))
    with torch.no_grad():  # make every weight distinct from its initial value
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return strategy, info, frozen, model


def batch(strategy, info):
    gen = torch.Generator().manual_seed(5)
    samples = [{"input_ids": torch.randint(0, V, (n,), generator=gen), "loss_mask": torch.ones(n, dtype=torch.long),
                "aux_hidden": torch.randn(n, 3 * H, generator=gen), "last_hidden": torch.randn(n, H, generator=gen)}
               for n in (9, 6)]
    return strategy.collate(samples, ["a", "b"])


def test_export_writes_exactly_the_sglang_keys_shapes_and_dtypes(tmp_path):
    strategy, info, _frozen, model = build()  # trained in float32, exported by default in bfloat16
    strategy.export(model, tmp_path, info)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        got = {k: (tuple(f.get_tensor(k).shape), f.get_tensor(k).dtype) for k in f.keys()}
    bf16 = torch.bfloat16
    assert got == {
        "fc.weight": ((H, 3 * H), bf16),
        "midlayer.input_layernorm.weight": ((H,), bf16),
        "midlayer.hidden_norm.weight": ((H,), bf16),
        "midlayer.self_attn.q_proj.weight": ((4 * 8, 2 * H), bf16),
        "midlayer.self_attn.k_proj.weight": ((2 * 8, 2 * H), bf16),
        "midlayer.self_attn.v_proj.weight": ((2 * 8, 2 * H), bf16),
        "midlayer.self_attn.o_proj.weight": ((H, 4 * 8), bf16),
        "midlayer.post_attention_layernorm.weight": ((H,), bf16),
        "midlayer.mlp.gate_proj.weight": ((48, H), bf16),
        "midlayer.mlp.up_proj.weight": ((48, H), bf16),
        "midlayer.mlp.down_proj.weight": ((H, 48), bf16),
        "norm.weight": ((H,), bf16),
        "lm_head.weight": ((VD, H), bf16),
        "d2t": ((VD,), torch.int64),
        "t2d": ((V,), torch.bool),
    }
    assert set(got) == set(EXPORT_KEYS)  # no embedding, no teacher head
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    used = (torch.arange(VD) + d2t).tolist()
    assert used == list(range(19)) + [45] and t2d.nonzero().flatten().tolist() == used


def test_export_config_is_a_llama_eagle3_config_sglang_reads(tmp_path):
    strategy, info, _frozen, model = build()
    strategy.export(model, tmp_path, info)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    expected = {"model_type": "llama", "hidden_size": H, "target_hidden_size": H, "intermediate_size": 48,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1,
                "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None,
                "max_position_embeddings": 128, "vocab_size": V, "draft_vocab_size": VD,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "dtype": "bfloat16",
                "specforge_strategy": "eagle3", "eos_token_id": 1, "bos_token_id": 2}
    assert {k: config[k] for k in expected} == expected
    assert "pad_token_id" not in config  # None in the target: left out rather than written as null
    # SGLang adds 1 to these to index its layer inputs: they are output-of-layer ids, as captured
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    # vLLM reads its own numbering at the top level, and would norm the residual first without the flag
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and config["norm_before_residual"] is False
    assert config["specforge_strategy_options"]["ttt_length"] == 3


def test_export_config_parses_as_a_transformers_llama_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    strategy, info, _frozen, model = build()
    strategy.export(model, tmp_path, info)
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert isinstance(config, transformers.LlamaConfig)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (H, 1, 2, 8)
    assert config.draft_vocab_size == VD and config.tie_word_embeddings is False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reloaded_export_has_identical_weights_and_logits(tmp_path, dtype):
    strategy, info, frozen, model = build(dtype)
    strategy.export(model, tmp_path, info, dtype=dtype)
    reloaded = strategy.load_export(tmp_path, info, frozen)
    a, b = model.state_dict(), reloaded.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert reloaded.config == model.config
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == dtype
    data = batch(strategy, info)
    with torch.no_grad():
        la = model(data["input_ids"], data["aux_hidden"], data["attention_mask"], 3)
        lb = reloaded(data["input_ids"], data["aux_hidden"], data["attention_mask"], 3)
        assert all(torch.equal(x, y) for x, y in zip(la, lb))
        assert torch.equal(strategy.forward_loss(model, data, StepContext()).loss,
                           strategy.forward_loss(reloaded, data, StepContext()).loss)


def test_loading_against_another_target_is_refused(tmp_path):
    strategy, info, _frozen, model = build()
    strategy.export(model, tmp_path, info)
    other, other_frozen = target(vocab=V + 1)
    with pytest.raises(Eagle3ExportError, match=f"vocabulary {V} and hidden size {H}.*has {V + 1} and {H}"):
        strategy.load_export(tmp_path, other, other_frozen)


def test_loading_a_directory_without_an_export_says_what_is_missing(tmp_path):
    strategy, info, frozen, _model = build()
    with pytest.raises(Eagle3ExportError, match=r"is not an EAGLE3 draft \(no config.json\)"):
        strategy.load_export(tmp_path, info, frozen)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(Eagle3ExportError, match="not \\['LlamaForCausalLMEagle3'\\]"):
        strategy.load_export(tmp_path, info, frozen)
    (tmp_path / "config.json").write_text(json.dumps(_config_of(strategy, info)))
    with pytest.raises(Eagle3ExportError, match="not a readable safetensors file"):
        strategy.load_export(tmp_path, info, frozen)


def _config_of(strategy, info):
    from specforge_plugin_eagle3.export import hf_config

    return hf_config(strategy.draft_config(info), info)


def _snapshot(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _export_with_config(tmp_path, edit):
    """An export of ``build()`` whose config.json was changed by ``edit(config)``; returns its config.json path."""
    strategy, info, frozen, model = build()
    strategy.export(model, tmp_path, info)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path / "config.json", strategy, info, frozen


def test_a_dflash_export_is_refused_with_the_strategy_to_load_it_with(tmp_path):
    pytest.importorskip("specforge_plugin_dflash")
    from specforge_plugin_dflash import DFlashOptions
    from specforge_plugin_dflash.strategy import DFlashStrategy

    info, frozen = target()
    dflash = DFlashStrategy(DFlashOptions(num_layers=1, num_target_layers=2))
    dflash.export(dflash.build_model(info, frozen, DataStats()), str(tmp_path))
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=3, draft_vocab_size=VD))
    config_file = re.escape(str(tmp_path / "config.json"))
    with pytest.raises(Eagle3ExportError, match=rf"^{config_file} holds an export of strategy 'dflash' "
                                                r"\(specforge_strategy\), not 'eagle3'; load it with --strategy dflash$"):
        strategy.load_export(tmp_path, info, frozen)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["specforge_strategy"]  # as a DFlash draft trained by another tool would be
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Eagle3ExportError, match=rf"^{config_file} names architectures \['DFlashDraftModel'\], not "
                                                r"\['LlamaForCausalLMEagle3'\]: it is not an EAGLE3 draft$"):
        strategy.load_export(tmp_path, info, frozen)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"])
def test_a_config_without_a_required_field_names_the_file_and_field(tmp_path, field):
    config_file, strategy, info, frozen = _export_with_config(tmp_path, lambda c: c.pop(field))
    with pytest.raises(Eagle3ExportError, match=rf"^{re.escape(str(config_file))} has no '{field}' field; an EAGLE3 "
                                                "draft needs it as an integer$"):
        strategy.load_export(tmp_path, info, frozen)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(intermediate_size="48"), "has 'intermediate_size' = '48'; an EAGLE3 draft needs it as an integer"),
    (lambda c: c.update(rms_norm_eps="small"), "has 'rms_norm_eps' = 'small'; an EAGLE3 draft needs it as a number"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, "3", 5]),
     ("has 'eagle_config.eagle_aux_hidden_state_layer_ids' = [0, '3', 5]; an EAGLE3 draft needs it as a list of "
     "integers")),
    (lambda c: c.update(num_key_value_heads=3), ("does not describe a valid EAGLE3 draft: num_attention_heads (4) must "
                                                "be a multiple of num_key_value_heads (3)")),
    (lambda c: c.update(num_hidden_layers=2), "describes 2 layers; the eagle3 strategy builds one"),
    (lambda c: c.update(num_attention_heads=0), ("has 'num_attention_heads' = 0; an EAGLE3 draft needs at least one "
                                                "attention head")),
])
def test_a_config_with_an_ill_formed_field_names_the_file_field_and_expected_form(tmp_path, edit, message):
    config_file, strategy, info, frozen = _export_with_config(tmp_path, edit)
    with pytest.raises(Eagle3ExportError, match=rf"^{re.escape(str(config_file))} {re.escape(message)}$"):
        strategy.load_export(tmp_path, info, frozen)


def test_weights_that_do_not_fit_the_config_name_the_tensor_and_both_shapes(tmp_path):
    _config_file, strategy, info, frozen = _export_with_config(tmp_path, lambda c: c.update(intermediate_size=64))
    weights = re.escape(str(tmp_path / "model.safetensors"))
    with pytest.raises(Eagle3ExportError, match=rf"^{weights}: midlayer.mlp.gate_proj.weight is torch.bfloat16 "
                                                r"\(48, 32\), the draft its config.json describes expects "
                                                r"torch.bfloat16 \(64, 32\)$"):
        strategy.load_export(tmp_path, info, frozen)


def test_a_draft_that_does_not_fit_the_layout_leaves_the_existing_export_intact(tmp_path):
    strategy, info, _frozen, model = build()
    strategy.export(model, tmp_path, info)
    before = _snapshot(tmp_path)
    model.extra = torch.nn.Linear(2, 2, bias=False)
    with pytest.raises(Eagle3ExportError, match=r"^the draft's state does not match the SGLang EAGLE3 layout: "
                                                r"missing \[\], unexpected \['extra.weight'\]$"):
        strategy.export(model, tmp_path, info)
    assert _snapshot(tmp_path) == before
    with pytest.raises(Eagle3ExportError, match="unexpected \\['extra.weight'\\]"):
        strategy.export(model, tmp_path / "new", info)
    assert not (tmp_path / "new").exists()
