"""The ``domino`` strategy: DFlash's strategy with the correction head, the dual loss and λ.

forward_loss, top to bottom (ALGORITHMS.md, "Domino")::

    blocks  = draw_blocks(..., label_shift)                      DFlash's anchors, labels, weights
    hidden  = block_hidden(blocks)                               [B, N, bs, H]   DFlash's backbone
    states  = model.block_states(blocks.tokens)                  [B, N, bs, g]   teacher-forced GRU
    base    = lm_head(hidden);  final = base + correction        per chunk of blocks, one pass
    base_ce, final_ce = Σw·CE(base), Σw·CE(final)
    λ       = base_loss_weight(global_step, total_steps)
    loss    = ((1 − λ)·final_ce + λ·base_ce) / Σw

Capture plan, collate, anchors, the backbone pass, ``tau_sim`` and the speculate loop are
DFlash's (inherited); only the drafting step differs (:attr:`DominoStrategy.draft_fn`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from specforge_core.dtypes import torch_dtype
from specforge_core.contracts import StepContext, StepOutput, TrainBatch
from specforge_core.protocols import DataStats, TargetInfo
from specforge_plugin_dflash.loss import block_metrics, chunked_cross_entropy
from specforge_plugin_dflash.strategy import DFlashStrategy

from .config import DominoHeadConfig
from .export import export_domino, load_domino
from .model import DominoBackbone
from .schedule import base_loss_weight
from .speculate import draft_domino_block


class DominoStrategy(DFlashStrategy):
    """Domino (arXiv 2605.29707): DFlash plus a GRU logit correction. Built as ``factory(options, context)``."""

    name = "domino"
    draft_fn = staticmethod(draft_domino_block)

    # ------------------------------------------------------------------ model
    def head_config(self, target: TargetInfo) -> DominoHeadConfig:
        """The correction head's widths and label alignment for ``target`` under the options."""
        return DominoHeadConfig.from_options(self.options, target.hidden_size)

    def build_model(self, target: TargetInfo, frozen_parts: Mapping[str, Any], stats: DataStats) -> DominoBackbone:
        return DominoBackbone(self.draft_config(target), frozen_parts["embed_tokens"], frozen_parts["lm_head"],
                              head=self.head_config(target), attention=self.options.attention,
                              dtype=torch_dtype(self.options.dtype), init_std=self.options.init_std)

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
        bs = blocks.block_size

        def both_heads(start: int, end: int) -> torch.Tensor:
            """[B, c, 2·bs, V]: the blocks' base logits, then their final logits, side by side."""
            base = model.logits(hidden[:, start:end])
            return torch.cat([base, model.final_logits(base, hidden[:, start:end], states[:, start:end])], dim=2)

        # Row 0 of the weights selects the base half of each block, row 1 the final half: one
        # pass over the logits gives both weighted sums.
        zeros = torch.zeros_like(blocks.weights)
        weights = torch.stack([torch.cat([blocks.weights, zeros], -1), torch.cat([zeros, blocks.weights], -1)])
        sums, predictions = chunked_cross_entropy(both_heads, blocks.labels.repeat(1, 1, 2), weights,
                                                  self.options.logit_chunk_size)
        base_ce, final_ce = sums
        weight = blocks.weights.sum()
        lam = self.base_loss_weight(ctx)
        loss = ((1.0 - lam) * final_ce + lam * base_ce) / torch.where(weight > 0, weight, torch.ones_like(weight))
        metrics = dict(label_mask=blocks.label_mask, keep=blocks.keep, label_shift=head.label_shift)
        ratios = {"final_loss": (float(final_ce.detach()), float(weight)),
                  "base_loss": (float(base_ce.detach()), float(weight)),
                  **block_metrics(predictions[..., bs:], blocks.labels, **metrics),
                  **block_metrics(predictions[..., :bs], blocks.labels, prefix="base_", **metrics),
                  # pooled: the fraction of samples with no valid anchor (numerator: their count)
                  "no_anchor_samples": (float((blocks.num_valid == 0).sum()), float(blocks.num_valid.numel()))}
        return StepOutput(loss=loss, metrics={"lambda": lam}, ratio_metrics=ratios)

    # ------------------------------------------------------------------ serving
    def export(self, model: DominoBackbone, out_dir: str, target: TargetInfo | None = None) -> str:
        """An SGLang DFlash directory with the Domino head (see :mod:`specforge_plugin_domino.export`)."""
        return str(export_domino(model, out_dir))

    def load_export(self, path: str, target: TargetInfo | None, frozen_parts: Mapping[str, Any]) -> DominoBackbone:
        """The draft back from an export, over the target's frozen ``embed_tokens`` and ``lm_head``."""
        return load_domino(path, frozen_parts, attention=self.options.attention)
