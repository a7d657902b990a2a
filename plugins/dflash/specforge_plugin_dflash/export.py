"""The SGLang checkpoint of a DFlash draft (``--speculative-algorithm DFLASH``).

A directory with ``model.safetensors`` and ``config.json``, the layout of SGLang's
``DFlashDraftModel`` (python/sglang/srt/models/dflash.py)::

    layers.{i}.self_attn.{q,k,v,o}_proj.weight     layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.mlp.{gate,up,down}_proj.weight      layers.{i}.{input,post_attention}_layernorm.weight
    fc.weight    hidden_norm.weight    norm.weight

No embedding and no lm_head: SGLang uses the target's. The weights are exactly the draft's
trainable parameters (the frozen target parts are left out), so a model whose parameter
names follow :class:`~specforge_plugin_dflash.model.DFlashBackbone` (a Domino subclass
with its extra heads included) exports and reloads through these functions unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch

from specforge_core.dtypes import dtype_name, torch_dtype
from specforge_core.errors import RecordError
from specforge_core.export import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportConfig,
    ExportError,
    export_state,
    load_checked_state,
    load_weights,
    open_export,
    write_export_files,
)

from .config import DFlashConfig, DFlashConfigError
from .model import DFlashBackbone

ARCHITECTURE = "DFlashDraftModel"

#: the top-level integer fields :meth:`DFlashConfig.from_hf_config` cannot do without
REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

Draft = TypeVar("Draft", bound=DFlashBackbone)


class DFlashExportError(ExportError, DFlashConfigError):
    """An export directory is missing, was written for another strategy, or does not match the draft or target."""


def dflash_hf_config(model: DFlashBackbone, strategy: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of ``model``: the DFlash fields, dtype, ``specforge_strategy``, then ``extra``.

    ``extra["dflash_config"]`` is merged into the DFlash one (Domino adds its projector
    fields there); other keys of ``extra`` are set at the top level.
    """
    config = model.config.to_hf_config()
    config["dtype"] = dtype_name(model.dtype)
    config["specforge_strategy"] = strategy
    extra = dict(extra or {})
    config["dflash_config"].update(extra.pop("dflash_config", {}))
    config.update(extra)
    return config


def write_export(model: torch.nn.Module, out_dir: str | os.PathLike[str], config: Mapping[str, Any], *,
                 error: type[ExportError] = DFlashExportError) -> Path:
    """Write ``model``'s trainable tensors (the frozen target parts left out) and ``config`` into ``out_dir``.

    A failure leaves an export already in ``out_dir`` as it was (see
    :func:`specforge_core.export.write_export_files`).
    """
    return write_export_files(out_dir, export_state(model), config, error=error)


def read_export(path: str | os.PathLike[str], strategy: str, *, error: type[ExportError] = DFlashExportError,
                architecture: str = ARCHITECTURE) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, tensors)`` of an export directory written for ``strategy``.

    Checks what every DFlash-layout export needs (``specforge_strategy``, the architecture,
    the fields :meth:`DFlashConfig.from_hf_config` reads) before the weights are loaded, so
    a foreign or damaged config.json fails with the file and field named.
    """
    config = open_export(path, what=f"a {strategy} draft", error=error)
    config.expect_identity(architecture, strategy)
    check_fields(config)
    return dict(config.data), load_weights(path, error=error)


def check_fields(config: ExportConfig) -> None:
    """Refuse a DFlash-layout config.json lacking a field the draft is built from, or holding it in a wrong form.

    :meth:`DFlashConfig.from_hf_config` reads the same fields; checking them here first
    gives an error naming the file, the field and its expected form instead of a KeyError.
    """
    for name in REQUIRED_INTS:
        config.value(name, int)
    section = config.section("dflash_config")
    section.value("mask_token_id", int)
    top_level_ids = config.ints("target_layer_ids", None)  # older loaders' place, read when dflash_config lacks it
    if top_level_ids is None:
        section.ints("target_layer_ids")
    else:
        section.ints("target_layer_ids", top_level_ids)
    config.value("dtype", str, "float32")


def load_state(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], source: str, *,
               error: type[ExportError] = DFlashExportError) -> torch.nn.Module:
    """Load an export's tensors into ``model``, which must expect exactly these keys, shapes and dtypes."""
    return load_checked_state(model, tensors, source, error=error)


def load_backbone(path: str | os.PathLike[str], strategy: str, frozen_parts: Mapping[str, torch.Tensor],
                  build: Callable[[DFlashConfig, Mapping[str, Any], torch.dtype], Draft], *,
                  error: type[ExportError] = DFlashExportError, architecture: str = ARCHITECTURE) -> Draft:
    """A DFlash-layout export of ``strategy`` back as the model ``build(config, raw config.json, dtype)`` makes.

    The export is checked against the target's frozen embedding and lm_head before the
    model is built, so an export of another target fails naming both shapes. Subclass
    plugins (Domino, DSpark) pass their own ``build`` and ``error``, and the ``architecture``
    their config.json names when it is not ``DFlashDraftModel``.
    """
    raw, tensors = read_export(path, strategy, error=error, architecture=architecture)
    source = Path(path) / CONFIG_FILE
    try:
        config = DFlashConfig.from_hf_config(raw)
        dtype = torch_dtype(raw.get("dtype", "float32"))
    except (DFlashConfigError, RecordError) as exc:
        raise error(f"{source} does not describe a valid {strategy} draft: {exc}") from None
    check_target(config, frozen_parts, source, error=error)
    return load_state(build(config, raw, dtype), tensors, str(Path(path) / WEIGHTS_FILE), error=error)


def check_target(config: DFlashConfig, frozen_parts: Mapping[str, torch.Tensor], source: Path, *,
                 error: type[ExportError] = DFlashExportError) -> None:
    """Refuse a target whose embedding or lm_head is not ``[vocab_size, hidden_size]`` of the exported draft."""
    want = (config.vocab_size, config.hidden_size)
    for name in ("embed_tokens", "lm_head"):
        got = tuple(frozen_parts[name].shape)
        if got != want:
            raise error(f"{source} describes a draft for a target with vocabulary {want[0]} and hidden size "
                        f"{want[1]}, but this target's {name} is {list(got)} (vocabulary {got[0]}, hidden size "
                        f"{got[-1]}); load the export against the target it was trained for")


def export_dflash(model: DFlashBackbone, out_dir: str | os.PathLike[str]) -> Path:
    """The ``dflash`` export of ``model``."""
    return write_export(model, out_dir, dflash_hf_config(model, "dflash"))


def load_dflash(path: str | os.PathLike[str], frozen_parts: Mapping[str, torch.Tensor], *,
                attention: str = "sdpa") -> DFlashBackbone:
    """A ``dflash`` export back as a :class:`DFlashBackbone` over the target's frozen embedding and lm_head."""
    return load_backbone(path, "dflash", frozen_parts, lambda config, _raw, dtype: DFlashBackbone(
        config, frozen_parts["embed_tokens"], frozen_parts["lm_head"], attention=attention, dtype=dtype))
