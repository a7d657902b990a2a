"""The ``eagle3`` strategy: what to capture, how to build, batch, train, export and decode.

Per sample it stores ``input_ids [S]``, ``loss_mask [S]``, ``aux_hidden [S, 3H]`` (three
target layers) and ``last_hidden [S, H]`` (the lm_head input; the teacher's logits are
recomputed from it with the frozen target lm_head instead of being stored).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import attrs
import torch

from specforge_core.contracts import FeatureSpec, StepOutput, TrainBatch
from specforge_core.data.collate import CollateError, pad_features
from specforge_core.errors import SpecforgeError
from specforge_core.hfconfig import config_value, rope_theta
from specforge_core.nn import compile_layers
from specforge_core.protocols import BuildContext, CapturePlan, DataStats, SpeculationResult, TargetInfo, VerifySession
from specforge_core.serving import DEFAULT_EXPORT_DTYPE

from .export import export_draft, load_draft
from .loss import align, round_depth, simulated_acceptance, tau_sim, teacher, ttt_loss, unroll_windows
from .model import Eagle3Config, Eagle3Draft
from .options import Eagle3Options, data_sized_vocab, resolve_aux_layer_ids, resolve_draft_vocab_size
from .speculate import speculate
from .vocab import build_vocab_mapping

AUX_FEATURE = "aux_hidden"
FEATURES = ("input_ids", "loss_mask", AUX_FEATURE, "last_hidden")


#: Stored samples do not match the eagle3 capture plan (the error every strategy's collate raises).
Eagle3BatchError = CollateError


class Eagle3Strategy:
    """EAGLE3 (arXiv 2503.01840), built as ``Eagle3Strategy(options, context)``."""

    def __init__(self, options: Eagle3Options | None = None, context: BuildContext | None = None) -> None:
        self.options = options or Eagle3Options()
        self.context = context or BuildContext()

    # ------------------------------------------------------------------ capture & build
    def capture_plan(self, target: TargetInfo) -> CapturePlan:
        hidden, dtype = target.hidden_size, target.dtype
        return CapturePlan(
            layer_ids=resolve_aux_layer_ids(self.options, target.num_layers),
            hidden_feature=AUX_FEATURE,
            last_hidden=True,
            features={"input_ids": FeatureSpec((-1,), "int64"),
                      "loss_mask": FeatureSpec((-1,), "int64"),
                      AUX_FEATURE: FeatureSpec((-1, 3 * hidden), dtype),
                      "last_hidden": FeatureSpec((-1, hidden), dtype)})

    def draft_config(self, target: TargetInfo) -> Eagle3Config:
        """The draft's shape for ``target``: h = H, heads and norms from ``target.extra``."""
        hidden = target.hidden_size
        heads = int(config_value(target.extra, "num_attention_heads", max(1, hidden // 64)))
        return Eagle3Config(
            hidden_size=hidden,
            target_hidden_size=hidden,
            intermediate_size=int(self.options.intermediate_size
                                  or config_value(target.extra, "intermediate_size", 4 * hidden)),
            num_attention_heads=heads,
            num_key_value_heads=int(config_value(target.extra, "num_key_value_heads", heads)),
            head_dim=int(config_value(target.extra, "head_dim", hidden // heads)),
            rms_norm_eps=float(config_value(target.extra, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(target.extra),
            max_position_embeddings=int(config_value(target.extra, "max_position_embeddings", 4096)),
            vocab_size=target.vocab_size,
            draft_vocab_size=resolve_draft_vocab_size(self.options, target.vocab_size),
            aux_layer_ids=resolve_aux_layer_ids(self.options, target.num_layers),
            dtype=self.options.dtype,
        )

    def build_model(self, target: TargetInfo, frozen_parts: Mapping[str, Any], stats: DataStats) -> Eagle3Draft:
        """The draft with the target's embedding and teacher lm_head, and the draft vocabulary from ``stats``.

        An empty ``DataStats()`` (no samples: the model is being rebuilt to load a checkpoint,
        whose ``d2t``/``t2d`` buffers then replace it) gets a placeholder vocabulary of the
        lowest ids; training data without token counts is an error.
        """
        missing = [name for name in ("embed_tokens", "lm_head") if name not in frozen_parts]
        if missing:
            raise SpecforgeError(f"eagle3 needs the target's frozen {' and '.join(missing)}; the target engine gave "
                                 f"only {sorted(frozen_parts)}")
        if self.options.draft_vocab_size is None and stats.token_counts is not None:
            self._size_vocab_from(stats.token_counts, target.vocab_size)
        config = self.draft_config(target)
        model = Eagle3Draft(config, frozen_parts["embed_tokens"], frozen_parts["lm_head"])
        counts = stats.token_counts
        if counts is None and not stats.num_samples:
            counts = torch.zeros(config.vocab_size, dtype=torch.long)  # placeholder: the lowest Vd ids
        model.set_vocab_mapping(*build_vocab_mapping(counts, config.vocab_size, config.draft_vocab_size))
        if self.options.compile:
            compile_layers([model.midlayer])
        return model

    def _size_vocab_from(self, token_counts: Any, vocab_size: int) -> None:
        """Fix ``draft_vocab_size`` from the data (the runtime records the resolved options in run.json)."""
        import sys

        size = data_sized_vocab(token_counts, self.options.draft_vocab_coverage, vocab_size)
        counts = torch.as_tensor(token_counts).long()
        covered = float(torch.sort(counts, descending=True).values[:size].sum()) / max(1, int(counts.sum()))
        self.options = attrs.evolve(self.options, draft_vocab_size=size)
        if self.context.rank == 0:
            print(f"eagle3: draft vocabulary of {size} of the target's {vocab_size} tokens, covering "
                  f"{100 * covered:.1f}% of the supervised tokens (strategy.draft_vocab_coverage="
                  f"{self.options.draft_vocab_coverage:g}; set strategy.draft_vocab_size to choose)",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ training
    def collate(self, samples: Sequence[Mapping[str, Any]], sample_ids: Sequence[str]) -> TrainBatch:
        """Right-pad to the longest sample (with zeros); ``attention_mask [B, S]`` marks real tokens."""
        tensors, lengths = pad_features(samples, sample_ids, FEATURES, strategy="eagle3",
                                        dtypes={"input_ids": torch.long, "loss_mask": torch.long})
        ids = tensors["input_ids"]
        real = torch.arange(ids.shape[1], device=ids.device) < torch.tensor(lengths, device=ids.device)[:, None]
        tensors["attention_mask"] = real.long()
        return TrainBatch(tensors=tensors, sample_ids=tuple(sample_ids), num_tokens=sum(lengths))

    def forward_loss(self, model: Eagle3Draft, batch: TrainBatch, ctx: Any) -> StepOutput:
        """Align, ask the teacher, unroll ``ttt_length`` steps, and score every step (see :mod:`.loss`)."""
        attention_mask = batch["attention_mask"]
        ids, loss_mask, last_hidden = align(batch["input_ids"], batch["loss_mask"], batch["last_hidden"],
                                            attention_mask, self.options.loss_positions)
        p_t, target_ids, position_mask = teacher(model, last_hidden, loss_mask)
        training = getattr(ctx, "training", True)
        # training computes only the positions the loss reads; eval's decode replay reads every position
        trim = training and self.options.trim_unroll
        windows = unroll_windows(position_mask, self.options.ttt_length) if trim else None
        step_hidden = model.unroll(ids, batch[AUX_FEATURE], attention_mask, self.options.ttt_length, windows)
        # decode: each row only at the steps a round reaches it at (no round starts on a prompt token)
        depth = round_depth(batch["loss_mask"]) if self.options.loss_positions == "decode" else None
        loss, ratios = ttt_loss(step_hidden, lambda rows, targets: model.lm_head(model.norm(rows), targets),
                                p_t, target_ids, position_mask, loss_mask, model.d2t, self.options.loss_decay,
                                windows, depth)
        if not training:  # the decode replay: eval only (a host-side walk per sample)
            # as deep as decoding drafts (spec_depth), within the steps the unroll has (ttt_length)
            depth = self.options.spec_depth or self.options.ttt_length
            with torch.no_grad():
                step_logits = [model.logits(hidden) for hidden in step_hidden[:depth]]
            ratios.update(simulated_acceptance(step_logits, target_ids, batch["loss_mask"], model.d2t))
        return StepOutput(loss=loss, ratio_metrics=ratios)

    def derived_metrics(self, pooled: dict[str, float]) -> dict[str, float]:
        """``tau_sim``, the former figure, from the pooled ``acc_k`` ratios (kept one release as an alias of
        sorts: it is bonus-excluded and overstates; ``accept_len_sim`` is the one to read)."""
        return {"tau_sim": tau_sim(pooled)}

    # ------------------------------------------------------------------ serving
    def export(self, model: Eagle3Draft, out_dir: str | os.PathLike[str], target: TargetInfo | None = None, *,
               fmt: str = "sglang", dtype: str = DEFAULT_EXPORT_DTYPE) -> Any:
        """Write a ``LlamaForCausalLMEagle3`` directory SGLang and vLLM serve (``fmt`` sglang or vllm: the
        same folder) or vLLM's speculators layout (``fmt`` speculators); see :mod:`.export`."""
        return export_draft(model, out_dir, target, dtype=dtype, options=self.options, fmt=fmt)

    def load_export(self, path: str | os.PathLike[str], target: TargetInfo,
                    frozen_parts: Mapping[str, Any]) -> Eagle3Draft:
        return load_draft(path, target, frozen_parts)

    def speculate(self, model: Eagle3Draft, session: VerifySession, prompt_ids: Any, *, max_new_tokens: int,
                  eos_token_id: Any = None) -> SpeculationResult:
        """Chain-draft ``spec_depth`` tokens per round; output equals the target's greedy decode."""
        depth = self.options.spec_depth or self.options.ttt_length
        return speculate(model, session, prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         depth=depth, hidden_feature=AUX_FEATURE)
