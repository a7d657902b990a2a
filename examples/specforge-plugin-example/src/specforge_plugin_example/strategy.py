"""The ``example`` strategy: what to capture, the draft, batching, the loss, and the serving methods.

forward_loss, top to bottom::

    logits   = model(last_hidden)                        [B, S, K, V]
    label j  = input_ids[t + 2 + j]                      supervised where loss_mask[t + 2 + j] = 1
    loss     = Σ_j Σ_t CE(logits_j[t], label j)·m / Σ m
    acc_j    = correct / supervised, per head            ratio metrics: pooled exactly across batches and ranks
    tau_sim  = Σ_k Π_{j≤k} acc_j                         derived from the pooled accuracies
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from specforge_core.contracts import FeatureSpec, StepContext, StepOutput, TrainBatch
from specforge_core.data.collate import pad_features
from specforge_core.protocols import BuildContext, CapturePlan, DataStats, TargetInfo

from . import ExampleOptions
from .model import ExampleDraft
from .serving import export_draft, load_draft, speculate

FEATURES = ("input_ids", "loss_mask", "last_hidden")


class ExampleStrategy:
    """Medusa-style heads on the last hidden state. Built by the spec's factory as ``ExampleStrategy(options, context)``."""

    def __init__(self, options: ExampleOptions, context: BuildContext | None = None) -> None:
        self.options = options
        self.context = context

    # -- training ----------------------------------------------------------------------------
    def capture_plan(self, target: TargetInfo) -> CapturePlan:
        """No decoder layers, just the lm_head input (``last_hidden``) next to the ids and the loss mask."""
        return CapturePlan(last_hidden=True, features={
            "input_ids": FeatureSpec((-1,), "int64"),
            "loss_mask": FeatureSpec((-1,), "int64"),
            "last_hidden": FeatureSpec((-1, target.hidden_size), target.dtype),
        })

    def build_model(self, target: TargetInfo, frozen_parts: Mapping[str, Any], stats: DataStats) -> ExampleDraft:
        return ExampleDraft(target.hidden_size, self.options.num_heads, frozen_parts["lm_head"], self.options.init_std)

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]], sample_ids: Sequence[str]) -> TrainBatch:
        tensors, lengths = pad_features(samples, sample_ids, FEATURES, strategy="example",
                                        dtypes={"input_ids": torch.long, "loss_mask": torch.long})
        return TrainBatch(tensors=tensors, sample_ids=sample_ids, num_tokens=sum(lengths))

    def forward_loss(self, model: ExampleDraft, batch: TrainBatch, ctx: StepContext) -> StepOutput:
        logits = model(batch["last_hidden"])  # [B, S, K, V]
        ids, mask = batch["input_ids"], batch["loss_mask"].float()
        total = logits.new_zeros(())
        supervised = 0.0
        ratios = {}
        for j in range(logits.shape[2]):
            shift = j + 2
            if ids.shape[1] <= shift:  # every sample is too short for this head
                ratios[f"acc_{j}"] = (0.0, 0.0)
                continue
            head_logits, labels, weight = logits[:, :-shift, j], ids[:, shift:], mask[:, shift:]
            ce = F.cross_entropy(head_logits.transpose(1, 2), labels, reduction="none")
            total = total + (ce * weight).sum()
            supervised += float(weight.sum())
            correct = ((head_logits.argmax(-1) == labels).float() * weight).sum()
            ratios[f"acc_{j}"] = (float(correct), float(weight.sum()))
        ratios["loss"] = (float(total.detach()), supervised)
        return StepOutput(loss=total / max(supervised, 1.0), ratio_metrics=ratios)

    def derived_metrics(self, pooled: Mapping[str, float]) -> dict[str, float]:
        """``tau_sim``: expected drafts accepted per verification, Σ_k Π_{j≤k} acc_j (bonus token excluded)."""
        tau, running = 0.0, 1.0
        for j in range(self.options.num_heads):
            running *= pooled.get(f"acc_{j}", 0.0)
            tau += running
        return {"tau_sim": tau}

    # -- serving (serving.py) ----------------------------------------------------------------
    def export(self, model: ExampleDraft, out_dir: str, target: TargetInfo | None = None, *,
               dtype: str | None = None) -> str:
        """The spec's one format, ``example``; weights in ``dtype`` (None: as trained)."""
        return str(export_draft(model, out_dir, dtype=dtype, options=self.options))

    def load_export(self, path: str, target: TargetInfo | None, frozen_parts: Mapping[str, Any]) -> ExampleDraft:
        return load_draft(path, frozen_parts)

    def speculate(self, model: ExampleDraft, session: Any, prompt_ids: Any, *, max_new_tokens: int,
                  eos_token_id: int | Sequence[int] | None = None) -> Any:
        was_training = model.training
        model.eval()
        try:
            return speculate(model, session, prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        finally:
            model.train(was_training)
