"""The example plugin's hooks: one strategy, named lazily so listing plugins stays cheap.

This module is what the ``specforge`` entry point names: ``specforge plugins`` imports it, so it
imports nothing heavy (no torch). The implementation lives in :mod:`.strategy` (training) and
:mod:`.serving` (export, load_export, speculate), named by the spec's ``factory`` string.
"""

import attrs

from specforge_core import hookimpl
from specforge_core.options import option, positive
from specforge_core.specs import StrategySpec

__version__ = "0.2.0"


@attrs.frozen
class ExampleOptions:
    """Options of the ``example`` strategy (``--set strategy.<name>=<value>``)."""

    num_heads: int = option(3, "Draft heads: head j predicts the token j+2 positions after the target's last "
                               "hidden state (the target's own lm_head already gives the next one).", check=positive)
    init_std: float = option(0.02, "Standard deviation of the heads' initial weights.", check=positive)


@hookimpl
def specforge_strategies():
    return [
        StrategySpec(
            name="example",
            factory="specforge_plugin_example.strategy:ExampleStrategy",
            options=ExampleOptions,
            description="Medusa-style heads on the target's last hidden state, each drafting one more token ahead.",
            requires={"last_hidden", "verify"},  # trains on the lm_head input; decodes against the target
            export_formats=("example",),  # its own format: no serving engine loads it, `specforge eval` measures it
            best_metric="tau_sim",  # a derived metric (see derived_metrics), named without its "eval/" prefix
            best_mode="max",
        )
    ]
