"""specforge-plugin-dspark: the ``dspark`` strategy (DFlash plus a Markov head and a confidence head, arXiv 2607.05147).

This is the hook module the ``specforge`` entry point names, so it stays cheap: the options
(DFlash's, extended) and the spec live here; the model and the strategy are named lazily and
import torch only when a run builds them.

Everything DSpark shares with DFlash (the backbone, anchors and blocks, the chunked loss loop,
D-PACE weighting, the export layout and checks, the lossless verify loop) is imported from
``specforge_plugin_dflash``'s public API: this package holds only what DSpark adds. See
README.md for the walk-through.
"""

from __future__ import annotations

import attrs

from specforge_core import hookimpl
from specforge_core.options import fraction, non_negative, option, positive
from specforge_plugin_dflash import DFlashOptions, variant_spec

__version__ = "0.1.0"

#: Markov head variants this plugin trains (SGLang also serves ``gated`` and ``rnn``).
MARKOV_HEAD_TYPES = ("vanilla",)


@attrs.frozen
class DSparkOptions(DFlashOptions):
    """Options of the ``dspark`` strategy: every ``dflash`` option, plus the two heads, the loss mix and decoding."""

    block_size: int = option(
        7, "Block slots: the anchor's slot and MASK slots; slot k drafts the token anchor+k+1, so a block drafts "
           "block_size tokens (SGLang's gamma). The recipes use 7.", check=positive)
    markov_rank: int = option(256, "Rank r of the Markov head Embedding(V, r) -> Linear(r, V) over the previous "
                                   "token (the recipes use 256).", check=positive)
    markov_head_type: str = option("vanilla", "Markov head variant (vanilla: the bias depends on the previous "
                                              "token only).", choices=MARKOV_HEAD_TYPES)
    confidence_with_markov: bool = option(
        True, "The confidence head reads [draft hidden ; Markov embedding of the previous token] (SGLang's default, "
              "confidence_head_with_markov); false: the draft hidden state only, Linear(H -> 1).")
    ce_loss_alpha: float = option(0.1, "Weight of the cross-entropy against the data's next token.",
                                  check=non_negative)
    l1_loss_alpha: float = option(0.9, "Weight of the L1 distance to the target's distribution "
                                       "(from the captured last_hidden).", check=non_negative)
    confidence_loss_alpha: float = option(1.0, "Weight of the confidence head's BCE against "
                                               "clamp(1 - L1/2, 0, 1).", check=non_negative)
    confidence_threshold: float = option(
        0.0, "Decoding: cut a drafted block before the first slot whose confidence (sigmoid of the confidence "
             "head) is below this, so fewer unlikely tokens are verified. 0 never cuts.", check=fraction)


@hookimpl
def specforge_strategies():
    # The target's last hidden state too: the teacher distribution of the L1 term. SGLang and vLLM
    # serve it from one folder; vLLM's speculators layout uses another slot convention.
    return [variant_spec("dspark", "specforge_plugin_dspark.strategy:DSparkStrategy", DSparkOptions,
                         "DSpark: DFlash block drafting with a Markov head over the previous token and a confidence "
                         "head that can cut a block at decode time.", requires={"last_hidden"},
                         export_formats=("sglang", "vllm"))]
