"""Fixtures of the mooncake plugin's tests: a real mooncake_master on loopback.

Tests that need Mooncake take the ``master`` (shared by the session) or ``fresh_master``
(one per test) fixture; both skip, with the reason, where the Mooncake client cannot be
loaded (no wheel, or no libibverbs1), so the rest of the suite still runs there.
"""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

from specforge_plugin_mooncake.master import LocalMaster, client_missing


def close_idle_clients(master_address: str) -> None:
    from specforge_plugin_mooncake.store import close_idle_clients as close

    close(master_address)

#: Read lease of the test masters: long enough for any test transfer, short enough that
#: tests waiting for a lease to expire stay fast.
LEASE_TTL_MS = 500


@pytest.fixture(scope="session")
def needs_mooncake() -> None:
    reason = client_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def master(needs_mooncake) -> Iterator[LocalMaster]:
    """One mooncake_master for the session; tests keep apart through their namespaces."""
    with LocalMaster(lease_ttl_ms=LEASE_TTL_MS) as running:
        yield running
        close_idle_clients(running.master_address)


@pytest.fixture
def fresh_master(needs_mooncake) -> Iterator[LocalMaster]:
    """A mooncake_master of this test alone (segments and eviction nobody else shares)."""
    with LocalMaster(lease_ttl_ms=LEASE_TTL_MS) as running:
        yield running
        close_idle_clients(running.master_address)


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def small_options(master: LocalMaster, namespace: str, **overrides):
    """Store options for tests: small segments, so many stores fit in one test process."""
    settings = {"namespace": namespace, "global_segment_size": 64 * 2**20, "local_buffer_size": 16 * 2**20,
                "lease_wait_s": 5.0, **overrides}
    return master.options(**settings)


def open_test_store(master: LocalMaster, namespace: str, **overrides):
    """A MooncakeStore on ``master`` with :func:`small_options`; the caller closes it."""
    from specforge_core.protocols import BuildContext
    from specforge_plugin_mooncake.store import MooncakeStore

    return MooncakeStore(small_options(master, namespace, **overrides), BuildContext(run_id="mooncake-test"))


@pytest.fixture
def open_store():
    """``open_store(master, namespace, **options)``: a store closed at teardown (also on failure)."""
    opened = []

    def open_one(master: LocalMaster, namespace: str, **overrides):
        store = open_test_store(master, namespace, **overrides)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()
