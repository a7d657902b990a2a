"""The eagle3 strategy against the core's strategy contract."""

from specforge_core.protocols import BuildContext
from specforge_core.testing.strategy_suite import StrategyConformance

from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.strategy import Eagle3Strategy


class TestEagle3Conformance(StrategyConformance):
    """Default options on the suite's 8-layer random target (Vd = V = 97: no mapping)."""

    def make_strategy(self):
        return Eagle3Strategy(Eagle3Options(ttt_length=3), BuildContext(run_id="t"))


class TestEagle3ConformanceWithVocabMapping(StrategyConformance):
    """A draft vocabulary smaller than the target's, so d2t/t2d and position_mask matter."""

    def make_strategy(self):
        return Eagle3Strategy(Eagle3Options(ttt_length=4, draft_vocab_size=40), BuildContext(run_id="t"))
