"""StrategyConformance's speculate checks fail for loops that are not lossless or miscount their forwards."""

import attrs
import pytest

from specforge_core.protocols import BuildContext
from specforge_core.testing import StrategyConformance

dflash = pytest.importorskip("specforge_plugin_dflash.strategy")
from specforge_plugin_dflash import DFlashOptions  # noqa: E402

OPTIONS = DFlashOptions(block_size=4, num_anchors=3, num_layers=1)


class SkipsTheRollback:
    """A session whose truncate does nothing: rejected draft tokens stay in the target's context."""

    def __init__(self, session):
        self._session = session
        self.prefill = session.prefill

    @property
    def length(self):
        return self._session.length

    def extend(self, ids):
        return self._session.extend(ids)

    def truncate(self, length):
        pass


class NoRollback(dflash.DFlashStrategy):
    def speculate(self, model, session, prompt_ids, **kwargs):
        return super().speculate(model, SkipsTheRollback(session), prompt_ids, **kwargs)


class ForgetsThePrefill(dflash.DFlashStrategy):
    def speculate(self, model, session, prompt_ids, **kwargs):
        result = super().speculate(model, session, prompt_ids, **kwargs)
        return attrs.evolve(result, accept_lengths=result.accept_lengths[1:])


def suite_for(strategy_class):
    class Suite(StrategyConformance):
        def make_strategy(self):
            return strategy_class(OPTIONS, BuildContext())

    return Suite()


def test_a_loop_that_keeps_rejected_tokens_fails_the_losslessness_check():
    with pytest.raises(AssertionError, match="speculate is not lossless on prompt"):
        suite_for(NoRollback).test_speculate_stays_lossless_when_drafts_are_accepted_and_stops_at_eos()


def test_a_loop_that_miscounts_its_forwards_fails_the_accounting_check():
    with pytest.raises(AssertionError, match="one accept length per target forward"):
        suite_for(ForgetsThePrefill).test_speculate_reproduces_the_targets_greedy_decode()


def test_the_same_loop_done_right_passes():
    suite_for(dflash.DFlashStrategy).test_speculate_reproduces_the_targets_greedy_decode()


@pytest.mark.parametrize("drafts, target_next, stop, budget, expected", [
    ([5, 6, 7], [5, 6, 7, 8], frozenset(), None, (3, [5, 6, 7, 8])),  # all accepted, then the bonus
    ([5, 6, 7], [5, 9, 7, 8], frozenset(), None, (1, [5, 9])),  # the first mismatch ends it; the target's token
    ([5, 6, 7], [4, 6, 7, 8], frozenset(), None, (0, [4])),  # nothing accepted: one token a round
    ([], [4], frozenset(), None, (0, [4])),  # nothing drafted
    ([5, 6, 7], [5, 6, 7, 8], frozenset({6}), None, (3, [5, 6])),  # stop after an end-of-sequence token
    ([5, 6, 7], [5, 6, 7, 8], frozenset(), 2, (3, [5, 6])),  # no more than the budget
])
def test_accept_drafts_keeps_the_matching_prefix_and_the_targets_next_token(drafts, target_next, stop, budget,
                                                                            expected):
    from specforge_core.speculative import accept_drafts

    assert accept_drafts(drafts, target_next, stop=stop, budget=budget) == expected


def test_accept_drafts_refuses_a_target_row_per_position_mismatch():
    from specforge_core.speculative import accept_drafts

    with pytest.raises(ValueError, match="2 drafts and the token before them, so 3, got 2"):
        accept_drafts([1, 2], [1, 2])
