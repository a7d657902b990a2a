"""Records: exact JSON round trips, and no tensors in control-plane records."""

import json

import numpy as np
import pytest
import torch

from specforge_core.contracts import FeatureSpec, SampleRef, StepContext, StepOutput, TrainBatch, check_record
from specforge_core.errors import RecordError


def make_ref(**overrides):
    fields = dict(sample_id="s-1", run_id="r", store="disk:///tmp/x",
                  features={"input_ids": FeatureSpec((12,), "int64"), "aux_hidden": FeatureSpec([12, 96], "bfloat16")},
                  strategy="eagle3", num_tokens=12, generation=3, meta={"source": "a.jsonl:7", "turns": [1, 2]})
    fields.update(overrides)
    return SampleRef(**fields)


def test_sample_ref_json_round_trip_is_exact():
    ref = make_ref()
    text = ref.to_json()
    assert SampleRef.from_json(text) == ref
    data = json.loads(text)
    assert data["features"]["aux_hidden"] == {"shape": [12, 96], "dtype": "bfloat16"}
    assert data["schema_version"] == 1


def test_sample_ref_reports_its_bytes():
    assert make_ref().nbytes == 12 * 8 + 12 * 96 * 2


def test_step_context_round_trip():
    ctx = StepContext(global_step=7, total_steps=100, epoch=1)
    assert StepContext.from_json(ctx.to_json()) == ctx
    assert StepContext.from_json(StepContext().to_json()).total_steps is None


def test_feature_spec_wildcard_accepts_concrete_shapes_of_the_same_dtype():
    plan = FeatureSpec((-1, 96), "bfloat16")
    assert plan.accepts(FeatureSpec((40, 96), "bfloat16"))
    assert not plan.accepts(FeatureSpec((40, 95), "bfloat16"))
    assert not plan.accepts(FeatureSpec((40, 96), "float32"))


def test_feature_spec_rejects_torch_dtype_spelling():
    with pytest.raises(RecordError, match="bare dtype name like 'bfloat16', got 'torch.bfloat16'"):
        FeatureSpec((1,), "torch.bfloat16")


@pytest.mark.parametrize("value", [torch.zeros(2), np.zeros(2)])
def test_tensor_inside_a_record_is_rejected_with_its_path(value):
    with pytest.raises(RecordError, match=r"record\.meta\.stats\[1\] holds a .*; control-plane records carry "
                                          r"metadata only"):
        check_record({"meta": {"stats": [1, value]}})


def test_tensor_in_sample_ref_meta_is_rejected_at_construction():
    with pytest.raises(RecordError, match=r"meta\.hidden holds a torch\.Tensor"):
        make_ref(meta={"hidden": torch.ones(3)})


def test_non_json_values_and_nan_are_rejected():
    with pytest.raises(RecordError, match=r"record\.x holds a set"):
        check_record({"x": {1, 2}})
    with pytest.raises(RecordError, match="is NaN"):
        check_record({"x": float("nan")})
    with pytest.raises(RecordError, match="non-string key 3"):
        check_record({3: "a"})


def test_from_json_rejects_garbage_and_unknown_fields():
    with pytest.raises(RecordError, match="SampleRef is not valid JSON"):
        SampleRef.from_json("{not json")
    data = make_ref().to_dict() | {"tensor_blob": "x"}
    with pytest.raises(RecordError, match=r"SampleRef has unknown fields \['tensor_blob'\]"):
        SampleRef.from_dict(data)
    with pytest.raises(RecordError, match="SampleRef JSON must be an object, got list"):
        SampleRef.from_json("[1]")


def test_train_batch_carries_tensors_and_ids():
    batch = TrainBatch(tensors={"x": torch.arange(4)}, sample_ids=["a", "b"], num_tokens=4)
    assert batch.sample_ids == ("a", "b")
    assert torch.equal(batch["x"], torch.arange(4))


def test_step_output_record_is_plain_metadata():
    out = StepOutput(loss=torch.tensor(1.5), metrics={"lambda": 0.25}, ratio_metrics={"acc": (3, 4)})
    record = out.to_record()
    assert record == {"loss": 1.5, "metrics": {"lambda": 0.25}, "ratio_metrics": {"acc": [3.0, 4.0]}}
    check_record(record)
