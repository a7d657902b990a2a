"""specforge-plugin-eagle3: the ``eagle3`` strategy (EAGLE3 draft models, arXiv 2503.01840).

This hook module is imported by ``specforge plugins``, so it stays cheap: no torch here;
the implementation is named lazily (``specforge_plugin_eagle3.strategy:Eagle3Strategy``).
"""

from specforge_core import hookimpl
from specforge_core.specs import StrategySpec

from .options import Eagle3Options

__version__ = "0.1.0"

__all__ = ["Eagle3Options", "specforge_strategies"]


@hookimpl
def specforge_strategies():
    return [
        StrategySpec(
            name="eagle3",
            factory="specforge_plugin_eagle3.strategy:Eagle3Strategy",
            options=Eagle3Options,
            description="EAGLE3: one decoder layer over three fused target layers, trained with a "
                        "test-time-training unroll; exports a LlamaForCausalLMEagle3 folder SGLang and vLLM serve.",
            requires={"aux_hidden_states", "last_hidden"},
            export_formats=("sglang", "vllm", "speculators"),
            best_metric="accept_len_sim",
            best_mode="max",
            # SpecForge's EAGLE3 recipes (lr 1e-4; warmup_ratio 0.015, its schema default).
            suggested_train={"lr": 1e-4, "warmup_ratio": 0.015},
        )
    ]
