"""StrategyConformance: the contract every strategy plugin is tested against.

Subclass it and override :meth:`make_strategy` (and optionally :meth:`make_engine`)::

    class TestMyStrategy(StrategyConformance):
        def make_strategy(self):
            return MyStrategy(MyOptions(), BuildContext())

The suite builds a small random target (a :class:`~specforge_core.testing.reference_target.
ReferenceTarget`: info, frozen parts, capture and verify sessions), synthetic samples that
match the strategy's capture plan, and checks the training contract: collate, forward_loss,
gradients reach trainable parameters only, frozen parts are neither trained nor saved, ratio
metrics pool exactly across batch sizes, export round trips when supported, and — for a
strategy with ``speculate`` — that speculative decoding reproduces the target's greedy decode
token for token, untrained and after a short training on the target's own continuations (so
accepted drafts are exercised too), stopping at the end-of-sequence token.
"""

from __future__ import annotations

import copy
import inspect
import math
import tempfile
from typing import Any

import pytest
import torch

from ..contracts import StepContext, StepOutput, TrainBatch
from ..preflight import accepted_kwargs
from ..serving import DEFAULT_EXPORT_DTYPE
from ..protocols import DataStats, TargetInfo
from .reference_target import ReferenceTarget


class StrategyConformance:
    """Contract tests for a strategy; override ``make_strategy``."""

    #: Set False for strategies whose forward_loss samples randomly (e.g. anchors) and so
    #: cannot give identical pooled metrics for different batchings.
    deterministic = True
    #: Sequence lengths of the synthetic samples.
    lengths = (12, 9, 16, 7)
    #: Optimizer steps (and learning rate) of the short training before the second speculate check:
    #: enough for some drafts to be accepted, so the accept path is checked, not only the rejections.
    speculate_train_steps = 20
    speculate_lr = 1e-2
    #: Tokens generated per prompt by the speculate checks.
    speculate_max_new_tokens = 24
    #: The serving format the export round trip writes; None: the first its installed spec declares.
    export_format: str | None = None

    # ---------------------------------------------------------------- to override
    def make_strategy(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def make_engine(self, eos_token_id: int | None = 1) -> Any:
        """The target the suite trains and decodes against: a small random Llama-shaped model
        (8 layers, H = 32, V = 97, 4 heads / 2 kv), implementing the target engine protocol."""
        return ReferenceTarget(eos_token_id=eos_token_id)

    def make_target(self) -> tuple[TargetInfo, dict[str, torch.Tensor]]:
        """:meth:`make_engine`'s info and frozen parts."""
        engine = self.make_engine()
        return engine.info(), engine.frozen_parts()

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

    # ---------------------------------------------------------------- speculative decoding
    def prompts(self, engine: Any, count: int, seed: int) -> list[list[int]]:
        """``count`` random prompts of 6 to 10 tokens (ids 3..V-2: no special or MASK token)."""
        gen = torch.Generator().manual_seed(seed)
        vocab = engine.info().vocab_size
        return [torch.randint(3, vocab - 1, (int(torch.randint(6, 11, (1,), generator=gen)),), generator=gen).tolist()
                for _ in range(count)]

    def check_speculation(self, strategy: Any, model: Any, engine: Any, prompts: list[list[int]],
                          eos_token_id: int | None) -> list[int]:
        """Speculate every prompt; assert it equals the target's greedy decode and accounts for its forwards.
        Returns every verification's accept length."""
        plan = strategy.capture_plan(engine.info())
        accepted: list[int] = []
        model.eval()
        for prompt in prompts:
            want = engine.greedy(prompt, self.speculate_max_new_tokens)
            result = strategy.speculate(model, engine.session(torch.tensor(prompt), plan), prompt,
                                        max_new_tokens=self.speculate_max_new_tokens, eos_token_id=eos_token_id)
            got = list(result.tokens)
            assert got == want, (f"speculate is not lossless on prompt {prompt}: it gave {got}, the target's greedy "
                                 f"decode is {want}")
            assert result.target_forwards == len(result.accept_lengths), "one accept length per target forward"
            assert sum(result.accept_lengths) == len(got), "the accept lengths must add up to the tokens"
            assert result.accept_lengths[0] == 1, "the prompt's prefill forward yields exactly the first token"
            assert all(n >= 1 for n in result.accept_lengths), "every verification yields at least the bonus token"
            if result.accepted_drafts:  # optional; only a prompt's last round may end without its bonus
                assert len(result.accepted_drafts) == len(result.accept_lengths) - 1, "one count per verification"
                assert result.accepted_drafts[:-1] == [n - 1 for n in result.accept_lengths[1:-1]], \
                    "a round that goes on emits its accepted drafts and the bonus"
                assert result.accept_lengths[-1] - 1 <= result.accepted_drafts[-1] <= result.accept_lengths[-1]
            accepted.extend(result.accept_lengths[1:])
        return accepted

    def test_speculate_reproduces_the_targets_greedy_decode(self):
        strategy = self.make_strategy()
        if not hasattr(strategy, "speculate"):
            pytest.skip("the strategy does not decode")
        engine = self.make_engine(eos_token_id=None)
        info, frozen = engine.info(), engine.frozen_parts()
        torch.manual_seed(0)
        model = strategy.build_model(info, frozen, DataStats())
        self.check_speculation(strategy, model, engine, self.prompts(engine, 3, seed=11), None)

    def test_speculate_stays_lossless_when_drafts_are_accepted_and_stops_at_eos(self):
        strategy = self.make_strategy()
        if not hasattr(strategy, "speculate"):
            pytest.skip("the strategy does not decode")
        engine = self.make_engine(eos_token_id=None)
        info = engine.info()
        plan = strategy.capture_plan(info)
        # Train on the target's own continuations of some prompts, then decode those prompts.
        prompts = self.prompts(engine, 6, seed=21)
        texts = [prompt + engine.greedy(prompt, 40) for prompt in prompts]
        samples = []
        for prompt, sample in zip(prompts, engine.capture([{"input_ids": torch.tensor(t)} for t in texts], plan)):
            mask = torch.ones(sample["input_ids"].numel(), dtype=torch.long)
            mask[: len(prompt)] = 0
            samples.append({**{k: v for k, v in sample.items() if k in plan.features}, "loss_mask": mask})
        missing = set(plan.features) - set(samples[0])
        assert not missing, f"the target captured no {sorted(missing)} for the capture plan"
        samples = [{k: v.to(getattr(torch, plan.features[k].dtype)) for k, v in s.items()} for s in samples]
        torch.manual_seed(0)
        model = strategy.build_model(info, engine.frozen_parts(), self.stats(samples, info))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=self.speculate_lr)
        ids = [f"t{i}" for i in range(len(samples))]
        model.train()
        for step in range(self.speculate_train_steps):
            loss = strategy.forward_loss(model, strategy.collate(samples, ids),
                                         StepContext(global_step=step, total_steps=self.speculate_train_steps)).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        accepted = self.check_speculation(strategy, model, engine, prompts, None)
        assert max(accepted) > 1, (
            f"after {self.speculate_train_steps} training steps no draft token was accepted, so the accept path "
            "went unchecked; raise speculate_train_steps or speculate_lr for this strategy")
        # An end-of-sequence token inside the continuation: the decode stops right after it.
        want = engine.greedy(prompts[0], self.speculate_max_new_tokens)
        eos = want[len(want) // 2]
        stopped = self.make_engine(eos_token_id=eos)
        assert self.check_speculation(strategy, model, stopped, prompts[:1], eos) is not None
        assert stopped.greedy(prompts[0], self.speculate_max_new_tokens)[-1] == eos

    @staticmethod
    def _installed_format(strategy: Any) -> str | None:
        """The first export format of the installed spec whose factory makes ``strategy`` (None if none does)."""
        from ..plugins import get_plugin_manager

        factory = f"{type(strategy).__module__}:{type(strategy).__qualname__}"
        for spec in get_plugin_manager().specs("strategy").values():
            if spec.factory == factory and getattr(spec, "export_formats", ()):
                return spec.export_formats[0]
        return None

    def test_export_round_trip_gives_identical_outputs(self):
        """What is served is the trained draft rounded to the export dtype: the reloaded export computes
        exactly what the draft computes with its trainable weights cast to the dtypes the export holds."""
        strategy, target, frozen, samples, model = self.setup_parts()
        if not hasattr(strategy, "export"):
            pytest.skip("the strategy does not export")
        with tempfile.TemporaryDirectory() as out:
            # the format and dtype `specforge export` passes by default, where the method requires them (where it
            # has defaults of its own, those)
            wanted = {"fmt": self.export_format or self._installed_format(strategy), "dtype": DEFAULT_EXPORT_DTYPE}
            parameters = inspect.signature(strategy.export).parameters
            strategy.export(model, out, target, **{
                key: value for key, value in accepted_kwargs(strategy.export, **wanted).items()
                if key in parameters and parameters[key].default is inspect.Parameter.empty})
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
