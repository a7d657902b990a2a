"""The ``hf`` target engine: a transformers causal LM run in-process.

``HFTargetEngine`` loads a model (a local folder saved with ``save_pretrained``, a hub id
when the user has network, or the embedded toy target), captures the hidden states a
strategy's :class:`~specforge_core.protocols.CapturePlan` asks for, hands out the frozen
embedding / lm_head / final norm, and opens KV-cached :class:`HFVerifySession` s for
speculative decoding.

Layer ids follow the serving engines' convention (:mod:`specforge_core.serving`): layer id
``i`` is the hidden state *entering* decoder layer ``i + 1`` (the output of layer ``i``,
transformers' ``hidden_states[i + 1]``), recorded exactly where SGLang and vLLM record it, at
that layer's input. So ids run ``0..L-2``; the last layer's output (id ``L-1``) is refused,
since no serving engine can give it to a draft. ``last_hidden`` is the final norm's output
(``hidden_states[-1]``, the lm_head input).

Features are recorded with hooks on just the decoder layers a plan names (and the final
norm) rather than ``output_hidden_states=True``, which would keep every layer's ``[B, S, H]``
output alive: for an 8B target and a batch of 8 x 4096 tokens that is ~10 GB.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from specforge_core.contracts import FeatureSpec
from specforge_core.dtypes import dtype_name, torch_dtype
from specforge_core.hfconfig import rope_theta
from specforge_core.options import build_options, options_to_dict
from specforge_core.protocols import BuildContext, CapturePlan, TargetInfo
from specforge_core.serving import WHY_LAST_LAYER, max_servable_layer_id

from . import HFEngineOptions
from .attention import register_batch_invariant_attention
from .attention_support import choose_attention, read_model_attention
from .model_folder import local_model_folder
from .errors import CapturePlanError, TargetEngineError, TargetModelNotFoundError
from .padding import right_pad
from .toy import ensure_toy_target, read_manifest

#: Names under which transformers architectures keep the final norm on the base model.
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm")
#: Names under which they keep the decoder layers.
_DECODER_LAYER_NAMES = ("layers", "h", "blocks")


class HFTargetEngine:
    """Runs a transformers causal LM and captures its hidden states.

    Built by the ``hf`` spec as ``HFTargetEngine(options, context)``. With
    ``options.model`` unset it serves the toy target (built once and cached, see
    :mod:`specforge_plugin_hf.toy`), and :meth:`default_data` then names the toy
    conversations it was trained on.

    The target is frozen: every parameter has ``requires_grad=False`` and forwards run
    under ``torch.no_grad()`` (not ``inference_mode``, whose tensors could not be fed to a
    draft model's autograd graph).
    """

    def __init__(self, options: HFEngineOptions | None = None, context: BuildContext | None = None) -> None:
        # Re-validate: the engine can be built from an options instance that skipped the
        # CLI/YAML validation, and a bad dtype should fail before minutes of loading.
        self.options = build_options(HFEngineOptions, options_to_dict(options or HFEngineOptions()),
                                     section="target_engine")
        self.context = context or BuildContext()
        self.device = _resolve_device(self.options.device)
        if self.options.model is None:
            self.model_path: Path | None = ensure_toy_target(self.options.toy_variant)
            source = str(self.model_path)
        else:
            self.model_path = local_model_folder(self.options.model)
            source = str(self.model_path) if self.model_path is not None else self.options.model
        self._toy_manifest = read_manifest(self.model_path) if self.model_path is not None else None
        self._tokenizer = _load_tokenizer(source)
        self._model = _load_model(source, self.options, self.device)
        self._config = self._model.config.get_text_config()
        self._num_layers = int(self._config.num_hidden_layers)
        self._vocab_size = int(self._model.get_output_embeddings().weight.shape[0])
        self._cache_keyword = _cache_keyword(self._model)
        self._mask_token_id = self._default_mask_token_id()
        if self._toy_manifest is not None:
            self.model_id = f"specforge/toy-target-{self._toy_manifest['variant']}@{self._toy_manifest['recipe_digest']}"
        else:
            self.model_id = self.options.model or source

    # -- what strategies ask first -------------------------------------------------------

    def info(self) -> TargetInfo:
        """Layers, widths, vocabulary, dtype, chat template and the Llama-style fields drafts copy."""
        config = self._config
        extra = {
            "architecture": (self._model.config.architectures or [type(self._model).__name__])[0],
            "model_type": getattr(config, "model_type", None),
            "num_attention_heads": getattr(config, "num_attention_heads", None),
            "num_key_value_heads": getattr(config, "num_key_value_heads", None),
            "head_dim": getattr(config, "head_dim", None),
            "intermediate_size": getattr(config, "intermediate_size", None),
            "rms_norm_eps": getattr(config, "rms_norm_eps", None),
            "rope_parameters": getattr(config, "rope_parameters", None),
            "max_position_embeddings": getattr(config, "max_position_embeddings", None),
            "tie_word_embeddings": getattr(self._model.config, "tie_word_embeddings", None),
            "rope_theta": rope_theta({"rope_theta": getattr(config, "rope_theta", None),
                                      "rope_parameters": getattr(config, "rope_parameters", None)}),
            "mask_token_id": self._mask_token_id,
            "tokenizer_size": len(self._tokenizer),
            "bos_token_id": self._tokenizer.bos_token_id,
            "eos_token_id": self._tokenizer.eos_token_id,
            "stop_token_ids": self.stop_token_ids(),  # what ends a reply: decodes stop on these, as regenerate does
            "pad_token_id": self._tokenizer.pad_token_id,
            "unk_token_id": self._tokenizer.unk_token_id,
            "special_token_ids": sorted(int(i) for i in self._tokenizer.all_special_ids),
            "device": str(self.device),
            "attn_implementation": self._model.config._attn_implementation,
            "model_path": str(self.model_path) if self.model_path is not None else None,
        }
        if self._toy_manifest is not None:
            extra["toy_variant"] = self._toy_manifest["variant"]
            extra["toy_recipe_digest"] = self._toy_manifest["recipe_digest"]
        return TargetInfo(
            num_layers=self._num_layers,
            hidden_size=int(config.hidden_size),
            vocab_size=self._vocab_size,
            dtype=dtype_name(self._model.dtype),
            model_id=self.model_id,
            chat_template=self._tokenizer.chat_template,
            extra=_json_safe(extra),
        )

    def _default_mask_token_id(self) -> int | None:
        """The id DFlash-family drafts take as their mask token by default: :data:`SGLANG_DFLASH_MASK_TOKEN`'s where
        the vocabulary holds it within the model's, else the tokenizer's own mask token's (None without one)."""
        found = self._tokenizer.get_vocab().get(SGLANG_DFLASH_MASK_TOKEN)
        if found is not None and 0 <= int(found) < self._vocab_size:
            return int(found)
        own = getattr(self._tokenizer, "mask_token_id", None)
        return None if own is None else int(own)

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (a transformers tokenizer with its chat template)."""
        return self._tokenizer

    @property
    def model(self) -> Any:
        """The underlying transformers model (frozen, in eval mode)."""
        return self._model

    def cache_argument(self, cache: Any) -> dict[str, Any]:
        """``{keyword: cache}`` for a forward of :attr:`model` over a KV cache, under the keyword its transformers
        release takes (``cache``, or ``past_key_values`` before that rename)."""
        return {self._cache_keyword: cache}

    def frozen_parts(self) -> dict[str, torch.Tensor]:
        """``embed_tokens [V, H]``, ``lm_head [V, H]`` and final ``norm [H]`` weights, detached.

        They share memory with the target (no copy): read them, never write them.
        """
        return {
            "embed_tokens": self._model.get_input_embeddings().weight.detach(),
            "lm_head": self._model.get_output_embeddings().weight.detach(),
            "norm": self._final_norm().weight.detach(),
        }

    def default_data(self) -> tuple[Path, Path] | None:
        """(train.jsonl, eval.jsonl) of the toy conversations when serving the toy target, else None."""
        if self._toy_manifest is None or self.model_path is None:
            return None
        data = self._toy_manifest["data"]
        return self.model_path / data["train"], self.model_path / data["eval"]

    def default_eval_data(self) -> Path | None:
        """The toy's held-out conversations with every reply the target's own greedy reply, else None.

        The bundled eval split was written by the toy's data generator, and the toy gets a
        good share of it wrong (about two replies in three differ from its greedy ones), so
        acceptance simulated on it scores the draft after prefixes decoding never visits.
        Regenerated with ``specforge regenerate``'s code on first use (seconds) and kept
        beside the bundled file as ``eval.target.jsonl``; a folder that cannot be written
        to falls back to the bundled file.
        """
        default = self.default_data()
        if default is None:
            return None
        bundled = default[1]
        regenerated = bundled.with_name(bundled.stem + ".target.jsonl")
        if regenerated.exists():
            return regenerated
        from specforge_core.config import RegenerateOptions
        from specforge_core.regenerate import run_regenerate

        from .toy.build import build_lock

        try:
            with build_lock(bundled.with_name(f".{regenerated.name}.lock")):
                if not regenerated.exists():
                    run_regenerate(self, str(bundled), str(regenerated),
                                   RegenerateOptions(max_new_tokens=64, batch_size=32), progress=False)
        except OSError:  # a read-only toy folder: the bundled split still evaluates
            return bundled
        return regenerated

    # -- capture --------------------------------------------------------------------------

    def capture(self, samples: Sequence[Mapping[str, Any]], plan: CapturePlan) -> list[dict[str, Any]]:
        """Per sample and unpadded, the plan's features plus every key of the sample passed through.

        ``samples`` are mappings with a 1-D integer ``input_ids`` each. Samples run in
        right-padded batches of ``capture_batch_size`` (one forward per batch, without the
        lm_head); each returned tensor is a fresh, contiguous tensor of the sample's own
        length: ``plan.hidden_feature`` ``[S, len(layer_ids) * H]`` (when the plan names
        layers) and ``last_hidden`` ``[S, H]`` (when ``plan.last_hidden``), in the dtype
        the plan's ``features`` specs give, else the model's dtype.
        """
        layers = self._check_plan(plan)
        rows = [self._input_ids(sample, f"sample {index}") for index, sample in enumerate(samples)]
        results: list[dict[str, Any]] = []
        size = self.options.capture_batch_size
        for start in range(0, len(rows), size):
            results.extend(self._capture_batch(samples[start:start + size], rows[start:start + size], plan, layers))
        return results

    @torch.no_grad()
    def _capture_batch(self, samples: Sequence[Mapping[str, Any]], rows: list[torch.Tensor], plan: CapturePlan,
                       layers: tuple[int, ...]) -> list[dict[str, Any]]:
        lengths = [len(row) for row in rows]
        pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        ids, mask = right_pad(rows, pad_id, self.device)
        # The base model, not the causal LM: capture never needs logits, and the lm_head
        # is a large share of a big-vocabulary target's forward.
        with self._recording(plan, layers) as outputs:
            self._model.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
        results = []
        for i, (sample, length) in enumerate(zip(samples, lengths)):
            result = dict(sample)
            result.update(self._features(outputs, i, length, plan, layers))
            results.append(result)
        return results

    @contextlib.contextmanager
    def _recording(self, plan: CapturePlan, layers: tuple[int, ...]) -> Iterator[dict[Any, torch.Tensor]]:
        """Hooks that fill the yielded dict during one forward: layer id i -> the ``[B, S, H]`` hidden
        state entering decoder layer i+1, and ``"last"`` -> the final norm's output (``hidden_states[-1]``)."""
        outputs: dict[Any, torch.Tensor] = {}
        # Hooks live on the shared model, so a forward in another thread (a capture producer
        # next to a verify session) fires them too; record only this thread's forward.
        owner = threading.get_ident()

        def keep_input(key: Any) -> Any:
            def hook(_module: Any, args: Any, kwargs: Any) -> None:
                if threading.get_ident() == owner:
                    outputs[key] = self._check_layer_input(args[0] if args else kwargs["hidden_states"])
            return hook

        def keep_output(_module: Any, _inputs: Any, output: Any) -> None:
            if threading.get_ident() == owner:
                outputs["last"] = output[0] if isinstance(output, tuple) else output

        decoder_layers = self._decoder_layers()
        handles = [decoder_layers[i + 1].register_forward_pre_hook(keep_input(i), with_kwargs=True) for i in layers]
        if plan.last_hidden:
            handles.append(self._final_norm().register_forward_hook(keep_output))
        try:
            yield outputs
        finally:
            for handle in handles:
                handle.remove()

    def _features(self, outputs: Mapping[Any, torch.Tensor], row: int, length: int, plan: CapturePlan,
                  layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The plan's features of one row, unpadded, each a new contiguous tensor (never a view)."""
        features = {}
        if layers:
            # torch.cat always allocates, so the feature does not pin the padded batch.
            features[plan.hidden_feature] = torch.cat([outputs[i][row, :length] for i in layers], dim=-1)
        if plan.last_hidden:
            features["last_hidden"] = outputs["last"][row, :length].clone(memory_format=torch.contiguous_format)
        for name, tensor in features.items():
            spec = _feature_spec(plan, name)
            if spec is not None and dtype_name(tensor.dtype) != spec.dtype:
                features[name] = tensor.to(torch_dtype(spec.dtype))
        return features

    def _check_layer_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``, a decoder layer's input, as it is; one that is no ``[batch, tokens, hidden]`` stream (what a
        draft reads and serving engines capture) is refused, stopping the forward there: Gemma 3n's AltUp, for one,
        passes each layer several predictions of the stream stacked in front, whose rows would be read as copies
        of it."""
        hidden_size = int(self._config.hidden_size)
        if hidden.dim() != 3 or hidden.shape[-1] != hidden_size:
            raise TargetEngineError(
                f"target {self.model_id!r} ({type(self.model).__name__}) passes its decoder layers hidden states of "
                f"shape {list(hidden.shape)}, not [batch, tokens, {hidden_size}]: they are no single residual "
                "stream a draft reads (Gemma 3n's AltUp stacks several predictions of it), so this model cannot be "
                "a target here")
        return hidden

    def _check_plan(self, plan: CapturePlan) -> tuple[int, ...]:
        layers = tuple(plan.layer_ids)
        top = max_servable_layer_id(self._num_layers)
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= top:
                raise CapturePlanError(
                    f"capture plan asks for layer id {layer!r}, but target {self.model_id!r} has "
                    f"{self._num_layers} decoder layers: valid layer ids are 0..{top} (layer id i is the hidden "
                    f"state entering layer i+1; {WHY_LAST_LAYER})"
                )
        hidden = int(self._config.hidden_size)
        widths = {plan.hidden_feature: len(layers) * hidden} if layers else {}
        if plan.last_hidden:
            widths["last_hidden"] = hidden
        for name, width in widths.items():
            spec = _feature_spec(plan, name)
            if spec is not None and spec.shape[-1] not in (-1, width):
                raise CapturePlanError(
                    f"capture plan declares feature {name!r} with width {spec.shape[-1]}, but the target gives "
                    f"{width} ({len(layers) if name != 'last_hidden' else 1} x hidden size {hidden}); "
                    "derive the width from TargetInfo.hidden_size"
                )
        return layers

    def _input_ids(self, sample: Any, where: str) -> torch.Tensor:
        if isinstance(sample, Mapping):
            if "input_ids" not in sample:
                raise TargetEngineError(f"{where} has no 'input_ids' (it has: {', '.join(map(str, sample)) or 'nothing'})")
            ids = sample["input_ids"]
        else:
            ids = sample
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TargetEngineError(
                f"{where}: input_ids must be a non-empty 1-D integer tensor, got shape {tuple(ids.shape)} "
                f"dtype {dtype_name(ids.dtype)}"
            )
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self._vocab_size:
            bad = low if low < 0 else high
            raise TargetEngineError(
                f"{where}: token id {bad} is outside the target's vocabulary 0..{self._vocab_size - 1}; "
                "tokenize with the target's tokenizer (engine.tokenizer)"
            )
        return ids.to(device=self.device, dtype=torch.long)

    def _decoder_layers(self) -> torch.nn.ModuleList:
        base = self._model.base_model
        for name in _DECODER_LAYER_NAMES:
            layers = getattr(base, name, None)
            if isinstance(layers, torch.nn.ModuleList) and len(layers) == self._num_layers:
                return layers
        raise TargetEngineError(
            f"cannot find the {self._num_layers} decoder layers of {type(self._model).__name__} (looked for "
            f"{', '.join(_DECODER_LAYER_NAMES)} on its base model); this architecture is not supported by the hf engine"
        )

    def _final_norm(self) -> torch.nn.Module:
        base = self._model.base_model
        for name in _FINAL_NORM_NAMES:
            module = getattr(base, name, None)
            if isinstance(module, torch.nn.Module) and getattr(module, "weight", None) is not None:
                return module
        raise TargetEngineError(
            f"cannot find the final norm of {type(self._model).__name__} (looked for "
            f"{', '.join(_FINAL_NORM_NAMES)} on its base model); this architecture is not supported by the hf engine"
        )

    # -- generation -------------------------------------------------------------------------

    def stop_token_ids(self) -> list[int]:
        """The tokens that end a reply: the tokenizer's EOS and the generation config's (often several)."""
        from specforge_core.speculative import stop_token_ids

        ids = set(stop_token_ids(self._tokenizer.eos_token_id))
        generation = getattr(self._model, "generation_config", None)
        ids |= stop_token_ids(getattr(generation, "eos_token_id", None))
        return sorted(ids)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> list[list[int]]:
        """Continue each prompt (token ids) in one batched, KV-cached decode; the new tokens of each.

        Greedy when ``temperature`` is 0, else sampled (seed torch's RNG first for repeatable
        output). A reply ends after its first stop token (:meth:`stop_token_ids`, kept in the
        result) or at ``max_new_tokens``. Prompts are left-padded; position ids follow the
        attention mask, so a padded prompt continues as it would alone.
        """
        from transformers import GenerationConfig

        if not prompts:
            return []
        rows = [self._input_ids(prompt, f"prompt {index}") for index, prompt in enumerate(prompts)]
        stops = self.stop_token_ids()
        pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else (stops or [0])[0]
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=self.device)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = row
            mask[i, width - len(row):] = 1
        sampling = temperature > 0
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampling,
                                  temperature=temperature if sampling else None, top_p=top_p if sampling else None,
                                  top_k=None, eos_token_id=stops or None, pad_token_id=pad_id)
        out = self._model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        replies = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
            replies.append(row[:end])
        return replies

    # -- verification -----------------------------------------------------------------------

    def session(self, prompt_ids: Any, plan: CapturePlan) -> HFVerifySession:
        """A KV-cached session over ``prompt_ids`` (1-D); its ``prefill`` holds the prompt's outputs."""
        return HFVerifySession(self, prompt_ids, plan)


class HFVerifySession:
    """A target forward with a transformers ``DynamicCache``, for speculative decoding.

    Creating the session runs the prompt; :attr:`prefill` holds its outputs (the same
    keys as :meth:`extend`), so the first token and the draft's first features come from
    it. ``extend(ids)`` appends tokens and returns, for those tokens only, ``logits
    [n, V]`` plus the plan's features; ``truncate(length)`` drops cached positions at and
    beyond ``length`` (rejected draft tokens); ``length`` is the number of cached positions.
    """

    def __init__(self, engine: HFTargetEngine, prompt_ids: Any, plan: CapturePlan) -> None:
        from transformers import cache_utils

        self._engine = engine
        self._plan = plan
        self._layers = engine._check_plan(plan)
        self._cache = self._new_cache()
        # Sliding-window layers (Mistral, Gemma 2/3) keep only their window, so a rejected draft could not be taken
        # back out of them; recording their past lets truncate roll them back. Each extend first restricts them
        # to their window again (so a session that only extends, as the timed greedy reference does, holds a
        # window, not its whole past), which leaves truncate the positions of the last extend to roll back;
        # one reaching further back rebuilds the cache from the token ids it holds (:meth:`_rebuild`).
        # Linear-attention layers are left as they are: rolled back that way their recurrent state keeps the
        # rejected tokens (logits off by 1e-2 on a tiny Qwen3-Next), so their truncate raises instead.
        # (a transformers release without a kind of layer has no layer of that kind: the empty tuple matches none)
        linear, sliding = (getattr(cache_utils, name, ()) for name in ("LinearAttentionCacheLayerMixin",
                                                                       "DynamicSlidingWindowLayer"))
        self._linear = any(isinstance(layer, linear) for layer in self._cache.layers)
        self._rollback = (not self._linear and hasattr(self._cache, "activate_past_recording")
                          and any(isinstance(layer, sliding) for layer in self._cache.layers))
        if self._rollback:
            self._cache.activate_past_recording()
        # with rollback: the cached token ids, and the least length a truncate reaches from what is recorded
        self._ids: list[int] = []
        self._floor = 0
        self.length = 0
        self.prefill: dict[str, torch.Tensor] | None = None if prompt_ids is None else self.extend(prompt_ids)

    @torch.no_grad()
    def extend(self, ids: Any) -> dict[str, torch.Tensor]:
        ids = self._engine._input_ids(ids, "session.extend")
        if self._rollback and self.length:
            self._cache.crop(0)  # windowed layers back to their window (full layers keep everything)
            self._floor = self.length
        # position ids and the causal mask follow from the cache length
        with self._engine._recording(self._plan, self._layers) as outputs:
            out = self._engine.model(input_ids=ids[None], use_cache=True, **self._engine.cache_argument(self._cache))
        self.length += len(ids)
        if self._rollback:
            self._ids.extend(ids.tolist())
        result = {"logits": out.logits[0]}
        result.update(self._engine._features(outputs, 0, len(ids), self._plan, self._layers))
        return result

    def truncate(self, length: int) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise TargetEngineError(f"session.truncate({length!r}): length must be an integer in 0..{self.length} "
                                    "(the number of cached positions)")
        if self._rollback and length < self._floor:
            self._rebuild(length)
        elif length < self.length or self._rollback:
            try:
                self._cache.crop(length - self.length)  # a negative count removes that many positions
            except RuntimeError as exc:
                why = ("its linear-attention layers keep a recurrent state that cannot give back the rejected draft "
                       "tokens, so speculative decoding cannot verify drafts on it" if self._linear else str(exc))
                raise TargetEngineError(f"this target's cache cannot roll back: {why}") from exc
            self.length = length
            if self._rollback:  # windowed layers now hold the window before `length`, and no more
                self._floor = length
                del self._ids[length:]

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self._engine.model.config)

    @torch.no_grad()
    def _rebuild(self, length: int) -> None:
        """The cache of the first ``length`` tokens, made again by one forward over them: a truncate to before
        the last extend, whose windowed layers no longer hold what that position saw (speculative decoding
        truncates within the last extend and never comes here)."""
        self._cache = self._new_cache()
        self._cache.activate_past_recording()
        del self._ids[length:]
        if length:
            ids = torch.tensor(self._ids, dtype=torch.long, device=self._engine.device)
            self._engine.model(input_ids=ids[None], use_cache=True, logits_to_keep=1,
                               **self._engine.cache_argument(self._cache))
        self.length, self._floor = length, 0


#: The mask token SGLang's DFlash runtime assumes when a draft's config names none: it refuses a draft whose
#: ``mask_token_id`` is not that token's id where the target's vocabulary holds it.
SGLANG_DFLASH_MASK_TOKEN = "<|MASK|>"


# -- loading ----------------------------------------------------------------------------------


def _cache_keyword(model: Any) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` in the transformers releases that renamed
    it (``past_key_values`` is deprecated there, to go in 5.40), ``past_key_values`` before them."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise TargetEngineError("target_engine.device is 'cuda' but torch sees no CUDA device; "
                                    "use --set target_engine.device=cpu (or auto)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def _resolve_dtype(dtype: str, device: torch.device, config: Any) -> torch.dtype:
    if dtype != "auto":
        return torch_dtype(dtype)
    if device.type == "cpu":
        # bfloat16 matmuls are slow on most CPUs and float32 keeps capture batch-invariant
        return torch.float32
    saved = getattr(config, "dtype", None)
    return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16


def _resolve_attention(name: str, device: torch.device, config: Any) -> str:
    """The transformers ``attn_implementation`` for option value ``name``: ``auto`` resolved
    to one that runs this model, an explicit choice that cannot refused before any weight loads."""
    name = choose_attention(name, device, read_model_attention(config))
    if name == "batch_invariant":
        return register_batch_invariant_attention()
    return name


def _load_tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise TargetModelNotFoundError(
            f"cannot load the tokenizer of target model {source!r} ({_reason(exc)}); a local folder needs the "
            "tokenizer files (tokenizer.json, tokenizer_config.json), a hub id needs network (HF_HUB_OFFLINE unset)"
        ) from exc


def _load_model(source: str, options: HFEngineOptions, device: torch.device) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source)
        attn_implementation = _resolve_attention(options.attn_implementation, device, config)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=_resolve_dtype(options.dtype, device, config),
            attn_implementation=attn_implementation,
        )
    except (OSError, ValueError) as exc:
        raise TargetModelNotFoundError(f"cannot load target model {source!r} as a causal LM ({_reason(exc)}); "
                                       "pass a folder written by save_pretrained") from exc
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def _reason(exc: BaseException) -> str:
    """An exception's message on one line, without its closing period (it goes mid-sentence)."""
    return " ".join(str(exc).split()).rstrip(".")


def _feature_spec(plan: CapturePlan, name: str) -> FeatureSpec | None:
    """The plan's spec of feature ``name`` (plans may carry FeatureSpecs or their dicts)."""
    spec = plan.features.get(name)
    return FeatureSpec.from_dict(spec) if isinstance(spec, Mapping) else spec


def _json_safe(value: dict[str, Any]) -> dict[str, Any]:
    """Drop what JSON cannot carry (TargetInfo travels in manifests and checkpoints)."""
    safe = {}
    for key, item in value.items():
        try:
            json.dumps(item, allow_nan=False)
        except (TypeError, ValueError):
            continue
        safe[key] = item
    return safe


__all__ = ["HFTargetEngine", "HFVerifySession"]
