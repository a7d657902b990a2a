"""The example strategy against the core's strategy contract (training, export round trip, lossless decoding)."""

from specforge_core.protocols import BuildContext
from specforge_core.testing import StrategyConformance

from specforge_plugin_example import ExampleOptions
from specforge_plugin_example.strategy import ExampleStrategy


class TestExampleStrategy(StrategyConformance):
    def make_strategy(self):
        return ExampleStrategy(ExampleOptions(num_heads=2), BuildContext())


def test_the_plugin_is_found_with_its_provenance(plugin_manager):
    spec = plugin_manager.get("strategy", "example")
    assert spec.provenance.distribution == "specforge-plugin-example"
    assert spec.requires == {"last_hidden", "verify"}
