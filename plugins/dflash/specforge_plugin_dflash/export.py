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

import attrs
import torch

from specforge_core.dtypes import dtype_name, torch_dtype
from specforge_core.errors import RecordError
from specforge_core.export import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportConfig,
    ExportError,
    SPECULATORS_TYPE,
    check_format,
    export_state,
    load_checked_state,
    load_weights,
    open_export,
    speculators_config,
    speculators_type,
    strategy_fields,
    write_export_files,
)
from specforge_core.protocols import TargetInfo
from specforge_core.serving import check_servable_layer_ids, engine_layer_ids

from .config import DFlashConfig, DFlashConfigError
from .model import DFlashBackbone

ARCHITECTURE = "DFlashDraftModel"

#: the top-level integer fields :meth:`DFlashConfig.from_hf_config` cannot do without
REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

Draft = TypeVar("Draft", bound=DFlashBackbone)


class DFlashExportError(ExportError, DFlashConfigError):
    """An export directory is missing, was written for another strategy, or does not match the draft or target."""


def dflash_hf_config(model: DFlashBackbone, strategy: str, extra: Mapping[str, Any] | None = None, *,
                     dtype: str | None = None, options: Any = None) -> dict[str, Any]:
    """``config.json`` of ``model``: the DFlash fields, the fields vLLM needs, the export ``dtype`` (None:
    the draft's own) as ``torch_dtype`` and ``dtype``, the strategy and its ``options``, then ``extra``.

    ``extra["dflash_config"]`` is merged into the DFlash one (Domino adds its projector
    fields there); other keys of ``extra`` are set at the top level.
    """
    if model.config.num_target_layers:  # a draft built for a target (loaded foreign configs may not say)
        check_servable_layer_ids(model.config.target_layer_ids, model.config.num_target_layers,
                                 "the draft's target_layer_ids", error=DFlashExportError)
    config = model.config.to_hf_config()
    config["torch_dtype"] = config["dtype"] = dtype or dtype_name(model.dtype)
    # vLLM's runner reads the captured layers here, in its numbering (our id + 1); without the
    # field some versions take dflash_config's ids as they are and capture one layer too early.
    config["eagle_aux_hidden_state_layer_ids"] = engine_layer_ids(model.config.target_layer_ids)
    config["norm_before_residual"] = False
    config.update(strategy_fields(strategy, options))
    extra = dict(extra or {})
    config["dflash_config"].update(extra.pop("dflash_config", {}))
    config.update(extra)
    return config


def write_export(model: torch.nn.Module, out_dir: str | os.PathLike[str], config: Mapping[str, Any], *,
                 error: type[ExportError] = DFlashExportError) -> Path:
    """Write ``model``'s trainable tensors (the frozen target parts left out), in the dtype ``config`` names,
    and ``config`` into ``out_dir``.

    A failure leaves an export already in ``out_dir`` as it was (see
    :func:`specforge_core.export.write_export_files`).
    """
    return write_export_files(out_dir, export_state(model, config.get("torch_dtype")), config, error=error)


def read_export(path: str | os.PathLike[str], strategy: str, *,
                error: type[ExportError] = DFlashExportError) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, tensors)`` of an export directory written for ``strategy``, in either layout (a
    speculators-layout config.json is read as its native equivalent, see :func:`from_speculators`).

    Checks what every DFlash-layout export needs (``specforge_strategy``, the architecture,
    the fields :meth:`DFlashConfig.from_hf_config` reads) before the weights are loaded, so
    a foreign or damaged config.json fails with the file and field named.
    """
    config = open_export(path, what=f"a {strategy} draft", error=error)
    if speculators_type(config.data) is not None:
        config = from_speculators(config)
    config.expect_identity(ARCHITECTURE, strategy)
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
    config.value("torch_dtype", str, config.value("dtype", str, "float32"))


def load_state(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], source: str, *,
               error: type[ExportError] = DFlashExportError) -> torch.nn.Module:
    """Load an export's tensors into ``model``, which must expect exactly these keys, shapes and dtypes."""
    return load_checked_state(model, tensors, source, error=error)


def load_backbone(path: str | os.PathLike[str], strategy: str, frozen_parts: Mapping[str, torch.Tensor],
                  build: Callable[[DFlashConfig, Mapping[str, Any], torch.dtype], Draft], *,
                  error: type[ExportError] = DFlashExportError) -> Draft:
    """A DFlash-layout export of ``strategy`` back as the model ``build(config, raw config.json, dtype)`` makes.

    The export is checked against the target's frozen embedding and lm_head before the
    model is built, so an export of another target fails naming both shapes. Subclass
    plugins (Domino) pass their own ``build`` and ``error``.
    """
    raw, tensors = read_export(path, strategy, error=error)
    source = Path(path) / CONFIG_FILE
    try:
        config = DFlashConfig.from_hf_config(raw)
        dtype = torch_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32")
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


def export_dflash(model: DFlashBackbone, out_dir: str | os.PathLike[str], *, dtype: str | None = None,
                  options: Any = None, fmt: str = "sglang", target: TargetInfo | None = None) -> Path:
    """The ``dflash`` export of ``model`` in format ``fmt`` (sglang and vllm: one folder; or speculators),
    weights in ``dtype`` (None: the draft's own)."""
    check_format(fmt, FORMATS, "dflash", error=DFlashExportError)
    config = dflash_hf_config(model, "dflash", dtype=dtype, options=options)
    if fmt == "speculators":
        config = to_speculators(config, target)
    return write_export(model, out_dir, config)


#: The formats :func:`export_dflash` writes (``sglang`` and ``vllm`` are one folder).
FORMATS = ("sglang", "vllm", "speculators")
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
#: The Qwen3 fields of a native config.json that go under speculators' ``transformer_layer_config``.
LAYER_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "attention_bias", "rms_norm_eps", "rope_theta",
                "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "torch_dtype")


def to_speculators(config: Mapping[str, Any], target: TargetInfo | None) -> dict[str, Any]:
    """A native DFlash config.json in vLLM's speculators layout (the tensor names are the same in both).

    The block's drafted positions are the proposal length (``block_size - 1``); the target
    layers go in vLLM's numbering under ``aux_hidden_state_layer_ids``. Attention within a block
    is bidirectional, as trained (``sliding_window_non_causal``; the draft has no sliding window).
    """
    dflash = config["dflash_config"]
    out = {key: value for key, value in config.items() if key.startswith("specforge_")}
    out.update({
        "architectures": [SPECULATORS_ARCHITECTURE],
        SPECULATORS_TYPE: "dflash",
        "speculators_config": speculators_config("dflash", dflash["block_size"] - 1, target),
        "transformer_layer_config": {key: config[key] for key in LAYER_FIELDS if key in config},
        "draft_vocab_size": config["vocab_size"],
        "target_hidden_size": config["hidden_size"],
        "block_size": dflash["block_size"],
        "aux_hidden_state_layer_ids": engine_layer_ids(dflash["target_layer_ids"]),
        "mask_token_id": dflash["mask_token_id"],
        "num_target_layers": dflash["num_target_layers"],
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,
        "torch_dtype": config["torch_dtype"], "dtype": config["dtype"],
    })
    return out


def from_speculators(data: ExportConfig) -> ExportConfig:
    """A speculators-layout DFlash config.json as the native one :func:`check_fields` and
    :meth:`DFlashConfig.from_hf_config` read (the aux layer ids back in our numbering)."""
    if data.get(SPECULATORS_TYPE) != "dflash":
        raise data.fail(f"is a speculators {data.get(SPECULATORS_TYPE)!r} draft, not a DFlash one")
    if data.value("sample_from_anchor", bool, False):
        raise data.fail("sets sample_from_anchor: a DFlash variant that drafts from the anchor position, which "
                        "the dflash strategy does not build")
    layer = data.value("transformer_layer_config", dict)
    block_size = data.value("block_size", int)
    ids = [i - 1 for i in data.ints("aux_hidden_state_layer_ids")]  # vLLM's numbering: ours is one less
    num_target_layers = data.value("num_target_layers", int, 0)
    native: dict[str, Any] = {**layer, **{k: v for k, v in data.data.items() if k.startswith("specforge_")}}
    native.update({"architectures": [ARCHITECTURE], "block_size": block_size, "num_target_layers": num_target_layers,
                   "dflash_config": {"block_size": block_size, "mask_token_id": data.value("mask_token_id", int),
                                     "target_layer_ids": ids, "num_target_layers": num_target_layers}})
    for key in ("torch_dtype", "dtype"):
        if data.get(key) is not None:
            native[key] = data.get(key)
    return attrs.evolve(data, data=native)


def load_dflash(path: str | os.PathLike[str], frozen_parts: Mapping[str, torch.Tensor], *,
                attention: str = "sdpa") -> DFlashBackbone:
    """A ``dflash`` export back as a :class:`DFlashBackbone` over the target's frozen embedding and lm_head."""
    return load_backbone(path, "dflash", frozen_parts, lambda config, _raw, dtype: DFlashBackbone(
        config, frozen_parts["embed_tokens"], frozen_parts["lm_head"], attention=attention, dtype=dtype))
