"""The DFlash training data path: anchors, blocks, labels and weights, the block attention mask.

A sample of length S with ``loss_mask`` gives blocks like this (bs = block size)::

    valid anchors  i with loss_mask[i] = loss_mask[i+1] = 1
    anchors        up to num_anchors of them, uniformly, sorted        [B, N]  (keep marks real ones)
    block b        [token at anchor_b, MASK x (bs-1)]                  [B, N, bs]
    positions      anchor_b + 0..bs-1                                   [B, N, bs]
    labels         token at anchor_b + k (+ label_shift)                [B, N, bs]
    weights        keep * [j < S] * [k + shift > 0] * loss_mask[j] * exp(-(k + shift - 1)/gamma),
                   j = anchor_b + k + shift

Queries are the N*bs block tokens; keys are the S context positions followed by the block
tokens. Block b sees the context strictly before its anchor and its own block, both ways.
Training attends in groups of blocks (:func:`grouped_block_attention`): anchors are sorted,
so a group of neighbouring blocks needs only the context up to its last anchor and its own
blocks' keys, and the dense ``[N*bs, S + N*bs]`` pattern (mostly masked out) is never
computed.

Randomness: each sample draws its anchors from its own generator seeded by
``(seed, step, sample_id)`` (:func:`anchor_generator`), so the anchors do not depend on
which other samples share the batch, on the loader's threads, or on global RNG state, and
a resumed run draws exactly the same ones.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Iterator, Sequence

import attrs
import torch


@attrs.frozen
class Blocks:
    """The blocks drawn from a batch (N = the most anchors any row kept; at least 1).

    ``keep [B, N]`` is False on padding blocks of rows that kept fewer anchors (their
    anchor is 0, their token ids are all MASK, their weights are 0); ``num_valid [B]``
    counts each sample's valid anchors before the ``num_anchors`` cap (0 = the sample
    supervises nothing and is reported, not trained on).
    """

    anchors: torch.Tensor  # [B, N] long
    keep: torch.Tensor  # [B, N] bool
    num_valid: torch.Tensor  # [B] long
    ids: torch.Tensor  # [B, N, bs] long: [anchor token, MASK x (bs-1)]
    positions: torch.Tensor  # [B, N, bs] long: anchor + k
    tokens: torch.Tensor  # [B, N, bs] long: the real token at anchor + k (clamped; teacher forcing for heads)
    labels: torch.Tensor  # [B, N, bs] long: token at anchor + k + label_shift (clamped into the sequence)
    label_mask: torch.Tensor  # [B, N, bs] bool: the supervised positions (accuracy counts these)
    weights: torch.Tensor  # [B, N, bs] float32: label_mask times the decay

    @property
    def block_size(self) -> int:
        return self.ids.shape[-1]


def valid_anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: position i is a valid anchor iff ``loss_mask[i] = loss_mask[i+1] = 1``."""
    mask = loss_mask.bool()
    valid = torch.zeros_like(mask)
    valid[:, :-1] = mask[:, :-1] & mask[:, 1:]
    return valid


def anchor_generator(seed: int, step: int, sample_id: str) -> torch.Generator:
    """A CPU generator seeded by ``(seed, step, sample_id)`` through SHA-256 (stable across processes)."""
    digest = hashlib.sha256(f"{seed}\x00{step}\x00{sample_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` valid anchors per row, uniformly without replacement, sorted.

    ``generators`` holds one generator per row. Returns ``anchors [B, N]`` (0 where not
    kept), ``keep [B, N]`` bool and ``num_valid [B]``, on ``loss_mask``'s device, with
    ``N = max(1, most anchors kept by a row)``. Sampling runs on CPU.
    """
    if len(generators) != loss_mask.shape[0]:
        raise ValueError(f"sample_anchors needs one generator per row: {len(generators)} for {loss_mask.shape[0]} rows")
    valid = valid_anchor_mask(loss_mask.detach().cpu())
    picked = []
    for row, generator in zip(valid, generators):
        candidates = row.nonzero().flatten()
        choice = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        picked.append(candidates[choice].sort().values)
    width = max(1, max(p.numel() for p in picked))
    anchors = torch.zeros(len(picked), width, dtype=torch.long)
    keep = torch.zeros(len(picked), width, dtype=torch.bool)
    for b, row in enumerate(picked):
        anchors[b, : row.numel()] = row
        keep[b, : row.numel()] = True
    device = loss_mask.device
    return anchors.to(device), keep.to(device), valid.sum(1).to(device)


def decay_weights(block_size: int, gamma: float | None, *, label_shift: int = 0,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """``[bs]`` float32: ``exp(-(k + label_shift - 1)/gamma)`` (ones if ``gamma`` is None; k + shift = 0 gets 1)."""
    distance = (torch.arange(block_size, device=device, dtype=torch.float32) + label_shift - 1).clamp(min=0)
    return torch.ones_like(distance) if gamma is None else torch.exp(-distance / gamma)


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                 num_valid: torch.Tensor, *, block_size: int, mask_token_id: int, gamma: float | None = None,
                 label_shift: int = 0) -> Blocks:
    """Blocks, labels and weights for ``anchors [B, N]`` over ``input_ids``/``loss_mask [B, S]``.

    ``label_shift`` = 0 is DFlash (position k predicts ``anchor + k``; position 0, the
    anchor itself, is not supervised); Domino's ``shift_label`` uses 1 (position k predicts
    ``anchor + k + 1``; position 0 supervised; decay ``exp(-k/gamma)``).
    """
    seq_len = input_ids.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors[:, :, None] + offsets  # [B, N, bs]
    ids = torch.full_like(positions, mask_token_id)
    ids[:, :, 0] = torch.where(keep, torch.gather(input_ids, 1, anchors), mask_token_id)
    tokens = torch.gather(input_ids, 1, positions.clamp(max=seq_len - 1).flatten(1)).view_as(positions)
    target = positions + label_shift  # index of each position's label
    inside = target < seq_len
    safe = target.clamp(max=seq_len - 1).flatten(1)  # [B, N*bs]
    labels = torch.gather(input_ids, 1, safe).view_as(positions)
    supervised = torch.gather(loss_mask, 1, safe).view_as(positions).bool()
    label_mask = keep[:, :, None] & inside & (offsets + label_shift > 0) & supervised
    weights = label_mask.float() * decay_weights(block_size, gamma, label_shift=label_shift, device=input_ids.device)
    return Blocks(anchors=anchors, keep=keep, num_valid=num_valid, ids=ids, positions=positions, tokens=tokens,
                  labels=labels, label_mask=label_mask, weights=weights)


def draw_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, sample_ids: Sequence[str], *, seed: int, step: int,
                num_anchors: int, block_size: int, mask_token_id: int, gamma: float | None = None,
                label_shift: int = 0) -> Blocks:
    """Sample anchors (one :func:`anchor_generator` per sample) and build their blocks."""
    generators = [anchor_generator(seed, step, sample_id) for sample_id in sample_ids]
    anchors, keep, num_valid = sample_anchors(loss_mask, num_anchors, generators)
    return build_blocks(input_ids, loss_mask, anchors, keep, num_valid, block_size=block_size,
                        mask_token_id=mask_token_id, gamma=gamma, label_shift=label_shift)


def block_attention_mask(anchors: torch.Tensor, lengths: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """``[B, N*bs, S + N*bs]`` bool, True = the query may attend the key.

    Keys are the ``S = seq_len`` context positions followed by the ``N*bs`` block tokens.
    A query of block b sees context positions ``< anchors[:, b]`` that are inside the
    sample (``< lengths``), and every token of its own block; nothing of other blocks.
    A padding block (anchor 0) sees only itself, so no query row is empty.
    """
    batch, num_blocks = anchors.shape
    queries = num_blocks * block_size
    device = anchors.device
    key_pos = torch.arange(seq_len, device=device)
    anchor_of_query = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    context = (key_pos < anchor_of_query[:, :, None]) & (key_pos < lengths[:, None, None])  # [B, Q, S]
    block_of = torch.arange(queries, device=device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(batch, queries, queries)  # [B, Q, Q]
    return torch.cat([context, own_block], dim=-1)



@attrs.frozen
class AttentionGroup:
    """Block queries ``start:end`` (of the flattened ``N*bs``), which see context keys ``0:context``
    and the keys of their own group's blocks (``anchors [B, n]``: the group's blocks, of ``bs`` tokens)."""

    start: int
    end: int
    context: int
    anchors: torch.Tensor
    lengths: torch.Tensor  # [B]
    block_size: int

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """``[B, 1, end-start, context + end-start]`` bool (True = attend): :func:`block_attention_mask` cut to
        the group's keys. Built on first use (the masked kernels; CPU's path takes :meth:`GroupedBlockAttention.
        context_biases` instead)."""
        return block_attention_mask(self.anchors, self.lengths, self.context, self.block_size)[:, None]


@attrs.frozen
class GroupedBlockAttention:
    """The block attention pattern cut into groups of neighbouring blocks (see :func:`grouped_block_attention`).

    Passed to :meth:`~specforge_plugin_dflash.model.DFlashBackbone.run_layers` in place of the
    dense mask; built once per batch and shared by every layer.
    """

    seq_len: int  # S: the context keys precede the block keys
    groups: tuple[AttentionGroup, ...]
    block_size: int  # bs: block b's keys are block_size consecutive block keys
    visible: torch.Tensor  # [B, N]: how many context keys each block sees, min(anchor, length)

    @functools.cached_property
    def context_bias(self) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]:
        """:meth:`context_biases`, made once, on first use, and kept with the pattern: for callers that share
        them across layers and passes (float32 steps)."""
        return tuple(self.context_biases())

    def context_biases(self) -> Iterator[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per group, in order: the context part of its mask as an additive float32 bias ``[B, 1, Qg, context]``
        (0 = visible, -inf = not) and which query rows see no context key ``[B, 1, Qg]``; None for a group
        with no context.

        Made afresh, group by group, as the caller steps through them: a caller that drops each before the
        next keeps one group's at a time, where :attr:`context_bias` keeps every group's for the whole step
        (in the tiny bf16 DFlash step of ``bench/versus_reference.py``, 1.45 of the 16 MB it had in use at
        its peak). A group's rows are whole blocks whose rows see the same keys: one comparison of key
        positions against each block's visible count, then repeated over the block's rows (about 40 us
        for 64 rows of 500 keys, where comparing every row took 140)."""
        bs, device = self.block_size, self.visible.device
        keys = torch.arange(max((group.context for group in self.groups), default=0), device=device)
        seen, unseen = (torch.tensor(value, dtype=torch.float32, device=device) for value in (0.0, float("-inf")))
        for group in self.groups:
            if group.context == 0:
                yield None
                continue
            visible = self.visible[:, group.start // bs:group.end // bs]  # [B, n]: the group's blocks
            batch, blocks = visible.shape
            bias = torch.where(keys[:group.context] < visible[:, None, :, None], seen, unseen)  # [B, 1, n, context]
            bias = bias[:, :, :, None].expand(-1, -1, -1, bs, -1).reshape(batch, 1, blocks * bs, group.context)
            yield bias, (visible == 0).repeat_interleave(bs, dim=1)[:, None]


def grouped_block_attention(anchors: torch.Tensor, lengths: torch.Tensor, seq_len: int, block_size: int,
                            blocks_per_group: int) -> GroupedBlockAttention:
    """:func:`block_attention_mask`'s pattern, in groups of ``blocks_per_group`` blocks.

    Anchors are sorted per row, so group g (blocks ``g*n .. g*n+n-1``) sees no context key
    at or after ``max(min(anchor, length))`` over its blocks and rows, and nothing of other
    groups' blocks: attention over its keys only is the dense pattern's result (masked keys
    weigh exactly 0) at about ``(S/2 + n*bs) / (S + N*bs)`` of its work. Costs one
    device-to-host copy of the group bounds per batch.
    """
    visible = torch.minimum(anchors, lengths[:, None].to(anchors.dtype))  # [B, N]: context keys each block sees
    starts = range(0, anchors.shape[1], blocks_per_group)
    contexts = torch.stack([visible[:, b:b + blocks_per_group].max() for b in starts]).tolist()
    groups = tuple(AttentionGroup(first * block_size, min(first + blocks_per_group, anchors.shape[1]) * block_size,
                                  context, anchors[:, first:first + blocks_per_group], lengths, block_size)
                   for first, context in zip(starts, contexts))
    return GroupedBlockAttention(seq_len, groups, block_size, visible)
