"""The ``dflash`` strategy: capture plan, model, collate, loss, export and speculative decode.

forward_loss, top to bottom (docs/algorithms.md, "DFlash")::

    blocks  = draw_blocks(input_ids, loss_mask, sample ids)      anchors seeded by (seed, step, id)
    pattern = grouped_block_attention(anchors, lengths)           groups of blocks: context prefix + own blocks
    hidden  = model(target_hidden, block ids, positions, pattern) [B, N*bs, H]
    Σw·CE   = frozen_head_cross_entropy(hidden, lm_head, labels, weights)   fused, per chunk; w: decay or D-PACE;
                                                               block positions 1.. (position 0 is the anchor)
    loss    = Σw·CE / Σw                                               D-PACE: Σw·CE / batch size
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

from specforge_core.dtypes import torch_dtype
from specforge_core.nn import argmax_last, compile_layers
from specforge_core.contracts import FeatureSpec, StepContext, StepOutput, TrainBatch
from specforge_core.data.collate import pad_features
from specforge_core.protocols import BuildContext, CapturePlan, DataStats, SpeculationResult, TargetInfo
from specforge_core.serving import DEFAULT_EXPORT_DTYPE

from . import DFlashOptions
from .blocks import Blocks, block_attention_mask, build_blocks, draw_blocks, grouped_block_attention, valid_anchor_mask
from .config import DFlashConfig, mask_token_for_data
from .export import export_dflash, load_dflash
from .dpace import LossWeighting
from .loss import acceptance_lengths, block_metrics, frozen_head_cross_entropy, no_anchor_samples
from .model import DFlashBackbone
from .speculate import DraftFn, draft_block, speculative_decode

#: The feature holding the concatenated target layers.
HIDDEN_FEATURE = "target_hidden"
#: The ``step`` anchors are seeded with during evaluation: the same anchors at every eval.
EVAL_STEP = -1
#: What a sample holds, each ``[S, ...]``.
FEATURES = ("input_ids", "loss_mask", HIDDEN_FEATURE)


def collate_features(samples: Sequence[Mapping[str, torch.Tensor]], sample_ids: Sequence[str], *,
                     strategy: str = "dflash", features: Sequence[str] = FEATURES) -> TrainBatch:
    """Right-pad ``input_ids``, ``loss_mask`` (with 0) and ``target_hidden`` (with zeros) to the longest sample.

    The batch also carries ``lengths [B]``, the unpadded lengths. A sample that lacks one of
    the features, or whose features disagree on its length, is refused naming it
    (``strategy`` names the capture plan in that message). A variant that captures more
    (DSpark's ``last_hidden``) passes its own ``features``; floating ones are padded with zeros.
    """
    tensors, lengths = pad_features(samples, sample_ids, features, strategy=strategy,
                                    dtypes={"input_ids": torch.long, "loss_mask": torch.long})
    lengths = torch.tensor(lengths)
    return TrainBatch(tensors={**tensors, "lengths": lengths}, sample_ids=sample_ids, num_tokens=int(lengths.sum()))


#: At most this many attention groups per batch row (see the ``attention_group_blocks`` option).
MAX_ATTENTION_GROUPS = 4

def _max_across_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` of the process group (``value`` itself outside one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def _mask_origin(extra: Mapping[str, Any], token: int) -> str:
    """Why ``token`` fills the drafted positions, for the log line."""
    if extra.get("mask_token_id") == token:
        return "the tokenizer's mask token"
    size = extra.get("tokenizer_size")
    if isinstance(size, int) and token >= size:
        return "an embedding row the tokenizer never produces"
    return "the highest id that is no special token and not in the training data"


class DFlashStrategy:
    """DFlash (arXiv 2602.06036): a block drafted in one non-causal pass. Built as ``factory(options, context)``."""

    name = "dflash"
    #: How :meth:`speculate` drafts a block; a variant with its own drafting (Domino) swaps in its DraftFn.
    draft_fn: DraftFn = staticmethod(draft_block)
    #: The network :meth:`build_model` creates; a variant with extra heads (Domino) swaps in its subclass
    #: and describes the heads in :meth:`head_config` (or adds other arguments in :meth:`model_kwargs`).
    model_class: type[DFlashBackbone] = DFlashBackbone
    #: Write / read back the SGLang export (:meth:`export`, :meth:`load_export`); a variant swaps in its own.
    export_fn: Callable[..., Any] = staticmethod(export_dflash)
    load_fn: Callable[..., DFlashBackbone] = staticmethod(load_dflash)

    def __init__(self, options: DFlashOptions, context: BuildContext | None = None) -> None:
        self.options = options
        self.context = context

    # ------------------------------------------------------------------ plan and model
    def draft_config(self, target: TargetInfo) -> DFlashConfig:
        """The draft's dimensions, target layers and mask token for ``target`` under the options."""
        return DFlashConfig.from_target(target, self.options)

    def capture_plan(self, target: TargetInfo) -> CapturePlan:
        layer_ids = self.draft_config(target).target_layer_ids
        return CapturePlan(layer_ids=layer_ids, hidden_feature=HIDDEN_FEATURE, features={
            "input_ids": FeatureSpec((-1,), "int64"),
            "loss_mask": FeatureSpec((-1,), "int64"),
            HIDDEN_FEATURE: FeatureSpec((-1, len(layer_ids) * target.hidden_size), target.dtype),
        })

    def head_config(self, target: TargetInfo) -> Any:
        """The extra heads of a variant's :attr:`model_class`, passed to it as ``head=`` (None: DFlash has none)."""
        return None

    def model_kwargs(self, target: TargetInfo) -> dict[str, Any]:
        """Keyword arguments of :attr:`model_class` besides the config and the frozen parts (``head`` when
        :meth:`head_config` gives one)."""
        kwargs = {"attention": self.options.attention, "dtype": torch_dtype(self.options.dtype),
                  "init_std": self.options.init_std}
        head = self.head_config(target)
        return kwargs if head is None else {**kwargs, "head": head}

    def build_model(self, target: TargetInfo, frozen_parts: Mapping[str, Any], stats: DataStats) -> DFlashBackbone:
        """The draft for ``target``; its mask token is checked against the target's special tokens and the data."""
        config = self.draft_config(target)
        counts = getattr(stats, "token_counts", None)  # no stats: a rebuild, or a draft without data
        if self.options.mask_token_id is None:  # an explicit choice is the user's to make
            chosen = mask_token_for_data(config.mask_token_id, counts, target.extra)
            # Recorded in the options (and so in run.json): a rebuild without the data gets the same draft.
            self.options = attrs.evolve(self.options, mask_token_id=chosen)
            config = attrs.evolve(config, mask_token_id=chosen)
            if counts is not None and (self.context is None or self.context.rank == 0):
                print(f"{self.name}: mask token {chosen} ({_mask_origin(target.extra, chosen)}; set "
                          "strategy.mask_token_id to choose)", file=sys.stderr, flush=True)
        model = self.model_class(config, frozen_parts["embed_tokens"], frozen_parts["lm_head"],
                                 **self.model_kwargs(target))
        if self.options.compile:
            compile_layers(model.layers)
        return model

    # ------------------------------------------------------------------ training
    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]], sample_ids: Sequence[str]) -> TrainBatch:
        return collate_features(samples, sample_ids, strategy=self.name)

    def draw_blocks(self, model: DFlashBackbone, batch: TrainBatch, ctx: StepContext, *,
                    label_shift: int = 0) -> Blocks:
        """The batch's blocks; anchors seeded by (seed, global step — or :data:`EVAL_STEP` in eval —, sample id)."""
        return draw_blocks(batch["input_ids"], batch["loss_mask"], batch.sample_ids, seed=self.options.seed,
                           step=ctx.global_step if ctx.training else EVAL_STEP,
                           num_anchors=self.options.num_anchors, block_size=model.config.block_size,
                           mask_token_id=model.config.mask_token_id, gamma=self.options.loss_decay_gamma,
                           label_shift=label_shift)

    def block_hidden(self, model: DFlashBackbone, batch: TrainBatch, blocks: Blocks) -> torch.Tensor:
        """Final draft hidden states of every block position: ``[B, N, bs, H]``."""
        batch_size, num_blocks, bs = blocks.ids.shape
        seq_len, group = batch["input_ids"].shape[1], self.options.attention_group_blocks
        if group:
            group = max(group, -(-num_blocks // MAX_ATTENTION_GROUPS))  # bounded copies of the context's K/V
            pattern = grouped_block_attention(blocks.anchors, batch["lengths"], seq_len, bs, group)
        else:
            pattern = block_attention_mask(blocks.anchors, batch["lengths"], seq_len, bs)
        hidden = model(batch[HIDDEN_FEATURE], blocks.ids.flatten(1), blocks.positions.flatten(1), pattern)
        return hidden.view(batch_size, num_blocks, bs, -1)

    @property
    def loss_weighting(self) -> LossWeighting:
        """How positions are weighted and the loss normalised (the ``loss_type`` and ``dpace_alpha`` options)."""
        return LossWeighting.from_options(self.options)

    def forward_loss(self, model: DFlashBackbone, batch: TrainBatch, ctx: StepContext) -> StepOutput:
        """``L = Σw·CE / Σw`` (D-PACE: ``/ batch size``) over the batch's blocks, with ``loss``, ``acc``,
        ``accept_len`` and ``no_anchor_samples`` as ratio metrics."""
        blocks = self.draw_blocks(model, batch, ctx)
        hidden = self.block_hidden(model, batch, blocks)
        weighting = self.loss_weighting
        weights = weighting.position_weights(blocks.weights, blocks.label_mask)
        # a block's position 0 holds its anchor and is never supervised (weight 0, outside label_mask, and
        # D-PACE's products skip it): its logits are not computed, 1/bs of the head's GEMMs
        weighted_ce, drafted = frozen_head_cross_entropy(hidden[:, :, 1:], model.lm_head, blocks.labels[..., 1:],
                                                         weights[..., 1:], self.options.logit_chunk_size,
                                                         weighting=weighting)
        predictions = torch.cat([blocks.labels[..., :1], drafted], dim=-1)  # the anchor as its own "prediction"
        loss, weight = weighting.normalize(weighted_ce, weights, batch_size=blocks.anchors.shape[0])
        ratios = {"loss": (float(weighted_ce.detach()), weight),
                  **block_metrics(predictions, blocks.labels, blocks.label_mask, blocks.keep),
                  **no_anchor_samples(blocks.num_valid)}
        if not ctx.training:
            ratios.update(self.simulated_acceptance(model, batch))
        return StepOutput(loss=loss, ratio_metrics=ratios)

    def block_predictions(self, model: DFlashBackbone, batch: TrainBatch, blocks: Blocks) -> torch.Tensor:
        """The drafted token at every block position, ``[B, N, bs]`` (a variant with another head overrides it)."""
        hidden = self.block_hidden(model, batch, blocks)
        chunk = self.options.logit_chunk_size
        return torch.cat([argmax_last(model.logits(hidden[:, start:start + chunk]))
                          for start in range(0, hidden.shape[1], chunk)], dim=1)

    @torch.no_grad()
    def simulated_acceptance(self, model: DFlashBackbone, batch: TrainBatch, *, label_shift: int = 0,
                             drafted: int | None = None) -> dict[str, tuple[float, float]]:
        """``accept_len_sim`` and ``accept_rate_k``: greedy block decoding replayed over the batch's responses.

        A block is drafted at *every* valid anchor (in groups of ``eval_anchor_chunk``
        anchors per pass), its accepted prefix recorded at the anchor, and decoding walked
        over each response (:func:`specforge_core.acceptance.simulated_decode`). The
        ``accept_len`` metric averages blocks at randomly drawn anchors instead: positions a
        real decode jumps over weigh as much as those it visits. ``label_shift`` and ``drafted``
        are the blocks' as decoding drafts them (:func:`acceptance_lengths`): a round drafts
        ``drafted`` tokens, ``bs - 1`` unless given (DSpark drafts all ``bs`` slots).
        """
        from specforge_core.acceptance import simulated_decode

        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        bs = model.config.block_size
        valid = valid_anchor_mask(loss_mask)
        accepted = torch.zeros_like(input_ids)
        rows = [row.nonzero().flatten() for row in valid]
        group = self.options.eval_anchor_chunk
        # Under FSDP each draft pass is a collective: every rank runs as many, of the same width.
        longest = _max_across_ranks(max((len(r) for r in rows), default=0), input_ids.device)
        for start in range(0, longest, group):
            parts = [r[start:start + group] for r in rows]
            width = _max_across_ranks(max(1, max(len(p) for p in parts)), input_ids.device)  # same chunks everywhere
            anchors = torch.zeros(len(rows), width, dtype=torch.long, device=input_ids.device)
            keep = torch.zeros(len(rows), width, dtype=torch.bool, device=input_ids.device)
            for b, part in enumerate(parts):
                anchors[b, :len(part)] = part
                keep[b, :len(part)] = True
            blocks = build_blocks(input_ids, loss_mask, anchors, keep, keep.sum(1), block_size=bs,
                                  mask_token_id=model.config.mask_token_id, label_shift=label_shift)
            correct = (self.block_predictions(model, batch, blocks) == blocks.labels) & blocks.label_mask
            drafts = acceptance_lengths(correct, label_shift=label_shift, drafted=drafted) - 1  # [B, width]
            for b, part in enumerate(parts):
                accepted[b, part] = drafts[b, :len(part)]
        return simulated_decode(accepted, loss_mask.bool(), bs - 1 if drafted is None else drafted)

    def derived_metrics(self, pooled: Mapping[str, float]) -> dict[str, float]:
        """``tau_sim``: the former figure, ``accept_len - 1`` (bonus excluded, random anchors), kept one release;
        ``accept_len_sim`` is the one to read."""
        return {"tau_sim": pooled["accept_len"] - 1.0} if "accept_len" in pooled else {}

    # ------------------------------------------------------------------ serving
    def export(self, model: DFlashBackbone, out_dir: str, target: TargetInfo | None = None, *, fmt: str = "sglang",
               dtype: str = DEFAULT_EXPORT_DTYPE) -> str:
        """A ``DFlashDraftModel`` directory SGLang and vLLM serve (``fmt`` sglang or vllm: the same folder), or
        vLLM's speculators layout, written by :attr:`export_fn` (see :mod:`specforge_plugin_dflash.export`)."""
        return str(self.export_fn(model, out_dir, dtype=dtype, options=self.options, fmt=fmt, target=target))

    def load_export(self, path: str, target: TargetInfo | None, frozen_parts: Mapping[str, Any]) -> DFlashBackbone:
        """The draft back from an export (:attr:`load_fn`), over the target's frozen ``embed_tokens`` and ``lm_head``."""
        return self.load_fn(path, frozen_parts, attention=self.options.attention)

    def drafter(self) -> DraftFn:
        """The drafting step :meth:`speculate` runs: :attr:`draft_fn`, or one bound to decode-time options."""
        return self.draft_fn

    def speculate(self, model: DFlashBackbone, session: Any, prompt_ids: Any, *, max_new_tokens: int,
                  eos_token_id: int | Sequence[int] | None = None) -> SpeculationResult:
        """Greedy block speculative decoding against ``session``; token-identical to the target's greedy decode."""
        was_training = model.training
        model.eval()
        try:
            return speculative_decode(model, session, prompt_ids, feature=HIDDEN_FEATURE,
                                      max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, draft=self.drafter())
        finally:
            model.train(was_training)
