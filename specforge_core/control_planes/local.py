"""The in-process control planes: ``local`` (the default) and ``noop``.

Both pair a metadata store with a :class:`QueueChannel` shared by the producer thread and
the trainer thread of one process. Nothing survives the process: for restartable or
disaggregated runs use the ``sqlite`` control plane.
"""

from __future__ import annotations

from typing import Any

from .channel import QueueChannel
from .metadata import MemoryMetadataStore, NoopMetadataStore


class _InProcessControlPlane:
    """A metadata store plus a queue channel; ``options.max_queue`` is the backpressure bound.

    With ``max_queue = N > 0`` the producer pauses when ``N`` published refs are not yet
    reported consumed and resumes at ``N // 2``; 0 means unbounded. Keyword arguments
    (``idle_timeout_s``, ``poll_interval_s``, ``low_watermark``) go to the channel.
    """

    def __init__(self, metadata: Any, options: Any, **channel_options: Any) -> None:
        self.metadata = metadata
        self.channel = QueueChannel(high_watermark=options.max_queue or None, **channel_options)

    def close(self) -> None:
        """Release the handles; does not end the stream (``channel.close()`` does)."""
        self.channel.detach()
        self.metadata.close()


class LocalControlPlane(_InProcessControlPlane):
    """In-memory metadata with dedup and ack checks, and an in-process ref queue (the default).

    Exactly-once within the process's lifetime; nothing is durable.
    """

    def __init__(self, options: Any, context: Any = None, **channel_options: Any) -> None:
        super().__init__(MemoryMetadataStore(), options, **channel_options)


class NoopControlPlane(_InProcessControlPlane):
    """No bookkeeping at all (no dedup, no ack tracking, no exactly-once): a ref queue only.

    For benchmarks and throwaway runs where the producer never repeats a sample.
    """

    def __init__(self, options: Any, context: Any = None, **channel_options: Any) -> None:
        super().__init__(NoopMetadataStore(), options, **channel_options)
