"""Every export checked against the serving engines' own loading rules, re-stated here.

The rules below were read from the engines' loaders (SGLang: ``models/llama_eagle3.py``
``LlamaForCausalLMEagle3.load_weights``, ``models/dflash.py`` and
``speculative/dflash_utils.py`` ``parse_dflash_draft_config``, the Domino helpers; vLLM:
``models/llama_eagle3.py`` ``Eagle3LlamaForCausalLM``, ``models/qwen3_dflash.py``, the
runner's ``_get_eagle3_aux_layers_from_config``, and the speculators config loader). They
are written out as plain checks, independent of the export code, so that a change which
would break serving fails here. See docs/serving.md for what each rule protects.

Layer-id numbering, in one place: our id ``i`` = output of decoder layer ``i`` = the hidden
state entering layer ``i + 1``. SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` and
``dflash_config.target_layer_ids`` take ``i`` (SGLang adds 1); vLLM's top-level
``eagle_aux_hidden_state_layer_ids`` and speculators' aux ids take ``i + 1``. Both engines
capture layer *inputs* (vLLM 0.33 also the last layer's output; SGLang and earlier vLLM releases do not),
so ``i + 1`` must name a layer: ``i <= L - 2``.
"""

import copy
import json

import attrs
import pytest
import torch
from safetensors import safe_open

from specforge_core.protocols import BuildContext, DataStats, TargetInfo

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.blocks import block_attention_mask
from specforge_plugin_dflash.export import DFlashExportError
from specforge_plugin_dflash.strategy import DFlashStrategy
from specforge_plugin_domino import DominoOptions
from specforge_plugin_domino.strategy import DominoStrategy
from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.export import Eagle3ExportError
from specforge_plugin_eagle3.model import Eagle3Draft
from specforge_plugin_eagle3.strategy import Eagle3Strategy

L, H, V, HEADS, KV, HEAD_DIM, INTER = 6, 32, 96, 4, 2, 8, 48
VD = 40  # a pruned EAGLE3 draft vocabulary

#: SGLang and vLLM serve a float32 config.json as float16 under --dtype auto: exports name bf16.
SERVED_DTYPE = "bfloat16"


def target() -> tuple[TargetInfo, dict]:
    info = TargetInfo(num_layers=L, hidden_size=H, vocab_size=V, dtype="float32", model_id="/models/tiny-target",
                      extra={"architecture": "LlamaForCausalLM", "num_attention_heads": HEADS,
                             "num_key_value_heads": KV, "head_dim": HEAD_DIM, "intermediate_size": INTER,
                             "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                             "max_position_embeddings": 256, "eos_token_id": 1, "bos_token_id": 2,
                             "mask_token_id": 95})
    gen = torch.Generator().manual_seed(0)
    return info, {"embed_tokens": torch.randn(V, H, generator=gen), "lm_head": torch.randn(V, H, generator=gen),
                  "norm": torch.ones(H)}


def perturbed(model):
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    return model


def eagle3():
    info, frozen = target()
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=3, draft_vocab_size=VD), BuildContext())
    counts = torch.arange(V).flip(0)
    return strategy, info, frozen, perturbed(strategy.build_model(info, frozen, DataStats(token_counts=counts)))


def dflash(cls=DFlashStrategy, options=DFlashOptions, **extra):
    info, frozen = target()
    strategy = cls(options(num_layers=2, num_target_layers=3, block_size=4, **extra), BuildContext())
    torch.manual_seed(0)
    return strategy, info, frozen, perturbed(strategy.build_model(info, frozen, DataStats()))


def read(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return json.loads((folder / "config.json").read_text()), tensors


def as_served(model):
    """The trained draft as served: its trainable weights rounded to the export's bf16 (the target's
    frozen embedding and lm_head stay as they are)."""
    served = copy.deepcopy(model)
    with torch.no_grad():
        for param in served.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    return served


def floating_dtypes(tensors):
    return {t.dtype for t in tensors.values() if t.is_floating_point()}


def assert_servable_ids(ours, engine_ids):
    """Our ids within 0..L-2 (a layer input exists for each), the engine's exactly ours + 1."""
    assert all(0 <= i <= L - 2 for i in ours), ours
    assert engine_ids == [i + 1 for i in ours]
    assert all(1 <= i <= L - 1 for i in engine_ids)


# ---------------------------------------------------------------- EAGLE3
def eagle3_tensor_rules(tensors, prefix):
    """LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM: q/k/v fused into qkv_proj over the 2h-wide input
    [embedding ; hidden], gate/up fused, fc over three target layers, own lm_head over the draft vocab."""
    h, q, kv = H, HEADS * HEAD_DIM, KV * HEAD_DIM
    want = {"fc.weight": (h, 3 * H), "norm.weight": (h,), "lm_head.weight": (VD, h), "d2t": (VD,), "t2d": (V,),
            f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.hidden_norm.weight": (h,),
            f"{prefix}.post_attention_layernorm.weight": (h,),
            f"{prefix}.self_attn.q_proj.weight": (q, 2 * h), f"{prefix}.self_attn.k_proj.weight": (kv, 2 * h),
            f"{prefix}.self_attn.v_proj.weight": (kv, 2 * h), f"{prefix}.self_attn.o_proj.weight": (h, q),
            f"{prefix}.mlp.gate_proj.weight": (INTER, h), f"{prefix}.mlp.up_proj.weight": (INTER, h),
            f"{prefix}.mlp.down_proj.weight": (h, INTER)}
    assert {k: tuple(t.shape) for k, t in tensors.items()} == want  # no embed_tokens: the target's is shared
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert floating_dtypes(tensors) == {torch.bfloat16}
    # d2t holds offsets: draft id j maps to target id j + d2t[j], and t2d marks exactly those ids
    used = torch.arange(VD) + tensors["d2t"]
    assert sorted(used.tolist()) == tensors["t2d"].nonzero().flatten().tolist()


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_eagle3_folder_serves_in_sglang_and_vllm(tmp_path, fmt):
    strategy, info, _frozen, model = eagle3()
    strategy.export(model, str(tmp_path), info, fmt=fmt)
    config, tensors = read(tmp_path)
    eagle3_tensor_rules(tensors, "midlayer")
    # SGLang: the architecture, the draft vocabulary, an own lm_head (tied would reuse the embedding)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == VD and config["vocab_size"] == V and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == SERVED_DTYPE
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "max_position_embeddings"):
        assert isinstance(config[field], (int, float)), field
    # SGLang: eagle_config ids in our numbering; vLLM: top-level ids in its own, and the residual un-normed
    ours = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ours == [0, 2, 4] and len(ours) == 3
    assert_servable_ids(ours, config["eagle_aux_hidden_state_layer_ids"])
    assert config["norm_before_residual"] is False


def test_eagle3_speculators_layout_is_what_vllms_speculators_loader_reads(tmp_path):
    strategy, info, _frozen, model = eagle3()
    strategy.export(model, str(tmp_path), info, fmt="speculators")
    config, tensors = read(tmp_path)
    eagle3_tensor_rules(tensors, "layers.0")  # speculators names the decoder layer layers.0
    # vLLM's SpeculatorsConfig: these fields must exist, or it refuses the checkpoint; and vLLM takes a folder
    # down the speculators path only when its config has no top-level model_type
    assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
    methods = config["speculators_config"]["proposal_methods"]
    assert methods[0]["proposal_type"] == "greedy" and methods[0]["speculative_tokens"] == 3
    assert config["speculators_config"]["default_proposal_method"] == "greedy"
    assert config["speculators_config"]["verifier"] == {"name_or_path": "/models/tiny-target",
                                                        "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == V and layer["num_hidden_layers"] == 1
    assert layer["torch_dtype"] == SERVED_DTYPE and config["torch_dtype"] == SERVED_DTYPE
    # update_eagle3 defaults norm_before_residual to TRUE when absent: it must be written, false
    assert config["norm_before_residual"] is False
    assert config["draft_vocab_size"] == VD and config["target_hidden_size"] == H
    assert_servable_ids([0, 2, 4], config["eagle_aux_hidden_state_layer_ids"])


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_a_full_vocabulary_eagle3_draft_ships_no_vocabulary_maps(tmp_path, fmt):
    """vLLM's Eagle3LlamaForCausalLM makes its draft_id_to_target_id parameter only when draft_vocab_size differs
    from the target's vocabulary, and its weight loader refuses a d2t it then has nowhere to put; SGLang, given
    no d2t, drafts over the target's ids as they are. So a draft over the whole vocabulary ships neither map, in
    every format, and reads back with the identity."""
    info, frozen = target()
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=3, draft_vocab_size=V), BuildContext())
    model = perturbed(strategy.build_model(info, frozen, DataStats(token_counts=torch.arange(V).flip(0))))
    strategy.export(model, str(tmp_path), info, fmt=fmt)
    config, tensors = read(tmp_path)
    layer = config.get("transformer_layer_config", config)
    assert config["draft_vocab_size"] == layer["vocab_size"] == V
    assert "d2t" not in tensors and "t2d" not in tensors and tuple(tensors["lm_head.weight"].shape) == (V, H)
    reloaded = strategy.load_export(str(tmp_path), info, frozen)
    assert torch.equal(reloaded.d2t, torch.zeros(V, dtype=torch.long)) and bool(reloaded.t2d.all())
    torch.testing.assert_close(reloaded.state_dict()["lm_head.weight"], as_served(model).state_dict()["lm_head.weight"])


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_eagle3_load_export_reads_every_format_back_to_the_served_draft(tmp_path, fmt):
    strategy, info, frozen, model = eagle3()
    strategy.export(model, str(tmp_path), info, fmt=fmt)
    reloaded = strategy.load_export(str(tmp_path), info, frozen)
    assert reloaded.config.aux_layer_ids == (0, 2, 4) and reloaded.config.draft_vocab_size == VD
    state, want = reloaded.state_dict(), as_served(model).state_dict()
    assert list(state) == list(want)
    for name, tensor in want.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


def test_an_eagle3_draft_on_the_last_layer_is_refused_for_export_saying_why(tmp_path):
    _strategy, info, frozen, model = eagle3()
    config = attrs.evolve(model.config, aux_layer_ids=(0, 2, L - 1))
    bad = Eagle3Draft(config, frozen["embed_tokens"], frozen["lm_head"])
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=3, draft_vocab_size=VD), BuildContext())
    with pytest.raises(Eagle3ExportError, match=r"the draft's aux layer ids \[0, 2, 5\] names layer\(s\) \[5\], but a "
                                                r"draft for this 6-layer target can use ids 0\.\.4 only: SGLang and "
                                                r"vLLM capture the hidden state entering each decoder layer"):
        strategy.export(bad, str(tmp_path / "out"), info)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- DFlash
def dflash_tensor_rules(tensors, layers=2):
    """DFlashDraftModel / DFlashQwen3ForCausalLM: Qwen3 layers with q/k norms, fc over n target layers,
    hidden_norm; no embed_tokens and no lm_head (both engines use the target's)."""
    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    want = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(layers):
        want.update({f"layers.{i}.self_attn.q_proj.weight": (q, H), f"layers.{i}.self_attn.k_proj.weight": (kv, H),
                     f"layers.{i}.self_attn.v_proj.weight": (kv, H), f"layers.{i}.self_attn.o_proj.weight": (H, q),
                     f"layers.{i}.self_attn.q_norm.weight": (HEAD_DIM,),
                     f"layers.{i}.self_attn.k_norm.weight": (HEAD_DIM,),
                     f"layers.{i}.mlp.gate_proj.weight": (INTER, H), f"layers.{i}.mlp.up_proj.weight": (INTER, H),
                     f"layers.{i}.mlp.down_proj.weight": (H, INTER),
                     f"layers.{i}.input_layernorm.weight": (H,), f"layers.{i}.post_attention_layernorm.weight": (H,)})
    assert {k: tuple(t.shape) for k, t in tensors.items() if k in want} == want
    assert floating_dtypes(tensors) == {torch.bfloat16}
    return set(tensors) - set(want)


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_dflash_folder_serves_in_sglang_and_vllm(tmp_path, fmt):
    strategy, info, _frozen, model = dflash()
    strategy.export(model, str(tmp_path), info, fmt=fmt)
    config, tensors = read(tmp_path)
    assert dflash_tensor_rules(tensors) == set()
    assert config["architectures"] == ["DFlashDraftModel"] and config["torch_dtype"] == SERVED_DTYPE
    section = config["dflash_config"]
    # SGLang releases check ids against num_target_layers, some falling back to the DRAFT's depth when it is
    # absent (newer ones to max(target_layer_ids) + 1)
    assert section["num_target_layers"] == L and config["num_target_layers"] == L
    assert section["block_size"] == 4 and config["num_hidden_layers"] == 2
    assert isinstance(section["mask_token_id"], int) and 0 <= section["mask_token_id"] < V
    ours = section["target_layer_ids"]
    assert ours == [1, 2, 3] and all(i < section["num_target_layers"] for i in ours)
    # vLLM: the captured layers at the top level in its numbering (some versions would otherwise read
    # dflash_config's ids as they are and capture one layer too early)
    assert_servable_ids(ours, config["eagle_aux_hidden_state_layer_ids"])


def test_dflash_speculators_layout_is_what_vllms_speculators_loader_reads(tmp_path):
    strategy, info, _frozen, model = dflash()
    strategy.export(model, str(tmp_path), info, fmt="speculators")
    config, tensors = read(tmp_path)
    assert dflash_tensor_rules(tensors) == set()
    assert config["speculators_model_type"] == "dflash" and "model_type" not in config
    # the drafted positions of a block are the proposal length
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny-target"
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == V
    # update_dflash requires mask_token_id and the aux ids (vLLM's numbering, target_layer_ids = aux - 1);
    # block_size is the speculators library's (default 8 without it)
    assert isinstance(config["mask_token_id"], int) and config["block_size"] == 4
    assert_servable_ids([1, 2, 3], config["aux_hidden_state_layer_ids"])
    assert config["sample_from_anchor"] is False and config["draft_vocab_size"] == V


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_dflash_load_export_reads_every_format_back_to_the_served_draft(tmp_path, fmt):
    strategy, info, frozen, model = dflash()
    strategy.export(model, str(tmp_path), info, fmt=fmt)
    reloaded = strategy.load_export(str(tmp_path), info, frozen)
    assert reloaded.config == model.config and reloaded.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    feats, ids = torch.randn(1, 10, 3 * H, generator=gen), torch.randint(0, V, (1, 8), generator=gen)
    positions = torch.cat([torch.arange(3, 7), torch.arange(5, 9)])[None]
    mask = block_attention_mask(torch.tensor([[3, 5]]), torch.tensor([10]), 10, 4)
    served = as_served(model)
    with torch.no_grad():
        assert torch.equal(served.logits(served(feats, ids, positions, mask)),
                           reloaded.logits(reloaded(feats, ids, positions, mask)))


def test_a_dflash_draft_on_the_last_layer_is_refused_for_export_saying_why(tmp_path):
    _strategy, info, frozen, model = dflash()
    model.config = attrs.evolve(model.config, target_layer_ids=(0, 2, L - 1))
    strategy = DFlashStrategy(DFlashOptions(), BuildContext())
    with pytest.raises(DFlashExportError, match=r"the draft's target_layer_ids \[0, 2, 5\] names layer\(s\) \[5\].*"
                                                r"\(id L-1\) does not exist in a serving engine"):
        strategy.export(model, str(tmp_path / "out"), info)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- Domino
def test_domino_folder_is_what_sglangs_domino_runtime_loads(tmp_path):
    strategy, info, _frozen, model = dflash(DominoStrategy, DominoOptions, emb_dim=16, gru_hidden_dim=24)
    strategy.export(model, str(tmp_path), info)
    config, tensors = read(tmp_path)
    extra = dflash_tensor_rules(tensors)  # DFlash's layout, plus the head
    assert {k: tuple(tensors[k].shape) for k in extra} == {
        "prefix_gru.weight_ih_l0": (3 * 24, H), "prefix_gru.weight_hh_l0": (3 * 24, 24),  # no GRU biases
        "embed_proj.0.weight": (16, H + 24), "embed_proj.2.weight": (V, 16)}  # output = the target vocab
    # the runtime refuses anything but bf16 projector weights; the config must make the server pick bf16
    assert config["torch_dtype"] == SERVED_DTYPE and floating_dtypes(tensors) == {torch.bfloat16}
    section = config["dflash_config"]
    assert section["projector_type"] == "domino" and section["gru_hidden_dim"] == 24
    # one SGLang version reads emb_dim only at the top level; another checks both places agree
    assert config["emb_dim"] == section["emb_dim"] == 16
    assert section["pure_draft_prefix_len"] == 1 and isinstance(section["shift_label"], bool)
    assert section["num_target_layers"] == L and section["block_size"] > 1


def test_every_export_records_its_strategy_and_options_for_eval(tmp_path):
    for name, (strategy, info, _frozen, model) in {"eagle3": eagle3(), "dflash": dflash()}.items():
        strategy.export(model, str(tmp_path / name), info)
        config, _tensors = read(tmp_path / name)
        assert config["specforge_strategy"] == name
        assert config["specforge_strategy_options"]["seed" if name == "dflash" else "ttt_length"] == (
            0 if name == "dflash" else 3)
