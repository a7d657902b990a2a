"""Helpers for tests and benches of the postgres control plane (no pytest needed)."""

from __future__ import annotations

import hashlib
from typing import Any

from .server import LocalPostgres


def schema_of(tmp_path) -> str:
    """A schema name that is the same for one test's ``tmp_path`` (reopening sees the same tables)."""
    return "t_" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:16]


def plane_options(server: LocalPostgres, schema: str, **overrides: Any) -> Any:
    from specforge_plugin_postgres import PostgresControlPlaneOptions

    return PostgresControlPlaneOptions(dsn=server.dsn, schema=schema, **overrides)


def open_plane(server: LocalPostgres, schema: str, role: str = "colocated", rank: int = 0, world_size: int = 1,
               **overrides: Any) -> Any:
    """A PostgresControlPlane on ``server`` in ``schema``; the caller closes it."""
    from specforge_core.protocols import BuildContext
    from specforge_plugin_postgres.plane import PostgresControlPlane

    return PostgresControlPlane(plane_options(server, schema, **overrides),
                                BuildContext(role=role, rank=rank, world_size=world_size))
