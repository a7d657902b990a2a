"""specforge-plugin-dflash: the ``dflash`` strategy (block-parallel drafting, arXiv 2602.06036).

This is the hook module the ``specforge`` entry point names, so it stays cheap: options and
the spec live here, the model and the strategy are named lazily and import torch only when
a run builds them.

Public building blocks for plugins that extend DFlash (Domino, ...), importable from this
package without loading torch until they are used:

* :class:`~specforge_plugin_dflash.model.DFlashBackbone` and
  :class:`~specforge_plugin_dflash.model.DFlashConfig` — the draft network;
* :mod:`specforge_plugin_dflash.blocks` — anchor sampling, block construction, the block
  attention mask;
* :mod:`specforge_plugin_dflash.loss` — chunked weighted cross-entropy and block metrics;
* :mod:`specforge_plugin_dflash.dpace` — D-PACE position weighting (``loss_type``);
* :mod:`specforge_plugin_dflash.export` — the SGLang checkpoint layout;
* :mod:`specforge_plugin_dflash.speculate` — the reference speculative decode.
"""

from __future__ import annotations

import attrs

from specforge_core import hookimpl
from specforge_core.errors import OptionError
from specforge_core.options import compilable, fraction, non_negative, option, positive
from specforge_core.specs import StrategySpec

#: ``loss_type`` values (see :mod:`specforge_plugin_dflash.dpace`); here, so listing the options imports no torch.
LOSS_TYPES = ("dflash", "dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only")

__version__ = "0.1.0"


def _at_least_two(value: int) -> str | None:
    return None if value >= 2 else "must be >= 2 (position 0 holds the anchor; at least one position is drafted)"


def _layer_ids(value: list[int] | None) -> str | None:
    if value is None:
        return None
    if not value:
        return "must name at least one target layer (or be null for the defaults)"
    if any(i < 0 for i in value):
        return "must hold layer ids >= 0 (layer id i = the output of decoder layer i)"
    if len(set(value)) != len(value):
        return "must not repeat a layer id"
    return None


@attrs.frozen
class DFlashOptions:
    """Options of the ``dflash`` strategy (``--set strategy.<name>=<value>``)."""

    num_layers: int | None = option(
        None, "Draft decoder layers. null = min(5, target layers): the recipes use 5, and a draft deeper "
              "than a small target is pointless.", check=positive)
    target_layer_ids: list[int] | None = option(
        None, "Target layers whose outputs are concatenated into the draft context (layer id i = output of "
              "decoder layer i = the hidden state entering layer i+1; at most L-2, since serving engines capture "
              "layer inputs only). null = evenly spaced: n == 1 -> [L//2], else round(1 + i*(L-4)/(n-1)); on "
              "targets too small for that formula (ids collide or leave [0, L-2]) the n ids are spread evenly "
              "over [0, L-2] instead.", check=_layer_ids)
    num_target_layers: int = option(
        5, "How many target layers feed the context (n), when target_layer_ids is null; capped at L-1, the "
           "number of layer ids a serving engine can capture. (SGLang's config field of the same name is the target's depth; the export writes "
           "that one.)", check=positive)
    block_size: int = option(16, "Tokens per drafted block: the anchor plus block_size-1 drafted tokens.",
                             check=_at_least_two)
    num_anchors: int = option(
        8, "Blocks sampled per training sample (uniformly among valid anchors; rows with fewer keep fewer). "
           "The recipes use 512 on multi-thousand-token samples; 8 suits short chats.", check=positive)
    loss_decay_gamma: float | None = option(
        None, "Weight exp(-(k-1)/gamma) on block position k (loss_type dflash only). null = no decay; the "
              "recipes use 7.", check=positive)
    loss_type: str = option(
        "dflash", "How block positions are weighted. dflash: the decay above, L = Σw·CE/Σw. dpace (D-PACE, arXiv "
                  "2605.18810): w = the expected accepted continuation from the position, from the draft's own "
                  "confidence exp(-CE) (detached), L = Σw·CE/batch size; the two ablations keep one factor of it: "
                  "dpace-cumulative-confidence-only, dpace-continuation-value-only.", choices=LOSS_TYPES)
    dpace_alpha: float = option(
        0.5, "D-PACE smoothing: a position's confidence is (1-alpha)·exp(-CE) + alpha (0: the raw probability, "
             "1: every position counts fully).", check=fraction)
    mask_token_id: int | None = option(
        None, "Token id filling the drafted positions of a block; never EOS, pad or another special token. "
              "null = the tokenizer's mask token; else the first embedding row the tokenizer never produces "
              "(what the published Qwen3 drafts use); else the highest id that is not a special token, refused "
              "if the training data supervises it.", check=non_negative)
    logit_chunk_size: int = option(
        16, "Blocks of a sample per chunk of logits in the loss, so the [blocks*block_size, vocab] logits never "
            "exist at once. The fused losses (DFlash, Domino, DSpark) compute a chunk a tile of whole blocks at a "
            "time, about 256K logits each, and keep gradients rather than logits; DSpark recomputes each chunk "
            "in backward when there are several (its confidence head stays with autograd).", check=positive)
    eval_anchor_chunk: int = option(
        32, "Evaluation drafts a block at every valid anchor to replay decoding (accept_len_sim); this many "
            "anchors per sample go through the draft at once.", check=positive)
    seed: int = option(0, "Seed of anchor sampling; anchors depend on (seed, global step, sample id) only, so "
                          "a resumed run draws the same anchors.")
    attention: str = option("sdpa", "Attention kernel (both take an explicit block mask).",
                            choices=("sdpa", "eager"))
    attention_group_blocks: int = option(
        4, "Training attends in groups of at least this many neighbouring blocks: each group sees only the "
           "context up to its last anchor and its own blocks, not the whole [blocks*block_size, S + "
           "blocks*block_size] pattern (same result, less work). Groups grow so that there are at most 4 "
           "(on CUDA each holds its own copy of the context's keys and values: more groups would cost more "
           "memory than the dense mask saves at the recipes' 512 anchors; on CPU groups read views of them and "
           "every block attends its own keys in one call). 0 = one dense mask over all blocks.",
        check=non_negative)
    compile: bool = option(
        False, "torch.compile each draft decoder layer (dynamic shapes; the attention over the block pattern "
               "stays eager). The first steps pay for compiling (on CPU about a minute, and it needs a C++ "
               "compiler); measured on CPU at the bench's tiny shapes: 0.97-1.20x the eager step's speed in float32 "
               "with 12-15% less memory, 0.93-1.00x in bfloat16 (docs/benchmarks.md). Checkpoints and exports "
               "are the same either way.", check=compilable)
    dtype: str = option("float32", "Dtype of the trainable draft weights (bfloat16 trains with fp32 master "
                                   "weights in the optimizer).", choices=("float32", "bfloat16"))
    init_std: float = option(0.02, "Standard deviation of the initial draft weights.", check=positive)

    def __attrs_post_init__(self) -> None:
        if self.loss_type != "dflash" and self.loss_decay_gamma is not None:
            raise OptionError(
                f"option 'strategy.loss_decay_gamma' ({self.loss_decay_gamma}) weights positions for "
                f"loss_type=dflash only, and loss_type={self.loss_type} computes its own weights: unset "
                "strategy.loss_decay_gamma or set strategy.loss_type=dflash")


DFLASH_SPEC = StrategySpec(
    name="dflash",
    factory="specforge_plugin_dflash.strategy:DFlashStrategy",
    options=DFlashOptions,
    description="DFlash: a block of tokens drafted in one non-causal pass over the target's hidden states.",
    requires={"aux_hidden_states"},
    export_formats=("sglang", "vllm", "speculators"),
    best_metric="accept_len_sim",
    best_mode="max",
    # SpecForge's DFlash recipes (e.g. Qwen2.5-0.5B and Qwen3-8B online: lr 6e-4, warmup_ratio 0.04).
    suggested_train={"lr": 6e-4, "warmup_ratio": 0.04},
)


def variant_spec(name: str, factory: str, options: type, description: str, *,
                 requires: frozenset[str] | set[str] = frozenset(),
                 export_formats: tuple[str, ...] | None = None) -> StrategySpec:
    """The spec of a strategy built on DFlash (Domino, DSpark): DFlash's engine requirements (plus
    ``requires``) and best checkpoint metric (``accept_len_sim``, the variant's own) and recipe train defaults, with its name,
    factory, options and description, and the serving formats it writes (default: DFlash's)."""
    return attrs.evolve(DFLASH_SPEC, name=name, factory=factory, options=options, description=description,
                        requires=DFLASH_SPEC.requires | set(requires),
                        export_formats=DFLASH_SPEC.export_formats if export_formats is None else export_formats)


@hookimpl
def specforge_strategies():
    return [DFLASH_SPEC]
