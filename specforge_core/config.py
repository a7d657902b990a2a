"""Run configuration: YAML file < command-line flags < ``--set section.key=value``.

A config file looks like this (every section optional)::

    strategy: {name: eagle3, ttt_length: 7}     # or just `strategy: eagle3`
    target_engine: {name: hf, model: /models/Qwen3-8B, dtype: bfloat16}
    feature_store: memory
    control_plane: local
    train: {batch_size: 4, lr: 1e-4, max_steps: 2000}
    data: {path: chats.jsonl, max_length: 2048}
    output: out/

Component sections hold ``name`` plus that component's options; ``train`` and ``data``
hold the core's :class:`TrainOptions` and :class:`DataOptions`.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping, Sequence

import attrs
import yaml

from .errors import OptionError
from .options import build_options, fraction, non_negative, option, options_to_dict, parse_set_value, positive
from .plugins import PluginManager
from .serving import DEFAULT_EXPORT_DTYPE, EXPORT_DTYPES
from .specs import SPEC_KINDS, ComponentSpec, check_capabilities

COMPONENT_SECTIONS = tuple(SPEC_KINDS)  # strategy, target_engine, feature_store, control_plane
SECTIONS = COMPONENT_SECTIONS + ("train", "data", "regenerate")
TOP_LEVEL = SECTIONS + ("output", "run_id", "features", "role")
#: ``role`` values of a disaggregated run: a producer captures, a consumer trains.
ROLES = ("producer", "consumer")

DEFAULTS = {"target_engine": "hf", "control_plane": "local"}


@attrs.frozen
class TrainOptions:
    """How the training loop runs (the ``train`` section)."""

    batch_size: int = option(4, "Samples per micro-batch on each rank.", check=positive)
    accumulation_steps: int = option(1, "Micro-batches per optimizer update.", check=positive)
    lr: float = option(1e-4, "Peak learning rate of AdamW. The strategies suggest their published recipes' value "
                             "(eagle3 1e-4, dflash 6e-4); the toy target suggests 1e-3.", check=positive)
    min_lr_ratio: float = option(0.0, "Cosine floor as a fraction of lr.", check=fraction)
    weight_decay: float = option(0.0, "AdamW weight decay.", check=non_negative)
    warmup_steps: int = option(0, "Linear warmup length in optimizer steps (wins over warmup_ratio when > 0).",
                               check=non_negative)
    warmup_ratio: float = option(0.0, "Linear warmup as a fraction of the planned optimizer steps, used when "
                                      "warmup_steps is 0. The strategies suggest their published recipes' value "
                                      "(eagle3 0.015, dflash 0.04).", check=fraction)
    schedule: str = option("cosine", "LR schedule after warmup.", choices=("cosine", "constant"))
    max_steps: int | None = option(None, "Optimizer steps to run; None derives it from epochs and data size.",
                                   check=positive)
    epochs: int = option(1, "Passes over a fixed (offline) dataset.", check=positive)
    max_grad_norm: float = option(1.0, "Clip the global gradient norm to this (0 disables clipping).",
                                  check=non_negative)
    seed: int = option(0, "Seed for initialisation, shuffling and anchor sampling.")
    log_every: int = option(1, "Write metrics every N optimizer steps.", check=positive)
    eval_every: int = option(0, "Evaluate every N optimizer steps (0: only at the end).", check=non_negative)
    save_every: int = option(0, "Checkpoint every N optimizer steps (0: only at the end).", check=non_negative)
    keep_last: int = option(2, "Checkpoints kept by rotation (best is never deleted).", check=positive)
    device: str = option("auto", "Training device: auto, cpu, cuda.", choices=("auto", "cpu", "cuda"))
    threads: int | None = option(None, "Torch CPU threads of this process. None: OMP_NUM_THREADS when set, else the "
                                       "cores this process may run on. On a machine shared with other jobs, set "
                                       "it to the cores you have to yourself.", check=positive)
    keep_heap: bool = option(True, "Keep the C heap's memory between steps instead of handing it back to the system "
                                   "as a step ends and faulting it in again in the next (glibc: blocks up to 32 "
                                   "MiB from the heap, trimmed only above 1 GiB free; a few percent of a small "
                                   "draft's CPU step). false keeps the C library's defaults, as do glibc's MALLOC_* "
                                   "environment variables when set.")
    recompute_mlp: bool = option(False, "Make each gated MLP's gate and up projections again in backward instead of "
                                        "keeping them from forward (the draft layers' MLPs of every in-tree "
                                        "strategy; any specforge_core.nn.SwiGLU): two [tokens, intermediate] "
                                        "tensors fewer kept per MLP call (EAGLE3: per unroll step), for a "
                                        "second forward of those two projections (3-6% of a small draft's "
                                        "CPU step). The values and gradients are the same, bit for bit.")
    export: bool = option(True, "At the end, export the draft for serving into OUTPUT/export (when the strategy can), "
                                "in the first format its plugin declares.")
    export_dtype: str = option(DEFAULT_EXPORT_DTYPE, "dtype of the exported draft's weights: the dtype it will be "
                                                     "served in (SGLang and vLLM serve a float32 export as float16 "
                                                     "under --dtype auto).", choices=EXPORT_DTYPES)
    real_eval_prompts: int = option(16, "Held-out prompts for the real speculative-decoding check at the end "
                                        "(tau_real); 0 skips it.", check=non_negative)
    real_eval_max_new_tokens: int = option(64, "Tokens generated per prompt in that check.", check=positive)


@attrs.frozen
class DataOptions:
    """What conversations feed the run (the ``data`` section)."""

    path: str | None = option(None, "Training JSONL; None uses the bundled toy conversations.")
    eval_path: str | None = option(None, "Held-out JSONL for evaluation. None: the toy target's bundled eval "
                                         "split, or for your own data.path a share of it held out (eval_holdout).")
    eval_holdout: float = option(0.05, "Without eval_path, this share of data.path's rows is held out for "
                                       "evaluation (chosen by a hash of each row: the same rows every run), at "
                                       "least 1 and at most eval_holdout_max. 0 turns it off.", check=fraction)
    eval_holdout_max: int = option(200, "The most rows eval_holdout takes.", check=positive)
    max_length: int = option(2048, "Truncate tokenized samples to this many tokens.", check=positive)
    last_turn_only: bool = option(False, "Supervise only the last assistant turn.")
    strict: bool = option(False, "Make a malformed row fatal instead of skipping and counting it.")
    max_samples: int | None = option(None, "Use at most this many training samples.", check=positive)
    missing_samples: str = option("fail", "An offline run (--features DIR) whose store lacks samples its manifest "
                                          "lists: fail, or skip them (train on the rest and report what is missing).",
                                  choices=("fail", "skip"))


@attrs.frozen
class RegenerateOptions:
    """How `specforge regenerate` rewrites assistant turns with the target (the ``regenerate`` section)."""

    max_new_tokens: int = option(512, "Most tokens generated per assistant turn; a turn cut there is counted.",
                                 check=positive)
    temperature: float = option(0.0, "0 decodes greedily (the target's own most likely answer, what "
                                     "acceptance is measured against); above 0 samples.", check=non_negative)
    top_p: float = option(1.0, "Nucleus sampling: keep the most likely tokens up to this total probability "
                               "(with temperature > 0).", check=fraction)
    seed: int = option(0, "Seed of sampling; each batch is seeded from it and its first row, so a resumed run "
                          "samples what an uninterrupted one would (for the same batch_size).")
    batch_size: int = option(8, "Conversations generated together (one batched, KV-cached decode).", check=positive)


#: The core's own option sections (component sections are described by their plugins).
PLAIN_SECTIONS: dict[str, type] = {"train": TrainOptions, "data": DataOptions, "regenerate": RegenerateOptions}


@attrs.frozen(kw_only=True)
class ResolvedComponent:
    spec: ComponentSpec
    options: Any

    def to_dict(self) -> dict[str, Any]:
        prov = self.spec.provenance
        return {
            "name": self.spec.name,
            "plugin": prov.plugin if prov else None,
            "distribution": prov.distribution if prov else None,
            "version": prov.version if prov else None,
            "options": options_to_dict(self.options),
        }


#: ``data`` options that cannot change which samples a stream or a run reading its data takes (``strict``
#: only decides whether a bad row stops the run, ``missing_samples`` is for offline runs); every other
#: data option is part of their contracts (:func:`data_contract`).
DATA_OPTIONS_OUTSIDE_CONTRACT = frozenset({"strict", "missing_samples"})


def data_contract(data: Any) -> dict[str, Any]:
    """The ``data`` options that decide which rows a run reads and how they are prepared (all but
    :data:`DATA_OPTIONS_OUTSIDE_CONTRACT`), data paths made absolute."""
    contract = {}
    for key, value in options_to_dict(data).items():
        if key in DATA_OPTIONS_OUTSIDE_CONTRACT:
            continue
        if key in ("path", "eval_path") and value is not None:
            value = os.path.abspath(value)
        contract[key] = value
    return contract


@attrs.frozen(kw_only=True)
class RunPlan:
    """Everything a run needs, resolved and validated, before anything heavy is built."""

    components: dict[str, ResolvedComponent]
    train: TrainOptions
    data: DataOptions
    output: str
    run_id: str
    features: str | None = None
    #: ``producer`` or ``consumer`` in a disaggregated run (``features`` is then the directory
    #: the two share), None otherwise.
    role: str | None = None
    #: ``section.key`` of every option the user set (config file or --set), so suggested
    #: defaults (e.g. from the toy target) never override a choice.
    explicit: frozenset[str] = frozenset()

    def __getitem__(self, kind: str) -> ResolvedComponent:
        return self.components[kind]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "output": self.output,
            "features": self.features,
            "role": self.role,
            **{kind: comp.to_dict() for kind, comp in self.components.items()},
            "train": options_to_dict(self.train),
            "data": options_to_dict(self.data),
        }


def plan_to_raw(plan_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved plan (``RunPlan.to_dict()``) back to the raw config that resolves to it."""
    raw: dict[str, Any] = {kind: {"name": plan_dict[kind]["name"], **plan_dict[kind]["options"]}
                           for kind in COMPONENT_SECTIONS}
    raw.update({"train": dict(plan_dict["train"]), "data": dict(plan_dict["data"]), "output": plan_dict["output"],
                "run_id": plan_dict["run_id"]})
    for key in ("features", "role"):
        if plan_dict.get(key):
            raw[key] = plan_dict[key]
    return raw


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise OptionError(f"config file {os.fspath(path)!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise OptionError(f"config file {os.fspath(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise OptionError(f"config file {os.fspath(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name)
    if value is None:
        return {}
    if isinstance(value, str) and name in COMPONENT_SECTIONS:
        return {"name": value}
    if not isinstance(value, dict):
        raise OptionError(f"section '{name}' must be a mapping (or a component name), got {value!r}")
    return dict(value)


def set_option(raw: dict[str, Any], section: str, key: str, value: Any) -> None:
    """Set ``section.key`` in a raw config in place (a bare component name becomes ``{name: ...}``)."""
    body = _section(raw, section)
    body[key] = value
    raw[section] = body


def apply_sets(raw: dict[str, Any], assignments: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` assignments to a raw config mapping (returns a copy)."""
    raw = copy.deepcopy(raw)
    for item in assignments:
        key, sep, value = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or not field or "." in field:
            raise OptionError(f"--set {item!r}: expected the form section.key=value (e.g. train.lr=1e-4); "
                              f"sections: {', '.join(SECTIONS)}")
        if section not in SECTIONS:
            raise OptionError(f"--set {item!r}: unknown section '{section}'; sections: {', '.join(SECTIONS)}")
        set_option(raw, section, field, parse_set_value(value))
    return raw


def resolve_plan(manager: PluginManager, raw: Mapping[str, Any], *, default_feature_store: str | None = None) -> RunPlan:
    """Validate a raw config against the installed plugins and return the run plan.

    Fails before anything heavy is built: unknown sections or options, bad values, unknown
    component names, and a strategy whose requirements the target engine cannot meet.
    """
    raw = dict(raw)
    unknown = sorted(set(raw) - set(TOP_LEVEL))
    if unknown:
        raise OptionError(f"unknown config section '{unknown[0]}'; sections: {', '.join(TOP_LEVEL)}")
    features = raw.get("features")
    role = raw.get("role") or None
    defaults = dict(DEFAULTS, feature_store=default_feature_store or ("disk" if features else "memory"))
    if role is not None:
        defaults["control_plane"] = _check_role(raw, role, features, manager)
    components: dict[str, ResolvedComponent] = {}
    for kind in COMPONENT_SECTIONS:
        body = _section(raw, kind)
        name = body.pop("name", None) or defaults.get(kind)
        if not name:
            raise OptionError(f"no {kind.replace('_', ' ')} chosen: pass --{kind.replace('_', '-')} NAME "
                              f"or set {kind}.name in the config")
        spec = manager.get(kind, str(name))
        components[kind] = ResolvedComponent(spec=spec, options=spec.build_options(body))
    check_capabilities(components["strategy"].spec, components["target_engine"].spec)
    if role is not None:
        _check_role_store(role, components["feature_store"].spec, components["control_plane"].spec)
    train = build_options(TrainOptions, _section(raw, "train"), section="train")
    data = build_options(DataOptions, _section(raw, "data"), section="data")
    build_options(RegenerateOptions, _section(raw, "regenerate"), section="regenerate")  # a typo fails here too
    run_id = str(raw.get("run_id") or "run")
    output = str(raw.get("output") or os.path.join("runs", run_id))
    explicit = frozenset(f"{section}.{key}" for section in SECTIONS for key in _section(raw, section))
    plan = RunPlan(components=components, train=train, data=data, output=output, run_id=run_id,
                   features=str(features) if features else None, role=role, explicit=explicit)
    # The strategy's published recipe fills what the user left unset (shown by --dry-run).
    return with_suggested_train_options(plan, getattr(components["strategy"].spec, "suggested_train", {}))[0]


def check_data_files(plan: RunPlan) -> None:
    """A data file the plan will read and that is not there fails now, not after minutes of loading the target.

    Only capturing plans read data: not an offline run (``--features`` without a role) nor a
    consumer (its producer reads it), nor the export of a finished run.
    """
    if plan.role == "consumer" or (plan.features and plan.role is None):
        return
    for key in ("path", "eval_path"):
        path = getattr(plan.data, key)
        if path is not None and not os.path.isfile(path):
            state = "is a directory" if os.path.isdir(path) else "does not exist"
            raise OptionError(f"option 'data.{key}': {path} {state}; pass a JSONL file of conversations "
                              f"(--set data.{key}=FILE)")


def _check_role(raw: Mapping[str, Any], role: Any, features: Any, manager: PluginManager) -> str:
    """A disaggregated role needs a stream both sides reach; returns the control plane to use.

    Either a shared features directory (``--features DIR``, sqlite control plane) or a
    networked control plane (capability ``networked``, e.g. postgres), which keeps the
    stream's state itself so that the two sides share no directory.
    """
    if role not in ROLES:
        raise OptionError(f"unknown role {role!r}; choose producer (captures features) or consumer (trains)")
    chosen = _section(raw, "control_plane").get("name")
    if chosen is not None and "networked" in manager.get("control_plane", str(chosen)).capabilities:
        if features:
            raise OptionError(f"--role {role} with control_plane={chosen!r} keeps the stream in the control plane "
                              "and the feature store, on no shared directory; drop --features")
        return str(chosen)
    if not features:
        raise OptionError(f"--role {role} needs --features DIR: the directory the producer and the consumer share "
                          "(features, target parts and the control plane's database and ref channel), or a "
                          "networked control plane (--control-plane postgres) and feature store (--feature-store "
                          "mooncake) for hosts that share no directory")
    if chosen is not None and chosen != "sqlite":
        raise OptionError(f"--role {role} exchanges refs through the shared directory's sqlite control plane; "
                          f"control_plane={chosen!r} cannot be shared between the processes (leave it unset, or "
                          "use a networked control plane such as postgres)")
    return "sqlite"


def _check_role_store(role: str, spec: ComponentSpec, control_plane: ComponentSpec) -> None:
    """The training stream's feature store must be one that separate processes share."""
    if "cross_process" not in spec.capabilities:
        raise OptionError(f"--role {role} needs a feature store that separate processes share (capability "
                          f"cross_process); feature_store={spec.name!r} keeps tensors inside one process. Use disk "
                          "(the default: the features directory's store) or a network store such as mooncake")
    if "networked" in control_plane.capabilities and spec.name == "disk":
        raise OptionError(f"--role {role} with control_plane={control_plane.name!r} shares no directory between the "
                          "hosts, so the disk feature store cannot carry the samples; use a network store such as "
                          "--feature-store mooncake")


def with_suggested_train_options(plan: RunPlan, suggested: Mapping[str, Any]) -> tuple[RunPlan, dict[str, Any]]:
    """Apply a component's suggested ``train`` defaults to the options the user did not set."""
    applied = {k: v for k, v in suggested.items() if f"train.{k}" not in plan.explicit}
    if not applied:
        return plan, {}
    merged = {**options_to_dict(plan.train), **applied}
    train = build_options(TrainOptions, merged, section="train")
    return attrs.evolve(plan, train=train), applied


def engine_train_suggestions(plan: RunPlan) -> dict[str, Any]:
    """The ``train`` defaults the plan's target engine suggests for its options (no model is loaded)."""
    engine = plan["target_engine"]
    return engine.spec.suggested_train_options(engine.options)
