"""The domino strategy against the core's strategy contract, for both label alignments."""

from specforge_core.protocols import BuildContext
from specforge_core.testing.strategy_suite import StrategyConformance

from specforge_plugin_domino import DominoOptions
from specforge_plugin_domino.strategy import DominoStrategy


class TestDominoConformance(StrategyConformance):
    # Anchors come from (seed, step, sample id), never from the batch: exact pooling holds.
    deterministic = True

    def make_strategy(self):
        return DominoStrategy(DominoOptions(block_size=4, num_anchors=3, loss_decay_gamma=7.0, logit_chunk_size=2,
                                            emb_dim=16), BuildContext())


class TestDominoConformanceDFlashLabelsEagerBf16(StrategyConformance):
    def make_strategy(self):
        return DominoStrategy(DominoOptions(block_size=4, num_anchors=2, attention="eager", dtype="bfloat16",
                                            num_layers=1, shift_label=False, pure_draft_prefix_len=1, emb_dim=8,
                                            gru_hidden_dim=12), BuildContext())
