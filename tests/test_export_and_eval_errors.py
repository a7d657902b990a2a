"""Error paths of export, eval and the lossless check, each with its message."""

import json

import pytest
import torch

from sf_helpers import run_specforge
from specforge_core.errors import OptionError
from specforge_core.export import ExportError, export_model, load_exported_draft, resolve_checkpoint
from specforge_core.plugins import PluginManager
from specforge_core.protocols import SpeculationResult
from specforge_core.speculative import LosslessError, greedy_decode, measure_acceptance


def test_resolve_checkpoint_refuses_a_folder_that_is_neither_run_nor_checkpoint(tmp_path):
    with pytest.raises(ExportError, match="is neither a checkpoint .* nor a run directory with a 'best' or 'latest'"):
        resolve_checkpoint(tmp_path)


def test_export_cli_on_a_folder_without_checkpoints_exits_1_with_the_reason(tmp_path):
    proc = run_specforge("export", str(tmp_path), "--output", str(tmp_path / "out"), expect=1)
    assert "is neither a checkpoint" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_export_format_is_refused(tmp_path):
    with pytest.raises(ExportError, match="unknown export format 'onnx'; formats: sglang"):
        export_model(object(), None, None, tmp_path, "onnx")


def test_a_strategy_without_export_is_refused(tmp_path):
    with pytest.raises(ExportError, match="cannot export for serving"):
        export_model(object(), None, None, tmp_path)


def test_loading_a_draft_needs_its_config_and_strategy_name(tmp_path):
    manager = PluginManager().load()
    with pytest.raises(ExportError, match="is not an exported draft \\(no config.json\\)"):
        load_exported_draft(manager, tmp_path, engine=None)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(ExportError, match="does not name its strategy \\(specforge_strategy\\)"):
        load_exported_draft(manager, tmp_path, engine=None)


def test_eval_without_prompts_for_a_non_toy_target_is_a_usage_error(tmp_path):
    from specforge_core.topologies.capture import data_paths

    class Plan:
        class data:
            path = None
            eval_path = None

    class NoDefaults:
        def default_data(self):
            return None

    with pytest.raises(OptionError, match="no training data: pass --data FILE"):
        data_paths(Plan, NoDefaults())


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
