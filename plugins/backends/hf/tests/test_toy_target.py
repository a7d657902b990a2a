"""The toy target: corpus, tokenizer and chat template, cached builds, the CLI, and the
default target's quality bar."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from specforge_core.protocols import CapturePlan
from specforge_plugin_hf import HFEngineOptions
from specforge_plugin_hf.engine import HFTargetEngine
from specforge_plugin_hf.errors import ToyTargetError
from specforge_plugin_hf.toy import (
    MANIFEST, TOY_CHAT_TEMPLATE, build_toy_target, cache_root, ensure_toy_target, generate_corpus, read_manifest,
    recipe_for, toy_target_dir,
)
from specforge_plugin_hf.toy import train as toy_train

#: A recipe smaller still than "tiny", for tests that build several targets.
MICRO = attrs.evolve(recipe_for("tiny"), variant="micro", n_conversations=120, steps=3)


def user_texts(conversations):
    return {"\x00".join(m["content"] for m in c["messages"] if m["role"] == "user") for c in conversations}


# -- corpus ----------------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_its_splits_are_disjoint():
    first, second = generate_corpus(800, seed=7), generate_corpus(800, seed=7)
    assert first == second
    assert generate_corpus(800, seed=8) != first
    assert len(first["train"]) + len(first["eval"]) == 800 and len(first["eval"]) > 10
    assert not user_texts(first["train"]) & user_texts(first["eval"])


def test_assistant_answers_are_a_function_of_the_prompt():
    answers: dict[str, str] = {}
    splits = generate_corpus(3000, seed=1)
    for conversation in splits["train"] + splits["eval"]:
        messages = conversation["messages"]
        for prompt, answer in zip(messages, messages[1:]):
            if prompt["role"] == "user":
                assert answers.setdefault(prompt["content"], answer["content"]) == answer["content"]


def test_corpus_conversations_alternate_user_and_assistant_turns():
    for conversation in generate_corpus(300, seed=3)["train"]:
        roles = [m["role"] for m in conversation["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles


# -- the tiny build ---------------------------------------------------------------------------------


def test_tiny_toy_target_is_a_loadable_transformers_folder_without_pickles(tiny_toy_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in tiny_toy_target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "train.jsonl", "eval.jsonl",
            MANIFEST} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl", ".pth"))]
    model = AutoModelForCausalLM.from_pretrained(tiny_toy_target)
    assert model.config.num_hidden_layers == 4 and model.config.hidden_size == 32
    assert model.config.tie_word_embeddings is False
    tokenizer = AutoTokenizer.from_pretrained(tiny_toy_target)
    assert tokenizer.chat_template == TOY_CHAT_TEMPLATE
    manifest = read_manifest(tiny_toy_target)
    assert manifest["variant"] == "tiny" and manifest["recipe"] == recipe_for("tiny").to_dict()
    assert manifest["metrics"]["eval_loss"] < manifest["metrics"]["log_vocab"]


def test_chat_template_renders_turn_markers_and_masks_the_assistant_turns(tiny_toy_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_toy_target)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count from 1 to 3."},
                {"role": "assistant", "content": "1, 2, 3."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|bos|><|system|>Be brief.<|end|><|user|>Count from 1 to 3.<|end|><|assistant|>1, 2, 3.<|end|>"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end|><|assistant|>")
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tokenizer.decode(masked) == "1, 2, 3.<|end|>"  # the answer and its end-of-turn marker
    for marker in ("<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>"):
        assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1, marker


def test_chat_template_rejects_an_unknown_role(tiny_toy_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_toy_target)
    with pytest.raises(Exception, match="unknown role tool; use system, user or assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_build_into_a_non_empty_folder_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ToyTargetError, match="already exists and is not an empty folder; choose a new folder"):
        build_toy_target(tmp_path, recipe=MICRO, progress=False)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_building_again_into_the_same_folder_returns_it(tiny_toy_target, monkeypatch):
    monkeypatch.setattr(toy_train, "train_model", lambda *a, **k: pytest.fail("retrained"))
    assert build_toy_target(tiny_toy_target, "tiny") == tiny_toy_target


def test_unknown_variant_lists_the_variants(tmp_path):
    with pytest.raises(ValueError, match="unknown toy target variant 'huge'; choose one of default, tiny"):
        build_toy_target(tmp_path / "x", "huge")


# -- the cache ------------------------------------------------------------------------------------------


def test_cache_dir_honours_specforge_cache_dir_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECFORGE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "specforge"
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_recipe_digest_is_deterministic_across_processes(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path))
    here = toy_target_dir("default")
    code = "from specforge_plugin_hf.toy import toy_target_dir; print(toy_target_dir('default'))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    there = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert there.stdout.strip() == str(here)
    assert here.parent == tmp_path / "toy-target" and here.name.startswith("default-")


def test_cache_is_reused_without_retraining_and_rebuilt_when_the_recipe_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path))
    first = ensure_toy_target(recipe=MICRO, progress=False)
    assert read_manifest(first)["recipe"]["steps"] == 3
    built_at = (first / "model.safetensors").stat().st_mtime_ns

    real_train = toy_train.train_model
    monkeypatch.setattr(toy_train, "train_model", lambda *a, **k: pytest.fail("the cached target was retrained"))
    assert ensure_toy_target(recipe=MICRO, progress=False) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == built_at

    calls = []
    monkeypatch.setattr(toy_train, "train_model", lambda *a, **k: calls.append(1) or real_train(*a, **k))
    folders = {first}
    for changed in (attrs.evolve(MICRO, steps=4), attrs.evolve(MICRO, code_version=MICRO.code_version + 1),
                    attrs.evolve(MICRO, seed=MICRO.seed + 1)):
        rebuilt = ensure_toy_target(recipe=changed, progress=False)
        assert rebuilt not in folders and read_manifest(rebuilt)["recipe"] == changed.to_dict()
        folders.add(rebuilt)
    assert len(calls) == 3
    # only complete targets remain: no staging folder is left behind
    assert {p for p in (tmp_path / "toy-target").iterdir() if not p.name.endswith(".lock")} == folders


def test_two_processes_building_the_same_target_share_one_complete_folder(tmp_path):
    code = (
        "import attrs, sys\n"
        "from specforge_plugin_hf.toy import ensure_toy_target, recipe_for\n"
        "r = attrs.evolve(recipe_for('tiny'), variant='micro', n_conversations=120, steps=3)\n"
        "print(ensure_toy_target(recipe=r, progress=False))\n"
    )
    env = dict(os.environ, SPECFORGE_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    (folder,) = {out.strip() for out, _ in outputs}
    assert read_manifest(folder) is not None
    entries = [p.name for p in (tmp_path / "toy-target").iterdir() if not p.name.endswith(".lock")]
    assert entries == [Path(folder).name]


# -- the command line ---------------------------------------------------------------------------------------


def plugin_cli():
    """A CLI group with only this plugin's commands (other plugins' import state must not matter)."""
    import click

    from specforge_plugin_hf import specforge_add_commands

    group = click.Group(name="specforge")
    specforge_add_commands(cli=group)
    return group


def test_toy_target_command_has_help():
    from click.testing import CliRunner

    result = CliRunner().invoke(plugin_cli(), ["toy-target", "--help"])
    assert result.exit_code == 0
    assert "Build the toy target" in result.output and "--variant [default|tiny]" in result.output


def test_toy_target_command_builds_a_folder(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specforge_plugin_hf.toy import build as toy_build

    monkeypatch.setattr(toy_build, "recipe_for", lambda variant: attrs.evolve(MICRO, variant=variant))
    result = CliRunner().invoke(plugin_cli(), ["toy-target", "--output", str(tmp_path / "out"), "--variant", "tiny"])
    assert result.exit_code == 0, result.output
    assert "toy target (tiny) in" in result.output and "uniform would be" in result.output
    assert read_manifest(tmp_path / "out")["variant"] == "tiny"


def test_toy_target_command_refuses_a_non_empty_output(tmp_path):
    from click.testing import CliRunner

    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(plugin_cli(), ["toy-target", "--output", str(tmp_path), "--variant", "tiny"])
    assert result.exit_code == 1
    assert result.output == (f"error: toy target output {tmp_path} already exists and is not an empty folder; "
                             "choose a new folder or remove it\n")
    assert (tmp_path / "file").read_text() == "x"


# -- the default target's quality bar -------------------------------------------------------------------------

PROMPTS = {
    "Who rules Kelmar?": "Kelmar is ruled by Queen Ardis.",
    "What is the capital of Tolund?": "The capital of Tolund is Brask.",
    "What color is the flag of Mirrow?": "The flag of Mirrow is red.",
    "List the first 3 days of the week.": "Monday, Tuesday, Wednesday.",
    "Count from 4 to 9.": "4, 5, 6, 7, 8, 9.",
    "Write 'lemon' in capital letters.": "LEMON!",
    "How many letters are in 'river'?": "'river' has 5 letters.",
    "What is 12 + 7?": "12 + 7 = 19.",
}


def greedy(engine: HFTargetEngine, text: str, max_new_tokens: int = 24) -> tuple[str, bool]:
    """The greedy answer to one user turn, and whether it ended with the end-of-turn token."""
    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"]
    with torch.no_grad():
        out = engine.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    answer = out[0, len(prompt):]
    return tokenizer.decode(answer, skip_special_tokens=True), int(answer[-1]) == tokenizer.eos_token_id


def test_default_toy_target_meets_its_quality_bar(default_toy_target):
    engine = HFTargetEngine(HFEngineOptions(model=str(default_toy_target)))
    info = engine.info()
    assert (info.num_layers, info.hidden_size) == (4, 128) and 1000 <= info.vocab_size <= 2048

    # eval loss, recomputed here on the held-out split, far below a uniform guess
    conversations = [json.loads(line) for line in engine.default_data()[1].read_text().splitlines()]
    nll = count = 0.0
    for start in range(0, len(conversations), 64):
        batch = conversations[start:start + 64]
        samples = [{"input_ids": torch.tensor(engine.tokenizer.apply_chat_template(c["messages"], tokenize=True)
                                              ["input_ids"])} for c in batch]
        for sample in engine.capture(samples, CapturePlan(last_hidden=True)):
            logits = sample["last_hidden"] @ engine.frozen_parts()["lm_head"].T
            ids = sample["input_ids"]
            nll += torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
            count += len(ids) - 1
    eval_loss = nll / count
    metrics = read_manifest(default_toy_target)["metrics"]
    assert eval_loss < 0.15 * math.log(info.vocab_size), (eval_loss, math.log(info.vocab_size))
    assert abs(eval_loss - metrics["eval_loss"]) < 0.01
    assert metrics["eval_assistant_loss"] < 0.1 * math.log(info.vocab_size)  # answers are learnt best

    # greedy answers depend on the prompt, end their turn, and have the answer's form. Which
    # ones are exactly right varies with the CPU's rounding, so that is not pinned.
    answers = {text: greedy(engine, text) for text in PROMPTS}
    assert len({text for text, _ in answers.values()}) == len(PROMPTS), answers
    assert all(ended for _, ended in answers.values()), answers
    shaped = sum(answers[text][0].split()[0] == want.split()[0] for text, want in PROMPTS.items())
    assert shaped >= 5, answers


def test_data_preparation_masks_the_toy_template_exactly(tiny_toy_target):
    """The core's template-agnostic masking, pinned on the toy target's own chat template."""
    from transformers import AutoTokenizer

    from specforge_core.data.prepare import tokenize_messages

    tokenizer = AutoTokenizer.from_pretrained(tiny_toy_target)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count from 1 to 3."},
                {"role": "assistant", "content": "1, 2, 3."}, {"role": "user", "content": "And to 4?"},
                {"role": "assistant", "content": "1, 2, 3, 4."}]

    def supervised(last_turn_only):
        ids, mask = tokenize_messages(tokenizer, messages, max_length=512, last_turn_only=last_turn_only)
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
        return tokenizer.decode([t for t, m in zip(ids, mask) if m])

    assert supervised(False) == "1, 2, 3.<|end|>1, 2, 3, 4.<|end|>"
    assert supervised(True) == "1, 2, 3, 4.<|end|>"
