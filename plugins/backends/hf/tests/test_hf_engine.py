"""The hf target engine: conformance, exact batched capture, verify sessions, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from specforge_core.contracts import FeatureSpec
from specforge_core.errors import OptionError
from specforge_core.protocols import CapturePlan, TargetEngine, VerifySession
from specforge_core.testing.target_engine_suite import TargetEngineConformance
from specforge_plugin_hf import HFEngineOptions, specforge_target_engines
from specforge_plugin_hf.engine import HFTargetEngine
from specforge_plugin_hf.errors import CapturePlanError, TargetEngineError, TargetModelNotFoundError


def make_engine(folder: Path, **options) -> HFTargetEngine:
    return HFTargetEngine(HFEngineOptions(model=str(folder), **options))


@pytest.fixture(scope="module")
def engine(tiny_toy_target: Path) -> HFTargetEngine:
    return make_engine(tiny_toy_target)


def conversation_samples(engine: HFTargetEngine, split: int = 1, limit: int = 16) -> list[dict]:
    """Chat-templated toy conversations (the data capture really sees), of unequal lengths."""
    path = engine.default_data()[split]
    conversations = [json.loads(line) for line in path.read_text().splitlines()][:limit]
    samples = []
    for conversation in conversations:
        ids = engine.tokenizer.apply_chat_template(conversation["messages"], tokenize=True)["input_ids"]
        samples.append({"input_ids": torch.tensor(ids)})
    return samples


class TestHFEngineConformance(TargetEngineConformance):
    @pytest.fixture(autouse=True)
    def _toy(self, tiny_toy_target: Path) -> None:
        self.toy = tiny_toy_target

    def make_engine(self, tmp_path):
        return make_engine(self.toy)


def test_engine_satisfies_the_target_engine_protocol(engine):
    assert isinstance(engine, TargetEngine)
    session = engine.session(torch.tensor([1, 5, 7]), CapturePlan(hidden_feature="aux_hidden", layer_ids=(1,)))
    assert isinstance(session, VerifySession)


def test_spec_factory_builds_the_engine(tiny_toy_target):
    (spec,) = specforge_target_engines()
    options = spec.build_options({"model": str(tiny_toy_target), "capture_batch_size": 3})
    engine = spec.load_factory()(options, None)
    assert engine.info().num_layers == 4


# -- capture is exact ---------------------------------------------------------------------------


def test_padded_batch_capture_equals_a_direct_single_sample_forward_exactly(engine):
    """Each sample of a right-padded batch captures bit for bit what a plain transformers
    forward of that sample alone gives (CPU, float32, the batch_invariant attention)."""
    samples = conversation_samples(engine)
    # one long sample too, beyond the ~200 keys where eager attention stops being exact
    samples.append({"input_ids": torch.cat([s["input_ids"] for s in samples[:6]])[:250]})
    lengths = [len(s["input_ids"]) for s in samples]
    assert len(set(lengths)) > 3 and max(lengths) >= 200, lengths
    plan = CapturePlan(layer_ids=(0, 1, 2), hidden_feature="aux_hidden", last_hidden=True)
    captured = make_engine(engine.model_path, capture_batch_size=len(samples)).capture(samples, plan)
    for sample, result in zip(samples, captured):
        with torch.no_grad():
            hidden = engine.model(input_ids=sample["input_ids"][None], output_hidden_states=True).hidden_states
        want = torch.cat([hidden[1][0], hidden[2][0], hidden[3][0]], dim=-1)
        assert torch.equal(result["aux_hidden"], want), len(sample["input_ids"])
        assert torch.equal(result["last_hidden"], hidden[-1][0])


def test_batch_invariant_attention_computes_what_eager_attention_computes(engine):
    eager = make_engine(engine.model_path, attn_implementation="eager")
    assert eager.info().extra["attn_implementation"] == "eager"
    assert engine.info().extra["attn_implementation"] == "specforge_batch_invariant"
    samples = conversation_samples(engine, limit=6)
    plan = CapturePlan(hidden_feature="aux_hidden", layer_ids=(0, 1, 2), last_hidden=True)
    for ours, theirs in zip(engine.capture(samples, plan), eager.capture(samples, plan)):
        torch.testing.assert_close(ours["aux_hidden"], theirs["aux_hidden"], atol=1e-5, rtol=1e-5)


def test_capture_splits_batches_by_capture_batch_size(engine):
    samples = conversation_samples(engine, limit=5)
    plan = CapturePlan(hidden_feature="aux_hidden", layer_ids=(1,), last_hidden=True)
    whole = make_engine(engine.model_path, capture_batch_size=5).capture(samples, plan)
    split = make_engine(engine.model_path, capture_batch_size=2).capture(samples, plan)
    for a, b in zip(whole, split):
        assert torch.equal(a["aux_hidden"], b["aux_hidden"]) and torch.equal(a["last_hidden"], b["last_hidden"])


def test_layer_id_i_is_the_hidden_state_entering_layer_i_plus_one_as_serving_engines_record_it(engine):
    """The serving engines' rule, restated: SGLang and vLLM record, for capture index k, the
    hidden state (residual stream) *entering* decoder layer k, and our layer id i is their
    index i + 1. So id i must equal, bit for bit, the input of decoder layer i + 1 (recorded
    here by a pre-hook of the test's own), which is also transformers' hidden_states[i + 1]."""
    sample = conversation_samples(engine, limit=1)[0]
    layers = engine.model.base_model.layers
    seen = {}

    def record(index):
        def hook(_module, args, kwargs):
            seen[index] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    handles = [layer.register_forward_pre_hook(record(k), with_kwargs=True) for k, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            hidden = engine.model(input_ids=sample["input_ids"][None], output_hidden_states=True).hidden_states
    finally:
        for handle in handles:
            handle.remove()
    n = len(layers)
    result = engine.capture([sample], CapturePlan(hidden_feature="aux_hidden", layer_ids=tuple(range(n - 1)), last_hidden=True))[0]
    width = engine.info().hidden_size
    for i in range(n - 1):
        got = result["aux_hidden"][:, i * width:(i + 1) * width]
        assert torch.equal(got, seen[i + 1][0]), i
        assert torch.equal(got, hidden[i + 1][0]), i
    assert torch.equal(result["last_hidden"], hidden[-1][0])  # the final norm's output
    logits = result["last_hidden"] @ engine.frozen_parts()["lm_head"].T
    with torch.no_grad():
        want = engine.model(input_ids=sample["input_ids"][None]).logits[0]
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


# -- sessions -------------------------------------------------------------------------------------


def greedy_with_session(engine: HFTargetEngine, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    session = engine.session(prompt, CapturePlan(hidden_feature="aux_hidden", layer_ids=(0,)))
    token = int(session.prefill["logits"][-1].argmax())
    out = [token]
    while len(out) < max_new_tokens and token != engine.tokenizer.eos_token_id:
        token = int(session.extend(torch.tensor([token]))["logits"][-1].argmax())
        out.append(token)
    return out


def prompt_ids(engine: HFTargetEngine, text: str) -> torch.Tensor:
    enc = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    return torch.tensor(enc["input_ids"])


@pytest.mark.parametrize("text", ["What is 12 + 7?", "Who rules Kelmar?", "Spell 'lamp' backwards."])
def test_greedy_decoding_through_a_session_equals_generate(engine, text):
    prompt = prompt_ids(engine, text)
    with torch.no_grad():
        generated = engine.model.generate(prompt[None], max_new_tokens=12, do_sample=False,
                                          eos_token_id=engine.tokenizer.eos_token_id,
                                          pad_token_id=engine.tokenizer.pad_token_id)
    assert greedy_with_session(engine, prompt, 12) == generated[0, len(prompt):].tolist()


def test_session_verifies_a_draft_and_keeps_only_the_accepted_prefix(engine):
    """The speculative-decoding pattern: extend by a draft, keep the tokens the target
    agrees with, truncate the rest, and the cache equals a run over the accepted text."""
    plan = CapturePlan(layer_ids=(0, 2), hidden_feature="target_hidden", last_hidden=True)
    ids = conversation_samples(engine, limit=1)[0]["input_ids"]
    session = engine.session(ids[:12], plan)
    draft = torch.cat([ids[12:15], (ids[15:18] + 3) % engine.info().vocab_size])
    verified = session.extend(draft)
    assert set(verified) == {"logits", "target_hidden", "last_hidden"}
    assert verified["target_hidden"].shape == (6, 64) and verified["logits"].shape == (6, 384)
    session.truncate(15)
    after = session.extend(ids[15:20])
    reference = engine.session(ids[:20], plan).prefill
    torch.testing.assert_close(after["logits"], reference["logits"][15:20], atol=1e-5, rtol=0)
    torch.testing.assert_close(after["target_hidden"], reference["target_hidden"][15:20], atol=1e-5, rtol=0)


def test_session_without_a_prompt_starts_empty(engine):
    session = engine.session(None, CapturePlan(hidden_feature="aux_hidden", layer_ids=(0,)))
    assert session.length == 0 and session.prefill is None
    assert session.extend(torch.tensor([1, 4]))["logits"].shape == (2, 384)


# -- toy target as the default -------------------------------------------------------------------


def test_engine_without_a_model_serves_the_cached_toy_target_of_its_variant(use_toy_cache):
    """Served from the toy-target cache, built on first use. The tiny variant stands in for the
    default one (minutes to build; test_toy_target pins its quality): the path is the same."""
    from specforge_plugin_hf.toy import toy_target_dir

    assert HFEngineOptions().model is None and HFEngineOptions().toy_variant == "default"
    engine = HFTargetEngine(HFEngineOptions(toy_variant="tiny"))
    assert engine.model_path == toy_target_dir("tiny") and engine.model_path.parent == use_toy_cache / "toy-target"
    digest = engine.model_path.name.removeprefix("tiny-")
    assert engine.info().model_id == f"specforge/toy-target-tiny@{digest}"
    train, eval_ = engine.default_data()
    assert train.name == "train.jsonl" and eval_.name == "eval.jsonl" and train.is_file() and eval_.is_file()
    assert train.parent == eval_.parent == engine.model_path


def test_default_data_is_none_for_a_model_that_is_not_a_toy_target(tiny_toy_target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tiny_toy_target).save_pretrained(tmp_path / "plain")
    AutoTokenizer.from_pretrained(tiny_toy_target).save_pretrained(tmp_path / "plain")
    engine = make_engine(tmp_path / "plain")
    assert engine.default_data() is None
    assert engine.info().model_id == str(tmp_path / "plain")


# -- bad input gets a clear error -----------------------------------------------------------------


def test_missing_model_folder_names_the_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(TargetModelNotFoundError, match=f"target model folder {missing} does not exist; pass a "
                                                       "folder written by save_pretrained"):
        make_engine(missing)


def test_model_path_that_is_a_file_says_a_model_folder_is_expected(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a folder")
    message = (f"target model path {weights} is a file; target_engine.model must name a model folder written by "
               "save_pretrained, the folder holding config.json, the *.safetensors weights and the tokenizer files")
    with pytest.raises(TargetModelNotFoundError, match=re.escape(message)) as raised:
        make_engine(weights)
    assert "does not exist" not in str(raised.value)


def test_model_path_that_is_the_config_file_points_at_its_folder(tiny_toy_target):
    config = tiny_toy_target / "config.json"
    message = f"target model path {config} is a file (did you mean its folder {tiny_toy_target}?); target_engine.model"
    with pytest.raises(TargetModelNotFoundError, match=re.escape(message)):
        make_engine(config)


def test_hub_id_without_network_says_to_pass_a_local_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TargetModelNotFoundError, match="cannot load the tokenizer of target model "
                                                       "'specforge-test/no-such-model' \\(.*\\); .*a hub id needs network"):
        HFTargetEngine(HFEngineOptions(model="specforge-test/no-such-model"))


def test_folder_without_config_says_what_a_model_folder_holds(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetModelNotFoundError, match="has no config.json.*save_pretrained"):
        make_engine(tmp_path / "empty")


def test_folder_without_tokenizer_is_a_clear_error(tiny_toy_target, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_toy_target).save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(TargetModelNotFoundError, match="cannot load the tokenizer"):
        make_engine(tmp_path / "no-tokenizer")


def test_bad_layer_id_names_the_valid_range(engine):
    sample = conversation_samples(engine, limit=1)
    with pytest.raises(CapturePlanError, match=r"layer id 4, .* 4 decoder layers: valid layer ids are 0\.\.2"):
        engine.capture(sample, CapturePlan(hidden_feature="aux_hidden", layer_ids=(0, 4)))


def test_the_last_layers_output_is_refused_because_no_serving_engine_can_capture_it(engine):
    sample = conversation_samples(engine, limit=1)
    with pytest.raises(CapturePlanError, match=r"layer id 3, .*valid layer ids are 0\.\.2 .*the last layer's "
                                               r"output \(id L-1\) does not exist in a serving engine"):
        engine.capture(sample, CapturePlan(hidden_feature="aux_hidden", layer_ids=(0, 3)))
    with pytest.raises(CapturePlanError, match=r"layer id -1"):
        engine.session(sample[0]["input_ids"], CapturePlan(hidden_feature="aux_hidden", layer_ids=(-1,)))


def test_plan_feature_width_that_does_not_match_the_target_is_a_clear_error(engine):
    plan = CapturePlan(hidden_feature="aux_hidden", layer_ids=(0, 1), features={"aux_hidden": FeatureSpec((-1, 96), "float32")})
    with pytest.raises(CapturePlanError, match="width 96, but the target gives 64"):
        engine.capture(conversation_samples(engine, limit=1), plan)


@pytest.mark.parametrize("dtype", ["float8", "int32"])
def test_bad_dtype_lists_the_choices(tiny_toy_target, dtype):
    with pytest.raises(OptionError, match=f"target_engine.dtype': expected one of auto, float32, bfloat16, float16; "
                                          f"got '{dtype}'"):
        make_engine(tiny_toy_target, dtype=dtype)
    (spec,) = specforge_target_engines()
    with pytest.raises(OptionError, match="expected one of auto, float32"):
        spec.build_options({"dtype": dtype})


def test_dtype_option_sets_the_weights_and_features_dtype(tiny_toy_target):
    engine = make_engine(tiny_toy_target, dtype="bfloat16")
    assert engine.info().dtype == "bfloat16"
    result = engine.capture([{"input_ids": torch.tensor([1, 2, 3])}], CapturePlan(hidden_feature="aux_hidden", layer_ids=(0,), last_hidden=True))
    assert result[0]["aux_hidden"].dtype == torch.bfloat16


# -- loading ------------------------------------------------------


def test_cpu_target_is_loaded_frozen_in_eval_mode_in_the_chosen_dtype(tiny_toy_target):
    for dtype, want in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):
        model = make_engine(tiny_toy_target, device="cpu", dtype=dtype).model
        assert not model.training and getattr(model, "hf_device_map", None) is None
        assert {(p.device.type, p.dtype, p.requires_grad) for p in model.parameters()} == {("cpu", want, False)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_device_without_cuda_says_to_use_cpu(tiny_toy_target):
    with pytest.raises(TargetEngineError, match="no CUDA device; use --set target_engine.device=cpu"):
        make_engine(tiny_toy_target, device="cuda")


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([[1, 2], [3, 4]]), r"sample 0: input_ids must be a non-empty 1-D integer tensor, got shape \(2, 2\)"),
    (torch.tensor([], dtype=torch.long), r"non-empty 1-D integer tensor, got shape \(0,\)"),
    (torch.tensor([0.5, 1.0]), "dtype float32"),
    (torch.tensor([1, 384]), r"token id 384 is outside the target's vocabulary 0\.\.383"),
])
def test_malformed_input_ids_are_clear_errors(engine, ids, message):
    with pytest.raises(TargetEngineError, match=message):
        engine.capture([{"input_ids": ids}], CapturePlan(hidden_feature="aux_hidden", layer_ids=(0,)))


def test_sample_without_input_ids_lists_its_keys(engine):
    with pytest.raises(TargetEngineError, match="sample 0 has no 'input_ids' \\(it has: tokens\\)"):
        engine.capture([{"tokens": [1, 2]}], CapturePlan(hidden_feature="aux_hidden", layer_ids=(0,)))


@pytest.mark.parametrize("length", [-1, 9, 2.5])
def test_truncate_outside_the_cached_length_is_a_clear_error(engine, length):
    session = engine.session(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), CapturePlan(hidden_feature="aux_hidden", layer_ids=(0,)))
    with pytest.raises(TargetEngineError, match=r"length must be an integer in 0\.\.8"):
        session.truncate(length)
    assert session.length == 8


# -- the hook module stays cheap ------------------------------------------------------------------


def test_hook_module_and_toy_package_import_neither_torch_nor_transformers():
    import subprocess
    import sys

    code = ("import sys, specforge_plugin_hf, specforge_plugin_hf.toy; "
            "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_info_extra_is_json_metadata_with_the_fields_drafts_copy(engine):
    from specforge_core.contracts import check_record

    extra = engine.info().extra
    check_record(extra, "TargetInfo.extra")
    assert {"num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_parameters",
            "max_position_embeddings", "eos_token_id"} <= set(extra)


def forward_hooks(model) -> dict[str, int]:
    # transformers installs its own output-capturing hooks on first use; count them all
    return {name: len(module._forward_hooks) + len(module._forward_pre_hooks) for name, module in
            model.named_modules()}


def test_capture_leaves_no_hooks_on_the_target_even_when_the_forward_fails(engine):
    plan = CapturePlan(hidden_feature="aux_hidden", layer_ids=(0, 2), last_hidden=True)
    before = forward_hooks(engine.model)
    engine.capture(conversation_samples(engine, limit=2), plan)
    assert forward_hooks(engine.model) == before

    def fail(*_args):
        raise RuntimeError("boom")

    breaker = engine.model.base_model.layers[2].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.capture(conversation_samples(engine, limit=1), plan)
    finally:
        breaker.remove()
    assert forward_hooks(engine.model) == before


def test_concurrent_captures_and_sessions_in_threads_do_not_mix_features(engine):
    """A capture producer thread and a verify session share one model and its hooks."""
    from concurrent.futures import ThreadPoolExecutor

    samples = conversation_samples(engine, limit=6)
    plan = CapturePlan(hidden_feature="aux_hidden", layer_ids=(0, 2), last_hidden=True)
    want = [engine.capture([s], plan)[0] for s in samples]

    def capture(i):
        return engine.capture([samples[i]], plan)[0]

    def verify(i):
        return engine.session(samples[i]["input_ids"], plan).prefill

    with ThreadPoolExecutor(3) as pool:
        captured = list(pool.map(capture, list(range(6)) * 2))
        verified = list(pool.map(verify, range(6)))
    for i, got in enumerate(captured):
        assert torch.equal(got["aux_hidden"], want[i % 6]["aux_hidden"])
    for i, got in enumerate(verified):
        torch.testing.assert_close(got["last_hidden"], want[i]["last_hidden"], atol=1e-5, rtol=0)


def test_the_toy_eval_split_for_runs_holds_the_targets_own_replies(engine):
    bundled = engine.default_data()[1]
    own = engine.default_eval_data()
    assert own == bundled.with_name("eval.target.jsonl") and own.is_file()
    rows = [json.loads(line) for line in own.read_text().splitlines()]
    originals = [json.loads(line) for line in bundled.read_text().splitlines()]
    user_turns = [[m for m in r["messages"] if m["role"] == "user"] for r in rows]
    assert user_turns == [[m for m in r["messages"] if m["role"] == "user"] for r in originals]
    first = rows[0]["messages"]
    prompt = engine.tokenizer.apply_chat_template(first[:1], tokenize=False, add_generation_prompt=True)
    reply = engine.generate([engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]], max_new_tokens=64)[0]
    assert first[1]["content"] == engine.tokenizer.decode(reply[:-1] if reply[-1] in engine.stop_token_ids()
                                                          else reply)
    stamp = own.stat().st_mtime_ns
    assert engine.default_eval_data() == own and own.stat().st_mtime_ns == stamp  # made once, then reused


# -- sliding-window targets roll back too --------------------------------------------------------


def save_sliding_window_target(folder: Path, architecture: str) -> Path:
    """A random sliding-window transformers model (window 6) with a word-level tokenizer, saved as a model
    folder: Mistral (every layer windowed) or Gemma 3 (windowed and full layers in turn); or Qwen3-Next's
    linear-attention one, or Gemma 3n's (AltUp, and layers sharing their keys and values)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<unk>", "<eos>", "<bos>"] + [f"w{i}" for i in range(60)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                         eos_token="<eos>", bos_token="<bos>").save_pretrained(folder)
    common = dict(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                  sliding_window=6, pad_token_id=0, eos_token_id=2, bos_token_id=3)
    if architecture == "mistral":
        config, model_class = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    elif architecture == "qwen3_next":  # linear-attention and full layers in turn, a tiny mixture of experts
        config = transformers.Qwen3NextConfig(**common, layer_types=["linear_attention", "full_attention"] * 2,
                                              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                              linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=16, shared_expert_intermediate_size=16)
        model_class = transformers.Qwen3NextForCausalLM
    elif architecture == "gemma3n":  # AltUp: each layer takes two predictions of the stream; the last 2 share KV
        config = transformers.Gemma3nTextConfig(**common, layer_types=["sliding_attention", "full_attention"] * 2,
                                                vocab_size_per_layer_input=len(words), hidden_size_per_layer_input=8,
                                                num_kv_shared_layers=2, altup_num_inputs=2, laurel_rank=4,
                                                activation_sparsity_pattern=[0.0] * 4)
        model_class = transformers.Gemma3nForCausalLM
    else:
        config = transformers.Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention"] * 2)
        model_class = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    model_class(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("architecture", ["mistral", "gemma3"])
class TestHFSlidingWindowConformance(TargetEngineConformance):
    """The whole engine contract on sliding-window targets (window 6, samples of up to 40 tokens)."""

    @pytest.fixture(autouse=True)
    def _architecture(self, architecture: str) -> None:
        self.architecture = architecture

    def make_engine(self, tmp_path):
        return make_engine(save_sliding_window_target(tmp_path / self.architecture, self.architecture))


@pytest.mark.parametrize("architecture", ["mistral", "gemma3"])
def test_a_sliding_window_targets_session_rolls_back_rejected_drafts_past_its_window(tmp_path, architecture):
    """Sliding-window layers keep only their window; a session records their past so a truncate can take
    rejected drafts back out, long after the window filled: every verification's logits and features equal
    one forward over the accepted text."""
    engine = make_engine(save_sliding_window_target(tmp_path / architecture, architecture))
    plan = CapturePlan(layer_ids=(0, 2), hidden_feature="target_hidden")
    text = torch.randint(4, 64, (48,), generator=torch.Generator().manual_seed(1))
    reference = engine.session(text, plan).prefill
    session = engine.session(text[:10], plan)
    position, chunks = 10, [(4, 1), (5, 4), (3, 0), (6, 2), (2, 1), (5, 3), (4, 0), (6, 5), (3, 1), (5, 4)]
    for size, keep in chunks:  # verify the anchor and size-1 drafts, keep the anchor and `keep` drafts
        out = session.extend(text[position:position + size])
        for name in ("logits", "target_hidden"):
            torch.testing.assert_close(out[name], reference[name][position:position + size], atol=1e-5, rtol=0)
        position += keep + 1
        session.truncate(position)
    assert position == 41 and session.length == 41  # far past the window of 6


@pytest.mark.parametrize("architecture", ["mistral", "gemma3"])
def test_a_sliding_window_session_that_only_extends_holds_a_window(tmp_path, architecture):
    """A session that only extends (the timed greedy reference does) holds its windowed layers' window, not
    their whole past, and every output equals one forward over the text. (Truncates behind earlier extends and
    truncates, which then rebuild what those layers dropped: TestHFSlidingWindowConformance.)"""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    engine = make_engine(save_sliding_window_target(tmp_path / architecture, architecture))
    plan = CapturePlan(layer_ids=(0, 2), hidden_feature="target_hidden")
    text = torch.randint(4, 64, (30,), generator=torch.Generator().manual_seed(2))
    reference = engine.session(text, plan).prefill
    session = engine.session(text[:10], plan)
    for position in range(10, 30):
        out = session.extend(text[position:position + 1])
        for name in ("logits", "target_hidden"):
            torch.testing.assert_close(out[name], reference[name][position:position + 1], atol=1e-5, rtol=0)
    windowed = [layer for layer in session._cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    assert windowed and [layer.keys.shape[-2] for layer in windowed] == [6] * len(windowed)  # window 6: 5 and 1


def test_a_linear_attention_target_refuses_to_roll_back_naming_why(tmp_path):
    """A linear-attention layer's recurrent state cannot give back the tokens it took in: the first truncate of a
    rejected draft is refused, and the session stays as it was."""
    engine = make_engine(save_sliding_window_target(tmp_path / "next", "qwen3_next"))
    plan = CapturePlan(layer_ids=(0,), hidden_feature="target_hidden")
    session = engine.session(torch.arange(4, 14), plan)
    session.extend(torch.tensor([20, 21, 22]))
    with pytest.raises(TargetEngineError, match="this target's cache cannot roll back: its linear-attention layers "
                                                "keep a recurrent state that cannot give back the rejected draft "
                                                "tokens"):
        session.truncate(11)
    assert session.length == 13


def test_a_target_whose_layers_take_no_single_stream_is_refused_naming_the_shape(tmp_path):
    """Gemma 3n's layers take two predictions of the residual stream stacked in front ([2, batch, tokens, 32]):
    capturing them as a draft's features would read the stack's rows as copies of the stream, so a capture
    and a session are refused, naming the shape, and the target keeps no hook."""
    engine = make_engine(save_sliding_window_target(tmp_path / "gemma3n", "gemma3n"))
    plan = CapturePlan(layer_ids=(0, 1), hidden_feature="target_hidden")
    message = (r"target '.*gemma3n' \(Gemma3nForCausalLM\) passes its decoder layers hidden states of shape "
               r"\[2, 1, 7, 32\], not \[batch, tokens, 32\]: they are no single residual stream a draft reads")
    with pytest.raises(TargetEngineError, match=message):
        engine.capture([{"input_ids": torch.arange(4, 11)}], plan)
    with pytest.raises(TargetEngineError, match=message):
        engine.session(torch.arange(4, 11), plan)
    assert not any(layer._forward_pre_hooks for layer in engine._decoder_layers())


def test_a_forward_gets_its_cache_under_the_keyword_its_transformers_release_takes():
    """``cache`` where the forward takes it (the releases that renamed ``past_key_values``, which warns there),
    ``past_key_values`` for a forward from before the rename or one whose signature cannot be read."""
    import transformers

    from specforge_plugin_hf.engine import _cache_keyword

    class BeforeTheRename(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return input_ids

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))
    assert _cache_keyword(llama) == "cache"
    assert _cache_keyword(BeforeTheRename()) == "past_key_values"

    class Unreadable(torch.nn.Module):  # a forward whose signature inspect cannot read: the keyword every
        def forward(self, input_ids, cache=None):  # release before the rename takes, and which 5.x still does
            return input_ids

    Unreadable.forward.__signature__ = "not a signature"  # inspect.signature raises TypeError on it
    assert _cache_keyword(Unreadable()) == "past_key_values"


@pytest.mark.parametrize("extra_words, mask_token, want", [
    (["<|MASK|>", "<mask>"], "<mask>", "<|MASK|>"),  # SGLang's DFlash default wins where the vocabulary has it
    (["<mask>"], "<mask>", "<mask>"),  # else the tokenizer's own mask token
    ([], None, None),  # neither: the DFlash strategy picks a free id itself
])
def test_the_default_mask_token_is_the_one_sglangs_dflash_runtime_assumes(tmp_path, extra_words, mask_token, want):
    """SGLang's DFlash runtime takes ``<|MASK|>`` as a draft's mask token when the draft's config names none, and
    refuses a draft whose mask_token_id is not that token's id in the target's vocabulary: the engine reports that
    id where the vocabulary holds the token, even over a mask token the tokenizer registers otherwise."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(20)] + extra_words
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                         eos_token="<eos>", mask_token=mask_token).save_pretrained(tmp_path)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        pad_token_id=0, eos_token_id=2)).save_pretrained(tmp_path)
    extra = make_engine(tmp_path).info().extra
    assert extra["mask_token_id"] == (None if want is None else words.index(want))
