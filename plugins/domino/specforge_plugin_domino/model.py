"""The Domino draft network: DFlash's backbone plus the correction head (docs/algorithms.md, "Domino").

    hidden  = DFlashBackbone(target_hidden, block)            [.., bs, H]   h_k, unchanged DFlash
    base    = lm_head(hidden)                                 [.., bs, V]   frozen target lm_head
    states  = prefix_gru(embed(block tokens))                 [.., bs, g]   g_k, see the alignment below
    corr    = embed_proj([hidden ; states])                   [.., bs, V]   Linear(H+g -> e) -> SiLU -> Linear(e -> V)
    final_k = base_k + corr_k   for k >= suffix_start;  base_k otherwise

``prefix_gru`` is ``GRU(H -> g, 1 layer, no bias)`` over the **frozen target embeddings** of
the block's tokens: in training the real tokens (teacher forcing), when drafting the drafted
ones. With ``shift_label`` the state at position k has read tokens ``a..a+k``, otherwise
``a..a+k-1`` (a = the anchor); see :mod:`specforge_plugin_domino.config`.

The head's modules carry the names of the reference Domino draft (``prefix_gru.weight_ih_l0``,
``prefix_gru.weight_hh_l0``, ``embed_proj.0.weight``, ``embed_proj.2.weight``), so DFlash's
export writes them next to the backbone's keys unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specforge_core.nn import Linear
from specforge_plugin_dflash.config import DFlashConfig
from specforge_plugin_dflash.model import DFlashBackbone

from .config import DominoHeadConfig
from .gru import FusedGRU
from .head_loss import DualHeadSums, DualHeadTerms, dual_head_terms


class CorrectionProjection(nn.Sequential):
    """``embed_proj``: ``Linear(H+g -> e) -> SiLU -> Linear(e -> V)``, the reference's module and parameter names.

    With ``terms`` (training) its forward returns instead the fused cross-entropies of both heads
    (:func:`~specforge_plugin_domino.head_loss.dual_head_terms`, the fields of :class:`DualHeadSums`
    as plain tensors): the correction is never materialised apart from them. One call, the
    module's forward, so FSDP2 has gathered the weights, and hooks those tensors to gather them
    again for backward.
    """

    def __init__(self, inputs: int, width: int, vocab_size: int) -> None:
        super().__init__(Linear(inputs, width, bias=False), nn.SiLU(), Linear(width, vocab_size, bias=False))

    def forward(self, x: torch.Tensor,
                terms: DualHeadTerms | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if terms is None:
            return super().forward(x)
        return dual_head_terms(self[1](self[0](x)), self[2].weight, terms)


class DominoBackbone(DFlashBackbone):
    """A :class:`DFlashBackbone` with Domino's prefix GRU and logit correction as extra attributes.

    The DFlash parameters keep their names and initialisation; ``embed_proj``'s linears are
    initialised like DFlash's (normal, ``init_std``), the GRU with PyTorch's default
    (uniform in ``±1/sqrt(g)``). The head is created in ``dtype`` like the backbone.
    """

    def __init__(self, config: DFlashConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor, *,
                 head: DominoHeadConfig, attention: str = "sdpa", dtype: torch.dtype = torch.float32,
                 init_std: float = 0.02) -> None:
        super().__init__(config, embed_tokens, lm_head, attention=attention, dtype=dtype, init_std=init_std)
        self.head_config = head  # checked against the block size where it was made (DominoHeadConfig.from_*)
        hidden, gru = config.hidden_size, head.gru_hidden_dim
        self.prefix_gru = FusedGRU(hidden, gru)
        self.embed_proj = CorrectionProjection(hidden + gru, head.emb_dim, config.vocab_size)
        for layer in (self.embed_proj[0], self.embed_proj[2]):
            nn.init.normal_(layer.weight, std=init_std)
        self.prefix_gru.to(dtype)
        self.embed_proj.to(dtype)

    def prefix_states(self, tokens: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The GRU over the frozen embeddings of ``tokens [M, T]``, from ``state [1, M, g]`` (zeros if None).

        Returns the state after each token ``[M, T, g]`` and the last one ``[1, M, g]``.
        """
        return self.prefix_gru(self.embed(tokens), state)

    def block_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced GRU state ``g_k`` of every block position: ``tokens [.., bs]`` -> ``[.., bs, g]``.

        ``tokens`` are the real tokens at ``anchor + 0..bs-1``. With ``shift_label`` position k
        gets the state after ``tokens[0..k]``; otherwise after ``tokens[0..k-1]``, and position 0
        (never corrected then) gets zeros.
        """
        bs = tokens.shape[-1]
        steps = self.head_config.gru_steps(bs)
        states, _ = self.prefix_states(tokens.reshape(-1, bs)[:, :steps])  # [M, steps, g]
        states = F.pad(states, (0, 0, bs - steps, 0))  # [M, bs, g]: state k = after token k - (bs - steps)
        return states.view(*tokens.shape, -1)

    def correction(self, hidden: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """``embed_proj([h ; g])``: ``[.., H]`` and ``[.., g]`` -> ``[.., V]`` float32 logits."""
        return self.embed_proj(torch.cat([hidden, states], dim=-1)).float()

    def corrected_suffix(self, base: torch.Tensor, hidden: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The final logits of block positions ``>= suffix_start`` only: ``base_k + corr_k``, ``[.., bs - start, V]``
        (below ``suffix_start`` the final logits are the base ones)."""
        start = self.head_config.suffix_start
        corrected = base[..., start:, :] + self.correction(hidden[..., start:, :], states[..., start:, :])
        return corrected.to(base.dtype)

    def dual_head_loss(self, states: torch.Tensor, terms: DualHeadTerms) -> DualHeadSums:
        """Both heads' fused cross-entropies of a chunk of blocks: its GRU states ``[B, c, bs, g]``, and in ``terms``
        its hidden states ``[B, c, bs, H]``, labels and weights (:mod:`specforge_plugin_domino.head_loss`)."""
        start = self.head_config.suffix_start
        return DualHeadSums(*self.embed_proj(torch.cat([terms.hidden[..., start:, :], states[..., start:, :]], dim=-1),
                                             terms))

    def final_logits(self, base: torch.Tensor, hidden: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Base logits ``[.., bs, V]`` with the correction added at block positions ``>= suffix_start``.

        ``hidden [.., bs, H]`` and ``states [.., bs, g]`` are the same positions' ``h_k`` and ``g_k``.
        """
        start = self.head_config.suffix_start
        return torch.cat([base[..., :start, :], self.corrected_suffix(base, hidden, states)], dim=-2)
