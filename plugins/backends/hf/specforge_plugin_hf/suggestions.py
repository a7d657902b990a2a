"""Training defaults the ``hf`` engine suggests, decided from its options alone (no model is loaded).

Named by the spec's ``train_suggestions`` so that ``specforge run --dry-run`` shows the
plan a run will use, and a run applies the very same values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: For the toy target: it is tiny and its data small, so a higher peak LR with a short warmup
#: trains a useful draft within the embedded default's few minutes (EAGLE3: tau_real about
#: 3.8 instead of 1.9 at the core's conservative 1e-4).
TOY_TRAIN_OPTIONS = {"lr": 1e-3, "warmup_steps": 50}


def suggested_train_options(options: Any) -> dict[str, Any]:
    """``TOY_TRAIN_OPTIONS`` when the engine serves a toy target (the default, or a toy folder), else none; a
    ``model`` that names no model folder is refused as the engine refuses it."""
    from .model_folder import local_model_folder
    from .toy import read_manifest

    if options.model is not None:
        local_model_folder(options.model)  # a missing or foreign folder is refused here, by --dry-run too
        if read_manifest(Path(options.model).expanduser()) is None:
            return {}
    return dict(TOY_TRAIN_OPTIONS)
