"""Test helpers for EAGLE3 and strategies built on it: a tiny random target and batches over it.

    info, frozen = tiny_target()                    4 layers, H = 16, V = 11, 4 heads / 2 kv, no model behind
    samples, batch = tiny_batch(strategy, info, lengths=(5, 3))

Imports torch.
"""

from __future__ import annotations

import torch

from specforge_core.protocols import TargetInfo

V, H = 11, 16


def tiny_target(vocab: int = V, hidden: int = H, layers: int = 4) -> tuple[TargetInfo, dict[str, torch.Tensor]]:
    """A small Llama-shaped target description and seeded random frozen parts (no model behind them)."""
    info = TargetInfo(num_layers=layers, hidden_size=hidden, vocab_size=vocab, extra={
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 64})
    gen = torch.Generator().manual_seed(0)
    frozen = {"embed_tokens": torch.randn(vocab, hidden, generator=gen),
              "lm_head": torch.randn(vocab, hidden, generator=gen), "norm": torch.ones(hidden)}
    return info, frozen


def tiny_batch(strategy, info: TargetInfo, lengths: tuple[int, ...] = (5, 3), seed: int = 1, prompt: int = 1):
    """``(samples, batch)``: seeded random samples of ``lengths`` tokens (the first ``prompt`` of them a prompt)
    with the features EAGLE3 captures, and ``strategy``'s collate of them."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.long)
        mask[:prompt] = 0
        samples.append({"input_ids": torch.randint(0, info.vocab_size, (n,), generator=gen),
                        "loss_mask": mask,
                        "aux_hidden": torch.randn(n, 3 * info.hidden_size, generator=gen),
                        "last_hidden": torch.randn(n, info.hidden_size, generator=gen)})
    return samples, strategy.collate(samples, [f"s{i}" for i in range(len(samples))])
