"""specforge-plugin-domino: the ``domino`` strategy (DFlash plus a GRU logit correction, arXiv 2605.29707).

This is the hook module the ``specforge`` entry point names, so it stays cheap: the options
(DFlash's, extended) and the spec live here; the model and the strategy are named lazily
and import torch only when a run builds them.

Everything Domino shares with DFlash is imported from ``specforge_plugin_dflash``'s public
API (the options class, the backbone, blocks, loss, export and speculative decode): this
package holds only what Domino adds. See README.md for the walk-through.
"""

from __future__ import annotations

import attrs

import specforge_plugin_dflash as dflash_plugin
from specforge_core import hookimpl
from specforge_core.options import non_negative, option, positive
from specforge_plugin_dflash import DFlashOptions

__version__ = "0.1.0"


@attrs.frozen
class DominoOptions(DFlashOptions):
    """Options of the ``domino`` strategy: every ``dflash`` option, plus the correction head and the λ schedule."""

    emb_dim: int = option(256, "Width e of the correction projection Linear(H+g -> e) -> SiLU -> Linear(e -> V).",
                          check=positive)
    gru_hidden_dim: int | None = option(
        None, "Hidden size g of the prefix GRU. null = min(1024, 4*H): the recipe's 1024 on every target with "
              "H >= 256, a proportionate width on toy targets (a 1024-wide GRU over a 32-wide model is all head).",
        check=positive)
    pure_draft_prefix_len: int = option(
        1, "Drafted block positions that keep the base logits (no correction) at the start of the block; the "
           "correction starts at suffix_start = pure_draft_prefix_len (shift_label true) or 1 + "
           "pure_draft_prefix_len (false). 1 is the recipe and what SGLang's Domino runtime requires.",
        check=non_negative)
    shift_label: bool = option(
        True, "true: block position k predicts token anchor+k+1 (the anchor's own position drafts too; GRU "
              "state after tokens anchor..anchor+k). false: DFlash's labels (anchor+k; GRU state after "
              "anchor..anchor+k-1). true is the published recipe.")
    lambda_start: float = option(
        1.0, "Weight of the base-head loss at step 0: L = (1-lambda)*final + lambda*base, "
             "lambda(step) = clamp(lambda_start * (1 - min(step / max(1, floor(T*r)), 1)), 0, 1).",
        check=non_negative)
    lambda_decay_ratio: float = option(
        0.5, "r: the fraction of the T planned optimizer steps over which lambda decays linearly to 0 "
             "(lambda is 0 when the run has no known horizon).", check=non_negative)


@hookimpl
def specforge_strategies():
    # DFlash's spec with Domino's name, factory, options and description: the same engine
    # requirements (the target's hidden states) and the same best checkpoint metric (accept_len,
    # here the corrected head's).
    dflash = next(spec for spec in dflash_plugin.specforge_strategies() if spec.name == "dflash")
    # Only SGLang with Domino support serves it (vLLM has no Domino runtime).
    return [attrs.evolve(dflash, name="domino", factory="specforge_plugin_domino.strategy:DominoStrategy",
                         options=DominoOptions, export_formats=("sglang",),
                         description="Domino: DFlash block drafting plus a GRU over the drafted prefix that "
                                     "corrects the logits.")]
