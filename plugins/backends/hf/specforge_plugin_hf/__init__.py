"""specforge-plugin-hf: the ``hf`` target engine (transformers causal LMs)."""

import attrs

from specforge_core import hookimpl
from specforge_core.options import option
from specforge_core.specs import TargetEngineSpec

__version__ = "0.1.0"


@attrs.frozen
class HFEngineOptions:
    """Options of the ``hf`` target engine."""

    model: str | None = option(None, "Local folder (or hub id, with network) of a causal LM. None uses the "
                                     "toy target, built once and cached.")
    dtype: str = option("auto", "Target weights dtype.", choices=("auto", "float32", "bfloat16", "float16"))
    device: str = option("auto", "Where the target runs.", choices=("auto", "cpu", "cuda"))
    capture_batch_size: int = option(8, "Sequences per capture forward.")


@hookimpl
def specforge_target_engines():
    return [
        TargetEngineSpec(
            name="hf",
            factory="specforge_plugin_hf.engine:HFTargetEngine",
            options=HFEngineOptions,
            capabilities={"aux_hidden_states", "last_hidden", "frozen_parts", "verify"},
            description="Runs a transformers causal LM in-process and captures its hidden states.",
        )
    ]
