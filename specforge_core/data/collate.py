"""What every strategy's ``collate`` shares: check a batch's samples, right-pad their features.

A captured sample holds unpadded per-token features ``[S_i, ...]`` (``input_ids``,
``loss_mask``, hidden states); a strategy's ``collate`` turns B of them into batch tensors::

    lengths = sample_lengths(samples, ids, features, strategy=name)   S_i; each feature has it, one per sample
    padded  = pad_right([s[name] for s in samples])                    [B, max S_i, ...], zeros after S_i

:func:`pad_features` does both for a list of feature names.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from specforge_core.checksums import copy_checked
from specforge_core.errors import SpecforgeError
from specforge_core.heap import empty_reused


class CollateError(SpecforgeError):
    """Samples cannot be batched: no samples, a feature is missing, or feature shapes disagree."""


def sample_lengths(samples: Sequence[Mapping[str, Any]], sample_ids: Sequence[str], features: Sequence[str], *,
                   strategy: str) -> list[int]:
    """Each sample's length ``S_i``, after checking it holds every one of ``features``, all ``S_i`` long.

    ``strategy`` names the capture plan the samples should have come from, for the messages.
    """
    if not samples:
        raise CollateError(f"{strategy} collate got no samples; a batch needs at least one")
    if len(sample_ids) != len(samples):
        raise CollateError(f"{strategy} collate got {len(samples)} samples but {len(sample_ids)} sample ids")
    lengths = []
    for sample, sample_id in zip(samples, sample_ids):
        absent = [name for name in features if name not in sample]
        if absent:
            raise CollateError(f"sample {sample_id!r} lacks feature(s) {absent} (it has {sorted(sample)}); it was "
                               f"not captured with the {strategy} capture plan: capture it again with "
                               f"--strategy {strategy}")
        for name in features:
            if sample[name].dim() == 0:
                raise CollateError(f"feature {name!r} of sample {sample_id!r} is a scalar; features are per token, "
                                   "of shape [S, ...]")
        by_name = {name: int(sample[name].shape[0]) for name in features}
        if len(set(by_name.values())) != 1:
            raise CollateError(f"sample {sample_id!r} has features of different lengths: {by_name}; every feature "
                               "of a sample needs its length S first")
        lengths.append(by_name[features[0]])
    return lengths


def pad_right(tensors: Sequence[torch.Tensor], *, value: float = 0, dtype: torch.dtype | None = None,
              names: Sequence[str] | None = None) -> torch.Tensor:
    """``tensors [S_i, *rest]`` right-padded with ``value`` and stacked: ``[B, max S_i, *rest]``.

    The result has ``dtype`` (default: the first tensor's) and the first tensor's device.
    Only the first (sequence) dim may differ between tensors; a zero-length tensor gives a
    row of ``value``. ``names`` label the tensors in error messages (default ``tensor i``).
    """
    if not tensors:
        raise CollateError("pad_right got no tensors; a batch needs at least one sample")
    names = list(names) if names is not None else [f"tensor {i}" for i in range(len(tensors))]
    first = tensors[0]
    for name, tensor in zip(names, tensors):
        if tensor.dim() == 0:
            raise CollateError(f"{name} is a scalar; pad_right pads tensors of shape [S, ...] along S")
        if tensor.shape[1:] != first.shape[1:]:
            raise CollateError(f"{name} has shape {list(tensor.shape)} but {names[0]} has {list(first.shape)}: "
                               "only the first (sequence) dim may differ between samples")
    longest = max(int(tensor.shape[0]) for tensor in tensors)
    # Each element written once: rows copied, then only their tails filled. Filling the whole batch
    # first took 1.18-1.47x as long for 8 samples of 1-8 MiB (docs/benchmarks.md).
    # A large batch reuses the memory of an earlier one nothing holds any more, or faults its fresh pages in
    # 2 MiB at a time (specforge_core.heap.empty_reused).
    out = empty_reused((len(tensors), longest, *first.shape[1:]), dtype or first.dtype, first.device)
    for row, tensor in enumerate(tensors):
        length = int(tensor.shape[0])
        copy_checked(out[row, :length], tensor)  # a verifying store's check of the tensor runs just before
        if length < longest:
            out[row, length:] = value
    return out


def pad_features(samples: Sequence[Mapping[str, torch.Tensor]], sample_ids: Sequence[str], features: Sequence[str],
                 *, strategy: str, dtypes: Mapping[str, torch.dtype] | None = None
                 ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``features`` of every sample, zero-padded to the longest (:func:`pad_right`), and the unpadded lengths.

    Checks the samples first (:func:`sample_lengths`). ``dtypes`` casts chosen features
    (e.g. ``input_ids`` to int64); the others keep their first sample's dtype.
    """
    lengths = sample_lengths(samples, sample_ids, features, strategy=strategy)
    dtypes = dtypes or {}
    padded = {name: pad_right([sample[name] for sample in samples], dtype=dtypes.get(name),
                              names=[f"feature {name!r} of sample {sample_id!r}" for sample_id in sample_ids])
              for name in features}
    return padded, lengths
