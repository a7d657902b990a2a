"""specforge-plugin-postgres: the ``postgres`` control plane.

This module is what the ``specforge`` entry point loads, so it stays cheap: psycopg is not
imported here. The plane lives in :mod:`specforge_plugin_postgres.plane` and is imported
only when a run asks for it.
"""

import attrs

from specforge_core import hookimpl
from specforge_core.options import non_negative, option, positive
from specforge_core.specs import ControlPlaneSpec

__version__ = "0.1.0"


@attrs.frozen
class PostgresControlPlaneOptions:
    """Options of the ``postgres`` control plane."""

    dsn: str | None = option(None, "libpq connection string or URI, e.g. postgresql://USER:PASSWORD@HOST:5432/DBNAME"
                                   "?sslmode=require (TLS and passwords go here). Without it, host, port, dbname and "
                                   "user build one and the password comes from PGPASSWORD or ~/.pgpass.")
    host: str = option("127.0.0.1", "Server host, used when dsn is not set.")
    port: int = option(5432, "Server port, used when dsn is not set.", check=positive)
    dbname: str = option("specforge", "Database, used when dsn is not set.")
    user: str | None = option(None, "User, used when dsn is not set (default: libpq's, the OS user).")
    schema: str | None = option(None, "PostgreSQL schema holding this stream's tables, so several streams share "
                                       "one database. Defaults to one derived from the run (or stream) id.")
    connect_timeout_s: float = option(5.0, "Fail with a clear error when the server does not answer a connection "
                                           "within this many seconds (libpq counts whole seconds, at least 2).",
                                      check=positive)
    reconnect_timeout_s: float = option(60.0, "How long a lost connection (server restart, network cut) is "
                                              "retried before the run fails; also how long a first connection "
                                              "waits for a server that is starting up or recovering.",
                                        check=positive)
    high_watermark: int = option(1024, "Producers pause when this many published refs are not yet consumed.",
                                 check=positive)
    low_watermark: int = option(256, "Paused producers resume when the backlog falls to this.", check=non_negative)
    idle_timeout_s: float = option(600.0, "Consumer gives up with ChannelTimeoutError after this long without a "
                                          "new ref or a heartbeat.", check=positive)
    poll_interval_s: float = option(1.0, "Waiters wake on NOTIFY; this is how often they read the tables anyway "
                                         "(a safety net).", check=positive)


@hookimpl
def specforge_control_planes():
    return [
        ControlPlaneSpec(
            name="postgres",
            factory="specforge_plugin_postgres.plane:PostgresControlPlane",
            options=PostgresControlPlaneOptions,
            capabilities={"dedup", "durable", "cross_process", "networked"},
            description="PostgreSQL metadata and ref channel (LISTEN/NOTIFY) for producers and consumers on "
                        "different hosts.",
        )
    ]
