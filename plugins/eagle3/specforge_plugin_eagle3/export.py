"""Export to (and load from) the directory SGLang serves with ``--speculative-algorithm EAGLE3``.

    model.safetensors   the keys of :data:`EXPORT_KEYS` (no embedding: SGLang shares the
                        target's), in the draft's dtype; d2t int64, t2d bool
    config.json         architectures ["LlamaForCausalLMEagle3"], Llama fields, draft_vocab_size,
                        eagle_config.eagle_aux_hidden_state_layer_ids, specforge_strategy "eagle3"

SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` with our convention (id i =
output of decoder layer i; it adds 1 to index its own layer inputs), so the target captures
exactly the layers the draft was trained on. ``tie_word_embeddings`` must be false: SGLang
would otherwise use the embedding as the draft's lm_head.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from specforge_core.dtypes import dtype_name
from specforge_core.export import (
    WEIGHTS_FILE,
    ExportConfig,
    ExportError,
    check_keys,
    export_state,
    load_checked_state,
    load_weights,
    open_export,
    write_export_files,
)
from specforge_core.hfconfig import rope_theta
from specforge_core.protocols import TargetInfo

from .model import Eagle3Config, Eagle3Draft
from .options import default_aux_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
STRATEGY = "eagle3"
WHAT = "an EAGLE3 draft"
LAYOUT = "the SGLang EAGLE3 layout"

#: Every tensor of an export, named as SGLang's LlamaForCausalLMEagle3.load_weights expects.
EXPORT_KEYS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


class Eagle3ExportError(ExportError):
    """An export directory is incomplete, not an EAGLE3 draft, or made for another target."""


def hf_config(config: Eagle3Config, target: TargetInfo | None = None) -> dict[str, Any]:
    """The config.json of an export (a Llama config SGLang's LlamaForCausalLMEagle3 accepts)."""
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.target_hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": config.dtype,
        "dtype": config.dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids), "use_aux_hidden_state": True},
        "specforge_strategy": STRATEGY,
    }
    if target is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if target.extra.get(key) is not None:
                out[key] = target.extra[key]
        out["specforge_target"] = {"model_id": target.model_id, "num_layers": target.num_layers,
                                   "hidden_size": target.hidden_size, "vocab_size": target.vocab_size}
    return out


def config_from_hf(data: ExportConfig, target: TargetInfo) -> Eagle3Config:
    """The draft shape from an export's config.json (also accepts EAGLE3 drafts trained elsewhere).

    A field that is missing or of the wrong form, or a config of another strategy or
    architecture, raises :class:`Eagle3ExportError` naming the file, the field and what an
    EAGLE3 config needs there, rather than a bare KeyError from deep inside.
    """
    data.expect_identity(ARCHITECTURE, STRATEGY, strategy_required=False)
    if data.value("num_hidden_layers", int, 1) != 1:
        raise data.fail(f"describes {data.get('num_hidden_layers')} layers; the eagle3 strategy builds one")
    hidden, heads = data.value("hidden_size", int), data.value("num_attention_heads", int)
    if heads < 1:
        raise data.fail(f"has 'num_attention_heads' = {heads}; {WHAT} needs at least one attention head")
    vocab = data.value("vocab_size", int)
    aux = data.section("eagle_config").ints("eagle_aux_hidden_state_layer_ids", None)
    try:
        config = Eagle3Config(
            hidden_size=hidden,
            target_hidden_size=data.value("target_hidden_size", int, hidden),
            intermediate_size=data.value("intermediate_size", int),
            num_attention_heads=heads,
            num_key_value_heads=data.value("num_key_value_heads", int, heads),
            head_dim=data.value("head_dim", int, hidden // heads),
            rms_norm_eps=data.value("rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta(data.data),
            max_position_embeddings=data.value("max_position_embeddings", int, 4096),
            vocab_size=vocab,
            draft_vocab_size=data.value("draft_vocab_size", int, vocab),
            aux_layer_ids=tuple(aux) if aux else default_aux_layer_ids(target.num_layers),
            dtype=data.value("torch_dtype", str, data.value("dtype", str, "float32")),
        )
    except (ValueError, ZeroDivisionError) as exc:  # e.g. heads not a multiple of kv heads
        raise data.fail(f"does not describe a valid EAGLE3 draft: {exc}") from None
    if config.vocab_size != target.vocab_size or config.target_hidden_size != target.hidden_size:
        raise data.fail(
            f"describes a draft made for a target with vocabulary {config.vocab_size} and hidden size "
            f"{config.target_hidden_size}, but this target ({target.model_id or 'unnamed'}) has "
            f"{target.vocab_size} and {target.hidden_size}; load it against the target it was trained for"
        )
    return config


def export_draft(model: Eagle3Draft, out_dir: str | os.PathLike[str], target: TargetInfo | None = None) -> Path:
    """Write ``model`` as an SGLang EAGLE3 draft directory; returns the directory.

    The state is checked against :data:`EXPORT_KEYS` before anything is written, so a draft
    that does not fit SGLang's layout never replaces an earlier export.
    """
    state = export_state(model)
    check_keys(state, EXPORT_KEYS, "the draft's state", LAYOUT, error=Eagle3ExportError)
    config = hf_config(model.config, target)
    config["torch_dtype"] = config["dtype"] = dtype_name(state["fc.weight"].dtype)
    return write_export_files(out_dir, {k: state[k] for k in EXPORT_KEYS}, config, error=Eagle3ExportError)


def load_draft(path: str | os.PathLike[str], target: TargetInfo, frozen_parts: Mapping[str, Any]) -> Eagle3Draft:
    """Rebuild the draft from an export directory and the target's frozen parts."""
    data = open_export(path, what=WHAT, error=Eagle3ExportError)
    config = config_from_hf(data, target)
    state = load_weights(path, error=Eagle3ExportError)
    source = str(Path(path) / WEIGHTS_FILE)
    if "fc.weight" in state:  # the weights' own dtype wins over what the config says
        config = attrs.evolve(config, dtype=dtype_name(state["fc.weight"].dtype))
    if "d2t" not in state and "t2d" not in state and config.draft_vocab_size == config.vocab_size:
        state["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)  # full vocabulary: identity
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    state.pop("embed_tokens.weight", None)  # some trainers keep the (target's) embedding
    check_keys(state, EXPORT_KEYS, source, LAYOUT, error=Eagle3ExportError)
    try:
        model = Eagle3Draft(config, frozen_parts["embed_tokens"], frozen_parts.get("lm_head"))
    except ValueError as exc:  # the target's frozen parts do not fit the draft the export describes
        raise data.fail(f"describes a draft this target's frozen parts do not fit: {exc}") from None
    # Drafts written by other tools may store some tensors in another dtype: cast them on load.
    return load_checked_state(model, state, source, error=Eagle3ExportError, dtypes=False)
