"""Which attention implementation can run a target model, and what ``auto`` picks.

Some architectures change the attention scores in ways only some kernels implement:

* **logit softcapping** (Gemma2: ``attn_logit_softcapping``): scores become
  ``softcap * tanh(scores / softcap)`` before the softmax;
* **attention sinks** (gpt-oss: a learnt ``sinks`` logit per head): an extra softmax entry
  that takes probability mass but carries no value.

A kernel without them fails at the first forward (the batch-invariant attention and
``sdpa`` raise), or, for a flash kernel without sinks, quietly computes something else. So
the engine reads the model's features before loading any weights (the model built on the
meta device, which allocates nothing), lets ``auto`` pick a kernel that implements them,
and refuses an explicit choice that cannot run the model, naming the feature and the
choices that can.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch

from .errors import AttentionImplementationError

SOFTCAPPING = "logit softcapping"
SINKS = "attention sinks"

#: The model features each implementation (an ``attn_implementation`` option value) runs.
IMPLEMENTS: dict[str, frozenset[str]] = {
    "batch_invariant": frozenset(),
    "eager": frozenset({SOFTCAPPING, SINKS}),
    "sdpa": frozenset(),
    # flash-attn 2 takes a softcap; it has no sinks (transformers would drop them silently)
    "flash_attention_2": frozenset({SOFTCAPPING}),
}

#: What ``auto`` tries, in order, per device type: exact capture on CPU, speed on CUDA;
#: eager, last, runs every model.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"cpu": ("batch_invariant", "eager"), "cuda": ("sdpa", "eager")}


@attrs.frozen
class ModelAttention:
    """What of a model's attention limits the kernels that can run it.

    ``features`` maps a feature name (:data:`SOFTCAPPING`, :data:`SINKS`) to how the model
    shows it (for the error message); ``supports_sdpa`` / ``supports_flash`` are
    transformers' own flags for the architecture.
    """

    architecture: str
    features: dict[str, str] = attrs.field(factory=dict)
    supports_sdpa: bool = True
    supports_flash: bool = True


def read_model_attention(config: Any) -> ModelAttention:
    """The attention features of the causal LM ``config`` describes, without loading weights."""
    from transformers import AutoModelForCausalLM

    # On the meta device no memory is allocated, so this is cheap even for a large target
    # (transformers builds every model there first when loading it, so any loadable one
    # builds here). from_config writes into the config it gets, hence the copy.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    features = {}
    softcaps = {value for module in model.modules()
                if (value := getattr(module, "attn_logit_softcapping", None)) is not None}
    if softcaps:
        features[SOFTCAPPING] = f"attn_logit_softcapping={', '.join(map(str, sorted(softcaps)))}"
    sinks = [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"]
    if sinks:
        features[SINKS] = f"learnt sink logits such as {sinks[0]}"
    return ModelAttention(architecture=type(model).__name__, features=features,
                          supports_sdpa=bool(getattr(model, "_supports_sdpa", True)),
                          supports_flash=bool(getattr(model, "_supports_flash_attn", True)))


def why_not(name: str, device: torch.device, model: ModelAttention) -> str | None:
    """Why implementation ``name`` cannot run ``model`` on ``device``, or None when it can."""
    missing = [feature for feature in model.features if feature not in IMPLEMENTS[name]]
    if missing:
        shown = " and ".join(f"{feature} ({model.features[feature]})" for feature in missing)
        return f"its attention uses {shown}, which {name} does not implement"
    if name == "sdpa" and not model.supports_sdpa:
        return f"transformers has no sdpa attention for {model.architecture}"
    if name == "flash_attention_2":
        if device.type != "cuda":
            return f"flash_attention_2 runs only on CUDA, and the target runs on {device.type}"
        if not model.supports_flash:
            return f"transformers has no flash attention for {model.architecture}"
    return None


def choose_attention(requested: str, device: torch.device, model: ModelAttention) -> str:
    """The ``attn_implementation`` option value to load ``model`` with on ``device``.

    ``auto`` becomes the first of :data:`AUTO_ORDER` that runs the model; an explicit choice
    that cannot is refused with :class:`AttentionImplementationError`.
    """
    if requested == "auto":
        order = AUTO_ORDER.get(device.type, AUTO_ORDER["cuda"])
        return next(name for name in order if why_not(name, device, model) is None)
    reason = why_not(requested, device, model)
    if reason is None:
        return requested
    working = [name for name in IMPLEMENTS if why_not(name, device, model) is None]
    raise AttentionImplementationError(
        f"target_engine.attn_implementation={requested} cannot run {model.architecture}: {reason}; "
        f"on {device.type} use {' or '.join(working)}, or auto (which picks {choose_attention('auto', device, model)})"
    )


__all__ = ["AUTO_ORDER", "IMPLEMENTS", "SINKS", "SOFTCAPPING", "ModelAttention", "choose_attention",
           "read_model_attention", "why_not"]
