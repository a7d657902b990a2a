"""A ref channel in PostgreSQL tables: the stream of refs from producers to consumer ranks.

The API and its rules are the core's (``specforge_core.control_planes.channel``); this
says how they are kept in the database:

* every ref is a row of ``channel_refs`` at its **stream position** (0, 1, 2, ...);
  ``publish`` takes the next positions from ``channel_state.published`` in the same
  transaction that inserts the rows, so concurrent publishers are serialised and a ref is
  visible only whole (a poll never sees part of a batch);
* consumer rank ``r`` of ``w`` is handed the positions ``p`` with ``p % w == r``, in order;
  it remembers the next position it expects, so a poll returns only new refs. A position
  not there yet is waited for: refs behind a gap are never handed out early;
* ``close`` / ``fail`` record the end (and the position it came at) in ``channel_state``;
  the first of them wins, and consumers drain the refs before it first;
* ``channel_consumed`` holds each rank's consumed count (an absolute value, so writing it
  again is harmless); the producers' backpressure sums it. These counts and heartbeats are
  written without waiting for the WAL flush (see ``_ADVISORY``);
* every write sends ``NOTIFY``; a waiting consumer or paused producer sleeps on its
  :class:`~.database.Listener` until one arrives, re-reading the tables at least every
  ``poll_interval_s`` as a safety net.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from specforge_core.contracts import SampleRef
from specforge_core.control_planes.channel import RestartableChannel
from specforge_core.errors import ChannelClosedError

from .database import Database, Listener

#: Rows one poll reads at most (a consumer far behind reads its backlog in pieces).
READ_BATCH = 1024

# Consumed counts and heartbeats steer backpressure and idle clocks only: a server crash
# that loses the last ones costs a late wake-up, never a sample (a consumed count is an
# absolute value written again by the next report, and a restarted consumer restates it).
# So they skip the WAL flush (set_config(..., true) holds for this transaction only), which
# would otherwise double the consumer's durable writes per optimizer step: its ack is the
# one that must be on disk. Each is one statement, one round trip. A consumer whose
# connection was cut (a crash among the causes) restates its count at its next read, since
# a paused producer and a consumer waiting for it would otherwise wait for each other.
_ADVISORY = """
WITH write AS ({write})
SELECT set_config('synchronous_commit', 'off', true), pg_notify(%(notify)s, %(channel)s)
"""
_HEARTBEAT = _ADVISORY.format(write="UPDATE channel_state SET heartbeats = heartbeats + 1 WHERE channel = %(channel)s")
_CONSUMED = _ADVISORY.format(write="INSERT INTO channel_consumed (channel, rank, consumed) VALUES (%(channel)s, "
                                   "%(rank)s, %(consumed)s) ON CONFLICT (channel, rank) DO UPDATE SET consumed = "
                                   "excluded.consumed")

_STATE = "SELECT published, end_kind, end_reason, end_position, heartbeats FROM channel_state WHERE channel = %s"

# One statement, one snapshot: the channel's state and this rank's next refs. Refs published
# before an end recorded in that state are then surely among the rows.
_PULL = """
SELECT s.published, s.end_kind, s.end_reason, s.end_position, s.heartbeats, r.position, r.sample_id, r.ref
FROM channel_state s LEFT JOIN LATERAL (
    SELECT position, sample_id, ref FROM channel_refs
    WHERE channel = s.channel AND position >= %(next)s AND mod(position, %(world_size)s) = %(rank)s
    ORDER BY position LIMIT %(limit)s
) r ON true
WHERE s.channel = %(channel)s ORDER BY r.position
"""


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of one schema's control plane (short and fixed-length)."""
    return "specforge_" + hashlib.sha256(schema.encode()).hexdigest()[:24]


class PostgresChannel(RestartableChannel):
    """The ref channel ``name`` of a control plane's schema, opened as ``role`` (see the module docstring).

    ``role``: ``"producer"`` publishes, ``"consumer"`` polls its ``shard=(rank, world_size)``,
    ``"both"`` does both (one process; tests, colocated runs). Channel options
    (watermarks, idle timeout, poll interval) are the core's.
    """

    def __init__(self, db: Database, *, name: str = "stream", role: str = "both", shard: tuple[int, int] = (0, 1),
                 listen_timeout_s: float = 5.0, **channel_options: Any) -> None:
        super().__init__(role=role, shard=shard, **channel_options)
        self.db = db
        self.name = name
        self._max_sleep_s = self.poll_interval_s
        self.notify_name = notify_channel(db.schema or "")
        self._listen_timeout_s = listen_timeout_s
        self._listener: Listener | None = None
        self._next = self.rank  # the next stream position this consumer expects
        self._heartbeats_seen: int | None = None
        db.run(lambda conn: conn.execute("INSERT INTO channel_state (channel) VALUES (%s) ON CONFLICT DO NOTHING",
                                         (name,)))
        self._consumed_base = self._load_consumed() if role != "producer" else 0
        self._stored_on_connection = db.reconnects  # the connection the last consumed count went through
        if role != "consumer":
            self._sync_producer()

    # ---- waiting ---------------------------------------------------------------------
    def _wait(self, timeout: float) -> None:
        if self._listener is None:  # handles that never wait need no second connection
            self._listener = Listener(self.db.conninfo, self.notify_name, connect_timeout_s=self._listen_timeout_s)
        self._cond.release()  # let other threads of this handle publish or report meanwhile
        try:
            self._listener.wait(timeout)
        finally:
            self._cond.acquire()

    # ---- producer ----------------------------------------------------------------------
    def _sync_producer(self) -> None:
        state = self.db.run(lambda conn: conn.execute(_STATE, (self.name,)).fetchone())
        published, end_kind, end_reason = state[0], state[1], state[2]
        self._published = published  # every producer of the stream counts, for backpressure
        if end_kind is not None and self._terminal is None:
            self._terminal = "was closed" if end_kind == "closed" else f"was failed: {end_reason}"

    @property
    def where(self) -> str:
        return f"channel {self.name!r}"

    def _append_refs(self, refs: list[SampleRef]) -> None:
        sample_ids = [ref.sample_id for ref in refs]
        texts = [ref.to_json() for ref in refs]

        def work(conn: Any) -> int:
            row = conn.execute("UPDATE channel_state SET published = published + %s WHERE channel = %s AND "
                               "end_kind IS NULL RETURNING published", (len(refs), self.name)).fetchone()
            if row is None:
                raise ChannelClosedError(f"cannot publish: the ref channel {self.name!r} was ended by another "
                                         "process meanwhile. Open a new channel for a new stream")
            first = row[0] - len(refs)
            conn.execute("INSERT INTO channel_refs (channel, position, sample_id, ref) "
                         "SELECT %s, %s + n - 1, sample_id, ref FROM unnest(%b::text[], %b::text[]) "
                         "WITH ORDINALITY AS batch (sample_id, ref, n)", (self.name, first, sample_ids, texts))
            conn.execute("SELECT pg_notify(%s, %s)", (self.notify_name, self.name))
            return row[0]

        total = self.db.run(work, op_id=f"publish-{uuid.uuid4().hex}")
        self._published = total - len(refs)  # publish() adds len(refs) next

    def _append_end(self, failed: bool, reason: str) -> None:
        kind = "failed" if failed else "closed"

        def work(conn: Any) -> None:
            conn.execute("UPDATE channel_state SET end_kind = %s, end_reason = %s, end_position = published "
                         "WHERE channel = %s AND end_kind IS NULL", (kind, reason, self.name))
            conn.execute("SELECT pg_notify(%s, %s)", (self.notify_name, self.name))

        self.db.run(work)  # idempotent: the first end recorded wins

    def _append_heartbeat(self) -> None:
        self.db.run(lambda conn: conn.execute(_HEARTBEAT, {"channel": self.name, "notify": self.notify_name}),
                    single_statement=True)

    def published_sample_ids(self) -> set[str]:
        """Every sample id with a ref in this channel."""
        return {row[0] for row in self.db.run(lambda conn: conn.execute(
            "SELECT sample_id FROM channel_refs WHERE channel = %s", (self.name,)).fetchall())}

    def shard_sample_ids(self) -> list[str]:
        """The sample ids of this consumer's shard, in stream order."""
        return [row[0] for row in self.db.run(lambda conn: conn.execute(
            "SELECT sample_id FROM channel_refs WHERE channel = %s AND mod(position, %s) = %s ORDER BY position",
            (self.name, self.world_size, self.rank)).fetchall())]

    # ---- consumer ----------------------------------------------------------------------
    def _pull(self) -> bool:
        if self._stream_end is not None:
            return False
        if self.db.reconnects != self._stored_on_connection:  # see _CONSUMED: the last count may be lost
            self._store_consumed()
        params = {"channel": self.name, "next": self._next, "world_size": self.world_size, "rank": self.rank,
                  "limit": READ_BATCH}
        found = self.db.run(lambda conn: conn.execute(_PULL, params).fetchall(), single_statement=True)
        state = found[0][:5]
        rows = [row[5:] for row in found if row[5] is not None]
        arrived = False
        blocked = len(rows) < READ_BATCH
        for position, sample_id, text in rows:
            if position != self._next:
                blocked = True  # a gap: a ref still to come; nothing behind it is handed out before it
                break
            self._next += self.world_size
            arrived = True
            if sample_id not in self._skip:
                self._ready.append(SampleRef.from_json(text))
        _published, end_kind, end_reason, end_position, heartbeats = state
        if self._heartbeats_seen is not None and heartbeats != self._heartbeats_seen:
            arrived = True
        self._heartbeats_seen = heartbeats
        if end_kind == "closed" and self._next >= end_position:
            self._stream_end, self._stream_failed = "closed", False
        elif end_kind == "failed" and blocked:
            self._stream_end, self._stream_failed = str(end_reason), True
        return arrived

    def _load_consumed(self) -> int:
        row = self.db.run(lambda conn: conn.execute(
            "SELECT consumed FROM channel_consumed WHERE channel = %s AND rank = %s", (self.name, self.rank)).fetchone())
        return 0 if row is None else int(row[0])

    def _store_consumed(self) -> None:
        params = {"channel": self.name, "rank": self.rank, "consumed": self._consumed_base + self._reported,
                  "notify": self.notify_name}
        self.db.run(lambda conn: conn.execute(_CONSUMED, params), single_statement=True)
        self._stored_on_connection = self.db.reconnects

    def consumed(self) -> int:
        """Refs reported consumed by every rank."""
        return int(self.db.run(lambda conn: conn.execute(
            "SELECT coalesce(sum(consumed), 0) FROM channel_consumed WHERE channel = %s", (self.name,)).fetchone()[0]))

    def _idle_message(self, waited: float) -> str:
        return (f"no new ref or heartbeat on channel {self.name!r} of schema {self.db.schema!r} at "
                f"{self.db.address} for {waited:.1f}s (idle_timeout_s={self.idle_timeout_s}): is the producer "
                "running and pointed at this server and schema? If it is paused by backpressure, the consumers "
                "are not calling report_consumed(). A producer busy with long captures should call heartbeat(); "
                "otherwise raise idle_timeout_s.")

    def detach(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
