"""The example plugin's hooks: one strategy, named lazily so listing plugins stays cheap."""

import attrs

from specforge_core import hookimpl
from specforge_core.options import option, positive
from specforge_core.specs import StrategySpec

__version__ = "0.1.0"


@attrs.frozen
class ExampleOptions:
    """Options of the ``example`` strategy."""

    init_std: float = option(0.02, "Standard deviation of the draft head's initial weights.", check=positive)


@hookimpl
def specforge_strategies():
    return [
        StrategySpec(
            name="example",
            factory="specforge_plugin_example.strategy:ExampleStrategy",
            options=ExampleOptions,
            description="A linear head predicting token t+1 from the target's last hidden state at t.",
            requires={"last_hidden"},
            best_metric="acc",
            best_mode="max",
        )
    ]
