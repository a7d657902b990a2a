"""Where a stream's shared state lives, behind one interface: a shared directory, or the network.

:func:`open_stream` returns a :class:`~.record.DirectoryStream` (``--features DIR``: the
sqlite control plane, lock files, the manifest's stream record) or a
:class:`~.networked.NetworkedStream` (a networked control plane and a cross-process
store: markers, leases), which producers and consumers use alike.
"""

from __future__ import annotations

from typing import Any

from ...config import RunPlan
from ...protocols import BuildContext
from .networked import NetworkedStream, is_networked
from .record import DirectoryStream


def open_stream(plan: RunPlan, context: BuildContext, role: str) -> Any:
    """The stream ``plan`` names, opened for a process in ``role`` (``producer``, ``consumer.rank0``...)."""
    if is_networked(plan):
        return NetworkedStream(plan, context, role)
    return DirectoryStream(plan, context)
