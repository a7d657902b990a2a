"""The export folder I/O every strategy shares: crash-safe writing, and reading with errors that name file and field."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_core.export import (
    ExportConfig,
    ExportError,
    check_keys,
    export_model,
    export_state,
    load_checked_state,
    load_exported_draft,
    load_weights,
    open_export,
    speculators_config,
    verifier_note,
    write_export_files,
)
from specforge_core.plugins import PluginManager
from specforge_core.protocols import TargetInfo
from specforge_core.specs import StrategySpec


class FormatError(ExportError):
    """Stands in for a plugin's own error type."""


def snapshot(folder):
    """Every file of ``folder`` (hidden temporaries included) with its bytes."""
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture
def existing(tmp_path):
    """A folder holding an earlier export, and its snapshot."""
    folder = write_export_files(tmp_path / "export", {"w": torch.arange(6.0).view(2, 3)},
                                {"name": "old", "n": 1, "specforge_strategy": "tiny"})
    return folder, snapshot(folder)


class Tiny(torch.nn.Module):
    """A trainable linear layer next to a frozen (target-owned) parameter and a persistent buffer."""

    def __init__(self, width=3):
        super().__init__()
        self.proj = torch.nn.Linear(width, 2, bias=False)
        self.embed = torch.nn.Parameter(torch.ones(4, width), requires_grad=False)
        self.register_buffer("ids", torch.arange(4))


# ---------------------------------------------------------------- writing
def test_written_export_holds_the_tensors_and_sorted_json_config_and_no_temporaries(existing):
    folder, files = existing
    assert sorted(files) == ["config.json", "model.safetensors"]
    assert files["config.json"].decode() == '{\n  "n": 1,\n  "name": "old",\n  "specforge_strategy": "tiny"\n}\n'
    assert load_file(str(folder / "model.safetensors"))["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_export_state_leaves_out_frozen_parameters_and_keeps_buffers():
    state = export_state(Tiny())
    assert sorted(state) == ["ids", "proj.weight"]
    assert state["ids"].tolist() == [0, 1, 2, 3] and state["proj.weight"].shape == (2, 3)


def test_a_config_json_cannot_hold_fails_before_anything_is_written(existing):
    folder, files = existing
    with pytest.raises(FormatError, match=r"the export's config.json cannot be written as JSON \(Object of type set "
                                          rf"is not JSON serializable\); nothing was written to {re.escape(str(folder))}"):
        write_export_files(folder, {"w": torch.zeros(1)}, {"ids": {1, 2}}, error=FormatError)
    assert snapshot(folder) == files
    with pytest.raises(FormatError, match="cannot be written as JSON .*Out of range float values"):
        write_export_files(folder, {"w": torch.zeros(1)}, {"eps": float("nan")}, error=FormatError)
    assert snapshot(folder) == files


def test_tensors_safetensors_refuses_leave_an_existing_export_and_no_temporaries(existing):
    folder, files = existing
    shared = torch.ones(3)
    with pytest.raises(FormatError, match=rf"could not write the export to {re.escape(str(folder))} \(RuntimeError: "
                                          r"Some tensors share memory, .*: \[\{'[ab]', '[ab]'\}\]") as info:
        write_export_files(folder, {"a": shared, "b": shared}, {"name": "new"}, error=FormatError)
    assert str(info.value).endswith("; the folder was left as it was")
    assert snapshot(folder) == files


def test_a_failed_write_into_a_new_folder_leaves_no_folder(tmp_path):
    shared = torch.ones(3)
    with pytest.raises(FormatError, match=r"could not write the export to .*; nothing was written$"):
        write_export_files(tmp_path / "new", {"a": shared, "b": shared}, {}, error=FormatError)
    assert not (tmp_path / "new").exists()


def test_exporting_onto_a_file_is_refused_and_the_file_kept(tmp_path):
    (tmp_path / "out").write_text("notes")
    with pytest.raises(FormatError, match=rf"cannot export to {re.escape(str(tmp_path / 'out'))}: it exists and is "
                                          "not a folder; choose another --output"):
        write_export_files(tmp_path / "out", {"w": torch.zeros(1)}, {}, error=FormatError)
    assert (tmp_path / "out").read_text() == "notes"


SPEC = StrategySpec(name="tiny", factory="m:f", export_formats=("sglang",))


class FailingStrategy:
    def export(self, model, out_dir, target):
        raise FormatError("the draft does not fit the layout")


def test_export_model_removes_the_folder_it_created_when_the_strategy_fails(tmp_path, existing):
    with pytest.raises(FormatError, match="the draft does not fit the layout"):
        export_model(FailingStrategy(), None, None, tmp_path / "new", spec=SPEC)
    assert not (tmp_path / "new").exists()
    folder, files = existing
    with pytest.raises(FormatError, match="the draft does not fit the layout"):
        export_model(FailingStrategy(), None, None, folder, spec=SPEC)
    assert snapshot(folder) == files


class NaNConfigStrategy:
    def export(self, model, out_dir, target):
        write_export_files(out_dir, {"w": torch.zeros(1)}, {"scale": float("nan")}, error=FormatError)


def test_export_model_into_a_new_folder_that_the_writer_refuses_says_nothing_was_written(tmp_path):
    with pytest.raises(FormatError, match=rf"nothing was written to {re.escape(str(tmp_path / 'new'))}$"):
        export_model(NaNConfigStrategy(), None, None, tmp_path / "new", spec=SPEC)
    assert not (tmp_path / "new").exists()


class RecordingStrategy:
    """Records the keyword arguments its export is called with; an older one accepts none."""

    def __init__(self):
        self.calls = []

    def export(self, model, out_dir, target, *, fmt, dtype):
        self.calls.append((fmt, dtype))
        write_export_files(out_dir, {"w": torch.zeros(1)}, {}, error=FormatError)


class OlderStrategy:
    def export(self, model, out_dir, target):
        write_export_files(out_dir, {"w": torch.zeros(1)}, {"old": True}, error=FormatError)


def test_export_model_passes_the_format_and_dtype_to_strategies_that_take_them(tmp_path):
    spec = StrategySpec(name="tiny", factory="m:f", export_formats=("sglang", "vllm"))
    strategy = RecordingStrategy()
    export_model(strategy, None, None, tmp_path / "a", spec=spec)
    export_model(strategy, None, None, tmp_path / "b", spec=spec, fmt="vllm", dtype="float16")
    assert strategy.calls == [("sglang", "bfloat16"), ("vllm", "float16")]
    # an export method written before the keyword arguments existed still works
    export_model(OlderStrategy(), None, None, tmp_path / "c", spec=spec)
    assert json.loads((tmp_path / "c" / "config.json").read_text()) == {"old": True}


def test_export_dtype_casts_floating_weights_and_keeps_integer_buffers():
    state = export_state(Tiny(), "bfloat16")
    assert state["proj.weight"].dtype == torch.bfloat16 and state["ids"].dtype == torch.int64
    assert export_state(Tiny(), None)["proj.weight"].dtype == torch.float32


# ---------------------------------------------------------------- reading
def test_open_export_names_the_missing_file(tmp_path):
    with pytest.raises(FormatError, match=rf"^{re.escape(str(tmp_path))} is not a test draft \(no config.json\); "
                                          r"point at a folder written by `specforge export` "
                                          r"\(config.json \+ model.safetensors\)$"):
        open_export(tmp_path, what="a test draft", error=FormatError)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FormatError, match=r"is not a test draft \(no model.safetensors\)"):
        open_export(tmp_path, what="a test draft", error=FormatError)
    assert open_export(tmp_path, what="a test draft", weights=False).data == {}


@pytest.mark.parametrize("text, message", [
    ('{"hidden_size": 32,', r"config.json is not valid JSON \(Expecting property name enclosed in double quotes"),
    ("[1, 2]", r"config.json holds a JSON list, not an object; it is not a test draft's config"),
])
def test_open_export_refuses_a_config_that_is_not_a_json_object(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FormatError, match=message):
        open_export(tmp_path, what="a test draft", error=FormatError)


def reader(data, tmp_path):
    return ExportConfig(data, tmp_path / "config.json", "a test draft", FormatError)


def test_fields_are_read_with_their_kind_and_defaults(tmp_path):
    config = reader({"hidden_size": 32, "eps": 1, "tied": False, "ids": [0, 3], "unknown": None,
                     "inner": {"mask": 7}}, tmp_path)
    assert config.value("hidden_size", int) == 32
    eps = config.value("eps", float)
    assert eps == 1.0 and isinstance(eps, float)
    assert config.value("tied", bool) is False
    assert config.ints("ids") == [0, 3]
    assert config.value("unknown", int, 4096) == 4096  # JSON null reads as absent
    assert config.ints("absent", None) is None
    assert config.section("inner").value("mask", int) == 7
    assert config.section("absent").data == {}


@pytest.mark.parametrize("data, read, message", [
    ({}, lambda c: c.value("hidden_size", int), "has no 'hidden_size' field; a test draft needs it as an integer"),
    ({"hidden_size": None}, lambda c: c.value("hidden_size", int),
     "has no 'hidden_size' field; a test draft needs it as an integer"),
    ({"hidden_size": "32"}, lambda c: c.value("hidden_size", int),
     "has 'hidden_size' = '32'; a test draft needs it as an integer"),
    ({"hidden_size": True}, lambda c: c.value("hidden_size", int),
     "has 'hidden_size' = True; a test draft needs it as an integer"),
    ({"eps": "tiny"}, lambda c: c.value("eps", float), "has 'eps' = 'tiny'; a test draft needs it as a number"),
    ({"flag": 1}, lambda c: c.value("flag", bool), "has 'flag' = 1; a test draft needs it as true or false"),
    ({"ids": [1, "2"]}, lambda c: c.ints("ids"), r"has 'ids' = \[1, '2'\]; a test draft needs it as a list of integers"),
    ({"inner": {}}, lambda c: c.section("inner").value("mask", int),
     "has no 'inner.mask' field; a test draft needs it as an integer"),
    ({"inner": [1]}, lambda c: c.section("inner"), r"has 'inner' = \[1\]; a test draft needs it as an object"),
])
def test_a_missing_or_ill_formed_field_is_named_with_the_file_and_what_was_expected(tmp_path, data, read, message):
    with pytest.raises(FormatError, match=rf"^{re.escape(str(tmp_path / 'config.json'))} {message}$"):
        read(reader(data, tmp_path))


@pytest.mark.parametrize("data, required, message", [
    ({"specforge_strategy": "dflash", "architectures": ["DFlashDraftModel"]}, False,
     "holds an export of strategy 'dflash' (specforge_strategy), not 'eagle3'; load it with --strategy dflash"),
    ({"architectures": ["DFlashDraftModel"]}, False,
     "names architectures ['DFlashDraftModel'], not ['LlamaForCausalLMEagle3']: it is not a test draft"),
    ({"architectures": ["LlamaForCausalLMEagle3"]}, True,
     "has no 'specforge_strategy' field; a test draft needs it as a string"),
    ({"specforge_strategy": "eagle3"}, True,
     "names architectures None, not ['LlamaForCausalLMEagle3']: it is not a test draft"),
])
def test_a_config_of_another_strategy_or_architecture_is_refused(tmp_path, data, required, message):
    config = reader(data, tmp_path)
    with pytest.raises(FormatError, match=rf"^{re.escape(str(tmp_path / 'config.json'))} {re.escape(message)}$"):
        config.expect_identity("LlamaForCausalLMEagle3", "eagle3", strategy_required=required)


def test_a_matching_identity_passes_with_or_without_the_strategy_name(tmp_path):
    reader({"architectures": ["LlamaForCausalLMEagle3"]}, tmp_path).expect_identity(
        "LlamaForCausalLMEagle3", "eagle3", strategy_required=False)
    reader({"architectures": ["LlamaForCausalLMEagle3"], "specforge_strategy": "eagle3"}, tmp_path).expect_identity(
        "LlamaForCausalLMEagle3", "eagle3")


def test_unreadable_weights_are_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(FormatError, match=rf"^{re.escape(str(tmp_path / 'model.safetensors'))} is not a readable "
                                          "safetensors file: "):
        load_weights(tmp_path, error=FormatError)


def test_check_keys_lists_missing_and_unexpected_names():
    with pytest.raises(FormatError, match=r"^the state does not match the layout: missing \['b'\], unexpected \['c'\]$"):
        check_keys(["a", "c"], ["a", "b"], "the state", "the layout", error=FormatError)
    check_keys(["b", "a"], ["a", "b"], "the state", "the layout")


def test_loading_checks_names_shapes_and_dtypes_before_touching_the_model():
    model = Tiny()
    before = model.proj.weight.detach().clone()
    good = {"proj.weight": torch.full((2, 3), 5.0), "ids": torch.arange(4)}
    with pytest.raises(FormatError, match=r"^w.st: proj.weight is torch.float32 \(2, 4\), the draft its config.json "
                                          r"describes expects torch.float32 \(2, 3\)$"):
        load_checked_state(model, {**good, "proj.weight": torch.zeros(2, 4)}, "w.st", error=FormatError)
    with pytest.raises(FormatError, match=r"proj.weight is torch.float64 \(2, 3\).*expects torch.float32 \(2, 3\)"):
        load_checked_state(model, {**good, "proj.weight": torch.zeros(2, 3, dtype=torch.float64)}, "w.st",
                           error=FormatError)
    with pytest.raises(FormatError, match=r"^w.st does not match the draft its config.json describes: missing "
                                          r"\['ids'\], unexpected \[\]$"):
        load_checked_state(model, {"proj.weight": good["proj.weight"]}, "w.st", error=FormatError)
    assert torch.equal(model.proj.weight, before)  # nothing was loaded by the refused calls
    load_checked_state(model, {**good, "proj.weight": torch.zeros(2, 3, dtype=torch.float64)}, "w.st", dtypes=False)
    assert model.proj.weight.dtype == torch.float32 and model.proj.weight.abs().sum().item() == 0.0
    load_checked_state(model, good, "w.st")
    assert model.proj.weight.tolist() == [[5.0] * 3] * 2


def test_loading_an_exported_draft_with_a_broken_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ExportError, match=rf"^{re.escape(str(tmp_path / 'config.json'))} is not valid JSON"):
        load_exported_draft(PluginManager().load(), tmp_path, engine=None)


def test_round_trip_through_the_shared_reader_and_writer(tmp_path):
    model = Tiny()
    folder = write_export_files(tmp_path / "x", export_state(model), {"specforge_strategy": "tiny",
                                                                     "architectures": ["Tiny"]})
    config = open_export(folder, what="a tiny draft")
    config.expect_identity("Tiny", "tiny")
    other = Tiny()
    load_checked_state(other, load_weights(folder), "x")
    assert torch.equal(other.proj.weight, model.proj.weight)
    assert json.loads((folder / "config.json").read_text()) == {"specforge_strategy": "tiny", "architectures": ["Tiny"]}
    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))  # a plain safetensors file reads too
    assert list(load_weights(folder)) == ["w"]


def _speculators_folder_config(model_id):
    target = TargetInfo(num_layers=4, hidden_size=8, vocab_size=16, dtype="float32", model_id=model_id)
    return {"speculators_model_type": "eagle3", "speculators_config": speculators_config("eagle3", 7, target)}


def test_a_speculators_export_whose_verifier_is_no_hub_id_says_how_vllm_serves_it(tmp_path):
    target_dir = tmp_path / "my-target"
    target_dir.mkdir()
    # an existing folder, an absolute path, the toy target's name, a name with "--"
    for name in (str(target_dir), "/models/elsewhere", "specforge/toy-target-tiny@717b8dd932f9a64d", "org/a--b"):
        note = verifier_note(_speculators_folder_config(name), tmp_path / "draft")
        assert note is not None and note.startswith(f"note: {tmp_path / 'draft'} names its verifier {name!r}, "
                                                    "which is no hub repository id. Serve it as the draft of its "
                                                    "target: vllm serve TARGET --speculative-config"), name
        assert note.endswith("unless speculators_config.verifier.name_or_path is a hub repository id.")


def test_no_verifier_note_for_a_hub_id_a_native_folder_or_a_config_without_a_verifier(tmp_path):
    for hub_id in ("HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "meta-llama/Llama-3.1-8B"):
        assert verifier_note(_speculators_folder_config(hub_id), tmp_path) is None, hub_id
    assert verifier_note({"architectures": ["DFlashDraftModel"]}, tmp_path) is None  # the native layout
    assert verifier_note({"speculators_model_type": "dflash"}, tmp_path) is None
    assert verifier_note({"speculators_model_type": "dflash", "speculators_config": {"verifier": None}}, tmp_path) \
        is None


def test_export_model_writes_only_into_a_new_or_empty_folder_or_over_an_earlier_export(tmp_path, existing):
    class Writes:
        def export(self, model, out_dir, target):
            write_export_files(out_dir, {"w": torch.ones(2)}, {"specforge_strategy": "tiny"})

    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (tmp_path / "new" / "deeper", empty, existing[0]):
        export_model(Writes(), None, None, folder, spec=SPEC)
        assert load_file(folder / "model.safetensors")["w"].tolist() == [1.0, 1.0]
    checkpoint = tmp_path / "run" / "run-step4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"the trained weights")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    refused = {checkpoint: f"cannot export to {checkpoint}: it is a checkpoint (trainer_state.json)",
               tmp_path / "run": f"cannot export to {tmp_path / 'run'}: it holds a run (run-step4)",
               other: f"cannot export to {other}: the folder is not empty and holds no specforge export"}
    for folder, message in refused.items():
        files = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
        with pytest.raises(ExportError, match=re.escape(message)):
            export_model(Writes(), None, None, folder, spec=SPEC)
        assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == files
