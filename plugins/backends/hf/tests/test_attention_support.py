"""Attention choice: ``auto`` picks a kernel the model's attention runs on, and an explicit
choice that cannot run it is refused before any weight loads.

The models are tiny Gemma2 (logit softcapping) and gpt-oss (attention sinks) targets built
here from a config with random weights, saved with ``save_pretrained`` next to the tiny toy
target's tokenizer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specforge_core.protocols import CapturePlan
from specforge_plugin_hf import HFEngineOptions
from specforge_plugin_hf.attention_support import SINKS, SOFTCAPPING, choose_attention, read_model_attention
from specforge_plugin_hf.engine import HFTargetEngine
from specforge_plugin_hf.errors import AttentionImplementationError


def tiny_config(kind: str, tokenizer, **overrides):
    from transformers import Gemma2Config, GptOssConfig, LlamaConfig

    shape = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
             "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
             "pad_token_id": tokenizer.pad_token_id}
    if kind == "gemma2":  # softcapping on every attention layer (50.0 is Gemma2's own value)
        return Gemma2Config(**shape, **{"attn_logit_softcapping": 50.0, **overrides})
    if kind == "gpt_oss":  # a learnt sink logit per head, and a two-expert MoE
        return GptOssConfig(**shape, num_local_experts=2, num_experts_per_tok=1, **overrides)
    return LlamaConfig(**shape, **overrides)


@pytest.fixture(scope="module")
def toy_tokenizer(tiny_toy_target: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_toy_target)


@pytest.fixture(scope="module")
def tiny_models(toy_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders of a tiny Gemma2 and a tiny gpt-oss target, written by save_pretrained."""
    from transformers import AutoModelForCausalLM

    folders = {}
    for kind in ("gemma2", "gpt_oss"):
        folder = tmp_path_factory.mktemp(kind)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config(kind, toy_tokenizer)).save_pretrained(folder)
        toy_tokenizer.save_pretrained(folder)
        folders[kind] = folder
    return folders


def samples(tokenizer) -> list[dict]:
    texts = ["Who rules Kelmar?", "Count from 4 to 9, then back to 4, slowly.", "What is 12 + 7?"]
    return [{"input_ids": torch.tensor(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)["input_ids"])}
        for text in texts]


# -- auto picks what runs ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_auto_attention_on_cpu_picks_eager_for_softcapping_and_sinks_and_captures(tiny_models, kind):
    """Before: auto picked the batch-invariant attention and the first forward raised NotImplementedError."""
    from transformers import AutoModelForCausalLM

    engine = HFTargetEngine(HFEngineOptions(model=str(tiny_models[kind])))
    assert engine.info().extra["attn_implementation"] == "eager"
    reference = AutoModelForCausalLM.from_pretrained(tiny_models[kind], attn_implementation="eager")
    plan = CapturePlan(hidden_feature="aux_hidden", layer_ids=(0, 1), last_hidden=True)
    for sample in samples(engine.tokenizer):
        (captured,) = engine.capture([sample], plan)
        with torch.no_grad():
            out = reference(input_ids=sample["input_ids"][None], output_hidden_states=True)
        hidden = out.hidden_states
        torch.testing.assert_close(captured["aux_hidden"], torch.cat([hidden[1][0], hidden[2][0]], dim=-1),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(captured["last_hidden"], hidden[-1][0], atol=1e-5, rtol=1e-5)
        prefill = engine.session(sample["input_ids"], plan).prefill
        torch.testing.assert_close(prefill["logits"], out.logits[0], atol=1e-5, rtol=1e-5)


def test_model_features_are_read_without_loading_weights(toy_tokenizer):
    gemma2 = read_model_attention(tiny_config("gemma2", toy_tokenizer))
    assert gemma2.architecture == "Gemma2ForCausalLM"
    assert gemma2.features == {SOFTCAPPING: "attn_logit_softcapping=50.0"}
    gpt_oss = read_model_attention(tiny_config("gpt_oss", toy_tokenizer))
    assert set(gpt_oss.features) == {SINKS} and "self_attn.sinks" in gpt_oss.features[SINKS]
    assert read_model_attention(tiny_config("llama", toy_tokenizer)).features == {}


@pytest.mark.parametrize("kind, want", [("llama", "sdpa"), ("gemma2", "eager"), ("gpt_oss", "eager")])
def test_auto_attention_on_cuda_picks_sdpa_unless_the_model_needs_eager(toy_tokenizer, kind, want):
    # choose_attention only reads the device type, so no GPU is needed
    model = read_model_attention(tiny_config(kind, toy_tokenizer))
    assert choose_attention("auto", torch.device("cuda", 0), model) == want


def test_auto_attention_on_cpu_keeps_batch_invariant_for_a_model_without_such_features(toy_tokenizer):
    # Gemma2 with softcapping off runs on the batch-invariant attention, though transformers has no sdpa for it
    model = read_model_attention(tiny_config("gemma2", toy_tokenizer, attn_logit_softcapping=None))
    assert model.features == {}
    assert choose_attention("auto", torch.device("cpu"), model) == "batch_invariant"
    with pytest.raises(AttentionImplementationError,
                       match=r"attn_implementation=sdpa cannot run Gemma2ForCausalLM: transformers has no sdpa "
                             r"attention for Gemma2ForCausalLM; on cpu use batch_invariant or eager, or auto "
                             r"\(which picks batch_invariant\)"):
        choose_attention("sdpa", torch.device("cpu"), model)


# -- an explicit choice that cannot run is refused --------------------------------------------------


@pytest.mark.parametrize("kind, implementation, message", [
    ("gemma2", "batch_invariant", (
        r"attn_implementation=batch_invariant cannot run Gemma2ForCausalLM: its attention uses logit softcapping "
        r"\(attn_logit_softcapping=50\.0\), which batch_invariant does not implement; on cpu use eager, or auto "
        r"\(which picks eager\)")),
    ("gemma2", "sdpa", (r"logit softcapping \(attn_logit_softcapping=50\.0\), which sdpa does not implement; "
                        r"on cpu use eager")),
    ("gemma2", "flash_attention_2", (r"flash_attention_2 runs only on CUDA, and the target runs on cpu; "
                                     r"on cpu use eager")),
    ("gpt_oss", "batch_invariant", (
        r"attn_implementation=batch_invariant cannot run GptOssForCausalLM: its attention uses attention sinks "
        r"\(learnt sink logits such as model\.layers\.0\.self_attn\.sinks\), which batch_invariant does not "
        r"implement; on cpu use eager, or auto \(which picks eager\)")),
    ("gpt_oss", "sdpa", r"attention sinks .*, which sdpa does not implement; on cpu use eager"),
])
def test_explicit_attention_that_cannot_run_the_model_names_the_feature_and_what_works(
        tiny_models, kind, implementation, message):
    with pytest.raises(AttentionImplementationError, match=message):
        HFTargetEngine(HFEngineOptions(model=str(tiny_models[kind]), attn_implementation=implementation))


@pytest.mark.parametrize("kind, implementation, message", [
    ("gemma2", "sdpa", (r"which sdpa does not implement; on cuda use eager or flash_attention_2, or auto "
                        r"\(which picks eager\)")),
    ("gpt_oss", "flash_attention_2", (r"attention sinks .*, which flash_attention_2 does not implement; "
                                      r"on cuda use eager, or auto \(which picks eager\)")),
])
def test_explicit_attention_on_cuda_that_cannot_run_the_model_is_refused(toy_tokenizer, kind, implementation,
                                                                         message):
    model = read_model_attention(tiny_config(kind, toy_tokenizer))
    with pytest.raises(AttentionImplementationError, match=message):
        choose_attention(implementation, torch.device("cuda", 0), model)


def test_attention_is_refused_before_any_weight_loads(tiny_models, tmp_path):
    """The check reads only config.json: a folder whose weights are missing is refused for
    its attention, not reported as an unloadable model."""
    folder = shutil.copytree(tiny_models["gemma2"], tmp_path / "no-weights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(AttentionImplementationError, match="logit softcapping"):
        HFTargetEngine(HFEngineOptions(model=str(folder), attn_implementation="batch_invariant"))
