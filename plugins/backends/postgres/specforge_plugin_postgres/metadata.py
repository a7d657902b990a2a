"""The metadata store contract (``specforge_core.control_planes.metadata``) in PostgreSQL tables.

``commit`` and ``ack`` are each one statement for the whole batch (arrays, not a
statement per ref): one round trip and one transaction, durable when it returns (the
server's ``synchronous_commit``, on by default). After a crash of either side every
returned commit and ack is there, and a half-applied batch never is.

The time of both is the server's WAL flush (one per transaction; see
``bench/control_plane.py``), so each writes little: acks are narrow rows appended to an
ack ledger (``acks``) rather than updates of the wide ``samples`` rows, which would copy
every ref and its index entries again.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Sequence

from specforge_core.contracts import SampleRef
from specforge_core.control_planes.metadata import (
    Reconciliation,
    encode_marker,
    require_ack_args,
    require_sample_refs,
    unknown_ids_error,
)
from specforge_core.errors import ControlPlaneError

from .database import Database

def fresh_refs(batch: str) -> str:
    """CTEs that commit the refs of ``batch`` (a query with columns ``sample_id``, ``ref`` and
    ``n``, the order within the batch): ``fresh`` returns the ids inserted, and the duplicates
    counter grows by the others (parameter ``n``: the batch's length)."""
    return f"""batch AS (
    {batch}
), fresh AS (
    INSERT INTO samples (sample_id, ref) SELECT sample_id, ref FROM batch ORDER BY n
    ON CONFLICT (sample_id) DO NOTHING RETURNING sample_id
), duplicates AS (
    UPDATE counters SET value = value + %(n)s - (SELECT count(*) FROM fresh) WHERE name = 'duplicates'
)"""


# One statement (one round trip, one atomic commit) that inserts the fresh refs, counts the
# duplicates and records the op id with the fresh ids, for a retry after a lost answer.
# Parameters: ``ids``, ``refs`` (text arrays), ``n``, ``op``.
_COMMIT = f"""
WITH {fresh_refs("SELECT sample_id, ref, n FROM unnest(%(ids)b::text[], %(refs)b::text[]) "
                 "WITH ORDINALITY AS b (sample_id, ref, n)")}, op AS (
    INSERT INTO ops (op_id, result) SELECT %(op)s, coalesce(json_agg(sample_id), '[]')::text FROM fresh
)
SELECT sample_id FROM fresh
"""

# One statement: the acks and the durable step move only when every id is known; a sample
# acked before keeps its first step (the ledger's primary key). ``ids`` are distinct, so
# ``known`` needs no join. ``ack`` has it planned at each call (``prepare=False``): a plan the
# server cached for a prepared ack, made while ``samples`` was small, scanned the whole table,
# and every ack grew with the run; planned afresh it probes the index once the table is large.
_ACK = """
WITH known AS (
    SELECT count(*) AS n FROM samples WHERE sample_id = ANY(%(ids)b::text[])
), acked AS (
    INSERT INTO acks (sample_id, step) SELECT unnest(%(ids)b::text[]), %(step)s WHERE (SELECT n FROM known) = %(n)s
    ON CONFLICT (sample_id) DO NOTHING
), durable AS (
    UPDATE counters SET value = GREATEST(value, %(step)s) WHERE name = 'durable_step' AND (SELECT n FROM known) = %(n)s
)
SELECT n FROM known
"""


class PostgresMetadataStore:
    """Commits, acks with the durable global step, markers and reconcile over a :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def commit(self, refs: Sequence[SampleRef]) -> list[SampleRef]:
        items = require_sample_refs(refs)
        if not items:
            self.db.run(lambda conn: None)  # a closed store still says so
            return []
        sample_ids = [ref.sample_id for ref in items]
        texts = [ref.to_json() for ref in items]

        op_id = f"commit-{uuid.uuid4().hex}"

        def work(conn: Any) -> list[str]:
            return [row[0] for row in conn.execute(_COMMIT, {"ids": sample_ids, "refs": texts, "n": len(items),
                                                             "op": op_id})]

        fresh = set(self.db.run(work, op_id=op_id, single_statement=True))
        out = []
        for ref in items:  # in order; a repeat inside the batch is a duplicate
            if ref.sample_id in fresh:
                fresh.discard(ref.sample_id)
                out.append(ref)
        return out

    def ack(self, sample_ids: Sequence[str], global_step: int) -> None:
        ids = require_ack_args(sample_ids, global_step)
        distinct = list(dict.fromkeys(ids))

        def work(conn: Any) -> None:
            # Idempotent (first ack's step kept, durable step a maximum): a retry is harmless.
            found = conn.execute(_ACK, {"ids": distinct, "step": global_step, "n": len(distinct)},
                                 prepare=False).fetchone()[0]
            if found != len(distinct):  # nothing was applied; say which ids are unknown
                known = {row[0] for row in conn.execute("SELECT sample_id FROM samples WHERE sample_id = ANY(%b)",
                                                        (distinct,))}
                raise unknown_ids_error([sid for sid in distinct if sid not in known])

        self.db.run(work, single_statement=True)

    def requeue_acked_after(self, global_step: int) -> int:
        """Make the samples acked after ``global_step`` pending again; how many there were.

        For a consumer resuming from the checkpoint of ``global_step`` (see the sqlite
        store's method of the same name). Idempotent, so a retry is harmless.
        """
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise ControlPlaneError(f"requeue_acked_after needs a global step >= 0, got {global_step!r}")

        def work(conn: Any) -> int:
            count = conn.execute("DELETE FROM acks WHERE step > %s", (global_step,)).rowcount
            conn.execute("UPDATE counters SET value = LEAST(value, %s) WHERE name = 'durable_step'", (global_step,))
            return count

        return self.db.run(work)

    def durable_step(self) -> int:
        return self.db.run(lambda conn: conn.execute(
            "SELECT value FROM counters WHERE name = 'durable_step'").fetchone()[0])

    def reconcile(self) -> Reconciliation:
        def work(conn: Any) -> tuple[list, int]:
            rows = conn.execute("SELECT ref, acks.step IS NOT NULL FROM samples LEFT JOIN acks USING (sample_id) "
                                "ORDER BY seq").fetchall()
            step = conn.execute("SELECT value FROM counters WHERE name = 'durable_step'").fetchone()[0]
            return rows, step

        rows, step = self.db.run(work)
        acked, pending = [], []
        for text, is_acked in rows:
            (acked if is_acked else pending).append(SampleRef.from_json(text))
        return Reconciliation(acked=acked, pending=pending, durable_step=step)

    def acked_steps(self) -> dict[str, int]:
        """Every acked sample id with the global step of its first ack (the ack ledger, for audits)."""
        return dict(self.db.run(lambda conn: conn.execute(
            "SELECT sample_id, step FROM acks").fetchall()))

    def set_marker(self, key: str, value: Any) -> None:
        text = encode_marker(key, value)
        self.db.run(lambda conn: conn.execute(
            "INSERT INTO markers (key, value) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, text)))

    def set_marker_once(self, key: str, value: Any) -> Any:
        """Store ``value`` under ``key`` unless a value is there already; return the value kept.

        Two processes racing to write one record both get the same answer (the first one's).
        """
        text = encode_marker(key, value)

        def work(conn: Any) -> str:
            conn.execute("INSERT INTO markers (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING", (key, text))
            return conn.execute("SELECT value FROM markers WHERE key = %s", (key,)).fetchone()[0]

        return json.loads(self.db.run(work))

    def get_marker(self, key: str, default: Any = None) -> Any:
        row = self.db.run(lambda conn: conn.execute("SELECT value FROM markers WHERE key = %s", (key,)).fetchone())
        return default if row is None else json.loads(row[0])

    def stats(self) -> dict[str, int]:
        def work(conn: Any) -> tuple[int, int, int]:
            committed, acked = conn.execute("SELECT (SELECT count(*) FROM samples), (SELECT count(*) FROM acks)").fetchone()
            duplicates = conn.execute("SELECT value FROM counters WHERE name = 'duplicates'").fetchone()[0]
            return committed, acked, duplicates

        committed, acked, duplicates = self.db.run(work)
        return {"committed": committed, "acked": acked, "duplicates": duplicates, "pending": committed - acked}

    def close(self) -> None:
        self.db.close()
