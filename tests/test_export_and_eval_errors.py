"""Error paths of export, eval and the lossless check, each with its message."""

import json
import re

import pytest
import torch

from sf_helpers import run_specforge
from specforge_core.errors import OptionError
from specforge_core.export import ExportError, export_model, load_exported_draft, resolve_checkpoint
from specforge_core.plugins import PluginManager
from specforge_core.protocols import SpeculationResult
from specforge_core.specs import StrategySpec
from specforge_core.speculative import LosslessError, greedy_decode, measure_acceptance


def test_resolve_checkpoint_refuses_a_folder_that_is_neither_run_nor_checkpoint(tmp_path):
    with pytest.raises(ExportError, match="is neither a checkpoint .* nor a run directory with a 'best' or 'latest'"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"specforge_strategy": "eagle3"}))
    with pytest.raises(ExportError, match=re.escape(f"{tmp_path} is an export already (a draft for serving), not a "
                                                    "checkpoint: export from the run directory or the checkpoint")):
        resolve_checkpoint(tmp_path)


def test_export_cli_on_a_folder_without_checkpoints_exits_1_with_the_reason(tmp_path):
    proc = run_specforge("export", str(tmp_path), "--output", str(tmp_path / "out"), expect=1)
    assert "is neither a checkpoint" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_format_the_strategy_does_not_declare_is_refused_naming_the_ones_it_does(tmp_path):
    spec = StrategySpec(name="domino", factory="m:f", export_formats=("sglang",))
    with pytest.raises(ExportError, match=r"strategy 'domino' exports as sglang, not 'vllm'; pass --format sglang"):
        export_model(object(), None, None, tmp_path / "out", spec=spec, fmt="vllm")
    assert not (tmp_path / "out").exists()


def test_a_strategy_that_declares_no_format_is_refused(tmp_path):
    spec = StrategySpec(name="research", factory="m:f")
    with pytest.raises(ExportError, match=r"strategy 'research' declares no serving format \(its spec's "
                                          r"export_formats is empty\), so it cannot be exported"):
        export_model(object(), None, None, tmp_path / "out", spec=spec)
    assert not (tmp_path / "out").exists()


def test_an_unknown_export_dtype_is_refused(tmp_path):
    spec = StrategySpec(name="eagle3", factory="m:f", export_formats=("sglang",))
    with pytest.raises(ExportError, match="unknown export dtype 'int8'; choose one of bfloat16, float16, float32"):
        export_model(object(), None, None, tmp_path / "out", spec=spec, dtype="int8")
    assert not (tmp_path / "out").exists()


def test_loading_a_draft_needs_its_config_and_strategy_name(tmp_path):
    manager = PluginManager().load()
    with pytest.raises(ExportError, match="is not an exported draft \\(no config.json\\)"):
        load_exported_draft(manager, tmp_path, engine=None)
    run = tmp_path / "run"  # a run's folder, its export beside its checkpoints
    (run / "export").mkdir(parents=True)
    (run / "export" / "config.json").write_text("{}")
    with pytest.raises(ExportError, match=re.escape(f"(config.json + model.safetensors); did you mean "
                                                    f"{run / 'export'}, the run's export?")):
        load_exported_draft(manager, run, engine=None)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(ExportError, match="does not name its strategy \\(specforge_strategy\\)"):
        load_exported_draft(manager, tmp_path, engine=None)


def test_eval_without_prompts_for_a_non_toy_target_is_a_usage_error(tmp_path):
    from specforge_core.data.split import resolve_data_files

    class Plan:
        class data:
            path = None
            eval_path = None

    class NoDefaults:
        def default_data(self):
            return None

    with pytest.raises(OptionError, match="no training data: pass --data FILE"):
        resolve_data_files(Plan, NoDefaults())


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from specforge_plugin_hf import HFEngineOptions
    from specforge_plugin_hf.engine import HFTargetEngine
    from specforge_plugin_hf.toy import build_toy_target

    folder = build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)
    return HFTargetEngine(HFEngineOptions(model=str(folder)))


class WrongAtTheThirdToken:
    """A stand-in strategy whose speculate is deliberately not lossless (the check must catch it)."""

    def capture_plan(self, target):
        from specforge_core.protocols import CapturePlan

        return CapturePlan(layer_ids=(0,), last_hidden=False)

    def speculate(self, model, session, prompt_ids, *, max_new_tokens, eos_token_id):
        plan = self.capture_plan(None)
        tokens = greedy_decode(self.engine, prompt_ids, plan, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        tokens[2] = (tokens[2] + 1) % 50
        return SpeculationResult(tokens=tokens, target_forwards=len(tokens), accept_lengths=[1] * len(tokens))


def test_a_speculate_loop_that_changes_the_output_fails_the_lossless_check(tiny_engine):
    strategy = WrongAtTheThirdToken()
    strategy.engine = tiny_engine
    prompt = tiny_engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(LosslessError, match=r"prompt 0: speculative output differs from the target's greedy decode "
                                            r"at new token 2"):
        measure_acceptance(strategy, torch.nn.Identity(), tiny_engine, [prompt], max_new_tokens=6, progress=False)


def test_the_reference_decode_stops_at_any_of_several_eos_ids(tiny_engine):
    from specforge_core.protocols import CapturePlan

    plan = CapturePlan(layer_ids=(0,), last_hidden=False)
    prompt = tiny_engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    free = greedy_decode(tiny_engine, prompt, plan, max_new_tokens=6, eos_token_id=None)
    assert len(free) == 6
    # the third token as one of two stop ids ends the decode right after it
    stopped = greedy_decode(tiny_engine, prompt, plan, max_new_tokens=6, eos_token_id=[10**9, free[2]])
    assert stopped == free[:free.index(free[2]) + 1]


class TargetAsItsOwnDraft:
    """A lossless stand-in strategy: its 'speculation' is the target's greedy decode, one token per forward."""

    def capture_plan(self, target):
        from specforge_core.protocols import CapturePlan

        return CapturePlan(layer_ids=(0,), last_hidden=False)

    def speculate(self, model, session, prompt_ids, *, max_new_tokens, eos_token_id):
        tokens = greedy_decode(self.engine, prompt_ids, self.capture_plan(None), max_new_tokens=max_new_tokens,
                               eos_token_id=eos_token_id)
        return SpeculationResult(tokens=tokens, target_forwards=len(tokens), accept_lengths=[1] * len(tokens))


def test_measure_acceptance_times_both_decodes_and_reports_their_ratio(tiny_engine):
    strategy = TargetAsItsOwnDraft()
    strategy.engine = tiny_engine
    prompts = [tiny_engine.tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("hello", "count to 3")]
    result = measure_acceptance(strategy, torch.nn.Identity(), tiny_engine, prompts, max_new_tokens=6, progress=False)
    per_prompt = result["per_prompt"]
    # one token per verification forward: the acceptance length of plain decoding
    assert result["accept_len_real"] == result["tau_real"] == 1.0
    assert result["generated_tokens"] == sum(p["tokens"] for p in per_prompt) == 12
    greedy_s, speculative_s = sum(p["greedy_s"] for p in per_prompt), sum(p["speculative_s"] for p in per_prompt)
    assert greedy_s > 0 and speculative_s > 0
    assert result["greedy_tokens_per_s"] == pytest.approx(12 / greedy_s, rel=1e-4)
    assert result["speculative_tokens_per_s"] == pytest.approx(12 / speculative_s, rel=1e-4)
    assert result["speedup"] == pytest.approx(result["speculative_tokens_per_s"] / result["greedy_tokens_per_s"])
    assert "not a serving engine's speedup on a GPU" in result["speedup_convention"]


def test_both_decodes_stop_on_a_stop_token_only_the_generation_config_names(tiny_engine, monkeypatch):
    """A model whose turns end with a token its generation config names but its tokenizer's EOS is not (as
    Llama 3's end-of-turn): eval's decodes stop there, as regenerate's replies do, not at max_new_tokens."""
    from specforge_core.protocols import CapturePlan

    strategy = TargetAsItsOwnDraft()
    strategy.engine = tiny_engine
    prompt = tiny_engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    free = greedy_decode(tiny_engine, prompt, CapturePlan(layer_ids=(0,), last_hidden=False), max_new_tokens=6,
                         eos_token_id=None)
    assert free[2] != tiny_engine.tokenizer.eos_token_id
    monkeypatch.setattr(tiny_engine._model.generation_config, "eos_token_id", [free[2]])
    assert free[2] in tiny_engine.info().extra["stop_token_ids"]
    result = measure_acceptance(strategy, torch.nn.Identity(), tiny_engine, [prompt], max_new_tokens=6, progress=False)
    assert result["generated_tokens"] == free.index(free[2]) + 1 <= 3


def test_the_reference_decode_runs_no_forward_past_its_last_token_and_captures_no_draft_features(
        tiny_engine, monkeypatch):
    """A budget of 6 tokens: the prompt's forward and 5 more (the 6th token's logits are never read); stopped at
    the 3rd token: 2 more. Eval times that decode with no layer captured, the draft's plan being its own cost."""
    from specforge_core.protocols import CapturePlan
    from specforge_core.speculative import PLAIN_DECODE

    plans, extends = [], []
    opened = tiny_engine.session

    def counting_session(prompt_ids, plan):
        session = opened(prompt_ids, plan)
        plans.append(plan)
        extend = session.extend
        monkeypatch.setattr(session, "extend", lambda ids: extends.append(len(ids)) or extend(ids))
        return session

    monkeypatch.setattr(tiny_engine, "session", counting_session)
    prompt = tiny_engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    plan = CapturePlan(layer_ids=(0,), last_hidden=True)
    free = greedy_decode(tiny_engine, prompt, plan, max_new_tokens=6, eos_token_id=None)
    assert len(free) == 6 and extends == [1] * 5
    extends.clear()
    stopped = greedy_decode(tiny_engine, prompt, plan, max_new_tokens=6, eos_token_id=free[2])
    assert len(stopped) == free.index(free[2]) + 1 and len(extends) == len(stopped) - 1
    plans.clear()
    strategy = TargetAsItsOwnDraft()
    strategy.engine = tiny_engine
    measure_acceptance(strategy, torch.nn.Identity(), tiny_engine, [prompt], max_new_tokens=6, progress=False)
    # warm-up, then timed: the reference decode's session, then speculation's (whose stand-in opens another)
    assert plans == [PLAIN_DECODE, strategy.capture_plan(None), strategy.capture_plan(None)] * 2
    assert PLAIN_DECODE.layer_ids == () and not PLAIN_DECODE.last_hidden


@pytest.mark.parametrize("drafts, rates", [([2, 2], [1.0, 1.0]), ([], [1.0, 0.5])])
def test_real_accept_rates_count_the_drafts_a_round_reports(tiny_engine, drafts, rates):
    """Rounds of 3 and 2 tokens: the last ended on a stop token among its drafts (2 drafts, no bonus) when the
    strategy says so; a strategy that does not report its drafts has each round's taken as its tokens - 1."""
    strategy = TargetAsItsOwnDraft()
    strategy.engine = tiny_engine

    def rounds(model, session, prompt_ids, *, max_new_tokens, eos_token_id):
        tokens = TargetAsItsOwnDraft.speculate(strategy, model, session, prompt_ids, max_new_tokens=max_new_tokens,
                                               eos_token_id=eos_token_id).tokens
        lengths = [1, 3, 2][:len(tokens)] if max_new_tokens == 6 else [1] * len(tokens)
        return SpeculationResult(tokens=tokens, target_forwards=len(lengths), accept_lengths=lengths,
                                 accepted_drafts=drafts if max_new_tokens == 6 else [])

    strategy.speculate = rounds
    prompt = tiny_engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    result = measure_acceptance(strategy, torch.nn.Identity(), tiny_engine, [prompt], max_new_tokens=6, progress=False)
    assert result["accept_rates"] == pytest.approx(rates)


def test_eval_set_takes_only_strategy_and_target_engine_options_and_the_threads(tmp_path):
    proc = run_specforge("eval", "--draft", str(tmp_path), "--set", "data.max_samples=1", expect=2)
    assert "`specforge eval --set` takes strategy.KEY=VALUE, target_engine.KEY=VALUE and train.threads=N, not " \
           "data.*" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_specforge("eval", "--draft", str(tmp_path), "--set", "train.lr=1", expect=2)
    assert "`specforge eval --set` takes train.threads only of the train options, not train.lr" in proc.stderr
    proc = run_specforge("eval", "--draft", str(tmp_path), "--set", "train.threads=1", expect=1)  # taken: on to the draft
    assert "using 1 CPU thread(s)" in proc.stderr and f"{tmp_path} is not an exported draft" in proc.stderr


@pytest.mark.parametrize("flag", ["--num-prompts", "--max-new-tokens"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_eval_counts_below_one_are_usage_errors(tmp_path, flag, value):
    proc = run_specforge("eval", "--draft", str(tmp_path), flag, value, expect=2)
    assert f"Invalid value for '{flag}': {value} is not in the range x>=1." in proc.stderr


def test_export_dtype_outside_the_choices_is_a_usage_error(tmp_path):
    proc = run_specforge("export", str(tmp_path), "--dtype", "int8", "--output", str(tmp_path / "out"), expect=2)
    assert "'int8' is not one of 'bfloat16', 'float16', 'float32'" in proc.stderr and not (tmp_path / "out").exists()
