"""Checks that run before anything heavy: every factory imports, the strategy honours its protocol.

A plugin's hook module is cheap and names its implementation lazily, so an import error in the
implementation, a factory that is not callable, or a strategy missing a method would otherwise
pass ``specforge plugins`` and ``--dry-run`` and fail only after the target has loaded. The CLI
runs :func:`check_plan` right after resolving a plan (``--dry-run`` included), and the runtime
runs :func:`check_strategy` on the strategy it builds, before the target engine starts.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable

from .errors import PluginError
from .protocols import BuildContext, Strategy

#: What every strategy implements (:class:`~specforge_core.protocols.Strategy`).
STRATEGY_METHODS = ("capture_plan", "build_model", "collate", "forward_loss")
#: What a strategy that can be served implements: all three or none.
SERVING_METHODS = ("export", "load_export", "speculate")
#: How specforge calls each method: its positional arguments, the keywords it always passes, and those it passes
#: only where the method accepts them (:func:`accepted_kwargs`).
CALLS = {"capture_plan": (("target",), (), ()),
         "build_model": (("target", "frozen_parts", "stats"), (), ()),
         "collate": (("samples", "sample_ids"), (), ()),
         "forward_loss": (("model", "batch", "ctx"), (), ()),
         "export": (("model", "out_dir", "target"), (), ("fmt", "dtype")),
         "load_export": (("path", "target", "frozen_parts"), (), ()),
         "speculate": (("model", "session", "prompt"), ("max_new_tokens", "eos_token_id"), ())}


def load_factory(spec: Any) -> Any:
    """``spec``'s factory, imported; a clear :class:`PluginError` if it cannot be imported or called."""
    factory = spec.load_factory()
    if not callable(factory):
        raise PluginError(f"{spec.origin()}: factory {spec.factory!r} is a {type(factory).__name__}, not a class or "
                          "function; name the class the plugin builds its component with")
    return factory


def check_strategy(strategy: Any, spec: Any) -> None:
    """Refuse a strategy that lacks a required method, implements only part of the serving trio, or has a
    method whose signature cannot take specforge's call.

    The message names the plugin, the missing methods and, for a near miss (``forward_los``),
    the method it probably meant. ``strategy`` may be the strategy's class (``specforge plugins
    --check``, which builds nothing): its methods are then checked as its instances would have them.
    """
    label = strategy.__name__ if inspect.isclass(strategy) else type(strategy).__name__
    public = sorted(name for name in dir(strategy) if not name.startswith("_") and callable(getattr(strategy, name)))
    if not isinstance(strategy, Strategy):
        missing = [name for name in STRATEGY_METHODS if not callable(getattr(strategy, name, None))]
        raise PluginError(f"{spec.origin()}: {label} does not implement "
                          f"{_with_hints(missing, public)}; a strategy implements {', '.join(STRATEGY_METHODS)} "
                          "(specforge_core.protocols.Strategy)")
    served = [name for name in SERVING_METHODS if callable(getattr(strategy, name, None))]
    if served and len(served) < len(SERVING_METHODS):
        missing = [name for name in SERVING_METHODS if name not in served]
        raise PluginError(f"{spec.origin()}: {label} implements {', '.join(served)} but not "
                          f"{_with_hints(missing, public)}; a strategy that can be served implements all of "
                          f"{', '.join(SERVING_METHODS)} (export writes the draft, load_export reads it back, "
                          "speculate measures its real acceptance)")
    for name in (*STRATEGY_METHODS, *served):
        positional, always, optional = CALLS[name]
        method = getattr(strategy, name)
        if inspect.isclass(strategy) and not isinstance(inspect.getattr_static(strategy, name),
                                                        (staticmethod, classmethod)):
            method = functools.partial(method, None)  # as bound to an instance: without self
        keywords = {key: None for key in always}
        if optional:
            keywords.update(accepted_kwargs(method, **{key: None for key in optional}))
        _check_call(f"{spec.origin()}: {label}.{name}", method, name, positional, keywords)


def _check_call(what: str, function: Any, name: str, positional: tuple[str, ...], keywords: dict[str, Any]) -> None:
    """Refuse ``function`` if its signature cannot take the call specforge makes (a TypeError only at that call,
    perhaps after hours of training, otherwise)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will tell
        return
    try:
        signature.bind(*positional, **keywords)
    except TypeError as exc:
        call = ", ".join([*positional, *(f"{key}=..." for key in keywords)])
        raise PluginError(f"{what}{signature} cannot be called as specforge calls it, {name}({call}): {exc}; "
                          "see specforge_core.protocols.Strategy") from None


def check_plan(plan: Any) -> Any:
    """Import every component's factory and build and check the strategy; returns the strategy.

    Building a strategy is cheap by contract (``build_model`` does the work), so this runs for
    ``--dry-run`` too.
    """
    for kind in plan.components:
        load_factory(plan[kind].spec)
    resolved = plan["strategy"]
    factory = load_factory(resolved.spec)
    _check_call(f"{resolved.spec.origin()}: factory {resolved.spec.factory!r}", factory, "factory",
                ("options", "context"), {})
    strategy = factory(resolved.options, BuildContext(run_id=plan.run_id, output_dir=plan.output))
    check_strategy(strategy, resolved.spec)
    return strategy


def _with_hints(missing: list[str], available: list[str]) -> str:
    """``'a', 'b' (it has 'b_'; a typo?)`` for the missing method names."""
    parts = []
    for name in missing:
        close = difflib.get_close_matches(name, available, n=1, cutoff=0.75)
        parts.append(f"{name!r}" + (f" (it has {close[0]!r}; a typo?)" if close else ""))
    return ", ".join(parts)


def accepted_kwargs(function: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments of ``kwargs`` that ``function`` accepts: a protocol method grows by adding
    keyword arguments, and an implementation written before one was added simply does not get it."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {name: value for name, value in kwargs.items() if name in parameters}
