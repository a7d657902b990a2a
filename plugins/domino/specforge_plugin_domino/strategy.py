"""The ``domino`` strategy: DFlash's strategy with the correction head, the dual loss and λ.

forward_loss, top to bottom (docs/algorithms.md, "Domino")::

    blocks  = draw_blocks(..., label_shift)                      DFlash's anchors, labels, weights
    hidden  = block_hidden(blocks)                               [B, N, bs, H]   DFlash's backbone
    states  = model.block_states(blocks.tokens)                  [B, N, bs, g]   teacher-forced GRU
    λ       = base_loss_weight(global_step, total_steps)
    base    = lm_head(hidden);  final = base + correction        per chunk of blocks, fused (head_loss)
    base_ce, final_ce = Σw·CE(base), Σw·CE(final)             w: DFlash's decay, or D-PACE's per head (loss_type)
    loss    = ((1 − λ)·final_ce + λ·base_ce) / Σw              D-PACE: / batch size

Capture plan, collate, anchors, the backbone pass, building the model, the loss's
normalisation and ``no_anchor_samples``, ``tau_sim``, export / load and the speculate loop are
DFlash's (inherited); Domino swaps in its network (:attr:`DominoStrategy.model_class`, with the
head from :meth:`DominoStrategy.head_config`), its export functions and its drafting step
(:attr:`DominoStrategy.draft_fn`).
"""

from __future__ import annotations

from typing import Any

import torch

from specforge_core.contracts import StepContext, StepOutput, TrainBatch
from specforge_core.nn import argmax_last
from specforge_core.protocols import TargetInfo
from specforge_plugin_dflash.loss import block_metrics, no_anchor_samples
from specforge_plugin_dflash.strategy import DFlashStrategy

from .config import DominoHeadConfig
from .export import export_domino, load_domino
from .head_loss import DualHeadTerms
from .model import DominoBackbone
from .schedule import base_loss_weight
from .speculate import draft_domino_block


class DominoStrategy(DFlashStrategy):
    """Domino (arXiv 2605.29707): DFlash plus a GRU logit correction. Built as ``factory(options, context)``."""

    name = "domino"
    draft_fn = staticmethod(draft_domino_block)
    model_class = DominoBackbone
    export_fn = staticmethod(export_domino)
    load_fn = staticmethod(load_domino)

    # ------------------------------------------------------------------ model
    def head_config(self, target: TargetInfo) -> DominoHeadConfig:
        """The correction head's widths and label alignment for ``target`` under the options (checked against
        the block size), passed to :class:`DominoBackbone` as ``head=``."""
        return DominoHeadConfig.from_options(self.options, target.hidden_size)

    # ------------------------------------------------------------------ training
    def base_loss_weight(self, ctx: StepContext) -> float:
        """λ of this step (0 when the run has no planned number of steps)."""
        return base_loss_weight(ctx.global_step, ctx.total_steps, start=self.options.lambda_start,
                                decay_ratio=self.options.lambda_decay_ratio)

    def forward_loss(self, model: DominoBackbone, batch: TrainBatch, ctx: StepContext) -> StepOutput:
        """``L = (1-λ)·final + λ·base``; ratio metrics ``final_loss``, ``acc``, ``accept_len`` (final head),
        ``base_loss``, ``base_acc``, ``base_accept_len``, ``no_anchor_samples``; plain metric ``lambda``."""
        head = model.head_config
        blocks = self.draw_blocks(model, batch, ctx, label_shift=head.label_shift)
        hidden = self.block_hidden(model, batch, blocks)  # [B, N, bs, H]
        states = model.block_states(blocks.tokens)  # [B, N, bs, g]
        weighting = self.loss_weighting
        position_weights = weighting.position_weights(blocks.weights, blocks.label_mask)
        lam = self.base_loss_weight(ctx)
        # both heads' cross-entropies fused, a chunk of blocks at a time; only the suffix from suffix_start on
        # is corrected and scored again (below it the final head is the base head), and D-PACE reweights each
        # head from its own cross-entropies (see head_loss)
        total, sums, base_predictions, predictions = None, [], [], []
        chunk = self.options.logit_chunk_size
        for first in range(0, blocks.labels.shape[1], chunk):
            part = slice(first, first + chunk)
            terms = DualHeadTerms(hidden=hidden[:, part], head=model.lm_head, labels=blocks.labels[:, part],
                                  weights=position_weights[:, part], weighting=weighting,
                                  suffix_start=head.suffix_start, base_weight=lam)
            out = model.dual_head_loss(states[:, part], terms)
            total = out.loss if total is None else total + out.loss
            sums.append(out.sums)
            base_predictions.append(out.base_predictions)
            predictions.append(out.predictions)
        base_ce, final_ce = torch.stack(sums).sum(0)
        base_predictions, predictions = torch.cat(base_predictions, dim=1), torch.cat(predictions, dim=1)
        loss, weight = weighting.normalize(total, position_weights, batch_size=blocks.anchors.shape[0])
        metrics = dict(label_mask=blocks.label_mask, keep=blocks.keep, label_shift=head.label_shift)
        ratios = {"final_loss": (float(final_ce.detach()), weight),
                  "base_loss": (float(base_ce.detach()), weight),
                  **block_metrics(predictions, blocks.labels, **metrics),
                  **block_metrics(base_predictions, blocks.labels, prefix="base_", **metrics),
                  **no_anchor_samples(blocks.num_valid)}
        if not ctx.training:
            ratios.update(self.simulated_acceptance(model, batch, label_shift=head.label_shift))
        return StepOutput(loss=loss, metrics={"lambda": lam}, ratio_metrics=ratios)

    def block_predictions(self, model: DominoBackbone, batch: TrainBatch, blocks: Any) -> torch.Tensor:
        """The corrected (final) head's drafted token at every block position, ``[B, N, bs]``."""
        hidden = self.block_hidden(model, batch, blocks)
        states = model.block_states(blocks.tokens)
        chunk = self.options.logit_chunk_size
        out = []
        for start in range(0, hidden.shape[1], chunk):
            part = hidden[:, start:start + chunk]
            out.append(argmax_last(model.final_logits(model.logits(part), part, states[:, start:start + chunk])))
        return torch.cat(out, dim=1)
