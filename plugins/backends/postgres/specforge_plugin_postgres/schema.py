"""The tables of one control plane, in a PostgreSQL schema of its own.

Several streams share one database, each in its own schema (``control_plane.schema``)::

    meta              format and schema version, written once at creation
    samples           one row per committed sample: its ref (JSON) and commit order
    acks              the ack ledger: one row per acked sample with the global step of its first ack
    markers           small JSON values (data positions, stream record, leases' companions)
    counters          durable_step (highest acked global step), duplicates
    ops               ids of non-idempotent writes with their results (retries after a lost commit)
    channel_state     per ref channel: refs published, end of stream, heartbeat count
    channel_refs      per ref channel: the refs, each at its stream position
    channel_consumed  per ref channel and consumer rank: refs reported consumed
    leases            named leases (one producer setup, one consumer per rank) with expiry
    claims            a producer pool's work: one row per stream position, claimed with expiry,
                      counting the claims taken on it (attempts)

Creation takes a transaction-scoped advisory lock, so processes opening one fresh schema at
once do not race; an existing schema is checked before use and never altered.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import StreamMismatchError

SCHEMA_VERSION = 1
FORMAT = "specforge-control-plane"
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

_TABLES = """
CREATE TABLE meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE samples (
    seq bigserial PRIMARY KEY,
    sample_id text NOT NULL UNIQUE,
    ref text NOT NULL
);
CREATE TABLE acks (sample_id text PRIMARY KEY, step bigint NOT NULL);
CREATE TABLE markers (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE counters (name text PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE ops (op_id text PRIMARY KEY, result text NOT NULL);
CREATE TABLE channel_state (
    channel text PRIMARY KEY,
    published bigint NOT NULL DEFAULT 0,
    end_kind text,
    end_reason text,
    end_position bigint,
    heartbeats bigint NOT NULL DEFAULT 0
);
CREATE TABLE channel_refs (
    channel text NOT NULL,
    position bigint NOT NULL,
    sample_id text NOT NULL,
    ref text NOT NULL,
    PRIMARY KEY (channel, position)
);
CREATE TABLE channel_consumed (
    channel text NOT NULL,
    rank integer NOT NULL,
    consumed bigint NOT NULL,
    PRIMARY KEY (channel, rank)
);
CREATE TABLE leases (
    name text PRIMARY KEY,
    holder text NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE TABLE claims (
    position bigint PRIMARY KEY,
    holder text,
    expires_at timestamptz,
    attempt integer NOT NULL DEFAULT 0,
    done boolean NOT NULL DEFAULT false
);
CREATE INDEX claims_open ON claims (position) WHERE NOT done;
INSERT INTO counters (name, value) VALUES ('durable_step', 0), ('duplicates', 0);
"""
TABLE_NAMES = ("meta", "samples", "acks", "markers", "counters", "ops", "channel_state", "channel_refs",
               "channel_consumed", "leases", "claims")


def check_schema_name(name: Any) -> str:
    """``name`` if it is a plain lowercase PostgreSQL identifier, else a clear error."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise StreamMismatchError(f"control_plane.schema must be a lowercase identifier (letters, digits, '_', "
                                  f"at most 63 characters, not starting with a digit), got {name!r}")
    return name


def schema_for(run_id: str) -> str:
    """A schema name derived from a run or stream id (lowercase, other characters become '_')."""
    cleaned = re.sub(r"[^a-z0-9_]", "_", run_id.lower())
    name = f"specforge_{cleaned}"
    if len(name) > 63:  # keep it unique: a hash of the whole id stands for the cut part
        import hashlib

        name = name[:46] + "_" + hashlib.sha256(run_id.encode()).hexdigest()[:16]
    return name


def ensure_schema(conn: Any, schema: str, address: str) -> None:
    """Create ``schema`` with the tables above, or check that the existing one is ours and current."""
    from psycopg import sql

    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"specforge-schema:{schema}",))
    tables = {row[0] for row in conn.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,))}
    where = f"schema {schema!r} of {address}"
    if not tables:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        for statement in _TABLES.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute("INSERT INTO meta (key, value) VALUES ('format', %s), ('schema_version', %s)",
                      (FORMAT, str(SCHEMA_VERSION)))
        return
    if "meta" not in tables:
        raise StreamMismatchError(f"{where} holds tables that are not a specforge control plane "
                                  f"({', '.join(sorted(tables)[:6])}); name another schema with "
                                  "control_plane.schema")
    columns = {row[0] for row in conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = 'meta'",
        (schema,))}
    meta = {} if not {"key", "value"} <= columns else dict(
        conn.execute(sql.SQL("SELECT key, value FROM {}.meta").format(sql.Identifier(schema))).fetchall())
    if meta.get("format") != FORMAT:
        raise StreamMismatchError(f"{where} holds a table 'meta' that is not a specforge control plane's "
                                  f"(format {meta.get('format')!r}); name another schema with control_plane.schema")
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        raise StreamMismatchError(f"{where} has control-plane schema v{meta.get('schema_version')}; this specforge "
                                  f"reads v{SCHEMA_VERSION}. Use the specforge version that wrote it or another "
                                  "schema (control_plane.schema)")
    missing = sorted(set(TABLE_NAMES) - tables)
    if missing:
        raise StreamMismatchError(f"{where} lacks the tables {', '.join(missing)}; it was damaged by hand. Drop "
                                  "it (DROP SCHEMA ... CASCADE) or name another schema")

