"""The built-in control planes: the conformance suite for each, plus what only one of them does."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import sqlite3

import pytest

from specforge_core.builtin import LocalControlPlaneOptions, SqliteControlPlaneOptions, specforge_control_planes
from specforge_core.control_planes.channel import FileChannel
from specforge_core.control_planes.local import LocalControlPlane, NoopControlPlane
from specforge_core.control_planes.sqlite import SqliteControlPlane, SqliteMetadataStore
from specforge_core.errors import ChannelCorruptError, ChannelTimeoutError, ControlPlaneError
from specforge_core.protocols import BuildContext, ControlPlane, MetadataStore, RefChannel
from specforge_core.testing.control_plane_suite import (
    TEST_CHANNEL_OPTIONS,
    ControlPlaneConformance,
    ids,
    sample_refs,
)


def _in_process_plane(cls, high_watermark=None, **channel_options):
    return cls(LocalControlPlaneOptions(max_queue=high_watermark or 0), BuildContext(), **channel_options)


class TestLocalControlPlane(ControlPlaneConformance):
    dedups, durable, cross_process = True, False, False

    def make_control_plane(self, tmp_path, role="colocated", **channel_options):
        return _in_process_plane(LocalControlPlane, **channel_options)


class TestNoopControlPlane(ControlPlaneConformance):
    dedups, durable, cross_process = False, False, False

    def make_control_plane(self, tmp_path, role="colocated", **channel_options):
        return _in_process_plane(NoopControlPlane, **channel_options)


def _sqlite_plane(tmp_path, role="colocated", **channel_options):
    options = SqliteControlPlaneOptions(path=str(tmp_path / "control"), **channel_options)
    return SqliteControlPlane(options, BuildContext(role=role))


class TestSqliteControlPlane(ControlPlaneConformance):
    dedups, durable, cross_process = True, True, True

    def make_control_plane(self, tmp_path, role="colocated", **channel_options):
        return _sqlite_plane(tmp_path, role, **channel_options)


def _channel(tmp_path, **options):
    return FileChannel(str(tmp_path), **{**TEST_CHANNEL_OPTIONS, **options})


def _ref_line(ref) -> bytes:
    return f'{{"kind":"ref","ref":{ref.to_json()}}}\n'.encode()


# ---- registration ------------------------------------------------------------------------
def test_builtin_specs_build_planes_that_satisfy_the_protocols(tmp_path):
    for spec in specforge_control_planes():
        plane = spec.load_factory()(spec.build_options(), BuildContext(output_dir=str(tmp_path)))
        try:
            assert isinstance(plane, ControlPlane), spec.name
            assert isinstance(plane.metadata, MetadataStore) and isinstance(plane.channel, RefChannel)
        finally:
            plane.close()
    assert os.path.exists(tmp_path / "control" / "metadata.sqlite")  # the sqlite default directory


def test_sqlite_plane_without_a_directory_says_how_to_give_one():
    with pytest.raises(ControlPlaneError, match=r"needs a directory: set its `path` option"):
        SqliteControlPlane(SqliteControlPlaneOptions(), BuildContext())


def test_sqlite_plane_rejects_a_low_watermark_not_below_the_high_one(tmp_path):
    with pytest.raises(ControlPlaneError, match="low_watermark must be >= 0 and below high_watermark=8, got 8"):
        _sqlite_plane(tmp_path, high_watermark=8, low_watermark=8)


def test_colocated_ranks_of_a_sqlite_plane_get_their_own_channel_and_share_the_metadata(tmp_path):
    options = SqliteControlPlaneOptions(path=str(tmp_path))
    planes = [SqliteControlPlane(options, BuildContext(rank=r, world_size=2)) for r in range(2)]
    try:
        assert [p.channel.path for p in planes] == [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
        planes[0].metadata.commit(sample_refs(1))
        assert planes[1].metadata.commit(sample_refs(1)) == []
    finally:
        for plane in planes:
            plane.close()


# ---- SQLite metadata ---------------------------------------------------------------------------
def test_sqlite_store_runs_in_wal_mode_with_full_sync_and_a_busy_timeout(tmp_path):
    store = SqliteMetadataStore(str(tmp_path / "m.sqlite"), busy_timeout_s=7)
    try:
        assert store.pragmas() == {"journal_mode": "wal", "synchronous": 2, "busy_timeout": 7000}  # 2 == FULL
        other = sqlite3.connect(tmp_path / "m.sqlite")
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
        other.close()
    finally:
        store.close()


def test_sqlite_store_keeps_refs_as_their_json(tmp_path):
    store = SqliteMetadataStore(str(tmp_path / "m.sqlite"))
    refs = sample_refs(2)
    store.commit(refs)
    store.close()
    db = sqlite3.connect(tmp_path / "m.sqlite")
    assert [row[0] for row in db.execute("SELECT ref FROM samples ORDER BY seq")] == [r.to_json() for r in refs]
    db.close()


def test_sqlite_store_refuses_a_newer_schema(tmp_path):
    path = tmp_path / "m.sqlite"
    SqliteMetadataStore(str(path)).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(ControlPlaneError, match="schema v99; this specforge reads v1"):
        SqliteMetadataStore(str(path))


def test_two_sqlite_handles_interleave_commits_and_acks(tmp_path):
    a, b = (SqliteMetadataStore(str(tmp_path / "m.sqlite"), busy_timeout_s=5) for _ in range(2))
    try:
        refs = sample_refs(20)
        for i in range(0, 20, 2):
            assert a.commit(refs[i:i + 2]) == refs[i:i + 2]
            assert b.commit(refs[i:i + 2]) == []
            b.ack(ids(refs[i:i + 2]), i // 2 + 1)
        assert a.stats() == {"committed": 20, "acked": 20, "duplicates": 20, "pending": 0}
        assert a.durable_step() == 10
    finally:
        a.close()
        b.close()


def _open_after_barrier(path, barrier, results):
    barrier.wait()
    try:
        SqliteMetadataStore(path, busy_timeout_s=10).close()
        results.put("ok")
    except Exception as exc:  # reported to the parent, which asserts on it
        results.put(repr(exc))


def test_processes_opening_one_fresh_database_at_once_all_succeed(tmp_path):
    # Creating a database and switching it to WAL races between processes; SQLite reports
    # that as "locked" without waiting, so the open must retry (a producer and a consumer
    # that start together hit this).
    ctx = multiprocessing.get_context("fork")
    outcomes = []
    for round_ in range(25):
        path = str(tmp_path / f"m{round_}.sqlite")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        workers = [ctx.Process(target=_open_after_barrier, args=(path, barrier, results)) for _ in range(4)]
        for worker in workers:
            worker.start()
        outcomes += [results.get(timeout=60) for _ in workers]
        for worker in workers:
            worker.join(timeout=60)
    assert outcomes == ["ok"] * 100


def test_a_database_in_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ControlPlaneError, match=r"cannot open the metadata database .*nowhere/m\.sqlite: unable to "
                                                r"open database file; check that the directory exists"):
        SqliteMetadataStore(str(tmp_path / "nowhere" / "m.sqlite"), busy_timeout_s=0.3)


def test_a_file_that_is_not_a_database_is_a_clear_error_and_left_alone(tmp_path):
    path = tmp_path / "m.sqlite"
    path.write_bytes(b"not a database, just text " * 100)
    with pytest.raises(ControlPlaneError, match=r"m\.sqlite: file is not a database; check .*a specforge metadata "
                                                r"database"):
        SqliteMetadataStore(str(path), busy_timeout_s=0.3)
    assert path.read_bytes() == b"not a database, just text " * 100


def test_a_database_held_past_the_busy_timeout_is_a_clear_error_and_keeps_its_rows(tmp_path):
    path = tmp_path / "m.sqlite"
    store = SqliteMetadataStore(str(path))
    store.commit(sample_refs(3))
    store.close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    waiting = SqliteMetadataStore(str(path), busy_timeout_s=0.3)  # opening an existing database writes nothing
    try:
        with pytest.raises(ControlPlaneError, match=r"m\.sqlite: database is locked; another process held it past "
                                                    r"the busy timeout"):
            waiting.commit(sample_refs(1))
    finally:
        waiting.close()
        holder.execute("ROLLBACK")
        holder.close()
    store = SqliteMetadataStore(str(path))
    assert store.stats() == {"committed": 3, "acked": 0, "duplicates": 0, "pending": 3}
    store.close()


# ---- the JSONL file channel ----------------------------------------------------------------------
def test_a_half_written_line_is_held_back_until_its_newline_arrives(tmp_path):
    channel = _channel(tmp_path)
    ref = sample_refs(1)[0]
    line = _ref_line(ref)
    with open(channel.refs_path, "ab") as handle:
        handle.write(line[:40])
    assert channel.poll(1, timeout=0) == []
    assert channel.poll(1, timeout=0) == []
    assert channel.bytes_read == 40  # an unchanged partial line is not read again
    with open(channel.refs_path, "ab") as handle:
        handle.write(line[40:])
    assert channel.poll(1, timeout=0) == [ref]
    assert channel.bytes_read == 40 + len(line)  # the held-back line is re-read from its start once
    channel.detach()


def test_a_garbage_line_is_reported_with_file_and_line_after_the_refs_before_it(tmp_path):
    channel = _channel(tmp_path)
    refs = sample_refs(2)
    channel.publish(refs)
    with open(channel.refs_path, "ab") as handle:
        handle.write(b"{not json\n")
    assert channel.poll(10, timeout=0) == refs  # nothing before the damage is lost
    for _ in range(2):
        with pytest.raises(ChannelCorruptError, match=rf"{channel.refs_path}:3: not JSON.*Restart the producer"):
            channel.poll(10, timeout=0)
    channel.detach()


@pytest.mark.parametrize("line, problem", [
    (b'{"kind":"gossip"}', "unknown record"),
    (b'{"kind":"ref","ref":{"sample_id":"x"}}', "bad ref record"),
    (b'[1, 2]', "unknown record"),
    (b'', "not JSON"),
])
def test_a_malformed_record_names_its_line(tmp_path, line, problem):
    channel = _channel(tmp_path)
    with open(channel.refs_path, "ab") as handle:
        handle.write(line + b"\n")
    with pytest.raises(ChannelCorruptError, match=rf"refs\.jsonl:1: {problem}"):
        channel.poll(1, timeout=0)
    channel.detach()


def test_poll_reads_only_the_bytes_appended_since_the_last_poll(tmp_path):
    channel = _channel(tmp_path)
    channel.publish(sample_refs(1000))
    drained = 0
    while drained < 1000:
        drained += len(channel.poll(512, timeout=0))
    assert channel.bytes_read == os.path.getsize(channel.refs_path)
    before = channel.bytes_read
    new = sample_refs(10, start=1000)
    channel.publish(new)
    assert channel.poll(64, timeout=0) == new
    assert channel.bytes_read - before == sum(len(_ref_line(r)) for r in new)
    channel.detach()


def test_a_long_backlog_is_read_in_bounded_chunks(tmp_path):
    channel = _channel(tmp_path, read_chunk_bytes=4096)
    refs = sample_refs(2000)
    channel.publish(refs)
    assert channel.poll(5, timeout=0) == refs[:5]
    assert channel.bytes_read <= 4096
    got = refs[:5]
    while len(got) < 2000:
        got += channel.poll(100, timeout=0)
    assert got == refs
    channel.detach()


def test_sharded_consumers_get_disjoint_sets_that_cover_the_stream(tmp_path):
    producer = _channel(tmp_path, role="producer")
    refs = sample_refs(100)
    rng = random.Random(0)
    start = 0
    while start < len(refs):
        size = rng.randint(1, 9)
        producer.publish(refs[start:start + size])
        start += size
    producer.close()
    shards = []
    for rank in range(3):
        consumer = _channel(tmp_path, role="consumer", shard=(rank, 3))
        got = []
        while not consumer.finished:
            got += consumer.poll(7, timeout=1)
        consumer.report_consumed(len(got))
        shards.append(got)
        consumer.detach()
    assert [ids(s) for s in shards] == [ids(refs[r::3]) for r in range(3)]  # disjoint, complete, in order
    assert producer.consumed() == 100  # the sum of the ranks' consumed files
    producer.detach()


def _crash_mid_record(tmp_path, published, torn) -> None:
    """A producer publishes ``published`` and dies writing the first 30 bytes of ``torn``."""
    crashed = _channel(tmp_path, role="producer")
    crashed.publish(published)
    crashed.detach()
    with open(crashed.refs_path, "ab") as handle:
        handle.write(_ref_line(torn)[:30])


def test_a_restarted_producer_cuts_off_a_torn_record_and_continues(tmp_path):
    refs = sample_refs(3)
    _crash_mid_record(tmp_path, refs[:2], refs[2])
    with pytest.warns(RuntimeWarning, match="dropping 30 bytes of a record a crashed producer left half-written"):
        second = _channel(tmp_path, role="producer", read_chunk_bytes=256)
    assert second.backlog() == 2  # counts what its predecessor published, however many chunks
    second.publish(refs[2:])
    second.close()
    consumer = _channel(tmp_path, role="consumer")
    assert consumer.poll(10, timeout=0) == refs
    second.detach()
    consumer.detach()


def test_a_consumer_that_saw_a_torn_record_reads_what_the_restarted_producer_wrote_there(tmp_path):
    refs = sample_refs(3)
    _crash_mid_record(tmp_path, refs[:1], refs[1])
    consumer = _channel(tmp_path, role="consumer")
    assert consumer.poll(10, timeout=0) == refs[:1]  # the torn bytes were seen, not consumed
    with pytest.warns(RuntimeWarning, match="dropping 30 bytes"):
        second = _channel(tmp_path, role="producer")
    second.publish(refs[2:])  # lands where the torn record was
    assert consumer.poll(10, timeout=0) == refs[2:]
    second.detach()
    consumer.detach()


def test_a_producer_cannot_reopen_a_closed_stream(tmp_path):
    first = _channel(tmp_path, role="producer")
    first.close()
    first.detach()
    second = _channel(tmp_path, role="producer")
    with pytest.raises(Exception, match="cannot publish: the ref channel was closed.*fresh directory"):
        second.publish(sample_refs(1))
    second.detach()


def test_a_consumer_handle_cannot_publish(tmp_path):
    _channel(tmp_path, role="producer").detach()
    consumer = _channel(tmp_path, role="consumer")
    with pytest.raises(ControlPlaneError) as caught:
        consumer.publish(sample_refs(1))
    assert str(caught.value) == (f"this handle of {tmp_path / 'refs.jsonl'} was opened with role='consumer'; open it "
                                 "with role='producer' to publish, heartbeat or wait for capacity")
    consumer.detach()


@pytest.mark.parametrize(("options", "message"), [
    ({"role": "reader"}, "channel role must be 'producer', 'consumer' or 'both', got 'reader'"),
    ({"role": "consumer", "shard": (2, 2)}, "shard must be (rank, world_size) with 0 <= rank < world_size, got (2, 2)"),
    ({"role": "consumer", "shard": (-1, 2)}, "shard must be (rank, world_size) with 0 <= rank < world_size, got (-1, 2)"),
])
def test_a_bad_role_or_shard_is_refused_before_the_channel_touches_its_directory(tmp_path, options, message):
    with pytest.raises(ControlPlaneError) as caught:
        FileChannel(str(tmp_path / "channel"), **options)
    assert str(caught.value) == message
    assert not (tmp_path / "channel").exists()


def test_a_consumer_fail_stops_the_producer(tmp_path):
    producer = _channel(tmp_path, role="producer")
    consumer = _channel(tmp_path, role="consumer")
    producer.publish(sample_refs(1))
    consumer.fail("loss became NaN")
    with pytest.raises(Exception, match="the ref channel was failed: loss became NaN"):
        producer.publish(sample_refs(1, start=1))
    producer.detach()
    consumer.detach()


def test_a_consumer_started_before_the_producer_times_out_naming_the_missing_file(tmp_path):
    consumer = _channel(tmp_path / "typo", role="consumer", idle_timeout_s=0.1)
    with pytest.raises(ChannelTimeoutError, match=r"refs\.jsonl \(refs\.jsonl does not exist yet\).*producer running"):
        consumer.poll(1)
    assert not os.path.exists(tmp_path / "typo")  # a consumer never creates the directory


def test_a_corrupt_consumed_file_is_reported_with_its_path(tmp_path):
    producer = _channel(tmp_path, role="producer")
    (tmp_path / "consumed.0.json").write_text("{oops")
    with pytest.raises(ChannelCorruptError, match=r"consumed\.0\.json does not hold a consumed count.*Delete it"):
        producer.consumed()
    producer.detach()


def test_a_restarted_consumer_resumes_its_consumed_count(tmp_path):
    producer = _channel(tmp_path, role="producer")
    producer.publish(sample_refs(4))
    first = _channel(tmp_path, role="consumer")
    first.poll(3)
    first.report_consumed(3)
    first.detach()
    assert json.loads((tmp_path / "consumed.0.json").read_text())["consumed"] == 3
    second = _channel(tmp_path, role="consumer", skip_ids=["s0", "s1", "s2"])
    assert ids(second.poll(10, timeout=0)) == ["s3"]
    second.report_consumed(1)
    assert producer.consumed() == 4
    producer.detach()
    second.detach()


# ---- restarts through the SQLite control plane -------------------------------------------------
def test_resume_producer_publishes_only_committed_refs_missing_from_the_channel(tmp_path):
    refs = sample_refs(5)
    crashed = _sqlite_plane(tmp_path, role="producer")
    crashed.metadata.commit(refs)
    crashed.channel.publish(refs[:3])  # crashed before publishing s3, s4
    crashed.close()
    producer = _sqlite_plane(tmp_path, role="producer")
    assert producer.resume_producer() == 2
    assert producer.resume_producer() == 0
    producer.channel.close()
    consumer = _sqlite_plane(tmp_path, role="consumer")
    assert consumer.channel.poll(10, timeout=0) == refs
    producer.close()
    consumer.close()


def test_resume_consumer_skips_acked_refs_and_hands_out_the_pending_ones(tmp_path):
    refs = sample_refs(6)
    producer = _sqlite_plane(tmp_path, role="producer")
    producer.channel.publish(producer.metadata.commit(refs))
    first = _sqlite_plane(tmp_path, role="consumer")
    got = first.channel.poll(4)
    first.metadata.ack(ids(got[:2]), 1)  # crashed with s2, s3 polled but not acked
    first.close()
    second = _sqlite_plane(tmp_path, role="consumer")
    reconciliation = second.resume_consumer()
    assert ids(reconciliation.acked) == ["s0", "s1"] and ids(reconciliation.pending) == ["s2", "s3", "s4", "s5"]
    assert second.channel.poll(10, timeout=0) == refs[2:]
    producer.close()
    second.close()
