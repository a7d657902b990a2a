"""The durable control plane: SQLite metadata (WAL, synchronous=FULL) + a JSONL file channel.

Layout of its directory (``options.path``, default ``OUTPUT/control``)::

    metadata.sqlite        samples (commit order, ref JSON, acked step), markers, counters
    refs.jsonl             the ref channel (see channel.FileChannel)
    consumed.<rank>.json   each consumer rank's consumed count (producer backpressure)

Several processes may open the same database: every write is one ``BEGIN IMMEDIATE``
transaction and a busy timeout makes a writer wait for another instead of failing. WAL
needs the processes on one host (or a filesystem with working POSIX locks and shared
memory); a network filesystem shared between nodes is not supported for the database.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from typing import Any, Iterator, Sequence

from ..contracts import SampleRef
from ..errors import ControlPlaneError
from .channel import FileChannel
from .durable import ResumableControlPlane
from .metadata import (
    Reconciliation,
    encode_marker,
    require_ack_args,
    require_sample_refs,
    unknown_ids_error,
)

SCHEMA_VERSION = 1
METADATA_FILE = "metadata.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- commit order
    sample_id TEXT NOT NULL UNIQUE,
    ref TEXT NOT NULL,                       -- SampleRef.to_json()
    acked_step INTEGER                       -- global step of the first ack, NULL while pending
);
CREATE TABLE IF NOT EXISTS markers (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters (name, value) VALUES ('durable_step', 0), ('duplicates', 0);
"""


def _held(exc: sqlite3.Error) -> bool:
    """Whether another connection holds the database (the busy timeout ran out)."""
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def database_error(path: str, exc: sqlite3.Error, doing: str) -> ControlPlaneError:
    """A SQLite failure on the metadata database ``path``, with what to do about its cause."""
    if _held(exc):
        hint = "another process held it past the busy timeout: is a stuck process holding it?"
    elif getattr(exc, "sqlite_errorname", "") == "SQLITE_CORRUPT":
        hint = ("the file is damaged, so what it recorded (committed and acked samples) cannot be trusted: restore "
                "it from a backup, or start again with a new control directory (for a disaggregated run, a new "
                "--features directory for the producer and a new --output for the consumer)")
    else:
        hint = ("check that the directory exists and is writable, that the file is a specforge metadata database, "
                "and that it is on a local filesystem")
    return ControlPlaneError(f"{doing} {path}: {exc}; {hint}")


class SqliteMetadataStore:
    """The metadata store contract (see :mod:`.metadata`), durable in one SQLite file.

    ``commit`` and ``ack`` are each one transaction, fsynced before they return
    (``journal_mode=WAL``, ``synchronous=FULL``): after a crash every returned commit and
    ack is there, and a half-applied batch never is. Thread-safe, and safe to open from
    several processes at once (``busy_timeout_s`` is how long a writer waits for another).
    """

    def __init__(self, path: str, *, busy_timeout_s: float = 30.0) -> None:
        self.path = os.path.abspath(path)
        self._lock = threading.Lock()  # one connection, shared by the producer and trainer threads
        self._db: sqlite3.Connection | None = None
        deadline = time.monotonic() + busy_timeout_s
        delay = 0.005
        while True:
            try:
                self._db = self._open(busy_timeout_s)
                return
            except sqlite3.Error as exc:
                # Two processes creating the same fresh database race on the switch to WAL
                # and on WAL recovery; SQLite reports those as "locked" without calling the
                # busy handler, so the open itself retries until the busy timeout.
                if _held(exc) and time.monotonic() + delay <= deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
                    continue
                raise database_error(self.path, exc, "cannot open the metadata database") from None

    def _open(self, busy_timeout_s: float) -> sqlite3.Connection:
        """Connect, switch to WAL + synchronous=FULL and create the schema (one attempt)."""
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a batch is exactly one transaction.
        db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        try:
            db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise ControlPlaneError(f"{self.path}: SQLite refused journal_mode=WAL (got {mode!r}); put the "
                                        "control directory on a local filesystem")
            db.execute("PRAGMA synchronous = FULL")
            if db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
                return db  # written before: opening it writes nothing (a refused run leaves it byte-identical)
            db.execute("BEGIN IMMEDIATE")
            try:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version not in (0, SCHEMA_VERSION):
                    raise ControlPlaneError(f"{self.path} has metadata schema v{version}; this specforge reads "
                                            f"v{SCHEMA_VERSION}. Use the specforge version that wrote it or a "
                                            "fresh control directory.")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except BaseException:
            db.close()
            raise
        return db

    # ---- plumbing ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._db is None:
                raise ControlPlaneError(f"the metadata store {self.path} is closed; open a new control plane")
            try:
                # IMMEDIATE takes the write lock now: two processes that both read and then
                # try to upgrade would get SQLITE_BUSY, which the busy timeout does not retry.
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise database_error(self.path, exc, "the metadata database") from None
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(sqlite3.Error):  # a damaged file may refuse the rollback too
                    self._db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):  # a damaged page surfaces in the query that reads it
                    raise database_error(self.path, exc, "the metadata database") from None
                raise

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        with self._transaction() as db:  # a read transaction sees one consistent snapshot
            return db.execute(sql, args).fetchall()

    def pragmas(self) -> dict[str, Any]:
        """The connection's durability settings (for checks and diagnostics)."""
        return {name: self._query(f"PRAGMA {name}")[0][0] for name in ("journal_mode", "synchronous", "busy_timeout")}

    # ---- contract ----------------------------------------------------------------------
    def commit(self, refs: Sequence[SampleRef]) -> list[SampleRef]:
        items = require_sample_refs(refs)
        texts = [ref.to_json() for ref in items]
        fresh = []
        with self._transaction() as db:
            for ref, text in zip(items, texts):
                cursor = db.execute("INSERT OR IGNORE INTO samples (sample_id, ref) VALUES (?, ?)",
                                    (ref.sample_id, text))
                if cursor.rowcount == 1:
                    fresh.append(ref)
            if len(fresh) < len(items):
                db.execute("UPDATE counters SET value = value + ? WHERE name = 'duplicates'",
                           (len(items) - len(fresh),))
        return fresh

    def ack(self, sample_ids: Sequence[str], global_step: int) -> None:
        ids = require_ack_args(sample_ids, global_step)
        with self._transaction() as db:
            unknown = []
            for sid in ids:
                cursor = db.execute("UPDATE samples SET acked_step = ? WHERE sample_id = ? AND acked_step IS NULL",
                                    (global_step, sid))
                if cursor.rowcount == 0 and db.execute("SELECT 1 FROM samples WHERE sample_id = ?",
                                                       (sid,)).fetchone() is None:
                    unknown.append(sid)
            if unknown:
                raise unknown_ids_error(list(dict.fromkeys(unknown)))  # __exit__ rolls the batch back
            db.execute("UPDATE counters SET value = MAX(value, ?) WHERE name = 'durable_step'", (global_step,))

    def requeue_acked_after(self, global_step: int) -> int:
        """Make the samples acked after ``global_step`` pending again; how many there were.

        For a consumer resuming from the checkpoint of ``global_step``: what it trained on
        after that checkpoint was lost with the crash, so those samples must be trained on
        again. The durable step comes down to ``global_step`` with them.
        """
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise ControlPlaneError(f"requeue_acked_after needs a global step >= 0, got {global_step!r}")
        with self._transaction() as db:
            count = db.execute("UPDATE samples SET acked_step = NULL WHERE acked_step > ?", (global_step,)).rowcount
            db.execute("UPDATE counters SET value = MIN(value, ?) WHERE name = 'durable_step'", (global_step,))
        return count

    def durable_step(self) -> int:
        return self._query("SELECT value FROM counters WHERE name = 'durable_step'")[0][0]

    def reconcile(self) -> Reconciliation:
        with self._transaction() as db:
            rows = db.execute("SELECT ref, acked_step IS NOT NULL FROM samples ORDER BY seq").fetchall()
            step = db.execute("SELECT value FROM counters WHERE name = 'durable_step'").fetchone()[0]
        acked, pending = [], []
        for text, is_acked in rows:
            (acked if is_acked else pending).append(SampleRef.from_json(text))
        return Reconciliation(acked=acked, pending=pending, durable_step=step)

    def set_marker(self, key: str, value: Any) -> None:
        text = encode_marker(key, value)
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO markers (key, value) VALUES (?, ?)", (key, text))

    def get_marker(self, key: str, default: Any = None) -> Any:
        rows = self._query("SELECT value FROM markers WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else default

    def stats(self) -> dict[str, int]:
        with self._transaction() as db:
            committed, acked = db.execute("SELECT COUNT(*), COUNT(acked_step) FROM samples").fetchone()
            duplicates = db.execute("SELECT value FROM counters WHERE name = 'duplicates'").fetchone()[0]
        return {"committed": committed, "acked": acked, "duplicates": duplicates, "pending": committed - acked}

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class SqliteControlPlane(ResumableControlPlane):
    """Durable control plane for disaggregated and restartable runs.

    ``SqliteControlPlane(options, context)`` opens ``metadata.sqlite`` and ``refs.jsonl`` in
    ``options.path`` (default ``context.output_dir/control``). ``context.role`` picks the
    channel role: ``producer`` publishes and commits, ``consumer`` polls and acks (sharded
    by ``context.rank`` / ``context.world_size``), anything else (colocated, offline) does
    both in one process; such a run with several ranks keeps one channel per rank in
    ``rank<r>/`` (every rank is its own producer) and shares the metadata.

    After a restart call :meth:`resume_producer` (producer) or :meth:`resume_consumer`
    (consumer) before the first publish / poll.
    """

    def __init__(self, options: Any, context: Any = None) -> None:
        directory = options.path
        if directory is None and context is not None and context.output_dir is not None:
            directory = os.path.join(context.output_dir, "control")
        if directory is None:
            raise ControlPlaneError("the sqlite control plane needs a directory: set its `path` option "
                                    "(--set control_plane.path=DIR) or give the run an output directory")
        role = getattr(context, "role", "colocated")
        rank, world_size = getattr(context, "rank", 0), getattr(context, "world_size", 1)
        channel_role = role if role in ("producer", "consumer") else "both"  # colocated/offline: both
        channel_dir = directory if channel_role != "both" or world_size == 1 else os.path.join(directory, f"rank{rank}")
        os.makedirs(directory, exist_ok=True)
        self.path = directory
        self.metadata = SqliteMetadataStore(os.path.join(directory, METADATA_FILE))
        try:
            self.channel = FileChannel(
                channel_dir, role=channel_role,
                shard=(rank, world_size) if channel_role == "consumer" else (0, 1),
                high_watermark=options.high_watermark, low_watermark=options.low_watermark,
                idle_timeout_s=options.idle_timeout_s, poll_interval_s=options.poll_interval_s,
            )
        except Exception:
            self.metadata.close()
            raise

    def close(self) -> None:
        """Release the database and channel handles. Does not end the stream: call
        ``channel.close()`` (producer) for that."""
        self.channel.detach()
        self.metadata.close()
