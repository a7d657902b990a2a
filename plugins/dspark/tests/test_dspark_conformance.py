"""The dspark strategy against the core's strategy contract."""

from specforge_core.protocols import BuildContext
from specforge_core.testing.strategy_suite import StrategyConformance

from specforge_plugin_dspark import DSparkOptions
from specforge_plugin_dspark.strategy import DSparkStrategy


class TestDSparkConformance(StrategyConformance):
    # Anchors come from (seed, step, sample id), never from the batch: exact pooling holds.
    deterministic = True

    def make_strategy(self):
        return DSparkStrategy(DSparkOptions(block_size=4, num_anchors=3, loss_decay_gamma=7.0, logit_chunk_size=2,
                                            markov_rank=16), BuildContext())


class TestDSparkConformanceDPaceEagerBf16WithoutMarkovConfidence(StrategyConformance):
    def make_strategy(self):
        return DSparkStrategy(DSparkOptions(block_size=3, num_anchors=2, attention="eager", dtype="bfloat16",
                                            num_layers=1, markov_rank=8, confidence_with_markov=False,
                                            loss_type="dpace", confidence_threshold=0.5), BuildContext())
