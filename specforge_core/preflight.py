"""Checks that run before anything heavy: every factory imports, the strategy honours its protocol.

A plugin's hook module is cheap and names its implementation lazily, so an import error in the
implementation, a factory that is not callable, or a strategy missing a method would otherwise
pass ``specforge plugins`` and ``--dry-run`` and fail only after the target has loaded. The CLI
runs :func:`check_plan` right after resolving a plan (``--dry-run`` included), and the runtime
runs :func:`check_strategy` on the strategy it builds, before the target engine starts.
"""

from __future__ import annotations

import difflib
from typing import Any

from .errors import PluginError
from .protocols import BuildContext, Strategy

#: What every strategy implements (:class:`~specforge_core.protocols.Strategy`).
STRATEGY_METHODS = ("capture_plan", "build_model", "collate", "forward_loss")
#: What a strategy that can be served implements: all three or none.
SERVING_METHODS = ("export", "load_export", "speculate")


def load_factory(spec: Any) -> Any:
    """``spec``'s factory, imported; a clear :class:`PluginError` if it cannot be imported or called."""
    factory = spec.load_factory()
    if not callable(factory):
        raise PluginError(f"{spec.origin()}: factory {spec.factory!r} is a {type(factory).__name__}, not a class or "
                          "function; name the class the plugin builds its component with")
    return factory


def check_strategy(strategy: Any, spec: Any) -> None:
    """Refuse a strategy that lacks a required method, or implements only part of the serving trio.

    The message names the plugin, the missing methods and, for a near miss (``forward_los``),
    the method it probably meant.
    """
    public = sorted(name for name in dir(strategy) if not name.startswith("_") and callable(getattr(strategy, name)))
    if not isinstance(strategy, Strategy):
        missing = [name for name in STRATEGY_METHODS if not callable(getattr(strategy, name, None))]
        raise PluginError(f"{spec.origin()}: {type(strategy).__name__} does not implement "
                          f"{_with_hints(missing, public)}; a strategy implements {', '.join(STRATEGY_METHODS)} "
                          "(specforge_core.protocols.Strategy)")
    served = [name for name in SERVING_METHODS if callable(getattr(strategy, name, None))]
    if served and len(served) < len(SERVING_METHODS):
        missing = [name for name in SERVING_METHODS if name not in served]
        raise PluginError(f"{spec.origin()}: {type(strategy).__name__} implements {', '.join(served)} but not "
                          f"{_with_hints(missing, public)}; a strategy that can be served implements all of "
                          f"{', '.join(SERVING_METHODS)} (export writes the draft, load_export reads it back, "
                          "speculate measures its real acceptance)")


def check_plan(plan: Any) -> Any:
    """Import every component's factory and build and check the strategy; returns the strategy.

    Building a strategy is cheap by contract (``build_model`` does the work), so this runs for
    ``--dry-run`` too.
    """
    for kind in plan.components:
        load_factory(plan[kind].spec)
    resolved = plan["strategy"]
    strategy = load_factory(resolved.spec)(resolved.options, BuildContext(run_id=plan.run_id, output_dir=plan.output))
    check_strategy(strategy, resolved.spec)
    return strategy


def _with_hints(missing: list[str], available: list[str]) -> str:
    """``'a', 'b' (it has 'b_'; a typo?)`` for the missing method names."""
    parts = []
    for name in missing:
        close = difflib.get_close_matches(name, available, n=1, cutoff=0.75)
        parts.append(f"{name!r}" + (f" (it has {close[0]!r}; a typo?)" if close else ""))
    return ", ".join(parts)
