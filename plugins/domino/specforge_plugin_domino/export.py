"""The SGLang checkpoint of a Domino draft: DFlash's, plus the head's keys and config fields.

SGLang serves Domino as a DFlash draft whose ``dflash_config.projector_type`` is
``"domino"`` (``python/sglang/srt/models/dflash.py``, ``speculative/dflash_utils.py``,
``speculative/domino_utils.py``), so the directory is DFlash's layout with four more tensors::

    layers.*  fc.weight  hidden_norm.weight  norm.weight        DFlash's keys, unchanged
    prefix_gru.weight_ih_l0   [3g, H]                           GRU gates r, z, n (no biases)
    prefix_gru.weight_hh_l0   [3g, g]
    embed_proj.0.weight       [e, H+g]                          Linear(H+g -> e); embed_proj.1 is the SiLU
    embed_proj.2.weight       [V, e]                            Linear(e -> V)

and ``config.json`` is DFlash's with ``dflash_config`` extended by ``projector_type: "domino"``,
``emb_dim``, ``gru_hidden_dim``, ``pure_draft_prefix_len`` and ``shift_label`` (``emb_dim`` is
repeated at the top level, as the reference checkpoints do; SGLang accepts either place and
checks they agree), and ``specforge_strategy: "domino"``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from specforge_core.export import CONFIG_FILE, ExportConfig, check_format

from specforge_plugin_dflash.config import DFlashConfig
from specforge_plugin_dflash.export import DFlashExportError, dflash_hf_config, load_backbone, write_export

from .config import PROJECTOR_TYPE, DominoConfigError, DominoHeadConfig
from .model import DominoBackbone

STRATEGY = "domino"


class DominoExportError(DFlashExportError, DominoConfigError):
    """A Domino export directory is missing, not a Domino draft, or does not fit the draft or target.

    A :class:`DFlashExportError` (the layout is DFlash's) and a :class:`DominoConfigError`
    (the head's fields are Domino's), so callers catching either keep working.
    """


def domino_hf_config(model: DominoBackbone, *, dtype: str | None = None, options: Any = None) -> dict[str, Any]:
    """``config.json`` of ``model``: DFlash's, with the head's fields merged into ``dflash_config``."""
    head = model.head_config
    return dflash_hf_config(model, STRATEGY, {"dflash_config": head.to_dflash_config(), "emb_dim": head.emb_dim},
                            dtype=dtype, options=options)


#: What SGLang's Domino runtime serves: bf16 weights (it refuses others at start-up) and a pure prefix of 1.
SERVED_DTYPE, SERVED_PURE_PREFIX = "bfloat16", 1


def export_domino(model: DominoBackbone, out_dir: str | os.PathLike[str], *, dtype: str | None = SERVED_DTYPE,
                  options: Any = None, fmt: str = "sglang", target: Any = None) -> Path:
    """The ``domino`` export of ``model`` (every trainable tensor: the backbone's and the head's).

    Refused, before anything is written, for what SGLang's Domino runtime cannot serve: weights
    other than bf16 (it checks the projector's and the target's dtype), and a head trained with
    ``pure_draft_prefix_len`` other than 1. SGLang is the only engine with Domino support.
    """
    check_format(fmt, ("sglang",), STRATEGY, error=DominoExportError)
    if dtype != SERVED_DTYPE:
        raise DominoExportError(f"SGLang's Domino runtime requires {SERVED_DTYPE} projector weights (and a "
                                f"{SERVED_DTYPE} target); export with --dtype {SERVED_DTYPE}, not {dtype}")
    prefix = model.head_config.pure_draft_prefix_len
    if prefix != SERVED_PURE_PREFIX:
        raise DominoExportError(f"SGLang's Domino runtime serves pure_draft_prefix_len {SERVED_PURE_PREFIX} only; this "
                                f"draft was trained with {prefix}, so it cannot be served; train with "
                                f"strategy.pure_draft_prefix_len={SERVED_PURE_PREFIX} for a draft SGLang serves")
    return write_export(model, out_dir, domino_hf_config(model, dtype=dtype, options=options),
                        error=DominoExportError)


def head_from_hf(raw: Mapping[str, Any], source: Path) -> DominoHeadConfig:
    """The head's shape and alignment from an export's config.json, with errors naming the file and field."""
    fields = ExportConfig(raw, source, "a Domino draft", DominoExportError).section("dflash_config")
    if fields.get("projector_type") != PROJECTOR_TYPE:
        raise fields.fail(f"has 'dflash_config.projector_type' = {fields.get('projector_type')!r}, not "
                          f"{PROJECTOR_TYPE!r}: it is not a Domino draft")
    for name in ("emb_dim", "gru_hidden_dim", "pure_draft_prefix_len"):
        fields.value(name, int)
    fields.value("shift_label", bool)
    try:
        return DominoHeadConfig.from_hf_config(raw)
    except DominoConfigError as exc:  # the head does not fit the block (pure prefix too long, ...)
        raise DominoExportError(f"{source} does not describe a valid Domino draft: {exc}") from None


def load_domino(path: str | os.PathLike[str], frozen_parts: Mapping[str, torch.Tensor], *,
                attention: str = "sdpa") -> DominoBackbone:
    """A ``domino`` export back as a :class:`DominoBackbone` over the target's frozen embedding and lm_head.

    The head's shape and alignment come from the export's config.json, not from options.
    """
    def build(config: DFlashConfig, raw: Mapping[str, Any], dtype: torch.dtype) -> DominoBackbone:
        return DominoBackbone(config, frozen_parts["embed_tokens"], frozen_parts["lm_head"],
                              head=head_from_hf(raw, Path(path) / CONFIG_FILE), attention=attention, dtype=dtype)

    return load_backbone(path, STRATEGY, frozen_parts, build, error=DominoExportError)
