"""What only the postgres control plane does: clear connection errors, NOTIFY wake-ups,
surviving a server restart, schemas of other streams, leases and a producer pool's claims."""

from __future__ import annotations

import json
import os
import socket
import time

import psycopg
import pytest

from specforge_core.errors import ClaimLostError, ControlPlaneError, LeaseHeldError
from specforge_core.testing.control_plane_suite import Background, ids, sample_refs
from specforge_plugin_postgres.errors import PostgresNotReadyError, PostgresUnavailableError, StreamMismatchError
from specforge_plugin_postgres.server import free_port
from specforge_plugin_postgres.testing import open_plane


def _open_with_dsn(dsn, schema="t_conn", **options):
    from specforge_core.protocols import BuildContext
    from specforge_plugin_postgres import PostgresControlPlaneOptions
    from specforge_plugin_postgres.plane import PostgresControlPlane

    return PostgresControlPlane(PostgresControlPlaneOptions(dsn=dsn, schema=schema, **options), BuildContext())


# ---- connecting ------------------------------------------------------------------------------
def test_a_port_nobody_listens_on_is_a_clear_error_naming_the_address_at_once():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(PostgresUnavailableError, match=rf"cannot connect to PostgreSQL at u@127\.0\.0\.1:{port}/db: .*"
                                                         r"nothing accepts connections there"):
        _open_with_dsn(f"postgresql://u:secret@127.0.0.1:{port}/db")
    assert time.monotonic() - start < 5


def test_a_server_that_never_answers_fails_within_the_connect_timeout():
    with socket.socket() as silent:  # accepts TCP connections and says nothing: a hung server
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(PostgresUnavailableError, match=r"nothing answered within 2s \(control_plane\."
                                                             r"connect_timeout_s\)"):
            _open_with_dsn(f"postgresql://u@127.0.0.1:{port}/db", connect_timeout_s=2)
        assert time.monotonic() - start < 8


def test_a_wrong_password_is_refused_with_a_hint_and_never_echoed(postgres):
    dsn = postgres.dsn_for("specforge", password="not-the-password")
    with pytest.raises(PostgresUnavailableError, match=r"refused the login: check the user and password") as caught:
        _open_with_dsn(dsn)
    assert "not-the-password" not in str(caught.value)


def test_a_missing_database_says_to_create_it(postgres):
    with pytest.raises(PostgresUnavailableError, match=r"/nosuchdb: .*the database does not exist: create it"):
        _open_with_dsn(postgres.dsn_for("nosuchdb"))


def test_a_malformed_dsn_names_the_option():
    with pytest.raises(ControlPlaneError, match=r"control_plane\.dsn is not a PostgreSQL connection string"):
        _open_with_dsn("host 127.0.0.1")


# ---- schemas ---------------------------------------------------------------------------------
def test_a_schema_holding_other_tables_is_refused_and_left_alone(postgres, schema):
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.invoices (id int)")
        with pytest.raises(StreamMismatchError, match=rf"schema '{schema}' .* holds tables that are not a specforge "
                                                      r"control plane \(invoices\); name another schema"):
            open_plane(postgres, schema)
        tables = conn.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                              (schema,)).fetchall()
    assert tables == [("invoices",)]


def stream_of_three_samples(postgres, schema):
    """A control plane's schema holding three committed samples, its handle closed."""
    plane = open_plane(postgres, schema)
    plane.metadata.commit(sample_refs(3))
    plane.close()


def test_a_schema_of_another_version_is_refused_and_keeps_its_rows(postgres, schema):
    stream_of_three_samples(postgres, schema)
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {schema}.meta SET value = '99' WHERE key = 'schema_version'")
        with pytest.raises(StreamMismatchError, match=r"has control-plane schema v99; this specforge reads v1"):
            open_plane(postgres, schema)
        assert conn.execute(f"SELECT count(*) FROM {schema}.samples").fetchone()[0] == 3


def test_a_schema_missing_one_of_its_tables_is_refused_and_keeps_its_rows(postgres, schema):
    stream_of_three_samples(postgres, schema)
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {schema}.markers")
        with pytest.raises(StreamMismatchError, match=rf"schema '{schema}' .* lacks the tables markers; it was damaged "
                                                      r"by hand\. Drop it \(DROP SCHEMA \.\.\. CASCADE\) or name "
                                                      r"another schema"):
            open_plane(postgres, schema)
        assert conn.execute(f"SELECT count(*) FROM {schema}.samples").fetchone()[0] == 3


def test_a_schema_whose_meta_table_is_not_ours_is_refused_and_left_alone(postgres, schema):
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.meta (setting text, value text)")
        conn.execute(f"INSERT INTO {schema}.meta VALUES ('colour', 'blue')")
        with pytest.raises(StreamMismatchError, match=rf"schema '{schema}' .* holds a table 'meta' that is not a "
                                                      r"specforge control plane's"):
            open_plane(postgres, schema)
        assert conn.execute(f"SELECT setting, value FROM {schema}.meta").fetchall() == [("colour", "blue")]


def test_a_consumer_handle_cannot_publish(postgres, schema):
    open_plane(postgres, schema).close()
    consumer = open_plane(postgres, schema, role="consumer")
    try:
        with pytest.raises(ControlPlaneError) as caught:
            consumer.channel.publish(sample_refs(1))
        assert str(caught.value) == ("this handle of channel 'stream' was opened with role='consumer'; open it with "
                                     "role='producer' to publish, heartbeat or wait for capacity")
    finally:
        consumer.close()


def test_a_bad_schema_name_is_refused():
    from specforge_plugin_postgres.schema import check_schema_name

    with pytest.raises(StreamMismatchError, match=r"control_plane\.schema must be a lowercase identifier.*'Bad-Name'"):
        check_schema_name("Bad-Name")


def test_two_streams_in_one_database_stay_apart(postgres, schema):
    first, second = open_plane(postgres, schema + "_a"), open_plane(postgres, schema + "_b")
    try:
        first.metadata.commit(sample_refs(3))
        first.channel.publish(sample_refs(3))
        assert second.metadata.stats()["committed"] == 0
        assert second.channel.poll(5, timeout=0) == []
    finally:
        first.close()
        second.close()


def _scans_of_samples(plane, dsn, schema):
    """(sequential scans, index scans) of the ``samples`` table so far, with ``plane``'s own counts flushed."""
    plane.metadata.db.run(lambda conn: conn.execute("SELECT pg_stat_force_next_flush()"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return conn.execute("SELECT seq_scan, idx_scan FROM pg_stat_user_tables WHERE schemaname = %s AND "
                            "relname = 'samples'", (schema,)).fetchone()


@pytest.mark.parametrize("plan_cache_mode", ["auto", "force_generic_plan"])
def test_acks_probe_the_sample_index_however_small_the_table_was_when_acks_began(postgres, schema, plan_cache_mode):
    # Acks that began on a small table must not keep a plan that scans it whole: that made
    # each ack cost more as the run grew (1.7 ms at 6k samples, 6 ms at 32k). The server picks
    # cached generic plans by its own estimates ("auto"), or always where configured so.
    plane = open_plane(postgres, schema)
    try:
        plane.metadata.db.run(lambda conn: conn.execute(f"SET plan_cache_mode = {plan_cache_mode}"))
        refs = sample_refs(20_000, run_id="grow")
        plane.metadata.commit(refs[:240])
        # the table's statistics say "a few hundred rows", as autovacuum records them early in a run
        plane.metadata.db.run(lambda conn: conn.execute("ANALYZE samples"))
        for step in range(1, 31):  # acks on a small table: the server may cache a plan for them
            plane.metadata.ack(ids(refs[(step - 1) * 8:step * 8]), step)
        plane.metadata.commit(refs[240:])
        seq_before, idx_before = _scans_of_samples(plane, postgres.dsn, schema)
        for step in range(31, 41):
            batch = refs[240 + (step - 31) * 64:240 + (step - 30) * 64]
            plane.metadata.ack(ids(batch), step)
        seq_after, idx_after = _scans_of_samples(plane, postgres.dsn, schema)
        assert seq_after == seq_before, "an ack scanned the whole samples table"
        assert idx_after - idx_before >= 10
        assert plane.metadata.stats() == {"committed": 20_000, "acked": 880, "duplicates": 0, "pending": 19_120}
    finally:
        plane.close()


# ---- waiting ---------------------------------------------------------------------------------
def test_a_waiting_consumer_is_woken_by_notify_not_by_its_poll_interval(postgres, schema):
    producer = open_plane(postgres, schema, role="producer", poll_interval_s=30)
    consumer = open_plane(postgres, schema, role="consumer", poll_interval_s=30)
    try:
        consumer.channel.poll(1, timeout=0.2)  # opens its LISTEN connection
        waiting = Background(lambda: consumer.channel.poll(4, timeout=20))
        time.sleep(0.2)
        refs = sample_refs(2)
        start = time.monotonic()
        producer.channel.publish(refs)
        assert waiting.result(timeout=10) == refs
        assert time.monotonic() - start < 3  # a 30 s safety-net interval would have kept it asleep
    finally:
        producer.close()
        consumer.close()


def test_ranks_of_a_consumer_group_get_disjoint_shares_in_stream_order(postgres, schema):
    producer = open_plane(postgres, schema, role="producer")
    ranks = [open_plane(postgres, schema, role="consumer", rank=r, world_size=3) for r in range(3)]
    try:
        refs = sample_refs(10)
        producer.channel.publish(refs[:4])
        producer.channel.publish(refs[4:])
        producer.channel.close()
        shares = [ids(rank.channel.poll(10, timeout=1)) for rank in ranks]
        assert shares == [["s0", "s3", "s6", "s9"], ["s1", "s4", "s7"], ["s2", "s5", "s8"]]
        assert all(rank.channel.poll(1, timeout=1) == [] and rank.channel.finished for rank in ranks)
    finally:
        for plane in [producer, *ranks]:
            plane.close()


# ---- a server restart --------------------------------------------------------------------------
def test_a_server_restart_is_ridden_out_and_nothing_applies_twice(fresh_postgres, schema):
    producer = open_plane(fresh_postgres, schema, role="producer")
    consumer = open_plane(fresh_postgres, schema, role="consumer")
    try:
        refs = sample_refs(6)
        producer.channel.publish(producer.metadata.commit(refs[:3]))
        assert consumer.channel.poll(10, timeout=2) == refs[:3]
        fresh_postgres.restart()  # fast shutdown: every open connection is cut
        producer.channel.publish(producer.metadata.commit(refs[3:]))
        assert consumer.channel.poll(10, timeout=5) == refs[3:]
        consumer.metadata.ack(ids(refs), 1)
        assert producer.metadata.stats() == {"committed": 6, "acked": 6, "duplicates": 0, "pending": 0}
        assert producer.metadata.db.reconnects >= 1
    finally:
        producer.close()
        consumer.close()


def test_a_server_gone_longer_than_the_reconnect_timeout_is_a_clear_error(fresh_postgres, schema):
    plane = open_plane(fresh_postgres, schema, reconnect_timeout_s=2)
    try:
        plane.metadata.commit(sample_refs(2))
        fresh_postgres.kill()
        start = time.monotonic()
        with pytest.raises(PostgresUnavailableError, match=r"lost the connection to PostgreSQL at .* within 2s "
                                                             r"\(control_plane\.reconnect_timeout_s\)"):
            plane.metadata.commit(sample_refs(1, start=2))
        assert time.monotonic() - start < 10
        fresh_postgres.start_again()
        assert plane.metadata.stats()["committed"] == 2  # the failed commit left nothing
    finally:
        plane.close()


def test_a_server_not_taking_connections_yet_is_waited_for_up_to_the_reconnect_timeout(fresh_postgres, schema):
    session = psycopg.connect(fresh_postgres.dsn, autocommit=True)
    try:
        fresh_postgres.stop_when_sessions_end()  # new connections now hear "the database system is shutting down"
        start = time.monotonic()
        with pytest.raises(PostgresNotReadyError, match=r"cannot connect to PostgreSQL at .*shutting down.*try "
                                                        r"again once it accepts connections"):
            open_plane(fresh_postgres, schema, reconnect_timeout_s=2)
        assert 2 <= time.monotonic() - start < 10  # it kept trying (a restart under way), then said why it stopped
    finally:
        session.close()
    wait_for_stop = time.monotonic() + 30  # the last session ended: the server stops, then starts again
    while os.path.exists(os.path.join(fresh_postgres.data_dir, "postmaster.pid")) and time.monotonic() < wait_for_stop:
        time.sleep(0.2)
    fresh_postgres.start_again()
    plane = open_plane(fresh_postgres, schema)
    try:
        assert plane.metadata.stats()["committed"] == 0
    finally:
        plane.close()


class _CuttingProxy:
    """A TCP relay on loopback in front of the real server that cuts connections as a server going down does, and
    relays the rest. It stands in for moments of a restart, which cannot be timed on a real server.

    Without ``cut_at`` the first ``cuts`` connections are closed as soon as they are accepted, before any byte (a
    fast shutdown mid-handshake, or a client frozen across a restart and woken after it: libpq then reports
    "server closed the connection unexpectedly"). With ``cut_at`` the first ``cuts`` ones are relayed until the
    client sends bytes containing it, then closed (a server that goes down just after it accepted the connection).
    :meth:`restart` closes every connection it relays, as a fast shutdown does, and cuts the next ``cuts`` again.
    """

    def __init__(self, port: int, cuts: int, cut_at: bytes | None = None) -> None:
        import threading

        self.cut, self._to_cut, self._port, self._cut_at = 0, cuts, port, cut_at
        self._relayed: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            armed = self._to_cut > 0
            self._to_cut -= armed
            if armed and self._cut_at is None:
                self.cut += 1
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self._port))
            self._relayed += [client, server]
            threading.Thread(target=self._relay, args=(client, server, self._cut_at if armed else None),
                             daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client, None), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, cut_at: bytes | None) -> None:
        try:
            while data := source.recv(65536):
                if cut_at is not None and cut_at in data:
                    self.cut += 1
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                end.close()

    def restart(self, cuts: int) -> None:
        """Close every relayed connection, and cut the next ``cuts`` ones (as the proxy was built to)."""
        for end in self._relayed:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._relayed.clear()
        self.cut, self._to_cut = 0, cuts

    def close(self) -> None:
        self._listener.close()


def test_a_connection_the_server_cuts_while_it_is_made_is_tried_again_as_a_restart_under_way(postgres, schema):
    """A rank that opens its control plane as the server restarts (CI saw one frozen mid-handshake across a restart)
    hears the connection cut before it is made: that is a server going down or coming back, waited for up to the
    reconnect timeout like "the database system is starting up", not refused at once as a server that is not
    there. Past the timeout it says what it heard and why it waited."""
    proxy = _CuttingProxy(postgres.port, cuts=3)
    try:
        dsn = postgres.dsn_for("specforge").replace(f":{postgres.port}/", f":{proxy.port}/")
        plane = _open_with_dsn(dsn, schema=schema, reconnect_timeout_s=30)
        try:
            assert proxy.cut == 3  # three attempts cut, the fourth made
            plane.metadata.commit(sample_refs(2))
            assert plane.metadata.stats()["committed"] == 2
        finally:
            plane.close()
    finally:
        proxy.close()
    always = _CuttingProxy(postgres.port, cuts=10**9)
    try:
        start = time.monotonic()
        with pytest.raises(PostgresNotReadyError, match=r"cannot connect to PostgreSQL at .*server closed the "
                                                        r"connection unexpectedly.*; the server closed the connection "
                                                        r"while it was being made, as one going down or restarting "
                                                        r"does: try again once it accepts connections$"):
            _open_with_dsn(f"postgresql://specforge@127.0.0.1:{always.port}/specforge", schema=schema,
                           reconnect_timeout_s=1)
        assert 1 <= time.monotonic() - start < 8 and always.cut >= 2  # it kept trying, then said why it stopped
    finally:
        always.close()


def test_a_connection_cut_just_after_it_is_made_is_tried_again_when_opening_and_when_reconnecting(postgres,
                                                                                                  schema):
    """The server goes down right after it accepted a connection, before the connection's own set-up (its search
    path) answers: opening a plane and reconnecting after a restart both wait for the server, as for a connection
    cut while it is being made, instead of failing on the first statement."""
    proxy = _CuttingProxy(postgres.port, cuts=2, cut_at=b"search_path")
    try:
        dsn = postgres.dsn_for("specforge").replace(f":{postgres.port}/", f":{proxy.port}/")
        plane = _open_with_dsn(dsn, schema=schema, reconnect_timeout_s=30)
        try:
            assert proxy.cut == 2  # two connections cut at their search path, then made
            plane.metadata.commit(sample_refs(2))
            proxy.restart(cuts=2)  # every connection cut, and the next two again at their search path
            plane.metadata.commit(sample_refs(2, start=2))
            assert proxy.cut == 2 and plane.metadata.stats()["committed"] == 4
        finally:
            plane.close()
    finally:
        proxy.close()
    always = _CuttingProxy(postgres.port, cuts=10**9, cut_at=b"search_path")
    try:
        start = time.monotonic()
        with pytest.raises(PostgresNotReadyError, match=r"cannot connect to PostgreSQL at .*; the server closed the "
                                                        r"connection just after it was made, as one going down or "
                                                        r"restarting does: try again once it accepts connections$"):
            _open_with_dsn(postgres.dsn_for("specforge").replace(f":{postgres.port}/", f":{always.port}/"),
                           schema=schema, reconnect_timeout_s=1)
        assert 1 <= time.monotonic() - start < 8 and always.cut >= 2  # it kept trying, then said why it stopped
    finally:
        always.close()


def test_a_listener_whose_listen_is_cut_waits_and_then_listens(postgres):
    """A LISTEN the server cuts is a server away for a moment: the wait sleeps as without a server, and the next
    one opens the connection again and listens."""
    from specforge_plugin_postgres.database import Listener

    proxy = _CuttingProxy(postgres.port, cuts=1, cut_at=b"LISTEN")
    listener = Listener(postgres.dsn_for("specforge").replace(f":{postgres.port}/", f":{proxy.port}/"), "t_wake",
                        connect_timeout_s=5)
    try:
        assert listener.wait(0.1) is False and proxy.cut == 1  # cut: nothing heard
        assert listener.wait(0.1) is True  # opened: what was notified before it may be lost, read again
        with psycopg.connect(postgres.dsn_for("specforge"), autocommit=True) as conn:
            conn.execute("NOTIFY t_wake")
        assert listener.wait(5) is True and listener.wait(0.1) is False
    finally:
        listener.close()
        proxy.close()


def test_a_consumer_restates_its_consumed_count_once_reconnected(fresh_postgres, schema):
    producer = open_plane(fresh_postgres, schema, role="producer", high_watermark=4, low_watermark=2)
    consumer = open_plane(fresh_postgres, schema, role="consumer", idle_timeout_s=60, poll_interval_s=0.2)
    try:
        producer.channel.publish(sample_refs(4))
        consumer.channel.report_consumed(len(consumer.channel.poll(4, timeout=5)))
        assert producer.channel.consumed() == 4
        # Consumed counts are written without a WAL flush: a crash right after a report loses it,
        # and a producer paused at the high watermark would wait for a consumer that waits for it.
        with psycopg.connect(fresh_postgres.dsn, autocommit=True) as conn:
            conn.execute(f'UPDATE "{schema}".channel_consumed SET consumed = 0')
        fresh_postgres.restart()
        assert consumer.channel.poll(1, timeout=1.0) == []  # it reconnects, and restates what it consumed
        assert producer.channel.consumed() == 4
    finally:
        producer.close()
        consumer.close()


# ---- leases and claims --------------------------------------------------------------------------
def test_a_live_lease_is_refused_and_an_expired_one_taken_over(postgres, schema):
    plane = open_plane(postgres, schema)
    try:
        plane.pool.take_lease("consumer.rank0", "alice", ttl_s=1.0)
        with pytest.raises(LeaseHeldError, match=r"consumer\.rank0 is held by another live process \(alice"):
            plane.pool.take_lease("consumer.rank0", "bob", ttl_s=1.0)
        plane.pool.renew("alice", 1.0)
        time.sleep(1.3)  # alice died: no renewal
        plane.pool.take_lease("consumer.rank0", "bob", ttl_s=1.0)
        assert plane.pool.renew("alice", 1.0) == 0 and plane.pool.renew("bob", 1.0) == 1
    finally:
        plane.close()


def test_claims_never_overlap_and_a_dead_producers_claim_returns_to_the_pool(postgres, schema):
    plane = open_plane(postgres, schema, role="producer")
    consumer = open_plane(postgres, schema, role="consumer")
    try:
        plane.pool.open_positions(6)
        assert plane.pool.claim("a", 2, ttl_s=1.0) == [(0, 1), (1, 1)]
        assert plane.pool.claim("b", 2, ttl_s=30) == [(2, 1), (3, 1)]
        refs = sample_refs(6)
        assert plane.pool.complete("b", [2, 3], refs[2:4]) is False
        assert consumer.channel.poll(10, timeout=0.2) == []  # position 0 is missing: nothing behind it yet
        time.sleep(1.2)  # "a" died mid-claim
        assert plane.pool.claim("b", 4, ttl_s=30, expired_only=True) == [(0, 2), (1, 2)]  # second attempts
        with pytest.raises(ClaimLostError, match=r"no longer claimed by a"):
            plane.pool.complete("a", [0, 1], refs[:2])
        assert plane.pool.complete("b", [0, 1], refs[:2]) is False
        assert plane.pool.claim("c", 9, ttl_s=30) == [(4, 1), (5, 1)]
        assert plane.pool.complete("c", [4, 5], refs[4:]) is True  # the last positions close the stream
        got = consumer.channel.poll(10, timeout=1)
        assert got == refs and consumer.channel.poll(1, timeout=1) == [] and consumer.channel.finished
        assert plane.metadata.stats() == {"committed": 6, "acked": 0, "duplicates": 0, "pending": 6}
        # What a retry after a lost answer would return instead of claiming again: each claim's op record.
        recorded = plane.metadata.db.run(lambda conn: conn.execute(
            "SELECT result FROM ops WHERE op_id LIKE 'claim-%' ORDER BY result").fetchall())
        assert sorted(json.loads(text) for (text,) in recorded) == [
            [[0, 1], [1, 1]], [[0, 2], [1, 2]], [[2, 1], [3, 1]], [[4, 1], [5, 1]]]
    finally:
        plane.close()
        consumer.close()
