"""ReferenceTarget: a small causal LM in plain torch, a real target for conformance tests.

Llama-shaped (token embedding, decoder layers of RMSNorm, rotary grouped-query attention and
a SwiGLU MLP, final norm, lm_head) with random weights drawn from a seed, computed in float64.
It implements the :class:`~specforge_core.protocols.TargetEngine` protocol — ``info``,
``capture``, ``frozen_parts``, ``session`` — so a strategy's ``speculate`` can be checked
against the target's greedy decode without transformers or a checkpoint: losslessness does
not depend on what the target learned.

A session recomputes the whole sequence on every ``extend`` (no cache to get wrong), so its
outputs for a position depend only on the tokens up to it: chunked, truncated and one-shot
forwards agree exactly.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..errors import TargetEngineError
from ..nn import apply_rope, rope_cos_sin
from ..protocols import CapturePlan, TargetInfo


class ReferenceTarget:
    """A seeded random causal LM implementing the target engine protocol (float64 inside, ``dtype`` outside)."""

    def __init__(self, *, num_layers: int = 8, hidden_size: int = 32, vocab_size: int = 97, num_heads: int = 4,
                 num_kv_heads: int = 2, intermediate_size: int = 64, seed: int = 1234, dtype: str = "float32",
                 eos_token_id: int | None = 1, tokenizer: Any = None) -> None:
        self.num_layers, self.hidden_size, self.vocab_size = num_layers, hidden_size, vocab_size
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.intermediate_size = intermediate_size
        self.dtype = dtype
        self.eos_token_id = eos_token_id
        self._tokenizer = tokenizer
        self._greedy: dict[tuple[int, ...], list[int]] = {}  # prompt -> the longest continuation decoded so far
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape: int, scale: float | None = None) -> torch.Tensor:
            std = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

        d, kv = self.head_dim, num_kv_heads * self.head_dim
        self.embed = weight(vocab_size, hidden_size, scale=1.0)
        self.layers = [{"q": weight(num_heads * d, hidden_size), "k": weight(kv, hidden_size),
                        "v": weight(kv, hidden_size), "o": weight(hidden_size, num_heads * d),
                        "gate": weight(intermediate_size, hidden_size), "up": weight(intermediate_size, hidden_size),
                        "down": weight(hidden_size, intermediate_size),
                        "norm1": 1.0 + 0.1 * weight(hidden_size, scale=1.0),
                        "norm2": 1.0 + 0.1 * weight(hidden_size, scale=1.0)} for _ in range(num_layers)]
        self.final_norm = 1.0 + 0.1 * weight(hidden_size, scale=1.0)
        self.lm_head = weight(vocab_size, hidden_size) * 4.0  # peaked next-token distributions

    # -- what strategies ask first ------------------------------------------------------------

    def info(self) -> TargetInfo:
        """Layers, widths, vocabulary, dtype, and the Llama fields drafts copy."""
        return TargetInfo(num_layers=self.num_layers, hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                          dtype=self.dtype, model_id="specforge/reference-target",
                          extra={"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                                 "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                                 "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
                                 "mask_token_id": self.vocab_size - 1, "pad_token_id": 0,
                                 "eos_token_id": self.eos_token_id, "bos_token_id": 2})

    @property
    def tokenizer(self) -> Any:
        """The tokenizer given at construction (this target works on token ids; None by default)."""
        return self._tokenizer

    def frozen_parts(self) -> dict[str, torch.Tensor]:
        """``embed_tokens [V, H]``, ``lm_head [V, H]`` and the final ``norm [H]``, in the target's dtype."""
        out = getattr(torch, self.dtype)
        return {"embed_tokens": self.embed.to(out), "lm_head": self.lm_head.to(out), "norm": self.final_norm.to(out)}

    # -- forward ---------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, layer_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """One forward over 1-D ``ids``: logits ``[S, V]``, the outputs of ``layer_ids`` and the last hidden state."""
        positions = torch.arange(ids.numel())
        cos, sin = (t.double()[:, None] for t in rope_cos_sin(positions, self.head_dim, 10000.0))  # [S, 1, d]
        causal = torch.ones(ids.numel(), ids.numel(), dtype=torch.bool).tril()
        x = self.embed[ids]
        outputs = {}
        for index, layer in enumerate(self.layers):
            h = _rms(x, layer["norm1"])
            q = apply_rope((h @ layer["q"].T).view(-1, self.num_heads, self.head_dim), cos, sin)
            k = apply_rope((h @ layer["k"].T).view(-1, self.num_kv_heads, self.head_dim), cos, sin)
            v = (h @ layer["v"].T).view(-1, self.num_kv_heads, self.head_dim)
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            attended = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                      attn_mask=causal)  # [heads, S, d]
            x = x + attended.transpose(0, 1).reshape(ids.numel(), -1) @ layer["o"].T
            h = _rms(x, layer["norm2"])
            x = x + (F.silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T
            if index in layer_ids:
                outputs[index] = x
        last = _rms(x, self.final_norm)
        return {"logits": last @ self.lm_head.T, "layers": outputs, "last_hidden": last}

    def _check_plan(self, plan: CapturePlan) -> None:
        # Layer id i is the hidden state entering decoder layer i+1, what serving engines capture: the
        # last layer's output (id L-1) is no layer's input, so the servable ids are 0..L-2.
        bad = [i for i in plan.layer_ids if not 0 <= i <= self.num_layers - 2]
        if bad:
            raise TargetEngineError(f"capture plan layer ids {bad} are not layers a serving engine captures: this "
                                    f"target's ids are 0..{self.num_layers - 2} (id i is the input of decoder "
                                    "layer i+1)")

    def _features(self, result: Mapping[str, Any], plan: CapturePlan, start: int) -> dict[str, torch.Tensor]:
        """The plan's features of positions ``start:`` of a forward, in the plan's dtypes (default: the target's)."""
        def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
            spec = plan.features.get(name)
            return tensor[start:].to(getattr(torch, spec.dtype if spec is not None else self.dtype)).contiguous()

        out = {}
        if plan.layer_ids:
            out[plan.hidden_feature] = cast(plan.hidden_feature,
                                            torch.cat([result["layers"][i] for i in plan.layer_ids], dim=-1))
        if plan.last_hidden:
            out["last_hidden"] = cast("last_hidden", result["last_hidden"])
        return out

    def capture(self, samples: Sequence[Mapping[str, Any]], plan: CapturePlan) -> list[dict[str, Any]]:
        """Each sample's plan features, unpadded (one forward per sample; other sample keys pass through)."""
        self._check_plan(plan)
        captured = []
        for sample in samples:
            ids = torch.as_tensor(sample["input_ids"], dtype=torch.long).flatten()
            captured.append({**sample, "input_ids": ids, **self._features(self._forward(ids, plan.layer_ids), plan, 0)})
        return captured

    def session(self, prompt_ids: Any, plan: CapturePlan) -> ReferenceSession:
        """A :class:`~specforge_core.protocols.VerifySession` over ``prompt_ids`` (None: empty)."""
        self._check_plan(plan)
        return ReferenceSession(self, prompt_ids, plan)

    @torch.no_grad()
    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """The target's greedy continuation of ``prompt_ids`` (stopping after ``eos_token_id``).

        One full forward per token (the reference has no cache); a continuation already decoded
        for the same prompt is reused and extended, since a greedy decode is a prefix of a longer one.
        """
        key = tuple(int(t) for t in prompt_ids)
        new = list(self._greedy.get(key, []))
        while len(new) < max_new_tokens and (not new or new[-1] != self.eos_token_id):
            new.append(int(self._forward(torch.tensor(list(key) + new), ())["logits"][-1].argmax()))
        self._greedy[key] = new
        return new[:max_new_tokens]


class ReferenceSession:
    """A verify session of :class:`ReferenceTarget`: the token list, recomputed on every ``extend``."""

    def __init__(self, target: ReferenceTarget, prompt_ids: Any, plan: CapturePlan) -> None:
        self._target, self._plan = target, plan
        self._tokens = torch.zeros(0, dtype=torch.long)
        self.prefill: dict[str, torch.Tensor] | None = None
        if prompt_ids is not None:
            self.prefill = self.extend(prompt_ids)

    @property
    def length(self) -> int:
        return int(self._tokens.numel())

    @torch.no_grad()
    def extend(self, ids: Any) -> dict[str, torch.Tensor]:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self._target.vocab_size:
            raise TargetEngineError(f"session.extend needs 1 or more token ids in 0..{self._target.vocab_size - 1}, "
                                    f"got {ids.tolist()}")
        start = self.length
        self._tokens = torch.cat([self._tokens, ids])
        result = self._target._forward(self._tokens, self._plan.layer_ids)
        return {"logits": result["logits"][start:].to(getattr(torch, self._target.dtype)),
                **self._target._features(result, self._plan, start)}

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise TargetEngineError(f"session.truncate({length!r}): length must be an integer in 0..{self.length}")
        self._tokens = self._tokens[:length]


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

