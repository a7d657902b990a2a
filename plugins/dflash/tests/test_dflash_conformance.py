"""The dflash strategy against the core's strategy contract."""

from specforge_core.protocols import BuildContext
from specforge_core.testing.strategy_suite import StrategyConformance

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.strategy import DFlashStrategy


class TestDFlashConformance(StrategyConformance):
    # Anchors are drawn per sample from (seed, step, sample id), not from the batch, so
    # pooled metrics are the same whatever the batching: the suite's exact-pooling test runs.
    deterministic = True

    def make_strategy(self):
        return DFlashStrategy(DFlashOptions(block_size=4, num_anchors=3, loss_decay_gamma=7.0, logit_chunk_size=2),
                              BuildContext())


class TestDFlashConformanceEagerBf16(StrategyConformance):
    def make_strategy(self):
        return DFlashStrategy(DFlashOptions(block_size=3, num_anchors=2, attention="eager", dtype="bfloat16",
                                            num_layers=1), BuildContext())
