"""What the durable, cross-process control planes (``sqlite``, plugins') do after a restart.

A plane with a durable metadata store and a channel that can skip ids, count a rank's
share and list what was published gets :meth:`resume_consumer` and
:meth:`resume_producer` from :class:`ResumableControlPlane`: the rules of a restart are the
same whatever keeps the refs.
"""

from __future__ import annotations

from typing import Any

from .metadata import Reconciliation


class ResumableControlPlane:
    """``resume_consumer`` / ``resume_producer`` over ``self.metadata`` and ``self.channel``.

    The channel provides ``skip(ids)``, ``reset_consumed(n)``, ``shard_sample_ids()`` and
    ``published_sample_ids()``; the metadata store ``reconcile()``.
    """

    metadata: Any
    channel: Any

    def resume_consumer(self) -> Reconciliation:
        """Prepare a (re)started consumer: acked samples will not be handed out again.

        The channel is re-read from its start; refs the metadata store lists as acked are
        skipped, the pending ones come again in this rank's shard. The returned
        reconciliation's ``acked`` refs are the ones to release from the feature store.
        """
        reconciliation = self.metadata.reconcile()
        acked = {ref.sample_id for ref in reconciliation.acked}
        self.channel.skip(acked)
        # What this rank reported consumed before may include samples now pending again:
        # the producer's backpressure counts only what stays acked.
        self.channel.reset_consumed(sum(sid in acked for sid in self.channel.shard_sample_ids()))
        return reconciliation

    def resume_producer(self) -> int:
        """Publish the pending refs a crashed producer committed but never published.

        Returns how many were published. Refs already in the channel are not published
        again, so consumers never get a sample twice.
        """
        pending = self.metadata.reconcile().pending
        published = self.channel.published_sample_ids()
        missing = [ref for ref in pending if ref.sample_id not in published]
        if missing:  # a stream that was closed already has nothing missing
            self.channel.publish(missing)
        return len(missing)
