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

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from specforge_core.dtypes import dtype_name, torch_dtype
from specforge_core.fileio import atomic_write, atomic_write_text

from .config import DFlashConfig, DFlashConfigError
from .model import DFlashBackbone

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class DFlashExportError(DFlashConfigError):
    """An export directory is missing, was written for another strategy, or does not match the draft."""


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an export holds: every parameter except frozen ones (the target's), plus persistent buffers."""
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    state = {}
    for name, tensor in model.state_dict().items():
        if name in frozen:
            continue
        if hasattr(tensor, "full_tensor"):  # an FSDP2 shard: gather (collective on every rank)
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().cpu().contiguous()
    return state


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


def write_export(model: torch.nn.Module, out_dir: str | os.PathLike[str], config: Mapping[str, Any]) -> Path:
    """Write ``model``'s trainable tensors and ``config`` into ``out_dir`` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = trainable_state(model)
    # Weights first, config last, each renamed into place: a crash never leaves a directory
    # that looks like a complete export.
    atomic_write(out / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_text(out / CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def read_export(path: str | os.PathLike[str], strategy: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, tensors)`` of an export directory written for ``strategy``."""
    root = Path(path)
    if not (root / CONFIG).is_file() or not (root / WEIGHTS).is_file():
        raise DFlashExportError(f"{root} is not a {strategy} export: it needs {CONFIG} and {WEIGHTS}")
    config = json.loads((root / CONFIG).read_text(encoding="utf-8"))
    written_for = config.get("specforge_strategy")
    if written_for != strategy or "DFlashDraftModel" not in config.get("architectures", []):
        raise DFlashExportError(f"{root} holds a {written_for or 'non-specforge'} export "
                                f"(architectures {config.get('architectures')}), not a {strategy} draft")
    return config, load_file(str(root / WEIGHTS))


def load_state(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], source: str) -> torch.nn.Module:
    """Load an export's tensors into ``model``, which must expect exactly these keys, shapes and dtypes."""
    expected = trainable_state(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise DFlashExportError(f"{source} does not match the draft: missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]}")
    for key, want in expected.items():
        got = tensors[key]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise DFlashExportError(f"{source}: {key} is {got.dtype} {tuple(got.shape)}, the draft expects "
                                    f"{want.dtype} {tuple(want.shape)}")
    model.load_state_dict(dict(tensors), strict=False)
    return model


def export_dflash(model: DFlashBackbone, out_dir: str | os.PathLike[str]) -> Path:
    """The ``dflash`` export of ``model``."""
    return write_export(model, out_dir, dflash_hf_config(model, "dflash"))


def load_dflash(path: str | os.PathLike[str], frozen_parts: Mapping[str, torch.Tensor], *,
                attention: str = "sdpa") -> DFlashBackbone:
    """A ``dflash`` export back as a :class:`DFlashBackbone` over the target's frozen embedding and lm_head."""
    config, tensors = read_export(path, "dflash")
    dtype = torch_dtype(config.get("dtype", "float32"))
    model = DFlashBackbone(DFlashConfig.from_hf_config(config), frozen_parts["embed_tokens"], frozen_parts["lm_head"],
                           attention=attention, dtype=dtype)
    return load_state(model, tensors, str(path))
