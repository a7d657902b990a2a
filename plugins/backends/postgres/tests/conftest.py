"""Fixtures of the postgres plugin's tests: a real PostgreSQL server on loopback.

``postgres`` is one server for the session (tests keep apart through their schemas);
``fresh_postgres`` is a server of one test's own (restarts, kills). Both skip, with the
reason, only where no PostgreSQL server binaries exist (see ``postgres_missing``).
"""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

from specforge_plugin_postgres.errors import PostgresUnavailableError
from specforge_plugin_postgres.server import LocalPostgres, postgres_bindir


def postgres_missing() -> str | None:
    """Why no test server can be started here, or None."""
    try:
        postgres_bindir()
    except PostgresUnavailableError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def needs_postgres() -> None:
    reason = postgres_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def needs_mooncake() -> None:
    """Skip, with the reason, where the Mooncake client cannot be loaded (no wheel, no libibverbs1)."""
    try:
        from specforge_plugin_mooncake.master import client_missing
    except ImportError as exc:
        pytest.skip(f"specforge-plugin-mooncake is not installed ({exc})")
    reason = client_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres(needs_postgres) -> Iterator[LocalPostgres]:
    """One PostgreSQL server for the session."""
    with LocalPostgres() as server:
        yield server


@pytest.fixture
def fresh_postgres(needs_postgres) -> Iterator[LocalPostgres]:
    """A PostgreSQL server of this test alone."""
    with LocalPostgres() as server:
        yield server


@pytest.fixture
def schema() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"
