"""Export to (and load from) the directory SGLang and vLLM serve as an EAGLE3 draft.

Format ``sglang`` (``vllm`` writes the same folder)::

    model.safetensors   the keys of :data:`EXPORT_KEYS` (no embedding: the engines share the
                        target's), floating-point weights in the export dtype; d2t int64, t2d bool,
                        for a pruned draft vocabulary only (:data:`VOCAB_MAPS`)
    config.json         architectures ["LlamaForCausalLMEagle3"], Llama fields, draft_vocab_size,
                        torch_dtype and dtype, eagle_config.eagle_aux_hidden_state_layer_ids (our
                        numbering), eagle_aux_hidden_state_layer_ids (vLLM's, our id + 1),
                        norm_before_residual false, specforge_strategy "eagle3" and its options

SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` with our convention (id i =
output of decoder layer i; it adds 1 to index its own layer inputs), so the target captures
exactly the layers the draft was trained on; vLLM reads the top-level field in its own
numbering, and no SGLang version takes layers from it. ``tie_word_embeddings`` must be false:
SGLang would otherwise use the embedding as the draft's lm_head.

Format ``speculators`` (vLLM's speculators layout, :func:`to_speculators`): the Llama fields
under ``transformer_layer_config``, a ``speculators_config`` naming the algorithm, the
proposal length and the verifier, the aux layer ids in vLLM's numbering at the top level,
and the decoder layer's tensors under ``layers.0.`` instead of ``midlayer.``. :func:`load_draft`
reads both layouts.
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
    SPECULATORS_TYPE,
    check_format,
    export_state,
    load_checked_state,
    speculators_config,
    speculators_type,
    strategy_fields,
    load_weights,
    open_export,
    write_export_files,
)
from specforge_core.hfconfig import rope_theta
from specforge_core.serving import DEFAULT_EXPORT_DTYPE, check_servable_layer_ids, engine_layer_ids
from specforge_core.protocols import TargetInfo

from .model import Eagle3Config, Eagle3Draft
from .options import Eagle3Options, default_aux_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
STRATEGY = "eagle3"
WHAT = "an EAGLE3 draft"
LAYOUT = "the SGLang EAGLE3 layout"
#: The formats :func:`export_draft` writes (``sglang`` and ``vllm`` are one folder).
FORMATS = ("sglang", "vllm", "speculators")

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


#: The draft -> target vocabulary maps, written only for a pruned draft vocabulary: vLLM's Eagle3LlamaForCausalLM
#: has a parameter to load ``d2t`` into only then, and refuses a folder that ships one without it; SGLang, given
#: none, drafts over the target's own ids. :func:`load_draft` restores the identity.
VOCAB_MAPS = ("d2t", "t2d")


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
        # SGLang reads our numbering here (and adds 1 itself) ...
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids), "use_aux_hidden_state": True},
        # ... vLLM reads its own, the captured layer's index (our id + 1), at the top level; and
        # our draft keeps the residual un-normed (vLLM's speculators default would norm it first).
        "eagle_aux_hidden_state_layer_ids": engine_layer_ids(config.aux_layer_ids),
        "norm_before_residual": False,
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


def export_draft(model: Eagle3Draft, out_dir: str | os.PathLike[str], target: TargetInfo | None = None, *,
                 dtype: str | None = DEFAULT_EXPORT_DTYPE, options: Any = None, fmt: str = "sglang") -> Path:
    """Write ``model`` as an EAGLE3 draft directory in format ``fmt`` (see the module doc); returns it.

    Floating-point weights are written in ``dtype`` (None: the draft's own), the dtype named
    in config.json; ``options`` (the strategy's) are recorded for `specforge eval`. The state
    is checked against :data:`EXPORT_KEYS` before anything is written, so a draft that does
    not fit the layout never replaces an earlier export.
    """
    check_format(fmt, FORMATS, STRATEGY, error=Eagle3ExportError)
    if target is not None:
        check_servable_layer_ids(model.config.aux_layer_ids, target.num_layers, "the draft's aux layer ids",
                                 error=Eagle3ExportError)
    state = export_state(model, dtype)
    check_keys(state, EXPORT_KEYS, "the draft's state", LAYOUT, error=Eagle3ExportError)
    config = hf_config(model.config, target)
    config["torch_dtype"] = config["dtype"] = dtype_name(state["fc.weight"].dtype)
    config.update(strategy_fields(STRATEGY, options))
    pruned = config["draft_vocab_size"] != config["vocab_size"]
    tensors = {k: state[k] for k in EXPORT_KEYS if pruned or k not in VOCAB_MAPS}
    if fmt == "speculators":
        depth = (getattr(options, "spec_depth", None) or getattr(options, "ttt_length", None)
                 or Eagle3Options().ttt_length)
        config, tensors = to_speculators(config, tensors, depth, target)
    return write_export_files(out_dir, tensors, config, error=Eagle3ExportError)


#: The Llama fields of a native config.json that go under speculators' ``transformer_layer_config``.
LAYER_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_hidden_layers", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings", "attention_bias", "mlp_bias",
                "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id")
#: speculators' EAGLE3 variants this draft does not build (each off in ours).
VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"


def to_speculators(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], speculative_tokens: int,
                   target: TargetInfo | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A native export's ``(config, tensors)`` in vLLM's speculators layout (what the speculators library writes;
    like it, and like a native export, ``d2t`` / ``t2d`` only for a pruned draft vocabulary)."""
    out = {key: value for key, value in config.items() if key.startswith("specforge_")}
    out.update({
        "architectures": [SPECULATORS_ARCHITECTURE],
        SPECULATORS_TYPE: STRATEGY,
        "speculators_config": speculators_config(STRATEGY, speculative_tokens, target),
        "transformer_layer_config": {key: config[key] for key in LAYER_FIELDS if key in config},
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(config["eagle_aux_hidden_state_layer_ids"]),
        **{flag: False for flag in VARIANT_FLAGS},
        "torch_dtype": config["torch_dtype"], "dtype": config["dtype"],
    })
    return out, {key.replace("midlayer.", "layers.0.", 1): tensor for key, tensor in tensors.items()}


def from_speculators(data: ExportConfig) -> ExportConfig:
    """A speculators-layout config.json as the native one :func:`config_from_hf` reads (ids in our numbering)."""
    if data.get(SPECULATORS_TYPE) != STRATEGY:
        raise data.fail(f"is a speculators {data.get(SPECULATORS_TYPE)!r} draft, not an eagle3 one")
    layer = data.value("transformer_layer_config", dict)
    on = [flag for flag in VARIANT_FLAGS if data.value(flag, bool, False)]
    if on:
        raise data.fail(f"sets {', '.join(on)}: an EAGLE3 variant the eagle3 strategy does not build")
    native: dict[str, Any] = {**layer, **{k: v for k, v in data.data.items() if k.startswith("specforge_")}}
    native["architectures"] = [ARCHITECTURE]
    for key in ("draft_vocab_size", "target_hidden_size", "torch_dtype", "dtype"):
        if data.get(key) is not None:
            native[key] = data.get(key)
    engine_ids = data.ints("eagle_aux_hidden_state_layer_ids", None)
    if engine_ids:  # vLLM's numbering (the captured layer's index): ours is one less
        native["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in engine_ids]}
    return attrs.evolve(data, data=native)


def native_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A speculators-layout checkpoint's tensors under the native names (``layers.0.`` -> ``midlayer.``)."""
    return {key.replace("layers.0.", "midlayer.", 1): tensor for key, tensor in tensors.items()}


def load_draft(path: str | os.PathLike[str], target: TargetInfo, frozen_parts: Mapping[str, Any]) -> Eagle3Draft:
    """Rebuild the draft from an export directory (either layout) and the target's frozen parts."""
    data = open_export(path, what=WHAT, error=Eagle3ExportError)
    speculators = speculators_type(data.data) is not None
    config = config_from_hf(from_speculators(data) if speculators else data, target)
    state = load_weights(path, error=Eagle3ExportError)
    if speculators:
        state = native_tensors(state)
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
