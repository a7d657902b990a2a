"""Connections to the server: clear errors, transactions that survive a server restart, LISTEN.

:class:`Database` owns one connection (shared by the threads of one process under a lock)
and runs each unit of work as one transaction. When the connection is lost (a server
restart, a network cut) it reconnects and runs the work again, for at most
``reconnect_timeout_s``. A transaction whose COMMIT was sent but whose answer was lost may
or may not have happened; work that must not happen twice passes an ``op_id``: the
transaction records it with its result in the ``ops`` table, and a retry that finds it
returns that result instead of running again.

:class:`Listener` is a second connection that only waits for ``NOTIFY``: waiters (a
consumer polling for refs, a producer paused by backpressure) sleep until a writer
notifies, not in a polling loop.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable

from specforge_core.errors import ControlPlaneError

from .errors import PostgresNotReadyError, PostgresUnavailableError


def describe_dsn(conninfo: str) -> tuple[str, dict[str, str]]:
    """``(address, fields)``: ``user@host:port/dbname`` for messages (never the password) and the parsed DSN."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        fields = {key: str(value) for key, value in conninfo_to_dict(conninfo).items()}
    except Exception as exc:  # noqa: BLE001 - psycopg raises ProgrammingError with libpq's text
        raise ControlPlaneError(f"control_plane.dsn is not a PostgreSQL connection string ({exc}); use "
                                "postgresql://USER:PASSWORD@HOST:PORT/DBNAME or 'host=... port=... dbname=...'")
    host = fields.get("host") or fields.get("hostaddr") or "localhost"
    port = fields.get("port") or "5432"
    user = fields.get("user")
    where = f"{host}:{port}" if not host.startswith("/") else f"socket {host} port {port}"
    return f"{user + '@' if user else ''}{where}/{fields.get('dbname', user or '')}", fields


#: What the server answers while it cannot take connections yet (SQLSTATE 57P03, which libpq
#: does not always pass on for a failed connection attempt).
_NOT_READY = ("the database system is starting up", "the database system is shutting down",
              "the database system is in recovery mode", "the database system is not yet accepting connections",
              "the database system is not accepting connections")


#: What libpq says of a connection the server closed before it was made: a server going down or restarting (a fast
#: shutdown cuts connections mid-handshake, as does a client frozen across one and woken after it).
_CUT = "server closed the connection unexpectedly"


def _first_line(exc: Exception) -> str:
    """What an error says, in one line (its type when it says nothing)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _closed_error(address: str, exc: Exception, moment: str) -> PostgresNotReadyError:
    """A connection the server closed at ``moment`` of its making: a server going down or restarting."""
    return PostgresNotReadyError(f"cannot connect to PostgreSQL at {address}: {_first_line(exc)}; the server closed "
                                 f"the connection {moment}, as one going down or restarting does: try again once it "
                                 "accepts connections")


def connect_error(address: str, exc: Exception, timeout_s: float) -> PostgresUnavailableError:
    """The message for a failed connection attempt: what happened and what to check."""
    text = _first_line(exc)
    low = str(exc).lower()
    if "password authentication failed" in low or "no password supplied" in low:
        hint = "the server refused the login: check the user and password in control_plane.dsn (or PGPASSWORD)"
    elif "does not exist" in low and "database" in low:
        hint = "the database does not exist: create it (createdb NAME) or name an existing one in control_plane.dsn"
    elif "timeout" in low:
        hint = (f"nothing answered within {timeout_s:g}s (control_plane.connect_timeout_s): check the host, port "
                "and the network between this host and the server")
    elif "refused" in low:
        hint = ("nothing accepts connections there: is PostgreSQL running, listening on that address "
                "(listen_addresses) and port?")
    elif "pg_hba" in low:
        hint = "the server's pg_hba.conf does not admit this host, user or database: add a line for it"
    elif getattr(exc, "sqlstate", None) == "57P03" or any(state in low for state in _NOT_READY):
        return PostgresNotReadyError(f"cannot connect to PostgreSQL at {address}: {text}; the server is starting up, "
                                     "shutting down or recovering: try again once it accepts connections")
    elif _CUT in low:
        return _closed_error(address, exc, "while it was being made")
    else:
        hint = "check control_plane.dsn and that the server is up"
    return PostgresUnavailableError(f"cannot connect to PostgreSQL at {address}: {text}; {hint}")


def _connect(conninfo: str, address: str, timeout_s: float, schema: str | None, listen: str | None = None) -> Any:
    """A connection with ``schema`` as its search path and, with ``listen``, LISTENing on that channel.

    A connection the server closes before those statements answer (it went down just after
    accepting it) is :class:`PostgresNotReadyError`, as one it closes while being made: the
    callers wait for a restart under way instead of failing.
    """
    import psycopg
    from psycopg import sql

    try:
        # libpq's connect_timeout is whole seconds, and it treats values below 2 as 2.
        conn = psycopg.connect(conninfo, connect_timeout=max(2, math.ceil(timeout_s)), autocommit=True,
                               application_name="specforge")
    except psycopg.Error as exc:
        raise connect_error(address, exc, timeout_s) from None
    try:
        if schema is not None:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        if listen is not None:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(listen)))
    except psycopg.Error as exc:
        broken = conn.broken  # (before the close, which a clean close would clear)
        close_quietly(conn)
        if not broken:
            raise
        raise _closed_error(address, exc, "just after it was made") from None
    return conn


def close_quietly(conn: Any) -> None:
    """Close a connection that may be broken already."""
    if conn is not None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is gone either way
            pass


def _retryable(conn: Any, exc: Exception) -> bool:
    """A lost connection or a transaction the server rolled back for concurrency: run it again."""
    import psycopg

    return bool(getattr(conn, "broken", False) or getattr(conn, "closed", False)) or isinstance(
        exc, (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected))


class Database:
    """One connection with transactions that are retried across reconnects (see the module docstring).

    ``schema`` becomes the connection's ``search_path``: the work's SQL names tables
    without a schema. ``closed_message`` is what a call after :meth:`close` raises.
    """

    def __init__(self, conninfo: str, *, schema: str | None, connect_timeout_s: float,
                 reconnect_timeout_s: float, closed_message: str) -> None:
        self.conninfo = conninfo
        self.address, _fields = describe_dsn(conninfo)
        self.schema = schema
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.closed_message = closed_message
        self.reconnects = 0
        self._lock = threading.RLock()
        # A server that answers it is starting up or recovering, or cuts the connection while it is being
        # made (a restart under way), is waited for, like a lost connection; one that is not there at all
        # is an error at once.
        deadline = time.monotonic() + reconnect_timeout_s
        while True:
            try:
                self._conn: Any = _connect(conninfo, self.address, connect_timeout_s, schema)
                break
            except PostgresNotReadyError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        self._closed = False

    def run(self, work: Callable[[Any], Any], *, op_id: str | None = None, single_statement: bool = False) -> Any:
        """Run ``work(connection)`` in one transaction and return its result, retrying on a lost connection.

        With ``op_id`` the result must be JSON-able: it is recorded in the same transaction,
        and a retry after an ambiguous commit returns the recorded result without running
        ``work`` again. ``single_statement`` work is one SQL statement, atomic without an
        explicit transaction (one round trip); with an ``op_id`` it records the id itself
        (``INSERT INTO ops``) in that statement.
        """
        import psycopg

        lost_at: float | None = None
        while True:
            with self._lock:
                if self._closed:
                    raise ControlPlaneError(self.closed_message)
                conn = self._conn
                try:
                    if conn is None:
                        conn = self._conn = _connect(self.conninfo, self.address, self.connect_timeout_s,
                                                     self.schema)
                        self.reconnects += 1
                    if op_id is not None and lost_at is not None:
                        row = conn.execute("SELECT result FROM ops WHERE op_id = %s", (op_id,)).fetchone()
                        if row is not None:
                            return json.loads(row[0])
                    if single_statement:  # atomic by itself: no BEGIN / COMMIT round trips
                        return work(conn)
                    with conn.transaction():
                        result = work(conn)
                        if op_id is not None:
                            conn.execute("INSERT INTO ops (op_id, result) VALUES (%s, %s)",
                                         (op_id, json.dumps(result)))
                    return result
                except PostgresUnavailableError as exc:
                    failure: Exception = exc  # the reconnect failed: keep trying until the deadline
                except psycopg.Error as exc:
                    if not _retryable(conn, exc):
                        raise ControlPlaneError(f"PostgreSQL at {self.address}: {type(exc).__name__}: {exc}") \
                            from None
                    failure = exc
                    if getattr(conn, "broken", False) or getattr(conn, "closed", False):
                        self._drop_connection()
            now = time.monotonic()
            lost_at = now if lost_at is None else lost_at
            if now - lost_at >= self.reconnect_timeout_s:
                raise PostgresUnavailableError(
                    f"lost the connection to PostgreSQL at {self.address} and could not get it back within "
                    f"{self.reconnect_timeout_s:g}s (control_plane.reconnect_timeout_s): {failure}. Is the server "
                    "up? Nothing of the interrupted call was applied twice; run the command again once it is.")
            time.sleep(min(0.2, self.reconnect_timeout_s))

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_connection()


class Listener:
    """A connection that LISTENs on one notification channel; :meth:`wait` sleeps until a NOTIFY.

    The connection is opened by the first wait, and a lost one is reopened by the next:
    such a wait returns True at once, since what was notified before the LISTEN is lost
    and the caller must read the state again.
    """

    def __init__(self, conninfo: str, channel: str, *, connect_timeout_s: float) -> None:
        self.conninfo = conninfo
        self.address, _fields = describe_dsn(conninfo)
        self.channel = channel
        self.connect_timeout_s = connect_timeout_s
        self._conn: Any = None  # opened by the first wait
        self._lock = threading.Lock()

    def _open(self) -> None:
        self._conn = _connect(self.conninfo, self.address, self.connect_timeout_s, None, listen=self.channel)

    def wait(self, timeout: float) -> bool:
        """Sleep until a notification arrives (True) or ``timeout`` seconds pass (False)."""
        import psycopg

        with self._lock:
            if self._conn is None:
                try:
                    self._open()
                except PostgresUnavailableError:
                    time.sleep(min(max(timeout, 0.0), 0.2))  # the server is away: the caller's clock runs on
                    return False
                return True
            try:
                for _notify in self._conn.notifies(timeout=max(timeout, 0.0), stop_after=1):
                    return True
                return False
            except psycopg.Error:
                self._close_connection()
                return True

    def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)

    def close(self) -> None:
        with self._lock:
            self._close_connection()
