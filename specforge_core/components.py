"""Building a run's components from its resolved plan: the one place a spec's factory is called.

Every topology, the export path and the capture command build strategies, target engines,
feature stores and control planes through :func:`build_component`, so a component is always
made the same way: its spec's lazy factory, called with the validated options and the
run's :class:`~specforge_core.protocols.BuildContext`.
"""

from __future__ import annotations

from typing import Any

from .protocols import BuildContext


def build_component(plan: Any, kind: str, context: BuildContext) -> Any:
    """The ``kind`` component of ``plan`` (a :class:`~specforge_core.config.RunPlan`), built for ``context``."""
    resolved = plan[kind]
    factory = resolved.spec.load_factory()
    return factory(resolved.options, context)
