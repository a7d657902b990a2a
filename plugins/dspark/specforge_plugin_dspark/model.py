"""The DSpark draft network: DFlash's backbone plus a Markov head and a confidence head (docs/algorithms.md, "DSpark").

    hidden  = DFlashBackbone(target_hidden, block)              [.., bs, H]   h_k, unchanged DFlash
    base    = lm_head(hidden)                                   [.., bs, V]   frozen target lm_head
    logits  = base + markov_w2(markov_w1(prev_k))               [.., bs, V]   prev_k = the token before slot k
    conf    = proj([h_k ; markov_w1(prev_k)])                   [.., bs]      a logit: will slot k be accepted?

Block slot k predicts the token ``anchor + k + 1``, so the token before it is ``anchor + k``:
in training the real token (teacher forcing), when drafting the anchor for slot 0 and the
previous slot's draft after that. Module names are those of SGLang's DSpark draft
(``markov_head.markov_w1``, ``markov_head.markov_w2``, ``confidence_head.proj``), so DFlash's
export writes them next to the backbone's keys unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from specforge_core.nn import Linear
from specforge_plugin_dflash.config import DFlashConfig
from specforge_plugin_dflash.model import DFlashBackbone

from .config import DSparkHeadConfig
from .head_loss import DistillationSums, DistillationTerms, distillation_terms


class MarkovHead(nn.Module):
    """The ``vanilla`` Markov head: a rank-r logit bias from the previous token alone."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, vocab_size, bias=False)

    def forward(self, previous: torch.Tensor,
                terms: DistillationTerms | None = None) -> tuple[torch.Tensor, torch.Tensor | DistillationSums]:
        """Token ids ``[...]`` -> their embedding ``markov_w1(previous) [..., r]`` and the logit bias
        ``markov_w2(embedding) [..., V]`` (float32). One call (the module's forward, which FSDP2 hooks)
        gives both, for the logits and the confidence head.

        With ``terms`` (training) the second result is instead the fused cross-entropy and L1 terms
        of the logits this bias belongs to (:mod:`specforge_plugin_dspark.head_loss`): the bias is
        never materialised apart from them.
        """
        embedding = self.markov_w1(previous)
        if terms is not None:
            return embedding, distillation_terms(embedding, self.markov_w2.weight, terms)
        return embedding, self.markov_w2(embedding).float()


class ConfidenceHead(nn.Module):
    """``proj: Linear(H [+ r] -> 1)`` over the draft hidden state (and the previous token's Markov embedding)."""

    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.proj = Linear(inputs, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., inputs]`` -> confidence logits ``[...]`` (float32; sigmoid gives the probability)."""
        return self.proj(features).squeeze(-1).float()


class DSparkBackbone(DFlashBackbone):
    """A :class:`DFlashBackbone` with DSpark's Markov head and confidence head as extra attributes.

    The DFlash parameters keep their names and initialisation; the heads' weights are drawn
    like DFlash's linears (normal, ``init_std``; the confidence bias starts at 0) and created
    in ``dtype``.
    """

    def __init__(self, config: DFlashConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor, *,
                 head: DSparkHeadConfig, attention: str = "sdpa", dtype: torch.dtype = torch.float32,
                 init_std: float = 0.02) -> None:
        super().__init__(config, embed_tokens, lm_head, attention=attention, dtype=dtype, init_std=init_std)
        self.head_config = head
        self.markov_head = MarkovHead(config.vocab_size, head.markov_rank)
        self.confidence_head = ConfidenceHead(head.confidence_inputs(config.hidden_size))
        for weight in (self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight,
                       self.confidence_head.proj.weight):
            nn.init.normal_(weight, std=init_std)
        nn.init.zeros_(self.confidence_head.proj.bias)
        self.markov_head.to(dtype)
        self.confidence_head.to(dtype)

    def markov_logits(self, base: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """``base [..., V]`` plus the Markov bias of the ``previous`` tokens ``[...]``: the logits DSpark drafts from."""
        return base + self.markov_head(previous)[1]

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor,
                   embedding: torch.Tensor | None = None) -> torch.Tensor:
        """Confidence logits ``[...]`` of slots with final hidden states ``[..., H]`` after ``previous`` tokens ``[...]``.

        ``embedding`` is ``previous``'s Markov embedding when the caller already has it (from
        :class:`MarkovHead`'s forward), so the head is not run twice.
        """
        features = hidden.to(self.dtype)
        if self.head_config.confidence_with_markov:
            if embedding is None:
                embedding = self.markov_head(previous)[0]
            features = torch.cat([features, embedding.to(self.dtype)], dim=-1)
        return self.confidence_head(features)
