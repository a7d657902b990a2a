"""Reading transformers-style model config mappings (``config.json``, ``TargetInfo.extra``).

Torch-free, so hook modules that build a draft's config can import it.
"""

from __future__ import annotations

from typing import Any, Mapping


def rope_theta(config: Mapping[str, Any]) -> float:
    """The RoPE base: ``rope_theta``, or transformers 5's ``rope_parameters.rope_theta``, else 10000."""
    rope = config.get("rope_parameters") or {}
    return float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def config_value(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """``config[key]``, or ``default`` when it is missing or null (engines report unknown fields as None)."""
    value = config.get(key)
    return default if value is None else value
