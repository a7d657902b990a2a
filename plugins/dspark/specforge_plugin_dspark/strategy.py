"""The ``dspark`` strategy: DFlash's strategy with shifted labels, the two heads and the combined loss.

forward_loss, top to bottom (docs/algorithms.md, "DSpark")::

    blocks  = draw_blocks(..., label_shift=1)                  slot k predicts anchor+k+1; w = valid·exp(-k/γ)
    hidden  = block_hidden(blocks)                             [B, N, bs, H]   DFlash's backbone
    per chunk of blocks (recomputed in backward when there are several; CE, L1 and their
    gradients fused in one pass over the chunk's logits: head_loss.py):
        logits = lm_head(hidden) + markov(token at anchor+k)  [.., bs, V]
        CE     = cross_entropy(logits, label)
        p_T    = softmax(lm_head(last_hidden[anchor+k]))      the target's distribution of the label
        L1     = ‖softmax(logits) − p_T‖₁
        accept = clamp(1 − L1/2, 0, 1)                         detached
        BCE    = bce_with_logits(confidence(h_k, token at anchor+k), accept)
    loss    = (α_ce·Σw·CE + α_l1·Σw·L1 + α_conf·Σw·BCE) / Σw   (D-PACE: w from the CE, / batch size)

Capture plan (plus ``last_hidden``), collate, anchors, the backbone pass, building the model,
``tau_sim``, export / load and the speculate loop are DFlash's (inherited, with DSpark's
network, export functions and drafting step swapped in).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F

from specforge_core.contracts import FeatureSpec, StepContext, StepOutput, TrainBatch
from specforge_core.nn import argmax_last
from specforge_core.protocols import CapturePlan, TargetInfo
from specforge_plugin_dflash.loss import block_metrics, no_anchor_samples, reduce_chunks
from specforge_plugin_dflash.speculate import DraftFn
from specforge_plugin_dflash.strategy import FEATURES, DFlashStrategy, collate_features

from .config import DSparkHeadConfig
from .export import export_dspark, load_dspark
from .head_loss import DistillationTerms
from .model import DSparkBackbone
from .speculate import draft_dspark_block

#: The target's lm_head input, the teacher of the L1 term.
LAST_HIDDEN = "last_hidden"
#: Block slot k predicts the token at anchor + k + LABEL_SHIFT.
LABEL_SHIFT = 1


def gather_positions(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``states [B, S, H]`` at ``positions [B, ...]`` (clamped into the sequence): ``[B, ..., H]``."""
    index = positions.clamp(max=states.shape[1] - 1).flatten(1)
    picked = torch.gather(states, 1, index[..., None].expand(-1, -1, states.shape[-1]))
    return picked.view(*positions.shape, states.shape[-1])


def distillation(logits: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The L1 term written out (training runs it fused, :mod:`.head_loss`): ``(L1, accept)`` per position,
    ``‖softmax(logits) − teacher‖₁`` (``[..., V]`` -> ``[...]``, differentiable) and the acceptance
    probability it implies, ``clamp(1 − L1/2, 0, 1)`` (detached: a target, not a path)."""
    l1 = (torch.softmax(logits, dim=-1) - teacher).abs().sum(-1)
    return l1, (1.0 - l1.detach() / 2).clamp(0.0, 1.0)


def probabilistic_acceptance(accept: torch.Tensor, label_mask: torch.Tensor, keep: torch.Tensor) -> tuple[float, float]:
    """Ratio metric ``tau_probabilistic``: the mean over kept blocks of ``Σ_k Π_{i≤k} accept_i``
    (``accept [B, N, bs]``; an unsupervised slot ends the product, like the end of a response)."""
    expected = (accept * label_mask).cumprod(dim=-1).sum(dim=-1)[keep]  # [kept blocks]
    return float(expected.sum()), float(expected.numel())


class DSparkStrategy(DFlashStrategy):
    """DSpark (arXiv 2607.05147): DFlash plus a Markov head and a confidence head. Built as ``factory(options, context)``."""

    name = "dspark"
    draft_fn = staticmethod(draft_dspark_block)
    model_class = DSparkBackbone
    export_fn = staticmethod(export_dspark)
    load_fn = staticmethod(load_dspark)

    # ------------------------------------------------------------------ plan and model
    def capture_plan(self, target: TargetInfo) -> CapturePlan:
        """DFlash's plan plus ``last_hidden [S, H]`` (the teacher distribution's lm_head input)."""
        plan = super().capture_plan(target)
        return attrs.evolve(plan, last_hidden=True, features={
            **plan.features, LAST_HIDDEN: FeatureSpec((-1, target.hidden_size), target.dtype)})

    def head_config(self, target: TargetInfo) -> DSparkHeadConfig:
        """The Markov and confidence heads under the options, passed to :class:`DSparkBackbone` as ``head=``."""
        return DSparkHeadConfig.from_options(self.options)

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]], sample_ids: Sequence[str]) -> TrainBatch:
        return collate_features(samples, sample_ids, strategy=self.name, features=(*FEATURES, LAST_HIDDEN))

    # ------------------------------------------------------------------ training
    def forward_loss(self, model: DSparkBackbone, batch: TrainBatch, ctx: StepContext) -> StepOutput:
        """The combined loss; ratio metrics ``loss``, ``ce_loss``, ``l1_loss``, ``confidence_loss``, ``acc``,
        ``accept_len`` (argmax drafts of all bs slots), ``tau_probabilistic``, ``confidence_error`` and
        ``no_anchor_samples``."""
        options = self.options
        blocks = self.draw_blocks(model, batch, ctx, label_shift=LABEL_SHIFT)
        hidden = self.block_hidden(model, batch, blocks)  # [B, N, bs, H]
        weighting = self.loss_weighting
        weights = weighting.position_weights(blocks.weights, blocks.label_mask)
        last_hidden = batch[LAST_HIDDEN]  # [B, S, H]

        def chunk(start: int, end: int) -> tuple[torch.Tensor, ...]:
            block_hidden = hidden[:, start:end]
            previous, labels = blocks.tokens[:, start:end], blocks.labels[:, start:end]  # token at anchor+k, anchor+k+1
            # the CE and L1 terms over logits = lm_head(h) + markov(previous), fused (head_loss.py)
            terms = DistillationTerms(hidden=block_hidden, head=model.lm_head, labels=labels,
                                      teacher_hidden=gather_positions(last_hidden, blocks.positions[:, start:end]),
                                      weights=weights[:, start:end], weighting=weighting,
                                      ce_alpha=options.ce_loss_alpha, l1_alpha=options.l1_loss_alpha)
            embedding, fused = model.markov_head(previous, terms)  # [B, c, bs, r], DistillationSums
            confidence = model.confidence(block_hidden, previous, embedding)
            bce = (fused.weights * F.binary_cross_entropy_with_logits(confidence, fused.accept, reduction="none")).sum()
            # [loss, Σw·CE, Σw·L1, Σw·BCE]: the loss carries the gradient, the sums are its terms for the metrics
            sums = torch.stack([fused.loss + options.confidence_loss_alpha * bce, *fused.sums, bce.detach()])
            return sums, fused.predictions, fused.accept, torch.sigmoid(confidence).detach()

        sums, predictions, accept, confidence = reduce_chunks(chunk, blocks.labels.shape[1], options.logit_chunk_size)
        total = sums[0]
        loss, denominator = weighting.normalize(total, weights, batch_size=blocks.anchors.shape[0])
        mask = blocks.label_mask
        ce_sum, l1_sum, bce_sum = (float(value) for value in sums[1:].detach())
        ratios = {"loss": (float(total.detach()), denominator), "ce_loss": (ce_sum, denominator),
                  "l1_loss": (l1_sum, denominator), "confidence_loss": (bce_sum, denominator),
                  **block_metrics(predictions, blocks.labels, mask, blocks.keep, label_shift=LABEL_SHIFT,
                                  drafted=blocks.block_size),
                  "tau_probabilistic": probabilistic_acceptance(accept, mask, blocks.keep),
                  "confidence_error": (float(((confidence - accept).abs() * mask).sum()), float(mask.sum())),
                  **no_anchor_samples(blocks.num_valid)}
        if not ctx.training:
            ratios.update(self.simulated_acceptance(model, batch, label_shift=LABEL_SHIFT, drafted=blocks.block_size))
        return StepOutput(loss=loss, ratio_metrics=ratios)

    def block_predictions(self, model: DSparkBackbone, batch: TrainBatch, blocks: Any) -> torch.Tensor:
        """The drafted token at every block slot, ``[B, N, bs]``: the block logits plus the Markov bias of the
        token before each slot. Teacher-forced tokens equal the drafted ones up to the first miss, which is
        all an accepted prefix depends on. With ``confidence_threshold`` > 0, a slot at or after the first whose
        confidence is below it is not drafted, as decoding cuts the block there: its entry is -1, no token."""
        hidden = self.block_hidden(model, batch, blocks)
        chunk, threshold = self.options.logit_chunk_size, self.options.confidence_threshold
        parts = []
        for start in range(0, hidden.shape[1], chunk):
            states, previous = hidden[:, start:start + chunk], blocks.tokens[:, start:start + chunk]
            embedding, bias = model.markov_head(previous)
            drafted = argmax_last(model.logits(states) + bias)
            if threshold > 0:
                kept = (torch.sigmoid(model.confidence(states, previous, embedding)) >= threshold).long().cumprod(-1)
                drafted = drafted.masked_fill(kept == 0, -1)
            parts.append(drafted)
        return torch.cat(parts, dim=1)

    # ------------------------------------------------------------------ serving
    def drafter(self) -> DraftFn:
        """DSpark's drafting step with the ``confidence_threshold`` option bound."""
        return functools.partial(draft_dspark_block, threshold=self.options.confidence_threshold)
