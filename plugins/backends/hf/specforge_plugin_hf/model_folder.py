"""Where the ``hf`` engine's ``model`` option points: a local model folder, checked, or a hub id.

Light on purpose (no torch, no transformers): the engine and its train suggestions (what
``specforge run --dry-run`` asks) both check the option with it.
"""

from __future__ import annotations

from pathlib import Path

from .errors import TargetModelNotFoundError


def local_model_folder(model: str) -> Path | None:
    """The local folder ``model`` names, or None when it can only be a hub id."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetModelNotFoundError(
                f"target model folder {path} has no config.json; point target_engine.model at a folder written "
                "by save_pretrained (config.json, *.safetensors and the tokenizer files)"
            )
        return path
    if path.exists():
        kind = "a file" if path.is_file() else "not a folder"
        hint = f" (did you mean its folder {path.parent}?)" if (path.parent / "config.json").is_file() else ""
        raise TargetModelNotFoundError(
            f"target model path {path} is {kind}{hint}; target_engine.model must name a model folder written by "
            "save_pretrained, the folder holding config.json, the *.safetensors weights and the tokenizer files"
        )
    hub_id = not path.is_absolute() and not model.startswith((".", "~")) and model.count("/") <= 1
    if not hub_id:
        raise TargetModelNotFoundError(
            f"target model folder {path} does not exist; pass a folder written by save_pretrained "
            "(or a hub id such as org/name when you have network)"
        )
    return None
