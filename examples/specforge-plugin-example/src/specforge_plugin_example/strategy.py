"""A deliberately tiny strategy: logits[t] = head(last_hidden[t]) predicts input_ids[t+1].

Heavy imports (torch) live here, not in the hook module.
"""

from __future__ import annotations

import torch
from torch import nn

from specforge_core.contracts import FeatureSpec, StepOutput, TrainBatch
from specforge_core.protocols import CapturePlan


class ExampleStrategy:
    def __init__(self, options, context):
        self.options = options
        self.context = context

    def capture_plan(self, target):
        return CapturePlan(last_hidden=True, features={
            "input_ids": FeatureSpec((-1,), "int64"),
            "loss_mask": FeatureSpec((-1,), "int64"),
            "last_hidden": FeatureSpec((-1, target.hidden_size), target.dtype),
        })

    def build_model(self, target, frozen_parts, stats):
        head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)
        nn.init.normal_(head.weight, std=self.options.init_std)
        return head

    def collate(self, samples, sample_ids):
        length = max(s["input_ids"].shape[0] for s in samples)
        hidden = samples[0]["last_hidden"].shape[1]
        ids = torch.zeros(len(samples), length, dtype=torch.long)
        mask = torch.zeros(len(samples), length, dtype=torch.long)
        states = torch.zeros(len(samples), length, hidden, dtype=samples[0]["last_hidden"].dtype)
        for row, sample in enumerate(samples):
            n = sample["input_ids"].shape[0]
            ids[row, :n] = sample["input_ids"]
            mask[row, :n] = sample["loss_mask"]
            states[row, :n] = sample["last_hidden"]
        return TrainBatch(tensors={"input_ids": ids, "loss_mask": mask, "last_hidden": states},
                          sample_ids=sample_ids, num_tokens=int(sum(s["input_ids"].shape[0] for s in samples)))

    def forward_loss(self, model, batch, ctx):
        logits = model(batch["last_hidden"][:, :-1].float())
        labels = batch["input_ids"][:, 1:]
        weight = batch["loss_mask"][:, 1:].float()
        ce = nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        denom = weight.sum().clamp(min=1.0)
        correct = ((logits.argmax(-1) == labels).float() * weight).sum()
        return StepOutput(loss=(ce * weight).sum() / denom,
                          ratio_metrics={"acc": (float(correct), float(weight.sum()))})
