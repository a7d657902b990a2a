"""Options of the ``eagle3`` strategy and the choice of target layers it fuses.

Pure Python (no torch): the hook module imports it, and ``specforge plugins`` imports the
hook module.
"""

from __future__ import annotations

from typing import Any

import attrs

from specforge_core.errors import OptionError
from specforge_core.serving import check_servable_layer_ids
from specforge_core.options import compilable, option, positive

#: EAGLE3 fuses exactly three target layers (low, middle, high); SGLang's draft ``fc``
#: is ``Linear(3 * target_hidden_size, hidden_size)``.
NUM_AUX_LAYERS = 3


def _check_aux_layer_ids(value: Any) -> str | None:
    if value is None:
        return None
    ids = list(value)
    if len(ids) != NUM_AUX_LAYERS:
        return f"must list exactly {NUM_AUX_LAYERS} layer ids (low, middle, high)"
    if any(i < 0 for i in ids):
        return "must be non-negative layer ids (layer id i is the output of decoder layer i)"
    if len(set(ids)) != len(ids):
        return "must be distinct layer ids"
    return None


def _check_decay(value: float) -> str | None:
    return None if 0.0 < value <= 1.0 else "must be in (0, 1]"


@attrs.frozen
class Eagle3Options:
    """Options of the ``eagle3`` strategy (``--set strategy.<name>=<value>``)."""

    ttt_length: int = option(7, "Test-time-training unroll steps K: the draft is trained to predict K tokens "
                                "ahead, each step feeding its own hidden state to the next.", check=positive)
    draft_vocab_size: int | None = option(
        None, "Draft vocabulary size Vd: the Vd most frequent supervised tokens of the training data; equal to "
              "the target vocab means no mapping. None = sized from the data: the fewest tokens that cover "
              "draft_vocab_coverage of the supervised tokens, rounded up to a multiple of 64, at most 32000 "
              "(the draft's lm_head is a large share of a CPU step: 32000 cost 3.6x the step time of 8192 on "
              "SmolLM2-135M).", check=positive)
    draft_vocab_coverage: float = option(
        0.99, "With draft_vocab_size None: the share of the training data's supervised tokens the draft "
              "vocabulary must cover.", check=lambda v: None if 0.0 < v <= 1.0 else "must be in (0, 1]")
    aux_layer_ids: tuple[int, ...] | None = option(
        None, "The three target layers fused by fc (layer id i = output of decoder layer i = the hidden state "
              "entering layer i+1, the serving engines' convention; at most L-2, since SGLang and vLLM capture "
              "layer inputs only). None = [1, L//2-1, L-4] for targets with L >= 8 layers, [0, L//2-1, L-2] for "
              "4 <= L < 8.",
        check=_check_aux_layer_ids)
    loss_decay: float = option(0.8, "Geometric weight of the unroll steps: the loss is sum_k loss_decay^k * S_k / N_0, "
                                    "S_k step k's summed soft cross-entropy, N_0 the tokens step 0 supervises.",
                               check=_check_decay)
    intermediate_size: int | None = option(None, "Width of the draft's SwiGLU MLP. None = the target's.",
                                           check=positive)
    spec_depth: int | None = option(None, "Draft tokens proposed per verification round when measuring real "
                                          "acceptance (speculate); eval's accept_len_sim replays rounds as deep, "
                                          "up to ttt_length (the steps the unroll has). None = ttt_length.",
                                    check=positive)
    loss_positions: str = option(
        "decode", "Which positions train. decode: those speculative decoding drafts from (after each response "
                  "token but the last, the first round after the prompt included), each unroll step only where "
                  "a round reaches that deep (none starts on a prompt token). reference: docs/algorithms.md's and "
                  "SpecForge's unshifted loss mask, which skips the first round of every reply and trains two "
                  "positions past its end.", choices=("decode", "reference"))
    trim_unroll: bool = option(
        True, "Training runs unroll steps 1..K-1 only over the positions the loss reads: in each sample from "
              "K-1 before its first supervised position to its last (a prompt and trailing padding cost step 0 "
              "only). Loss and gradients are the same either way; false computes every position, as the "
              "algorithm is written (bench/eagle3_windows.py measures the difference).")
    compile: bool = option(
        False, "torch.compile the draft's decoder layer (dynamic shapes; the attention over the growing "
               "unroll cache stays eager). The first steps pay for compiling (on CPU about a minute, and it "
               "needs a C++ compiler); docs/benchmarks.md measures what it changes. Checkpoints and "
               "exports are the same either way.", check=compilable)
    dtype: str = option("float32", "dtype of the trainable draft weights (the export's is train.export_dtype). "
                                   "The frozen target embedding and lm_head keep the target's dtype.",
                        choices=("float32", "bfloat16"))


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The docs/algorithms.md default ``[1, L//2-1, L-4]``; small targets get ``[0, L//2-1, L-2]``.

    Below 8 layers the default ids collide (L=6 gives [1, 2, 2]) or leave the range, so
    small targets take the first layer, the middle one and the last one a serving engine can
    capture (``L-2``: see :mod:`specforge_core.serving`), which are
    distinct for any L >= 4.
    """
    if num_layers < NUM_AUX_LAYERS + 1:
        raise OptionError(
            f"EAGLE3 fuses {NUM_AUX_LAYERS} distinct target layers among the ids a serving engine can capture "
            f"(0..L-2), but the target has only {num_layers} decoder layer(s); use a target with at least "
            f"{NUM_AUX_LAYERS + 1} layers"
        )
    if num_layers < 8:
        return (0, num_layers // 2 - 1, num_layers - 2)
    return (1, num_layers // 2 - 1, num_layers - 4)


def resolve_aux_layer_ids(options: Eagle3Options, num_layers: int) -> tuple[int, ...]:
    """The layer ids to capture for a target with ``num_layers`` layers, validated."""
    if options.aux_layer_ids is None:
        return default_aux_layer_ids(num_layers)
    ids = tuple(int(i) for i in options.aux_layer_ids)
    problem = _check_aux_layer_ids(ids)
    if problem:
        raise OptionError(f"option 'strategy.aux_layer_ids' {problem}; got {list(ids)}")
    check_servable_layer_ids(ids, num_layers, "strategy.aux_layer_ids")
    return ids


#: The largest draft vocabulary sized from the data (the published recipes' size).
MAX_DATA_SIZED_VOCAB = 32000


def data_sized_vocab(token_counts: Any, coverage: float, vocab_size: int) -> int:
    """The fewest most-frequent tokens covering ``coverage`` of the supervised tokens counted in
    ``token_counts [V]``, rounded up to a multiple of 64, capped at 32000 and at ``vocab_size``."""
    import torch

    counts = torch.as_tensor(token_counts).flatten().long()
    total = int(counts.sum())
    if total == 0:
        return min(vocab_size, MAX_DATA_SIZED_VOCAB)
    covered = torch.sort(counts, descending=True).values.cumsum(0)
    needed = int(torch.searchsorted(covered, torch.tensor(coverage * total - 1e-9)).item()) + 1
    return min(vocab_size, MAX_DATA_SIZED_VOCAB, -(-needed // 64) * 64)


def resolve_draft_vocab_size(options: Eagle3Options, vocab_size: int) -> int:
    """Vd for a target vocabulary of ``vocab_size``: the option, or (before the data is seen) min(V, 32000)."""
    if options.draft_vocab_size is None:
        return min(vocab_size, 32000)
    if options.draft_vocab_size > vocab_size:
        raise OptionError(
            f"option 'strategy.draft_vocab_size' is {options.draft_vocab_size}, larger than the target "
            f"vocabulary ({vocab_size}); use at most {vocab_size} (equal means no mapping)"
        )
    return int(options.draft_vocab_size)
