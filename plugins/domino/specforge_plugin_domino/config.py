"""What Domino adds to a DFlash draft's shape: the correction head and its label alignment.

Pure Python (no torch). :class:`DominoHeadConfig` is derived from the options and the
target, written into the export's ``dflash_config`` (next to DFlash's own fields) and read
back by ``load_export``. The two alignments (docs/algorithms.md, "Domino"), for a block of size
bs anchored at ``a``:

    ============================  ==============================  ==============================
                                  shift_label true                shift_label false (DFlash)
    ============================  ==============================  ==============================
    position k predicts           token a+k+1                     token a+k
    supervised positions          0..bs-1                         1..bs-1
    decay                         exp(-k/γ)                       exp(-(k-1)/γ)
    GRU state at position k       after tokens a..a+k             after tokens a..a+k-1
    GRU reads (label_shift s)     bs-1+s tokens: a..a+bs-2+s      (same formula)
    drafted positions (serving)   0..bs-2                         1..bs-1
    suffix_start (corrected k >=) pure_draft_prefix_len           1 + pure_draft_prefix_len
    ============================  ==============================  ==============================
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from specforge_plugin_dflash.config import DFlashConfigError

#: ``dflash_config.projector_type`` of a Domino export (what SGLang's DFlashDraftModel switches on).
PROJECTOR_TYPE = "domino"
#: The widest default GRU (the recipe's g) and the default's ratio to the target's hidden size.
MAX_DEFAULT_GRU_HIDDEN, GRU_HIDDEN_PER_H = 1024, 4


class DominoConfigError(DFlashConfigError):
    """The options or an exported config.json do not describe a valid Domino head."""


def default_gru_hidden_dim(hidden_size: int) -> int:
    """``min(1024, 4*H)``: the recipe's 1024 on any target with H >= 256, narrower on toy targets."""
    return min(MAX_DEFAULT_GRU_HIDDEN, GRU_HIDDEN_PER_H * hidden_size)


@attrs.frozen(kw_only=True)
class DominoHeadConfig:
    """The correction head (GRU width g, projection width e) and the label alignment it is trained with."""

    emb_dim: int
    gru_hidden_dim: int
    pure_draft_prefix_len: int = 1
    shift_label: bool = True

    @property
    def label_shift(self) -> int:
        """1 with ``shift_label`` (position k predicts ``anchor + k + 1``), else 0 (DFlash's labels)."""
        return int(self.shift_label)

    @property
    def suffix_start(self) -> int:
        """The first block position whose logits are corrected."""
        return self.pure_draft_prefix_len + 1 - self.label_shift

    def gru_steps(self, block_size: int) -> int:
        """How many block tokens the GRU reads: ``anchor .. anchor + bs - 2 + label_shift``."""
        return block_size - 1 + self.label_shift

    def check(self, block_size: int) -> DominoHeadConfig:
        """``self``, if at least one drafted position of a ``block_size`` block is corrected.

        Run once per head, by the constructors below (:meth:`from_options` for a new draft,
        :meth:`from_hf_config` for an export); the model trusts the head it is given.
        """
        if self.pure_draft_prefix_len > block_size - 2:
            raise DominoConfigError(
                f"option 'strategy.pure_draft_prefix_len' is {self.pure_draft_prefix_len}, but a block of "
                f"{block_size} drafts {block_size - 1} tokens, so at most {block_size - 2} of them can stay "
                "uncorrected; lower it or raise strategy.block_size")
        return self

    @classmethod
    def from_options(cls, options: Any, hidden_size: int) -> DominoHeadConfig:
        """The head for a target of ``hidden_size`` under :class:`~specforge_plugin_domino.DominoOptions`."""
        gru = options.gru_hidden_dim if options.gru_hidden_dim is not None else default_gru_hidden_dim(hidden_size)
        return cls(emb_dim=options.emb_dim, gru_hidden_dim=gru, pure_draft_prefix_len=options.pure_draft_prefix_len,
                   shift_label=options.shift_label).check(options.block_size)

    def to_dflash_config(self) -> dict[str, Any]:
        """The fields merged into the export's ``dflash_config`` (the names SGLang and the reference trainer use)."""
        return {"projector_type": PROJECTOR_TYPE, "emb_dim": self.emb_dim, "gru_hidden_dim": self.gru_hidden_dim,
                "pure_draft_prefix_len": self.pure_draft_prefix_len, "shift_label": self.shift_label}

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> DominoHeadConfig:
        """Read back what :meth:`to_dflash_config` wrote into ``config["dflash_config"]``."""
        fields = config.get("dflash_config") or {}
        if fields.get("projector_type") != PROJECTOR_TYPE:
            raise DominoConfigError(f"config.json has dflash_config.projector_type {fields.get('projector_type')!r}, "
                                    f"not {PROJECTOR_TYPE!r}: it is not a Domino draft")
        try:
            head = cls(emb_dim=int(fields["emb_dim"]), gru_hidden_dim=int(fields["gru_hidden_dim"]),
                       pure_draft_prefix_len=int(fields["pure_draft_prefix_len"]), shift_label=fields["shift_label"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DominoConfigError(f"config.json's dflash_config lacks a Domino field: {type(exc).__name__}: "
                                    f"{exc}") from None
        if not isinstance(head.shift_label, bool):
            raise DominoConfigError(f"config.json's dflash_config.shift_label is {head.shift_label!r}, not true/false")
        return head.check(int(fields.get("block_size", config.get("block_size", 16))))
