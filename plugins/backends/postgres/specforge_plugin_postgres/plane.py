"""The ``postgres`` control plane: metadata and ref channel in one PostgreSQL schema.

The same promises as the ``sqlite`` plane (see ``specforge_core.control_planes``), with
nothing on a shared filesystem: producer and consumer hosts only need to reach the server.
"""

from __future__ import annotations

from typing import Any

from specforge_core.control_planes.durable import ResumableControlPlane

from .channel import PostgresChannel
from .database import Database
from .metadata import PostgresMetadataStore
from .pool import PoolTables
from .schema import check_schema_name, ensure_schema, schema_for


def conninfo_from(options: Any) -> str:
    """The libpq connection string of ``options``: ``dsn`` as given, else built from host/port/dbname/user."""
    if options.dsn:
        return options.dsn
    from psycopg.conninfo import make_conninfo

    fields = {"host": options.host, "port": options.port, "dbname": options.dbname}
    if options.user:
        fields["user"] = options.user
    return make_conninfo(**fields)


class PostgresControlPlane(ResumableControlPlane):
    """Durable control plane on a PostgreSQL server, for producers and consumers on different hosts.

    ``PostgresControlPlane(options, context)`` connects (a clear
    :class:`~.errors.PostgresUnavailableError` within ``connect_timeout_s`` when the server
    cannot be reached or refuses the login), creates or checks the schema
    (``options.schema``, default derived from ``context.run_id``) and opens the metadata
    store and the ref channel. ``context.role`` picks the channel role as for ``sqlite``:
    ``producer`` publishes, ``consumer`` polls its shard (``context.rank`` of
    ``context.world_size``), anything else does both; a colocated run with several ranks
    keeps one channel per rank and shares the metadata.

    After a restart call :meth:`resume_producer` (producer) or :meth:`resume_consumer`
    (consumer) before the first publish / poll. ``pool`` holds the leases and a producer
    pool's claims (:class:`~.pool.PoolTables`).
    """

    def __init__(self, options: Any, context: Any = None) -> None:
        run_id = getattr(context, "run_id", "run")
        schema = check_schema_name(options.schema or schema_for(run_id))
        role = getattr(context, "role", "colocated")
        rank, world_size = getattr(context, "rank", 0), getattr(context, "world_size", 1)
        channel_role = role if role in ("producer", "consumer") else "both"
        channel_name = "stream" if channel_role != "both" or world_size == 1 else f"rank{rank}"
        db = Database(conninfo_from(options), schema=schema, connect_timeout_s=options.connect_timeout_s,
                      reconnect_timeout_s=options.reconnect_timeout_s, closed_message="")
        db.closed_message = (f"the postgres control plane (schema {schema!r} at {db.address}) is closed; open a new "
                             "control plane")
        try:
            db.run(lambda conn: ensure_schema(conn, schema, db.address))
            self.schema, self.address = schema, db.address
            self.metadata = PostgresMetadataStore(db)
            self.channel = PostgresChannel(
                db, name=channel_name, role=channel_role,
                shard=(rank, world_size) if channel_role == "consumer" else (0, 1),
                listen_timeout_s=options.connect_timeout_s,
                high_watermark=options.high_watermark, low_watermark=options.low_watermark,
                idle_timeout_s=options.idle_timeout_s, poll_interval_s=options.poll_interval_s,
            )
            self.pool = PoolTables(db, self.metadata, self.channel)
        except BaseException:
            db.close()
            raise

    @property
    def stream_name(self) -> str:
        """The name both sides of a stream share: the schema (a feature store's default namespace)."""
        return self.schema

    def close(self) -> None:
        """Release the connections. Does not end the stream: call ``channel.close()`` (producer) for that."""
        self.channel.detach()
        self.metadata.close()
