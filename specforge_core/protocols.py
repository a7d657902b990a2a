"""The small interfaces that components implement (typing.Protocol, structural).

Factories named by specs are called as ``factory(options, context)`` where ``options`` is
the validated options instance and ``context`` a :class:`BuildContext`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import attrs

if TYPE_CHECKING:
    from .contracts import SampleRef


@attrs.frozen(kw_only=True)
class BuildContext:
    """What every component factory is told about the run it belongs to."""

    run_id: str = "run"
    output_dir: str | None = None
    rank: int = 0
    world_size: int = 1
    role: str = "colocated"  # colocated | producer | consumer | offline


@runtime_checkable
class FeatureStore(Protocol):
    """Where feature tensors live between capture and training.

    ``uri`` identifies the store instance (it appears on every ref it returns);
    ``put`` stores a sample's tensors (each unpadded, first dim = tokens where that applies)
    and returns a :class:`SampleRef` with shape and dtype per feature; putting the same
    ``sample_id`` again makes a new generation and makes older refs stale.
    """

    uri: str

    def put(self, sample_id: str, tensors: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> SampleRef: ...

    def get(self, ref: SampleRef, keys: Sequence[str] | None = None) -> dict[str, Any]: ...

    def release(self, ref: SampleRef) -> None: ...

    def abort(self, sample_id: str) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@runtime_checkable
class MetadataStore(Protocol):
    """Durable (or not) bookkeeping of which samples exist and which were trained on."""

    def commit(self, refs: Sequence[SampleRef]) -> list[SampleRef]: ...

    def ack(self, sample_ids: Sequence[str], global_step: int) -> None: ...

    def durable_step(self) -> int: ...

    def reconcile(self) -> Any: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@runtime_checkable
class RefChannel(Protocol):
    """A stream of refs from producers to consumers."""

    def publish(self, refs: Iterable[SampleRef]) -> None: ...

    def poll(self, max_n: int, timeout: float | None = None) -> list[SampleRef]: ...

    def close(self) -> None: ...

    def fail(self, reason: str) -> None: ...


@runtime_checkable
class ControlPlane(Protocol):
    """A metadata store and a ref channel that belong together."""

    metadata: MetadataStore
    channel: RefChannel

    def close(self) -> None: ...


@attrs.frozen(kw_only=True)
class TargetInfo:
    """What a target engine tells strategies about the target model."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str = "float32"
    model_id: str = ""
    chat_template: str | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class CapturePlan:
    """Which target layers a strategy needs and the features it will read from a sample.

    ``layer_ids`` are decoder-layer indices (layer id i = transformers ``hidden_states[i+1]``);
    their outputs are concatenated in this order into one feature named ``hidden_feature``,
    ``[S, len(layer_ids) * H]`` (EAGLE3 names it ``aux_hidden``, DFlash ``target_hidden``).
    ``last_hidden`` asks for the lm_head input ``[S, H]`` (the final norm's output).
    ``features`` maps each stored feature name to its
    :class:`~specforge_core.contracts.FeatureSpec` (``-1`` for the sequence length); a plan
    with no ``layer_ids`` captures no concatenated feature.
    """

    layer_ids: tuple[int, ...] = attrs.field(converter=tuple, factory=tuple)
    hidden_feature: str = "target_hidden"
    last_hidden: bool = False
    features: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class DataStats:
    """What a strategy may learn from the training data before its model is built.

    ``token_counts`` is a LongTensor ``[vocab_size]``: how often each token id is supervised
    (``loss_mask == 1``) in the training split (EAGLE3 builds its draft vocabulary from it).
    """

    token_counts: Any = None
    num_samples: int = 0


@attrs.frozen(kw_only=True)
class SpeculationResult:
    """One prompt's speculative decode: the new tokens and how many target forwards they took.

    ``accept_lengths`` holds, per target forward, the tokens it produced: first the prompt's
    prefill (1 token), then each verification (accepted draft tokens plus the target's bonus
    token); so ``sum(accept_lengths) == len(tokens)`` and ``target_forwards ==
    len(accept_lengths)``. ``accepted_drafts`` holds, per verification, how many of its tokens
    are accepted drafts: ``accept_lengths - 1`` but in a round cut by a stop token or the budget,
    which may emit no bonus (``accept_drafts``' ``min(accepted, len(new))``). A strategy that
    leaves it empty has it taken as ``accept_lengths - 1``.
    """

    tokens: list[int]
    target_forwards: int
    accept_lengths: list[int] = attrs.field(factory=list)
    accepted_drafts: list[int] = attrs.field(factory=list)


@runtime_checkable
class Strategy(Protocol):
    """A draft algorithm, built by its spec's factory as ``factory(options, context)``.

    ``capture_plan`` says what to capture; ``build_model`` returns the trainable draft (an
    ``nn.Module``; frozen target parts it uses are frozen parameters or non-persistent
    buffers, so checkpoints leave them out); ``collate`` turns stored samples into a
    :class:`TrainBatch`; ``forward_loss`` returns a :class:`StepOutput` with ratio metrics as
    (numerator, denominator). ``specforge run`` checks these four exist before anything
    heavy is built (``isinstance(strategy, Strategy)``).

    Optional methods the core calls when present:

    * ``derived_metrics(pooled) -> dict`` — metrics computed from pooled ratio metrics
      (``tau_sim``), added to training and eval records;
    * ``export(model, out_dir, target, *, fmt, dtype)`` — write the draft in serving format
      ``fmt`` (one of the formats its spec declares in ``export_formats``: a directory the
      serving engine of that format loads), floating-point weights in ``dtype``; its
      config.json names the strategy and its options under ``specforge_strategy`` and
      ``specforge_strategy_options`` (see :func:`specforge_core.export.strategy_fields`); an
      implementation may accept fewer keyword arguments;
    * ``load_export(path, target, frozen_parts)`` — the model back from a directory in any
      format it writes;
    * ``speculate(model, session, prompt_ids, *, max_new_tokens, eos_token_id)`` — a real
      speculative decode against a :class:`VerifySession`, returning a
      :class:`SpeculationResult` whose tokens must equal the target's greedy decode.

    The last three go together (a strategy with some but not all of them is refused): they
    give a trained draft a served format and a measured acceptance length (``tau_real``).
    """

    def capture_plan(self, target: TargetInfo) -> CapturePlan: ...

    def build_model(self, target: TargetInfo, frozen_parts: Mapping[str, Any], stats: DataStats) -> Any: ...

    def collate(self, samples: Sequence[Mapping[str, Any]], sample_ids: Sequence[str]) -> Any: ...

    def forward_loss(self, model: Any, batch: Any, ctx: Any) -> Any: ...


@runtime_checkable
class VerifySession(Protocol):
    """A target forward with a KV cache, for speculative decoding.

    ``extend(ids)`` runs the target over new tokens appended to the cached prefix and
    returns, for those tokens only, ``logits [n, V]`` plus the plan's features (the plan's
    ``hidden_feature`` ``[n, len(layer_ids) * H]``, ``last_hidden [n, H]`` when asked);
    ``truncate(length)`` drops cached positions at and beyond ``length`` (rejected draft
    tokens), for any ``length`` from 0 to the session's, however many extends back;
    ``length`` is the number of cached positions. ``prefill`` holds what ``extend``
    returned for the prompt the session was opened on (None for a session opened empty), so
    a strategy's ``speculate`` takes the first token and its first context from it
    (:func:`specforge_core.speculative.prompt_outputs`).
    """

    length: int
    prefill: dict[str, Any] | None

    def extend(self, ids: Any) -> dict[str, Any]: ...

    def truncate(self, length: int) -> None: ...


@runtime_checkable
class TargetEngine(Protocol):
    """Runs the target model. Built by its spec's factory as ``factory(options, context)``.

    ``capture(samples, plan)`` takes dicts with a 1-D ``input_ids`` tensor each and returns,
    per sample and **unpadded**, the plan's features (other keys of a sample pass through);
    ``session(prompt_ids, plan)`` starts a :class:`VerifySession` over the prompt.

    ``frozen_parts()`` returns the target weights drafts reuse, as tensors in the target's
    dtype and on its device, ``requires_grad`` False:

    * ``embed_tokens [V, H]`` — the input embedding;
    * ``lm_head [V, H]`` — the output projection (the same tensor as ``embed_tokens`` for a
      target with tied embeddings);
    * ``norm [H]`` — the final norm's weight.

    They may share memory with the running target (the hf engine's do): read them, never
    write them; a draft that needs to change one copies it.
    """

    def info(self) -> TargetInfo: ...

    @property
    def tokenizer(self) -> Any: ...

    def capture(self, samples: Sequence[Mapping[str, Any]], plan: CapturePlan) -> list[dict[str, Any]]: ...

    def frozen_parts(self) -> dict[str, Any]: ...

    def session(self, prompt_ids: Any, plan: CapturePlan) -> VerifySession: ...
