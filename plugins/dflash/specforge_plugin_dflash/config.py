"""The shape of a DFlash draft: which target layers feed it, its dimensions, its mask token.

Pure Python (no torch): :class:`DFlashConfig` is what ``build_model`` derives from the
target and the options, what the SGLang ``config.json`` is written from, and what
``load_export`` reads back.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs

from specforge_core.errors import OptionError
from specforge_core.hfconfig import config_value, rope_theta
from specforge_core.serving import check_servable_layer_ids, max_servable_layer_id


class DFlashConfigError(OptionError):
    """The target, the options or an exported config.json do not describe a valid DFlash draft."""


def default_target_layer_ids(num_layers: int, n: int) -> list[int]:
    """``n`` distinct target layer ids (layer id i = output of decoder layer i) for a target of ``num_layers``.

    The DFlash formula (the one SGLang and the reference code use): ``n == 1 -> [L//2]``, else
    ``round(1 + i*(L-4)/(n-1))``; e.g. L=36, n=5 -> [1, 9, 17, 25, 33]. Every id stays within
    ``0..L-2``, the ids a serving engine can capture (:mod:`specforge_core.serving`). On small
    targets the formula collides or leaves that range (L=4 gives [1, 1, 1, 1]), and then the
    ids are spread evenly over ``[0, L-2]`` instead: ``floor(0.5 + i*(L-2)/(n-1))``, distinct
    because the spacing is >= 1. ``n`` is capped at ``L-1``, the number of servable ids.
    """
    top = max_servable_layer_id(num_layers)
    if top < 0:
        raise DFlashConfigError(f"the target has {num_layers} layer(s); DFlash needs at least 2, since a serving "
                                "engine cannot capture the last layer's output")
    n = min(n, top + 1)
    if n == 1:
        return [min(num_layers // 2, top)]
    ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    if len(set(ids)) == n and all(0 <= i <= top for i in ids):
        return ids
    return [math.floor(0.5 + i * top / (n - 1)) for i in range(n)]


def check_target_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """``ids`` if they are distinct layer ids a serving engine can capture from a ``num_layers``-layer target."""
    check_servable_layer_ids(ids, num_layers, "option 'strategy.target_layer_ids'", error=DFlashConfigError)
    if len(set(ids)) != len(ids):
        raise DFlashConfigError(f"option 'strategy.target_layer_ids' repeats a layer id: {ids}")
    return list(ids)


def special_token_ids(extra: Mapping[str, Any]) -> set[int]:
    """The target's special tokens in use: EOS (one or several), pad, BOS, unk and every other special id."""
    ids: set[int] = set()
    for key in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id", "special_token_ids"):
        value = extra.get(key)
        values = value if isinstance(value, (list, tuple)) else [value]
        ids.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return ids


def resolve_mask_token_id(explicit: int | None, vocab_size: int, extra: Mapping[str, Any]) -> int:
    """The token id filling a block's drafted positions: never EOS, pad or another special token in use.

    Order: ``explicit`` (the option, taken as given); ``extra["mask_token_id"]`` (the
    tokenizer's own mask token); the first embedding row the tokenizer never produces,
    ``extra["tokenizer_size"]`` when it is below ``vocab_size`` (the published Qwen3 drafts add
    ``<|MASK|>`` there); else the highest id that is not a special token (a rare ordinary
    token: tokenizers put merges learned last at the end). A tokenizer without a free token
    (SmolLM2's pads with its EOS ``<|im_end|>``) gets that last choice; the draft then checks it
    against the training data (:func:`check_mask_token`).
    """
    if explicit is not None:
        _check_id("option 'strategy.mask_token_id'", explicit, vocab_size)
        return explicit
    own = extra.get("mask_token_id")
    if own is not None:
        _check_id("the target's mask_token_id", own, vocab_size)
        return own
    special = special_token_ids(extra)
    tokenizer_size = extra.get("tokenizer_size")
    if isinstance(tokenizer_size, int) and tokenizer_size < vocab_size:
        return tokenizer_size
    candidate = vocab_size - 1
    while candidate in special and candidate > 0:
        candidate -= 1
    return candidate


def mask_token_for_data(mask_token_id: int, token_counts: Any, extra: Mapping[str, Any]) -> int:
    """``mask_token_id``, or, when the training data supervises it, the highest id that is neither a
    special token nor in the data (``token_counts [V]``: supervised counts; None: not known).

    A mask token the draft must also predict confuses its "fill this position" input with a
    real token. The tokenizer's own mask token and an unused embedding row never collide.
    """
    if token_counts is None or int(token_counts[mask_token_id]) == 0:
        return mask_token_id
    special = special_token_ids(extra)
    for candidate in range(len(token_counts) - 1, -1, -1):
        if candidate not in special and int(token_counts[candidate]) == 0:
            return candidate
    raise DFlashConfigError("every token id of the target's vocabulary is special or supervised by the training "
                            "data, so no mask token is free; set strategy.mask_token_id")


def _check_id(source: str, value: Any, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise DFlashConfigError(f"{source} is {value!r}, not a token id of the target's vocabulary "
                                f"(0..{vocab_size - 1}); set strategy.mask_token_id")


@attrs.frozen(kw_only=True)
class DFlashConfig:
    """Dimensions of a DFlash draft and how it plugs into its target.

    ``num_layers`` is the draft's depth; ``target_layer_ids`` the captured target layers
    (their count is the number of context features, ``fc`` maps ``len(ids)*hidden_size``
    to ``hidden_size``); ``num_target_layers`` the target's depth.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = attrs.field(converter=tuple, factory=tuple)
    num_target_layers: int = 0

    def __attrs_post_init__(self) -> None:
        if min(self.num_heads, self.num_kv_heads) < 1:
            raise DFlashConfigError(f"num_attention_heads ({self.num_heads}) and num_key_value_heads "
                                    f"({self.num_kv_heads}) must be at least 1")
        if self.num_heads % self.num_kv_heads:
            raise DFlashConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                    f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise DFlashConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                                    f"(0..{self.vocab_size - 1})")

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target: Any, options: Any) -> DFlashConfig:
        """The draft for ``target`` (a :class:`~specforge_core.protocols.TargetInfo`) under ``options``.

        Attention shape, MLP width, norm epsilon, RoPE base and context length come from
        ``target.extra`` (transformers config names), falling back to Qwen3-like ratios.
        """
        extra = target.extra
        heads = int(config_value(extra, "num_attention_heads", max(1, target.hidden_size // 128)))
        if options.target_layer_ids is None:
            ids = default_target_layer_ids(target.num_layers, options.num_target_layers)
        else:
            ids = check_target_layer_ids(options.target_layer_ids, target.num_layers)
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=int(config_value(extra, "intermediate_size", 3 * target.hidden_size)),
            num_layers=options.num_layers if options.num_layers is not None else min(5, target.num_layers),
            num_heads=heads,
            num_kv_heads=int(config_value(extra, "num_key_value_heads", heads)),
            head_dim=int(config_value(extra, "head_dim", target.hidden_size // heads)),
            vocab_size=target.vocab_size,
            rms_norm_eps=float(extra.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta(extra),
            max_position_embeddings=int(config_value(extra, "max_position_embeddings", 4096)),
            block_size=options.block_size,
            mask_token_id=resolve_mask_token_id(options.mask_token_id, target.vocab_size, extra),
            target_layer_ids=ids,
            num_target_layers=target.num_layers,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Qwen3-style ``config.json`` fields SGLang's ``DFlashDraftModel`` reads.

        ``block_size``, ``num_target_layers`` and ``target_layer_ids`` appear both at the top
        level (older loaders) and in ``dflash_config`` (current SGLang reads both places);
        ``num_target_layers`` is written because SGLang releases have checked the layer ids against it,
        falling back to the *draft's* depth without it (newer ones fall back to ``max(target_layer_ids) + 1``
        and check the ids against the running target at load).
        """
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "num_target_layers": self.num_target_layers,
            },
        }

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> DFlashConfig:
        """Read back what :meth:`to_hf_config` wrote (or a published DFlash config.json)."""
        dflash = config.get("dflash_config") or {}
        try:
            heads = int(config["num_attention_heads"])
            return cls(
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads", heads)),
                head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
                vocab_size=int(config["vocab_size"]),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta(config),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                block_size=int(dflash.get("block_size", config.get("block_size", 16))),
                mask_token_id=int(dflash["mask_token_id"]),
                target_layer_ids=[int(i) for i in dflash.get("target_layer_ids", config.get("target_layer_ids"))],
                num_target_layers=int(dflash.get("num_target_layers", config.get("num_target_layers", 0))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DFlashConfigError(f"config.json is not a DFlash draft config: {type(exc).__name__}: {exc}") from None
