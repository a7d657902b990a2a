"""TargetEngineConformance: the contract every target engine must honour, as pytest tests.

Subclass it in your engine's tests and say how to build the engine::

    from specforge_core.testing.target_engine_suite import TargetEngineConformance

    class TestMyEngine(TargetEngineConformance):
        def make_engine(self, tmp_path):
            return MyEngine(MyOptions(model=...), BuildContext(run_id="t"))

What it pins: ``info()`` agrees with ``frozen_parts()``; the frozen parts never ask for
gradients; ``capture`` returns unpadded per-sample features of the plan's shapes and
dtypes, in tensors that own their memory and can feed a draft's autograd graph; a padded
batch captures what each sample alone captures (bit for bit unless the engine sets
``capture_atol``); a layer id outside ``0..L-2`` (the ids a serving engine can capture,
see :mod:`specforge_core.serving`) is a clear error; and a verify session
driven in chunks, with rejected tokens truncated, matches one forward over the whole text.

Samples are random token ids of 16 tokens or more: engines whose kernels switch algorithm
for very short inputs (CPU BLAS small-matrix paths) are still held to exact equality on
realistic lengths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ..contracts import FeatureSpec
from ..dtypes import dtype_name
from ..errors import SpecforgeError
from ..protocols import CapturePlan, TargetInfo

#: Sample lengths the suite captures: unequal, so batches are padded, and >= 16 tokens.
SAMPLE_LENGTHS = (23, 57, 16, 40, 31)


class TargetEngineConformance:
    """Subclass and override :meth:`make_engine` to run the target engine contract tests."""

    #: Largest absolute difference allowed between a sample captured inside a padded batch
    #: and the same sample captured alone. 0.0 means bit-identical (the hf engine on CPU).
    capture_atol: float = 0.0
    #: Tolerance between a session fed in chunks and one forward over the same tokens.
    session_atol: float = 1e-5

    def make_engine(self, tmp_path: Any) -> Any:
        raise NotImplementedError("override make_engine(self, tmp_path) to return the engine under test")

    @pytest.fixture
    def engine(self, tmp_path: Any) -> Any:
        return self.make_engine(tmp_path)

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def plan_for(info: TargetInfo, *, dtype: str | None = None) -> CapturePlan:
        """Up to three distinct layers (first, middle, last servable: ``L-2``) plus the last hidden state."""
        top = info.num_layers - 2
        layers = tuple(sorted({0, top // 2, top}))
        dtype = dtype or info.dtype
        return CapturePlan(
            layer_ids=layers,
            hidden_feature="aux_hidden",
            last_hidden=True,
            features={
                "aux_hidden": FeatureSpec((-1, len(layers) * info.hidden_size), dtype),
                "last_hidden": FeatureSpec((-1, info.hidden_size), dtype),
            },
        )

    @staticmethod
    def samples_for(info: TargetInfo, lengths: tuple[int, ...] = SAMPLE_LENGTHS) -> list[dict[str, Any]]:
        generator = torch.Generator().manual_seed(1234)
        return [{"input_ids": torch.randint(0, info.vocab_size, (n,), generator=generator), "sample_id": f"s{i}"}
                for i, n in enumerate(lengths)]

    @staticmethod
    def _cpu(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu")

    def _assert_close(self, got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
        got, want = self._cpu(got), self._cpu(want)
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if atol == 0.0:
            assert torch.equal(got, want), f"{what}: not bit-identical (max diff {(got - want).abs().max().item()})"
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0.0, msg=what)

    # -- info and frozen parts ----------------------------------------------------------------

    def test_info_agrees_with_frozen_parts(self, engine: Any) -> None:
        info = engine.info()
        parts = engine.frozen_parts()
        assert info.num_layers >= 1 and info.hidden_size >= 1 and info.vocab_size >= 1
        assert tuple(parts["embed_tokens"].shape) == (info.vocab_size, info.hidden_size)
        assert tuple(parts["lm_head"].shape) == (info.vocab_size, info.hidden_size)
        assert tuple(parts["norm"].shape) == (info.hidden_size,)
        assert dtype_name(parts["lm_head"].dtype) == info.dtype
        assert info.chat_template is None or isinstance(info.chat_template, str)
        assert engine.tokenizer is not None

    def test_frozen_parts_do_not_require_grad(self, engine: Any) -> None:
        for name, tensor in engine.frozen_parts().items():
            assert not tensor.requires_grad, f"frozen part {name} requires grad"
            assert tensor.grad_fn is None, f"frozen part {name} is attached to an autograd graph"

    # -- capture ----------------------------------------------------------------------------

    def test_capture_returns_unpadded_features_of_the_plan(self, engine: Any) -> None:
        info = engine.info()
        plan = self.plan_for(info)
        samples = self.samples_for(info)
        results = engine.capture(samples, plan)
        assert len(results) == len(samples)
        for sample, result in zip(samples, results):
            n = len(sample["input_ids"])
            assert torch.equal(self._cpu(result["input_ids"]), sample["input_ids"])
            assert result["sample_id"] == sample["sample_id"], "sample keys must pass through"
            for name, spec in plan.features.items():
                tensor = result[name]
                got = FeatureSpec(tuple(tensor.shape), dtype_name(tensor.dtype))
                assert spec.accepts(got), f"{name}: got {got}, plan wants {spec}"
                assert tensor.shape[0] == n, f"{name} is padded: {tensor.shape[0]} rows for {n} tokens"
                assert tensor.is_contiguous()

    def test_captured_tensors_own_their_memory(self, engine: Any) -> None:
        info = engine.info()
        plan = self.plan_for(info)
        for result in engine.capture(self.samples_for(info), plan):
            for name in plan.features:
                tensor = result[name]
                owned = tensor.untyped_storage().nbytes()
                assert owned == tensor.numel() * tensor.element_size(), (
                    f"{name} is a view into a larger buffer ({owned} bytes for {tuple(tensor.shape)}); "
                    "return a copy so stored features do not pin the padded batch"
                )

    def test_capture_follows_the_plan_dtypes(self, engine: Any) -> None:
        info = engine.info()
        wanted = "float32" if info.dtype != "float32" else "bfloat16"  # never the engine's own dtype
        plan = self.plan_for(info, dtype=wanted)
        result = engine.capture(self.samples_for(info)[:2], plan)[0]
        assert result["aux_hidden"].dtype == getattr(torch, wanted)
        assert result["last_hidden"].dtype == getattr(torch, wanted)

    def test_padded_batch_captures_what_each_sample_alone_captures(self, engine: Any) -> None:
        info = engine.info()
        plan = self.plan_for(info)
        samples = self.samples_for(info)
        batched = engine.capture(samples, plan)
        for index, sample in enumerate(samples):
            alone = engine.capture([sample], plan)[0]
            for name in plan.features:
                self._assert_close(batched[index][name], alone[name], self.capture_atol, f"sample {index} {name}")

    def test_captured_features_can_feed_a_draft_autograd_graph(self, engine: Any) -> None:
        info = engine.info()
        result = engine.capture(self.samples_for(info)[:1], self.plan_for(info))[0]
        features = result["last_hidden"]  # as returned: not an inference-mode tensor, not detached copies
        weight = torch.zeros(info.hidden_size, 2, device=features.device, dtype=features.dtype, requires_grad=True)
        (features @ weight).sum().backward()
        assert weight.grad is not None

    def test_capture_of_no_samples_is_empty(self, engine: Any) -> None:
        assert engine.capture([], self.plan_for(engine.info())) == []

    def test_out_of_range_layer_id_is_a_clear_error(self, engine: Any) -> None:
        info = engine.info()
        bad = info.num_layers
        plan = CapturePlan(layer_ids=(0, bad), hidden_feature="aux_hidden")
        with pytest.raises((SpecforgeError, ValueError)) as excinfo:
            engine.capture(self.samples_for(info)[:1], plan)
        message = str(excinfo.value)
        assert str(bad) in message and f"0..{info.num_layers - 2}" in message, message

    def test_the_last_layers_output_is_refused_as_no_serving_engine_can_capture_it(self, engine: Any) -> None:
        """Layer id i is the hidden state entering layer i+1 (what SGLang and vLLM record), so the
        last layer's output, id L-1, is no layer's input: a draft trained on it could not be served."""
        info = engine.info()
        last = info.num_layers - 1
        plan = CapturePlan(layer_ids=(last,), hidden_feature="aux_hidden")
        with pytest.raises((SpecforgeError, ValueError)) as excinfo:
            engine.capture(self.samples_for(info)[:1], plan)
        message = str(excinfo.value)
        assert str(last) in message and f"0..{info.num_layers - 2}" in message, message

    # -- verification sessions ------------------------------------------------------------------

    def test_session_in_chunks_with_truncation_matches_one_forward(self, engine: Any) -> None:
        info = engine.info()
        plan = self.plan_for(info)
        ids = self.samples_for(info, (40,))[0]["input_ids"]
        whole = engine.session(ids, plan)
        assert whole.length == len(ids)
        want = whole.prefill

        session = engine.session(ids[:9], plan)
        pieces = [session.prefill]
        pieces.append(session.extend(ids[9:20]))
        # a rejected draft: four wrong tokens appended, then dropped again
        wrong = (ids[20:24] + 1) % info.vocab_size
        session.extend(wrong)
        assert session.length == 24
        session.truncate(20)
        assert session.length == 20
        pieces.append(session.extend(ids[20:33]))
        session.truncate(33)  # a no-op truncation keeps everything
        pieces.append(session.extend(ids[33:]))
        assert session.length == len(ids)
        for key in ("logits", "aux_hidden", "last_hidden"):
            got = torch.cat([self._cpu(piece[key]) for piece in pieces])
            self._assert_close(got, want[key], self.session_atol, f"session {key}")
        assert tuple(want["logits"].shape) == (len(ids), info.vocab_size)

    def test_session_truncates_behind_earlier_extends_and_earlier_truncates(self, engine: Any) -> None:
        """``truncate(length)`` takes any length: back across several extends, twice in a row each further
        back than the last, and to 0; what follows equals one forward over the text (an engine whose cache
        keeps only part of the past must rebuild what it dropped, not answer from less)."""
        info = engine.info()
        plan = self.plan_for(info)
        ids = self.samples_for(info, (40,))[0]["input_ids"]
        want = engine.session(ids, plan).prefill

        def check(piece: dict[str, Any], start: int, end: int, what: str) -> None:
            for key in ("logits", "aux_hidden", "last_hidden"):
                self._assert_close(self._cpu(piece[key]), want[key][start:end], self.session_atol, f"{what} {key}")

        session = engine.session(ids[:8], plan)
        for start in range(8, 20, 3):  # four extends of three tokens
            session.extend(ids[start:start + 3])
        session.truncate(11)  # back across three of them
        assert session.length == 11
        check(session.extend(ids[11:16]), 11, 16, "after a truncate across extends")
        session.truncate(15)
        session.truncate(12)  # behind the truncate before it
        assert session.length == 12
        check(session.extend(ids[12:30]), 12, 30, "after two truncates")
        session.truncate(0)
        assert session.length == 0
        check(session.extend(ids[:10]), 0, 10, "after a truncate to 0")

    def test_session_features_match_capture(self, engine: Any) -> None:
        info = engine.info()
        plan = self.plan_for(info)
        sample = self.samples_for(info, (30,))[0]
        captured = engine.capture([sample], plan)[0]
        prefill = engine.session(sample["input_ids"], plan).prefill
        for name in plan.features:
            self._assert_close(prefill[name], captured[name], self.session_atol, f"session vs capture {name}")

    def test_a_session_keeps_its_prompts_outputs_as_prefill_and_an_empty_one_none(self, engine: Any) -> None:
        info = engine.info()
        plan = self.plan_for(info)
        ids = self.samples_for(info, (20,))[0]["input_ids"]
        opened = engine.session(ids, plan)
        assert opened.length == 20 and tuple(opened.prefill["logits"].shape) == (20, info.vocab_size)
        empty = engine.session(None, plan)
        assert empty.length == 0 and empty.prefill is None
        extended = empty.extend(ids)
        for key in ("logits", "aux_hidden", "last_hidden"):
            self._assert_close(extended[key], opened.prefill[key], self.session_atol, f"prefill {key}")

    def test_session_truncate_beyond_its_length_is_a_clear_error(self, engine: Any) -> None:
        info = engine.info()
        session = engine.session(self.samples_for(info, (16,))[0]["input_ids"], self.plan_for(info))
        with pytest.raises((SpecforgeError, ValueError), match="0..16"):
            session.truncate(17)
