"""StrategyConformance: the contract every strategy plugin is tested against.

Subclass it and override :meth:`make_strategy` (and optionally :meth:`make_target`)::

    class TestMyStrategy(StrategyConformance):
        def make_strategy(self):
            return MyStrategy(MyOptions(), BuildContext())

The suite builds a small random target (info + frozen parts), synthetic samples that match
the strategy's capture plan, and checks the training contract: collate, forward_loss,
gradients reach trainable parameters only, frozen parts are neither trained nor saved,
ratio metrics pool exactly across batch sizes, and export round trips when supported.
"""

from __future__ import annotations

import copy

import math
import tempfile
from typing import Any

import pytest
import torch

from ..contracts import StepContext, StepOutput, TrainBatch
from ..protocols import DataStats, TargetInfo


class StrategyConformance:
    """Contract tests for a strategy; override ``make_strategy``."""

    #: Set False for strategies whose forward_loss samples randomly (e.g. anchors) and so
    #: cannot give identical pooled metrics for different batchings.
    deterministic = True
    #: Sequence lengths of the synthetic samples.
    lengths = (12, 9, 16, 7)

    # ---------------------------------------------------------------- to override
    def make_strategy(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def make_target(self) -> tuple[TargetInfo, dict[str, torch.Tensor]]:
        """A small random Llama-shaped target: info and frozen parts."""
        hidden, vocab, layers = 32, 97, 8
        gen = torch.Generator().manual_seed(1234)
        info = TargetInfo(num_layers=layers, hidden_size=hidden, vocab_size=vocab, dtype="float32",
                          model_id="conformance-random",
                          extra={"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                                 "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
                                 "head_dim": 8, "mask_token_id": vocab - 1, "pad_token_id": 0,
                                 "eos_token_id": 1, "bos_token_id": 2})
        frozen = {"embed_tokens": torch.randn(vocab, hidden, generator=gen),
                  "lm_head": torch.randn(vocab, hidden, generator=gen) / math.sqrt(hidden),
                  "norm": torch.ones(hidden)}
        return info, frozen

    # ---------------------------------------------------------------- helpers
    def samples(self, strategy: Any, target: TargetInfo) -> list[dict[str, torch.Tensor]]:
        """Synthetic stored samples matching the strategy's capture plan."""
        plan = strategy.capture_plan(target)
        gen = torch.Generator().manual_seed(7)
        out = []
        for length in self.lengths:
            sample = {}
            for name, spec in plan.features.items():
                shape = [length if d == -1 else d for d in spec.shape]
                dtype = getattr(torch, spec.dtype)
                if name == "input_ids":
                    sample[name] = torch.randint(3, target.vocab_size - 1, shape, generator=gen, dtype=dtype)
                elif name == "loss_mask":
                    mask = torch.ones(shape, dtype=dtype)
                    mask[: max(1, length // 4)] = 0  # a prompt part that is not supervised
                    sample[name] = mask
                elif dtype.is_floating_point:
                    sample[name] = torch.randn(shape, generator=gen).to(dtype)
                else:
                    sample[name] = torch.randint(0, 2, shape, generator=gen, dtype=dtype)
            out.append(sample)
        return out

    def stats(self, samples: list[dict[str, torch.Tensor]], target: TargetInfo) -> DataStats:
        counts = torch.zeros(target.vocab_size, dtype=torch.long)
        for s in samples:
            if "input_ids" in s and "loss_mask" in s:
                counts += torch.bincount(s["input_ids"][s["loss_mask"].bool()].long(), minlength=target.vocab_size)
        return DataStats(token_counts=counts, num_samples=len(samples))

    def setup_parts(self) -> tuple[Any, TargetInfo, dict[str, torch.Tensor], list[dict[str, torch.Tensor]], Any]:
        torch.manual_seed(0)
        strategy = self.make_strategy()
        target, frozen = self.make_target()
        samples = self.samples(strategy, target)
        model = strategy.build_model(target, frozen, self.stats(samples, target))
        return strategy, target, frozen, samples, model

    def loss(self, strategy: Any, model: Any, samples: list, ids: list[str] | None = None) -> StepOutput:
        ids = ids or [f"s{i}" for i in range(len(samples))]
        torch.manual_seed(3)
        return strategy.forward_loss(model, strategy.collate(samples, ids), StepContext(global_step=0, total_steps=10))

    # ---------------------------------------------------------------- tests
    def test_capture_plan_declares_sequence_features_and_valid_layers(self):
        strategy = self.make_strategy()
        target, _ = self.make_target()
        plan = strategy.capture_plan(target)
        assert plan.features, "the capture plan declares no feature"
        for name, spec in plan.features.items():
            assert spec.shape[0] == -1, f"feature {name} must have the sequence length (-1) first"
        # the ids a serving engine can capture: 0..L-2 (specforge_core.serving)
        assert all(0 <= i <= target.num_layers - 2 for i in plan.layer_ids), plan.layer_ids
        assert len(set(plan.layer_ids)) == len(plan.layer_ids), "layer ids must be distinct"

    def test_collate_keeps_sample_ids_and_counts_real_tokens(self):
        strategy, target, _frozen, samples, _model = self.setup_parts()
        batch = strategy.collate(samples, ["a", "b", "c", "d"])
        assert isinstance(batch, TrainBatch)
        assert batch.sample_ids == ("a", "b", "c", "d")
        assert batch.num_tokens == sum(self.lengths)

    def test_forward_loss_is_a_finite_scalar_with_ratio_metrics(self):
        strategy, _target, _frozen, samples, model = self.setup_parts()
        out = self.loss(strategy, model, samples)
        assert isinstance(out, StepOutput)
        assert out.loss.dim() == 0 and torch.isfinite(out.loss) and out.loss.requires_grad
        assert out.ratio_metrics, "strategies report ratio metrics for exact pooling"
        for name, (num, den) in out.ratio_metrics.items():
            assert den >= 0 and math.isfinite(num), name

    def test_gradients_reach_trainable_parameters_and_frozen_parts_stay_frozen(self):
        strategy, _target, frozen, samples, model = self.setup_parts()
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert trainable, "the draft has no trainable parameter"
        optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        self.loss(strategy, model, samples).loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
        optimizer.step()
        frozen_names = {n for n, p in model.named_parameters() if not p.requires_grad}
        after = model.state_dict()
        for name in frozen_names:
            assert torch.equal(before[name], after[name]), f"frozen {name} changed"
        changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(before[n], after[n])]
        assert changed, "an optimizer step changed no trainable parameter"
        for part in frozen.values():
            for name, param in model.named_parameters():
                if param.requires_grad and param.shape == part.shape:
                    assert not torch.equal(param.detach(), part), f"trainable {name} is a copy of a frozen part"

    def test_ratio_metrics_pool_exactly_across_batch_sizes(self):
        if not self.deterministic:
            pytest.skip("forward_loss samples randomly")
        strategy, _target, _frozen, samples, model = self.setup_parts()
        with torch.no_grad():
            whole = self.loss(strategy, model, samples).ratio_metrics
            split: dict[str, list[float]] = {}
            for i, sample in enumerate(samples):
                for name, (num, den) in self.loss(strategy, model, [sample], [f"s{i}"]).ratio_metrics.items():
                    acc = split.setdefault(name, [0.0, 0.0])
                    acc[0] += num
                    acc[1] += den
        for name, (num, den) in whole.items():
            assert split[name][1] == pytest.approx(den), name
            if den:
                assert split[name][0] / split[name][1] == pytest.approx(num / den, rel=1e-4, abs=1e-5), name

    def test_export_round_trip_gives_identical_outputs(self):
        """What is served is the trained draft rounded to the export dtype: the reloaded export computes
        exactly what the draft computes with its trainable weights cast to the dtypes the export holds."""
        strategy, target, frozen, samples, model = self.setup_parts()
        if not hasattr(strategy, "export"):
            pytest.skip("the strategy does not export")
        with tempfile.TemporaryDirectory() as out:
            strategy.export(model, out, target)
            reloaded = strategy.load_export(out, target, frozen)
            served = copy.deepcopy(model)
            exported = dict(reloaded.named_parameters())
            with torch.no_grad():
                for name, param in served.named_parameters():
                    if param.requires_grad:
                        param.data = param.data.to(exported[name].dtype)
            served.eval()
            reloaded.eval()
            with torch.no_grad():
                a = self.loss(strategy, served, samples)
                b = self.loss(strategy, reloaded, samples)
            assert torch.equal(a.loss, b.loss)
            assert a.ratio_metrics == b.ratio_metrics
