"""The strategy conformance suite, run against the test plugin's ``linear`` strategy."""

import torch

from fixtures.linear_plugin import LinearOptions, LinearStrategy
from specforge_core.protocols import BuildContext
from specforge_core.testing import StrategyConformance


class TestLinearStrategyConformance(StrategyConformance):
    def make_strategy(self):
        return LinearStrategy(LinearOptions(), BuildContext())

    def make_target(self):
        info, frozen = super().make_target()
        return info, {"proj": torch.eye(info.hidden_size)}
