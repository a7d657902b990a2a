"""Leases and a producer pool's claims, in the control plane's schema.

**Leases** replace lock files when producer and consumer hosts share no directory: a
lease is a row ``(name, holder, expires_at)``. :meth:`PoolTables.take_lease` takes a free
or expired lease and refuses one a live holder keeps; holders renew theirs (with their
claims) every few seconds, so a dead holder's lease expires ``ttl`` after its last renewal.

**Claims** partition a stream among several producer processes: one row per stream
position. A producer claims the lowest open positions with ``FOR UPDATE SKIP LOCKED``
(never two producers for one position), captures them, and :meth:`complete` marks them
done, commits their refs and publishes them at their positions in **one transaction**: a
position is published exactly once, or its claim is still open. A producer that dies
mid-claim stops renewing; its claims expire and return to the pool, and the next claim on
such a position reports a higher attempt (whose samples get ids of their own, see
``specforge_core.topologies.capture.stream_sample_id``).
"""

from __future__ import annotations

import uuid
from typing import Any, Sequence

from specforge_core.contracts import SampleRef
from specforge_core.errors import ClaimLostError, ControlPlaneError, LeaseHeldError

from .channel import PostgresChannel
from .database import Database
from .metadata import PostgresMetadataStore, fresh_refs


def _claim_statement(free: str) -> str:
    """One statement (one round trip, one atomic commit): take up to ``count`` of the lowest open
    positions whose claim is ``free`` for ``holder`` and record the op id with what was taken, for
    a retry after a lost answer (``Database.run``)."""
    return f"""
WITH taken AS (
    UPDATE claims SET holder = %(holder)s, expires_at = now() + make_interval(secs => %(ttl)s), attempt = attempt + 1
    WHERE position IN (SELECT position FROM claims WHERE NOT done AND ({free}) ORDER BY position
                       LIMIT %(count)s FOR UPDATE SKIP LOCKED)
    RETURNING position, attempt
), op AS (
    INSERT INTO ops (op_id, result)
    SELECT %(op)s, coalesce(json_agg(json_build_array(position, attempt) ORDER BY position), '[]')::text FROM taken
)
SELECT position, attempt FROM taken
"""


_CLAIM = _claim_statement("holder IS NULL OR expires_at < now()")
_CLAIM_EXPIRED = _claim_statement("holder IS NOT NULL AND expires_at < now()")  # a dead producer's claims only


# Commit the completed refs (dedup on sample id, duplicates counted) and publish the fresh ones
# at their claims' positions, in one statement; the channel_state update takes the row lock
# that serialises completions.
_PUBLISH_CLAIMED = f"""
WITH {fresh_refs("SELECT position, sample_id, ref, n FROM unnest(%(positions)s::bigint[], %(ids)b::text[], "
                 "%(refs)b::text[]) WITH ORDINALITY AS b (position, sample_id, ref, n)")}, published AS (
    INSERT INTO channel_refs (channel, position, sample_id, ref)
    SELECT %(channel)s, position, sample_id, ref FROM batch WHERE sample_id IN (SELECT sample_id FROM fresh)
)
UPDATE channel_state SET published = published + (SELECT count(*) FROM fresh) WHERE channel = %(channel)s
"""

# When no position is left open, end the stream at its length; wake the consumers either way.
_CLOSE_IF_LAST = """
WITH last AS (
    SELECT NOT EXISTS (SELECT 1 FROM claims WHERE NOT done) AS last
), closed AS (
    UPDATE channel_state SET end_kind = 'closed', end_reason = 'was closed', end_position = (SELECT count(*) FROM claims)
    WHERE channel = %(channel)s AND end_kind IS NULL AND (SELECT last FROM last)
)
SELECT last, pg_notify(%(notify)s, %(channel)s) FROM last
"""


class PoolTables:
    """Leases and claims of one control plane (see the module docstring)."""

    def __init__(self, db: Database, metadata: PostgresMetadataStore, channel: PostgresChannel) -> None:
        self.db, self.metadata, self.channel = db, metadata, channel

    # ---- leases ----------------------------------------------------------------------
    def take_lease(self, name: str, holder: str, ttl_s: float) -> None:
        """Take lease ``name`` for ``holder`` (free, expired or already ours), or raise :class:`LeaseHeldError`."""
        def work(conn: Any) -> Any:
            return conn.execute(
                "INSERT INTO leases (name, holder, expires_at) VALUES (%s, %s, now() + make_interval(secs => %s)) "
                "ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at "
                "WHERE leases.expires_at < now() OR leases.holder = excluded.holder RETURNING holder",
                (name, holder, ttl_s)).fetchone()

        if self.db.run(work) is None:
            other, left = self.db.run(lambda conn: conn.execute(
                "SELECT holder, extract(epoch FROM expires_at - now()) FROM leases WHERE name = %s", (name,)).fetchone())
            raise LeaseHeldError(f"{name} is held by another live process ({other}; its lease runs {float(left):.0f}s "
                                 "more unless it renews it). One runs at a time: stop it first, or wait for its lease "
                                 "to expire if it died")

    def release_leases(self, holder: str) -> None:
        """Give up every lease and open claim of ``holder`` (a clean exit: nobody waits for the expiry)."""
        def work(conn: Any) -> None:
            conn.execute("DELETE FROM leases WHERE holder = %s", (holder,))
            conn.execute("UPDATE claims SET holder = NULL, expires_at = NULL WHERE holder = %s AND NOT done", (holder,))

        self.db.run(work)

    def renew(self, holder: str, ttl_s: float) -> int:
        """Push back the expiry of ``holder``'s leases and open claims; how many leases it still holds."""
        def work(conn: Any) -> int:
            conn.execute("UPDATE claims SET expires_at = now() + make_interval(secs => %s) WHERE holder = %s AND "
                         "NOT done", (ttl_s, holder))
            return conn.execute("UPDATE leases SET expires_at = now() + make_interval(secs => %s) WHERE holder = %s",
                                (ttl_s, holder)).rowcount

        return self.db.run(work)

    # ---- claims ----------------------------------------------------------------------
    def open_positions(self, total: int) -> None:
        """Create the claims of positions ``0 .. total-1`` (idempotent: existing ones are kept)."""
        self.db.run(lambda conn: conn.execute(
            "INSERT INTO claims (position) SELECT generate_series(0, %s - 1) ON CONFLICT DO NOTHING", (total,)))

    def claim(self, holder: str, count: int, ttl_s: float, *, expired_only: bool = False) -> list[tuple[int, int]]:
        """Claim up to ``count`` of the lowest open positions for ``holder``: ``(position, attempt)``
        pairs by position, where ``attempt`` counts the claims ever taken on that position
        (1 the first time; more when an earlier holder's claim expired).

        ``expired_only`` takes only claims a dead producer left (what a producer paused by
        backpressure must still fill: the consumers wait for those gaps).
        """
        op_id = f"claim-{uuid.uuid4().hex}"
        statement = _CLAIM_EXPIRED if expired_only else _CLAIM

        def work(conn: Any) -> list[list[int]]:
            rows = conn.execute(statement, {"holder": holder, "ttl": ttl_s, "count": count, "op": op_id}).fetchall()
            return sorted([int(position), int(attempt)] for position, attempt in rows)

        # With an op id: a claim whose answer was lost (a server restart) returns the positions it
        # took when run again, rather than taking more; the lost ones would be renewed, never worked.
        claimed = self.db.run(work, op_id=op_id, single_statement=True)
        return [(position, attempt) for position, attempt in claimed]

    def open_claims(self) -> int:
        """Positions not yet published (claimed or not)."""
        return self.db.run(lambda conn: conn.execute("SELECT count(*) FROM claims WHERE NOT done").fetchone()[0])

    def complete(self, holder: str, positions: Sequence[int], refs: Sequence[SampleRef]) -> bool:
        """Mark ``positions`` done, commit ``refs`` and publish each at its position, in one transaction.

        Raises :class:`ClaimLostError` (nothing applied) when a claim is no longer ``holder``'s.
        Returns True when this completed the last open position: the stream is then closed.
        """
        if len(positions) != len(refs):
            raise ControlPlaneError(f"complete() got {len(positions)} positions and {len(refs)} refs")
        channel = self.channel
        params = {"positions": list(positions), "ids": [ref.sample_id for ref in refs],
                  "refs": [ref.to_json() for ref in refs], "n": len(refs), "channel": channel.name,
                  "notify": channel.notify_name}

        def work(conn: Any) -> bool:
            done = conn.execute("UPDATE claims SET done = true, holder = NULL, expires_at = NULL WHERE "
                                "position = ANY(%s) AND holder = %s AND NOT done RETURNING position",
                                (list(positions), holder)).fetchall()
            if len(done) != len(positions):
                raise ClaimLostError(f"{len(positions) - len(done)} of positions {list(positions)[:5]}... are no longer "
                                     f"claimed by {holder}: its claim expired and another producer took it. Nothing "
                                     "of this batch was published; raise the claim ttl if captures take this long")
            conn.execute(_PUBLISH_CLAIMED, params)
            # A statement of its own, so its snapshot comes after the channel_state row lock above:
            # of two producers completing the last positions at once, the second sees the first's.
            return bool(conn.execute(_CLOSE_IF_LAST, params).fetchone()[0])

        return bool(self.db.run(work, op_id=f"complete-{uuid.uuid4().hex}"))
