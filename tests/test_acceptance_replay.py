"""The simulated acceptance length replays greedy speculative decoding over each response."""

import pytest
import torch

from specforge_core.acceptance import accept_rates, leading_true, simulated_decode
from specforge_core.speculative import prompts_from_token_rows


def replay(accepted, response, depth):
    metrics = simulated_decode(torch.tensor([accepted]), torch.tensor([response], dtype=torch.bool), depth)
    return {name: num / den for name, (num, den) in metrics.items()}, metrics


def test_a_perfect_draft_emits_depth_plus_one_tokens_per_round_until_the_end_token():
    # prompt (3 tokens), then a 10-token reply whose last token is the end-of-turn token
    response = [0, 0, 0] + [1] * 10
    values, raw = replay([3] * 13, response, 3)
    # the first reply token comes from the prompt's forward; 9 remain: rounds of 4, 4, then 1 (the end token,
    # accepted as a draft: decoding stops there, no bonus)
    assert raw["accept_len_sim"] == (9.0, 3.0)
    assert values["accept_rate_1"] == 1.0 and values["accept_rate_3"] == 2 / 3


def test_a_useless_draft_emits_one_token_per_round():
    values, raw = replay([0] * 8, [0, 1, 1, 1, 1, 1, 1, 0], 4)
    assert raw["accept_len_sim"] == (5.0, 5.0) and values["accept_rate_1"] == 0.0


def test_rounds_jump_over_the_positions_they_accept():
    # accepted counts at the positions a walk visits: 2 at 1, then (1 + 2 + 1 = 4) 1 at 4, then 0 at 6
    response = [0, 1, 1, 1, 1, 1, 1, 1, 1]
    accepted = [9, 2, 9, 9, 1, 9, 0, 9, 9]
    _, raw = replay(accepted, response, 5)
    # position 7's round accepts the end token as its draft and emits nothing after it
    assert raw["accept_len_sim"] == (3.0 + 2.0 + 1.0 + 1.0, 4.0)
    assert raw["accept_rate_1"] == (3.0, 4.0) and raw["accept_rate_2"] == (1.0, 4.0)


def test_each_turn_of_a_conversation_is_its_own_decode():
    one = simulated_decode(torch.tensor([[0, 2, 2, 2, 2]]), torch.tensor([[0, 1, 1, 1, 1]]).bool(), 2)
    two = simulated_decode(torch.tensor([[0, 2, 2, 2, 2, 0, 2, 2, 2, 2]]),
                           torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1, 1, 1]]).bool(), 2)
    assert two["accept_len_sim"] == tuple(2 * v for v in one["accept_len_sim"])


def test_accepted_counts_past_the_depth_or_the_reply_are_capped():
    _, raw = replay([0, 50, 50, 50], [0, 1, 1, 1], 8)
    assert raw["accept_len_sim"] == (2.0, 1.0)


def test_leading_true_counts_until_the_first_miss():
    correct = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert leading_true(correct).tolist() == [2, 0, 4]


def test_real_accept_rates_from_the_accepted_drafts_of_each_round():
    assert accept_rates([0, 1, 3, 2], 3) == pytest.approx([0.75, 0.5, 0.25])  # accepted drafts per round
    assert accept_rates([], 3) == []


def test_prompts_from_samples_end_where_the_last_reply_starts():
    ids = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    mask = [0, 0, 1, 1, 0, 0, 1, 1, 0]
    assert prompts_from_token_rows([(ids, mask), (ids, [0] * 9), ([1, 2], [1, 1])], limit=5) == [ids[:6]]
    assert prompts_from_token_rows([(ids, mask)] * 3, limit=2) == [ids[:6], ids[:6]]
