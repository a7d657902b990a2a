"""Typed registrations that plugins return from the collection hooks.

A spec is a frozen record: the component's ``name``, a lazy ``factory`` string
(``"package.module:attribute"``, imported only when the component is built), an options
class, a one-line description, and what it provides or requires. The core fills in
``provenance`` (which distribution, version and entry point registered it).
"""

from __future__ import annotations

import difflib
import importlib
import re
from typing import Any

import attrs

from .errors import PluginError
from .options import NoOptions, build_options

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


@attrs.frozen
class Provenance:
    """Where a spec came from."""

    plugin: str  # entry point name (or "builtin")
    distribution: str
    version: str
    entry_point: str  # "name = module" as declared

    def describe(self) -> str:
        return f"{self.distribution} {self.version}"


def _check_factory(_instance: Any, _attribute: Any, value: str) -> None:
    if not isinstance(value, str) or not _FACTORY.match(value):
        raise PluginError(f"factory must be a 'package.module:attribute' string, got {value!r}")


def _check_name(_instance: Any, _attribute: Any, value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise PluginError(f"component name must be lowercase letters, digits, '-' or '_', got {value!r}")


@attrs.frozen(kw_only=True)
class ComponentSpec:
    """Fields shared by every kind of spec."""

    kind = "component"

    name: str = attrs.field(validator=_check_name)
    factory: str = attrs.field(validator=_check_factory)
    options: type = NoOptions
    description: str = ""
    provenance: Provenance | None = None

    def load_factory(self) -> Any:
        """Import and return the object named by ``factory``."""
        return self._load(self.factory, "factory")

    def _load(self, reference: str, field: str) -> Any:
        """Import the object a lazy ``"package.module:attribute"`` field of this spec names."""
        module_name, _, attr = reference.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as exc:  # noqa: BLE001 - reported with the spec's provenance
            origin = f" from {self.provenance.describe()}" if self.provenance else ""
            raise PluginError(
                f"{self.kind} '{self.name}'{origin}: cannot load {field} {reference!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return obj

    def build_options(self, values: dict[str, Any] | None = None) -> Any:
        return build_options(self.options, values, section=self.kind, owner=self.origin())

    def origin(self) -> str:
        return f"{self.kind} '{self.name}'" + (f" ({self.provenance.describe()})" if self.provenance else "")


#: The capability names target engines declare and strategies require, and what each promises.
#: An engine may declare more (a third-party strategy and engine can agree on their own names).
ENGINE_CAPABILITIES = {
    "aux_hidden_states": "capture() returns the outputs of the plan's layer_ids, concatenated into the plan's "
                         "hidden_feature [S, len(layer_ids)*H]",
    "last_hidden": "capture() returns last_hidden [S, H], the lm_head input, when the plan asks (last_hidden=True)",
    "frozen_parts": "frozen_parts() returns embed_tokens [V, H], lm_head [V, H] and norm [H] of the target",
    "verify": "session(prompt_ids, plan) opens a VerifySession (extend / truncate / prefill): what a strategy's "
              "speculate, and so tau_real, needs",
}


@attrs.frozen(kw_only=True)
class StrategySpec(ComponentSpec):
    """A draft algorithm.

    ``requires`` lists target-engine capabilities it needs (:data:`ENGINE_CAPABILITIES`: e.g.
    ``"aux_hidden_states"``, ``"last_hidden"``; a strategy that trains from features and also
    decodes needs ``"verify"`` for its real acceptance check); ``best_metric`` names the eval
    metric that picks the best checkpoint, as the strategy reports it (``"accept_len_sim"``, not
    ``"eval/accept_len_sim"``), and ``best_mode`` whether higher (``"max"``) or lower is better;
    ``export_formats`` names the serving
    formats its ``export`` can write (``"sglang"``, ``"vllm"``, ``"speculators"``, or a
    plugin's own), the first being the default — empty when the draft cannot be served, and
    then ``specforge export`` refuses it; ``suggested_train`` holds ``train`` options from the
    algorithm's published recipes (e.g. ``{"lr": 6e-4, "warmup_ratio": 0.04}``), applied
    wherever the user set nothing.
    """

    kind = "strategy"
    requires: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)
    export_formats: tuple[str, ...] = attrs.field(factory=tuple, converter=tuple)
    best_metric: str = "loss"
    best_mode: str = attrs.field(default="min", validator=attrs.validators.in_(("min", "max")))
    suggested_train: dict[str, Any] = attrs.field(factory=dict, converter=dict, eq=False)


@attrs.frozen(kw_only=True)
class TargetEngineSpec(ComponentSpec):
    """Something that runs the target model and produces features; ``capabilities`` names what it can give
    (:data:`ENGINE_CAPABILITIES`).

    ``train_suggestions`` optionally names (lazily, ``"package.module:function"``) a
    ``function(options) -> dict`` of ``train`` defaults the engine suggests for a target,
    e.g. a higher learning rate for a tiny one. It must answer from the options alone,
    without loading the model, so that ``specforge run --dry-run`` shows the plan the run
    will use; a run applies them only to the train options the user did not set.
    """

    kind = "target_engine"
    capabilities: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)
    train_suggestions: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_check_factory))

    def suggested_train_options(self, options: Any) -> dict[str, Any]:
        """The ``train`` defaults this engine suggests for ``options`` (no model is loaded)."""
        if self.train_suggestions is None:
            return {}
        suggested = self._load(self.train_suggestions, "train_suggestions")(options)
        if not isinstance(suggested, dict):
            raise PluginError(f"{self.origin()}: {self.train_suggestions} returned {type(suggested).__name__}, "
                              "not a dict of train options")
        return dict(suggested)


@attrs.frozen(kw_only=True)
class FeatureStoreSpec(ComponentSpec):
    """Where feature tensors live (``"cross_process"``, ``"consume_once"``, ``"retain"``...)."""

    kind = "feature_store"
    capabilities: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)


@attrs.frozen(kw_only=True)
class ControlPlaneSpec(ComponentSpec):
    """How sample metadata flows and is acknowledged (``"durable"``, ``"cross_process"``...)."""

    kind = "control_plane"
    capabilities: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)


#: kind name -> (spec class, hook name)
SPEC_KINDS: dict[str, tuple[type[ComponentSpec], str]] = {
    "strategy": (StrategySpec, "specforge_strategies"),
    "target_engine": (TargetEngineSpec, "specforge_target_engines"),
    "feature_store": (FeatureStoreSpec, "specforge_feature_stores"),
    "control_plane": (ControlPlaneSpec, "specforge_control_planes"),
}

#: First-party component names and the distribution that provides each.
FIRST_PARTY = {
    ("strategy", "eagle3"): "specforge-plugin-eagle3",
    ("strategy", "dflash"): "specforge-plugin-dflash",
    ("strategy", "domino"): "specforge-plugin-domino",
    ("strategy", "dspark"): "specforge-plugin-dspark",
    ("target_engine", "hf"): "specforge-plugin-hf",
    ("target_engine", "sglang"): "specforge-plugin-sglang",
    ("feature_store", "mooncake"): "specforge-plugin-mooncake",
    ("control_plane", "postgres"): "specforge-plugin-postgres",
}


def check_capabilities(strategy: StrategySpec, engine: TargetEngineSpec) -> None:
    """Fail, naming both plugins, when the engine cannot give what the strategy needs."""
    from .errors import CapabilityError

    missing = sorted(strategy.requires - engine.capabilities)
    if missing:
        known = sorted(set(ENGINE_CAPABILITIES) | set(engine.capabilities))
        typos = [f"{name!r} (did you mean {close[0]!r}?)" for name in missing if name not in ENGINE_CAPABILITIES
                 for close in [difflib.get_close_matches(name, known, n=1)] if close]
        raise CapabilityError(
            f"{strategy.origin()} requires {', '.join(missing)}, which {engine.origin()} "
            f"does not provide (it provides: {', '.join(sorted(engine.capabilities)) or 'nothing'}). "
            + (f"A misspelled requirement in the strategy's spec: {', '.join(typos)}." if typos else
               "Choose another --target-engine or strategy.")
        )
