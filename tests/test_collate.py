"""The collate helpers every strategy shares: right padding, the sample checks, their messages."""

import pytest
import torch

from specforge_core.data.collate import CollateError, pad_features, pad_right, sample_lengths
from specforge_core.errors import SpecforgeError


def test_pad_right_stacks_sequences_padded_to_the_longest_with_the_pad_value():
    out = pad_right([torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])], value=-1)
    assert out.tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
    assert out.dtype == torch.int64


def test_pad_right_pads_whole_rows_of_trailing_dims_with_zeros_by_default():
    a = torch.tensor([[1.5, 2.5], [3.5, 4.5]])
    out = pad_right([a[:1], a])
    assert out.shape == (2, 2, 2)
    assert out.tolist() == [[[1.5, 2.5], [0.0, 0.0]], [[1.5, 2.5], [3.5, 4.5]]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int32, torch.bool])
def test_pad_right_keeps_the_tensors_dtype(dtype):
    out = pad_right([torch.ones(2, 3, dtype=dtype), torch.ones(1, 3, dtype=dtype)])
    assert out.dtype == dtype
    assert out.to(torch.int64).tolist() == [[[1, 1, 1], [1, 1, 1]], [[1, 1, 1], [0, 0, 0]]]


def test_pad_right_casts_to_a_chosen_dtype():
    out = pad_right([torch.tensor([1, 0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)],
                    dtype=torch.long)
    assert out.dtype == torch.long and out.tolist() == [[1, 0], [1, 0]]


def test_a_zero_length_tensor_becomes_a_row_of_padding():
    out = pad_right([torch.empty(0, 2), torch.tensor([[7.0, 8.0]])], value=9.0)
    assert out.tolist() == [[[9.0, 9.0]], [[7.0, 8.0]]]
    assert pad_right([torch.empty(0, 4), torch.empty(0, 4)]).shape == (2, 0, 4)


def test_an_empty_batch_is_refused():
    with pytest.raises(CollateError, match="pad_right got no tensors; a batch needs at least one sample"):
        pad_right([])


def test_tensors_whose_trailing_dims_differ_are_refused_naming_both():
    with pytest.raises(CollateError, match=r"tensor 1 has shape \[2, 5\] but tensor 0 has \[3, 4\]: only the first "
                                           r"\(sequence\) dim may differ"):
        pad_right([torch.zeros(3, 4), torch.zeros(2, 5)])
    with pytest.raises(CollateError, match=r"tensor 1 has shape \[2\] but tensor 0 has \[3, 4\]"):
        pad_right([torch.zeros(3, 4), torch.zeros(2)])
    with pytest.raises(CollateError, match=r"'b' has shape \[1, 2, 2\] but 'a' has \[1, 2\]"):
        pad_right([torch.zeros(1, 2), torch.zeros(1, 2, 2)], names=["'a'", "'b'"])


def test_a_scalar_is_refused():
    with pytest.raises(CollateError, match=r"tensor 0 is a scalar; pad_right pads tensors of shape \[S, \.\.\.\]"):
        pad_right([torch.tensor(3)])


def sample(n, width=2, **drop):
    out = {"input_ids": torch.arange(n, dtype=torch.int32), "loss_mask": torch.ones(n, dtype=torch.int32),
           "hidden": torch.full((n, width), float(n))}
    for name in drop:
        del out[name]
    return out


def test_pad_features_pads_every_feature_and_returns_the_lengths():
    padded, lengths = pad_features([sample(3), sample(1)], ["a", "b"], ("input_ids", "loss_mask", "hidden"),
                                   strategy="toy", dtypes={"input_ids": torch.long})
    assert lengths == [3, 1]
    assert list(padded) == ["input_ids", "loss_mask", "hidden"]
    assert padded["input_ids"].dtype == torch.long and padded["input_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert padded["loss_mask"].dtype == torch.int32 and padded["loss_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert padded["hidden"].tolist() == [[[3.0, 3.0]] * 3, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]]


def test_a_missing_feature_is_refused_naming_the_sample_the_feature_and_what_it_has():
    with pytest.raises(CollateError) as raised:
        sample_lengths([sample(3), sample(2, hidden=True)], ["a", "b"], ("input_ids", "loss_mask", "hidden"),
                       strategy="toy")
    assert str(raised.value) == ("sample 'b' lacks feature(s) ['hidden'] (it has ['input_ids', 'loss_mask']); it was "
                                 "not captured with the toy capture plan: capture it again with --strategy toy")
    assert isinstance(raised.value, SpecforgeError)


def test_features_of_different_lengths_in_one_sample_are_refused():
    broken = dict(sample(3), hidden=torch.zeros(2, 2))
    with pytest.raises(CollateError, match=r"sample 'a' has features of different lengths: \{'input_ids': 3, "
                                           r"'hidden': 2\}"):
        sample_lengths([broken], ["a"], ("input_ids", "hidden"), strategy="toy")
    scalar = dict(sample(3), hidden=torch.tensor(1.0))
    with pytest.raises(CollateError, match="feature 'hidden' of sample 'a' is a scalar"):
        sample_lengths([scalar], ["a"], ("input_ids", "hidden"), strategy="toy")


def test_no_samples_or_ids_that_do_not_match_the_samples_are_refused():
    with pytest.raises(CollateError, match="toy collate got no samples; a batch needs at least one"):
        pad_features([], [], ("input_ids",), strategy="toy")
    with pytest.raises(CollateError, match="toy collate got 2 samples but 1 sample ids"):
        sample_lengths([sample(1), sample(2)], ["a"], ("input_ids",), strategy="toy")


def test_trailing_dims_that_differ_between_samples_name_the_feature_and_both_samples():
    with pytest.raises(CollateError, match=r"feature 'hidden' of sample 'b' has shape \[2, 3\] but feature 'hidden' "
                                           r"of sample 'a' has \[1, 2\]"):
        pad_features([sample(1), sample(2, width=3)], ["a", "b"], ("input_ids", "hidden"), strategy="toy")


def test_padding_overwrites_whatever_the_batch_memory_held_before():
    # the batch is allocated empty: a block just freed, full of 7s, is what it most likely reuses
    for _ in range(3):
        junk = torch.full((2, 64, 8), 7.0)
        del junk
        out = pad_right([torch.ones(64, 8), torch.ones(3, 8)])
        assert out[0].eq(1).all() and out[1, :3].eq(1).all() and out[1, 3:].eq(0).all()
