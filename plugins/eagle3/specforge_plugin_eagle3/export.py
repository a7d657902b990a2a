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

import json
import os
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch
from safetensors.torch import load_file, save_file

from specforge_core.dtypes import dtype_name
from specforge_core.errors import SpecforgeError
from specforge_core.fileio import atomic_write, atomic_write_text
from specforge_core.hfconfig import rope_theta
from specforge_core.protocols import TargetInfo

from .model import Eagle3Config, Eagle3Draft
from .options import default_aux_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
STRATEGY = "eagle3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

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


class Eagle3ExportError(SpecforgeError):
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


def config_from_hf(data: Mapping[str, Any], target: TargetInfo) -> Eagle3Config:
    """The draft shape from an export's config.json (also accepts EAGLE3 drafts trained elsewhere)."""
    if ARCHITECTURE not in (data.get("architectures") or []):
        raise Eagle3ExportError(f"config.json names architectures {data.get('architectures')}, not [{ARCHITECTURE!r}]")
    if data.get("specforge_strategy", STRATEGY) != STRATEGY:
        raise Eagle3ExportError(f"this export was made by strategy {data['specforge_strategy']!r}, not {STRATEGY!r}; "
                                f"load it with --strategy {data['specforge_strategy']}")
    if int(data.get("num_hidden_layers", 1)) != 1:
        raise Eagle3ExportError(f"the draft has {data['num_hidden_layers']} layers; the eagle3 strategy builds one")
    hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
    aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    config = Eagle3Config(
        hidden_size=hidden,
        target_hidden_size=int(data.get("target_hidden_size") or hidden),
        intermediate_size=int(data["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta(data),
        max_position_embeddings=int(data.get("max_position_embeddings") or 4096),
        vocab_size=int(data["vocab_size"]),
        draft_vocab_size=int(data.get("draft_vocab_size") or data["vocab_size"]),
        aux_layer_ids=tuple(aux) if aux else default_aux_layer_ids(target.num_layers),
        dtype=str(data.get("torch_dtype") or data.get("dtype") or "float32"),
    )
    if config.vocab_size != target.vocab_size or config.target_hidden_size != target.hidden_size:
        raise Eagle3ExportError(
            f"the draft was made for a target with vocabulary {config.vocab_size} and hidden size "
            f"{config.target_hidden_size}, but this target ({target.model_id or 'unnamed'}) has "
            f"{target.vocab_size} and {target.hidden_size}; load it against the target it was trained for"
        )
    return config


def _check_layout(state: Mapping[str, Any], what: str) -> None:
    missing, unexpected = sorted(set(EXPORT_KEYS) - set(state)), sorted(set(state) - set(EXPORT_KEYS))
    if missing or unexpected:
        raise Eagle3ExportError(f"{what} does not match the SGLang EAGLE3 layout: missing {missing}, "
                                f"unexpected {unexpected}")


def export_draft(model: Eagle3Draft, out_dir: str | os.PathLike[str], target: TargetInfo | None = None) -> Path:
    """Write ``model`` as an SGLang EAGLE3 draft directory; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):  # an FSDP2 shard: gather (collective on every rank)
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().cpu().contiguous()
    _check_layout(state, "the draft's state")
    config = hf_config(model.config, target)
    config["torch_dtype"] = config["dtype"] = dtype_name(state["fc.weight"].dtype)
    # safetensors first, config last: a directory with a config.json is a complete export
    atomic_write(out / WEIGHTS_FILE, lambda tmp: save_file({k: state[k] for k in EXPORT_KEYS}, tmp,
                                                           metadata={"format": "pt"}))
    atomic_write_text(out / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def load_draft(path: str | os.PathLike[str], target: TargetInfo, frozen_parts: Mapping[str, Any]) -> Eagle3Draft:
    """Rebuild the draft from an export directory and the target's frozen parts."""
    root = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (root / name).is_file():
            raise Eagle3ExportError(f"{root} has no {name}; point at a directory written by `specforge export` "
                                    "(config.json + model.safetensors)")
    try:
        data = json.loads((root / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise Eagle3ExportError(f"{root / CONFIG_FILE} is not valid JSON: {exc}") from None
    config = config_from_hf(data, target)
    try:
        state = load_file(str(root / WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise Eagle3ExportError(f"{root / WEIGHTS_FILE} is not a readable safetensors file: {exc}") from exc
    if "fc.weight" in state:  # the weights' own dtype wins over what the config says
        config = attrs.evolve(config, dtype=dtype_name(state["fc.weight"].dtype))
    if "d2t" not in state and "t2d" not in state and config.draft_vocab_size == config.vocab_size:
        state["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)  # full vocabulary: identity
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    state.pop("embed_tokens.weight", None)  # some trainers keep the (target's) embedding
    _check_layout(state, str(root / WEIGHTS_FILE))
    model = Eagle3Draft(config, frozen_parts["embed_tokens"], frozen_parts.get("lm_head"))
    model.load_state_dict(state)
    return model
