"""Benchmark of the built-in control planes; prints one JSON line per measurement.

* ``sqlite_commit_ack`` — refs/s through ``commit`` then ``ack`` (two fsynced transactions
  per batch, the production settings: WAL, synchronous=FULL) at batch 1 and 64, with the
  ratio to the 20k refs/s target and to the disk's raw sync rate probed around it (the
  physical limit of one durable transaction per sync);
* ``channel_publish`` / ``channel_poll`` — refs/s of the file channel (one fsync per
  published batch) and of the in-process queue;
* ``file_poll_vs_size`` — latency of polling 64 new refs when ``refs.jsonl`` already holds
  1k / 10k / 100k records, and ``file_poll_flatness``: largest / smallest (1.0 = flat);
* ``postgres_commit_ack`` — the same commit + ack loop through the ``postgres`` plugin over
  loopback TCP (a server this bench starts, fsync on, or ``--postgres-dsn``), with the
  ratio to its 10k refs/s goal, to the sqlite run of the same batch and to its physical
  limit: the server's rate of durable one-row INSERT + COMMIT round trips
  (``durable_commits_per_s``, probed before and after), of which a commit + ack pair
  takes two, so ``bound_refs_per_s`` = that rate x batch / 2. Both commit + ack loops also
  print the median time of a batch in the first and the last tenth of the run
  (``ratio_last_to_first`` near 1: no statement slows down as the tables grow);
* ``postgres_stream_commit_ack`` — a run's traffic at batch 64: a producer completing
  claims (commit + publish in one transaction) while a consumer polls, acks and reports,
  on separate connections, so the server shares WAL flushes between them (group commit);
* ``channel_publish`` / ``channel_poll`` for postgres — refs/s at batch 64, and
  ``postgres_poll_wakeup`` — the wake-up latency of a waiting consumer (another connection)
  from ``publish`` returning to its ``poll`` returning: LISTEN/NOTIFY, no sleep loop.

    python bench/control_plane.py [--dir DIR] [--seconds 2] [--sizes 1000,10000,100000]

``--dir`` should be on the filesystem production uses: fsync cost is the whole story.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

from specforge_core.control_planes.channel import FileChannel, QueueChannel
from specforge_core.control_planes.sqlite import SqliteMetadataStore
from specforge_core.testing.control_plane_suite import ids, sample_refs

TARGET_REFS_PER_S = 20_000
POSTGRES_TARGET_REFS_PER_S = 10_000
POLL_BATCH = 64


def emit(**record) -> None:
    # The machine's load at the time: timings on a shared machine are only comparable with it.
    print(json.dumps({**record, "load_average_1m": round(os.getloadavg()[0], 2)}), flush=True)


def raw_sync_rate(directory: str, seconds: float) -> float:
    """Rewrites of one 4 KiB block + fdatasync per second: the most durable writes the disk
    allows (no file growth, so this is an upper bound for any transaction log)."""
    path = os.path.join(directory, "fsync.probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    block, count, start = b"x" * 4096, 0, time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            os.pwrite(fd, block, 0)
            os.fdatasync(fd)
            count += 1
    finally:
        os.close(fd)
        os.remove(path)
    return count / (time.perf_counter() - start)


def commit_ack_loop(store, pool: list, batch: int, seconds: float) -> tuple[int, int, float, dict]:
    """Commit then ack ``batch`` refs at a time for ``seconds``: (refs, steps, elapsed, flatness),
    where ``flatness`` holds the median commit + ack time of the first and of the last tenth of
    the batches: a statement whose cost grows with the tables shows as a ratio above 1."""
    done, step, start, times = 0, 0, time.perf_counter(), []
    while done + batch <= len(pool) and time.perf_counter() - start < seconds:
        began = time.perf_counter()
        fresh = store.commit(pool[done:done + batch])
        step += 1
        store.ack(ids(fresh), step)
        times.append(time.perf_counter() - began)
        done += batch
    elapsed = time.perf_counter() - start
    assert store.stats()["acked"] == done
    tenth = max(1, len(times) // 10)
    first, last = statistics.median(times[:tenth]), statistics.median(times[-tenth:])
    flatness = {"batch_ms_first_tenth": round(first * 1e3, 3), "batch_ms_last_tenth": round(last * 1e3, 3),
                "ratio_last_to_first": round(last / first, 3)}
    return done, step, elapsed, flatness


def bench_sqlite(directory: str, pool: list, batch: int, seconds: float) -> float:
    # A shared disk's sync rate drifts a lot, so the limit is probed right before and after.
    probe_s = min(seconds, 1.0) / 2
    before = raw_sync_rate(directory, probe_s)
    store = SqliteMetadataStore(os.path.join(directory, f"bench-{batch}.sqlite"))
    try:
        done, step, elapsed, flatness = commit_ack_loop(store, pool, batch, seconds)
    finally:
        store.close()
    sync_rate = (before + raw_sync_rate(directory, probe_s)) / 2
    rate = done / elapsed
    transactions_per_s = 2 * step / elapsed  # commit + ack, each one fsynced transaction
    emit(bench="sqlite_commit_ack", batch=batch, refs=done, seconds=round(elapsed, 3), refs_per_s=round(rate),
         target_refs_per_s=TARGET_REFS_PER_S, ratio_to_target=round(rate / TARGET_REFS_PER_S, 3),
         transactions_per_s=round(transactions_per_s), raw_syncs_per_s=round(sync_rate),
         ratio_to_raw_sync=round(transactions_per_s / sync_rate, 3), **flatness, dir=directory)
    return rate


def durable_commit_rate(dsn: str, seconds: float) -> float:
    """One-row INSERT + COMMIT round trips per second on the server (fsync on): the physical
    limit of durable transactions there, a round trip plus one WAL flush each."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        table = f"flush_probe_{os.getpid()}"  # a logged table: a temporary one writes no WAL
        conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (n int)")
        conn.execute("SET synchronous_commit TO on")
        try:
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                conn.execute(f"INSERT INTO {table} VALUES (1)")
                count += 1
            return count / (time.perf_counter() - start)
        finally:
            conn.execute(f"DROP TABLE {table}")


def stream_commit_ack(plane, pool: list, batch: int, seconds: float) -> tuple[int, int, float]:
    """A run's control-plane traffic at ``batch``: a producer completes claims (commit + publish,
    one transaction) while a consumer polls, acks (durable) and reports consumption, each on
    its own connection as in a run. Returns (refs acked, acks, elapsed)."""
    producer, consumer = plane("producer"), plane("consumer")
    total = len(pool) - len(pool) % batch
    producer.pool.open_positions(total)
    stop = threading.Event()
    failures: list[BaseException] = []

    def produce() -> None:
        try:
            while not stop.is_set():
                positions = [position for position, _attempt in producer.pool.claim("bench", batch, 60.0)]
                if not positions:
                    return
                producer.pool.complete("bench", positions, [pool[p] for p in positions])
        except BaseException as exc:  # noqa: BLE001 - raised again in the measuring thread, not lost
            failures.append(exc)

    thread = threading.Thread(target=produce, daemon=True)
    done, acks, start = 0, 0, time.perf_counter()
    thread.start()
    try:
        while done < total and time.perf_counter() - start < seconds and not failures:
            refs = consumer.channel.poll(batch, timeout=5)
            acks += 1
            consumer.metadata.ack(ids(refs), acks)
            consumer.channel.report_consumed(len(refs))
            done += len(refs)
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        thread.join()
        producer.close()
        consumer.close()
    if failures:  # a producer that died would otherwise read as a rate of 0
        raise failures[0]
    return done, acks, elapsed


def bench_postgres(directory: str, dsn: str | None, pool: list, sqlite_rates: dict[int, float],
                   seconds: float) -> None:
    """The postgres plugin over loopback TCP: commit + ack, a run's traffic, publish / poll, wake-up latency."""
    try:
        from specforge_core.protocols import BuildContext
        from specforge_plugin_postgres import PostgresControlPlaneOptions
        from specforge_plugin_postgres.plane import PostgresControlPlane
        from specforge_plugin_postgres.server import LocalPostgres
    except ImportError as exc:
        emit(bench="postgres_commit_ack", skipped=f"specforge-plugin-postgres is not installed ({exc})")
        return
    server = None if dsn else LocalPostgres().start()
    dsn = dsn or server.dsn
    where = "bench-started, 127.0.0.1" if server else "given by --postgres-dsn"
    try:
        def plane(schema: str, role: str = "colocated", **options):
            return PostgresControlPlane(PostgresControlPlaneOptions(dsn=dsn, schema=schema, **options),
                                        BuildContext(role=role))

        def limit(measure):
            """``measure()`` with the server's durable commit rate probed right before and after
            (a shared disk's flush rate drifts a lot)."""
            probe_s = min(seconds, 1.0) / 2
            before = durable_commit_rate(dsn, probe_s)
            result = measure()
            return result, (before + durable_commit_rate(dsn, probe_s)) / 2

        for batch in (1, 64):
            def serial(batch=batch):
                handle = plane(f"bench_commit_{batch}_{os.getpid()}")
                try:
                    return commit_ack_loop(handle.metadata, pool, batch, seconds)
                finally:
                    handle.close()

            (done, step, elapsed, flatness), commit_rate = limit(serial)
            rate, transactions_per_s = done / elapsed, 2 * step / elapsed
            # Two durable transactions per batch, one after the other: at best batch/2 refs per flush.
            bound = commit_rate * batch / 2
            emit(bench="postgres_commit_ack", batch=batch, refs=done, seconds=round(elapsed, 3),
                 refs_per_s=round(rate), target_refs_per_s=POSTGRES_TARGET_REFS_PER_S,
                 ratio_to_target=round(rate / POSTGRES_TARGET_REFS_PER_S, 3),
                 ratio_to_sqlite=round(rate / sqlite_rates[batch], 3), transactions_per_s=round(transactions_per_s),
                 durable_commits_per_s=round(commit_rate), bound_refs_per_s=round(bound),
                 ratio_to_bound=round(rate / bound, 3), **flatness, server=where)
        batch = POLL_BATCH
        schema = f"bench_stream_{os.getpid()}"
        (done, acks, elapsed), commit_rate = limit(lambda: stream_commit_ack(
            lambda role: plane(schema, role, high_watermark=4 * batch, low_watermark=batch, idle_timeout_s=60),
            pool, batch, seconds))
        rate = done / elapsed
        emit(bench="postgres_stream_commit_ack", batch=batch, refs=done, seconds=round(elapsed, 3),
             refs_per_s=round(rate), target_refs_per_s=POSTGRES_TARGET_REFS_PER_S,
             ratio_to_target=round(rate / POSTGRES_TARGET_REFS_PER_S, 3), durable_commits_per_s=round(commit_rate),
             serial_bound_refs_per_s=round(commit_rate * batch / 2),
             ratio_to_serial_bound=round(rate / (commit_rate * batch / 2), 3), server=where,
             note="producer completes claims while a consumer polls, acks and reports, on separate connections: "
                  "their WAL flushes are shared (group commit)")
        schema = f"bench_channel_{os.getpid()}"
        producer = plane(schema, "producer", high_watermark=10**9, low_watermark=0)
        consumer = plane(schema, "consumer", idle_timeout_s=60)
        try:
            bench_channel("postgres", _PairedChannel(producer.channel, consumer.channel), pool, POLL_BATCH, seconds)
            latencies = []
            for index in range(30):
                refs = pool[index:index + 1]
                box: dict = {}
                waiter = threading.Thread(target=lambda: box.update(got=consumer.channel.poll(1)))
                waiter.start()
                time.sleep(0.05)  # the consumer is asleep in its wait when the ref is published
                producer.channel.publish(refs)
                published = time.perf_counter()
                waiter.join()
                latencies.append(time.perf_counter() - published)
                assert box["got"] == refs
            emit(bench="postgres_poll_wakeup", waits=len(latencies),
                 median_ms=round(statistics.median(latencies) * 1e3, 2),
                 max_ms=round(max(latencies) * 1e3, 2),
                 poll_interval_s=consumer.channel.poll_interval_s,
                 note="a waiting consumer woken by NOTIFY; without it the wait would last poll_interval_s")
        finally:
            producer.close()
            consumer.close()
    finally:
        if server is not None:
            server.stop()


class _PairedChannel:
    """A producer handle's publish and a consumer handle's poll, as one channel for :func:`bench_channel`."""

    def __init__(self, producer, consumer) -> None:
        self.publish, self.poll = producer.publish, consumer.poll


def bench_channel(name: str, channel, pool: list, batch: int, seconds: float) -> None:
    published, start = 0, time.perf_counter()
    while published + batch <= len(pool) and time.perf_counter() - start < seconds:
        channel.publish(pool[published:published + batch])
        published += batch
    elapsed = time.perf_counter() - start
    emit(bench="channel_publish", channel=name, batch=batch, refs=published, refs_per_s=round(published / elapsed))
    polled, start = 0, time.perf_counter()
    while polled < published:
        polled += len(channel.poll(batch, timeout=0))
    elapsed = time.perf_counter() - start
    emit(bench="channel_poll", channel=name, batch=batch, refs=polled, refs_per_s=round(polled / elapsed))


def bench_poll_vs_size(directory: str, pool: list, sizes: list[int], repeats: int) -> None:
    medians = {}
    for size in sizes:
        path = os.path.join(directory, f"poll-{size}")
        producer = FileChannel(path, role="producer")
        consumer = FileChannel(path, role="consumer", idle_timeout_s=60)
        for start in range(0, size, len(pool)):  # the channel does not dedup, so refs may repeat
            producer.publish(pool[:min(len(pool), size - start)])
        drained = 0
        while drained < size:
            drained += len(consumer.poll(4096, timeout=0))
        latencies = []
        for _ in range(repeats):
            producer.publish(pool[:POLL_BATCH])
            before, start = consumer.bytes_read, time.perf_counter()
            got = consumer.poll(POLL_BATCH, timeout=0)
            latencies.append(time.perf_counter() - start)
            assert len(got) == POLL_BATCH
        medians[size] = statistics.median(latencies)
        emit(bench="file_poll_vs_size", records_in_file=size, new_refs=POLL_BATCH,
             median_poll_us=round(medians[size] * 1e6, 1), bytes_read_per_poll=consumer.bytes_read - before,
             file_bytes=os.path.getsize(producer.refs_path))
        producer.detach()
        consumer.detach()
    emit(bench="file_poll_flatness", sizes=sizes,
         ratio_largest_to_smallest=round(medians[sizes[-1]] / medians[sizes[0]], 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time budget of each throughput measurement")
    parser.add_argument("--pool", type=int, default=40_000, help="distinct refs generated up front")
    parser.add_argument("--sizes", default="1000,10000,100000", help="channel file sizes, in records")
    parser.add_argument("--repeats", type=int, default=30, help="polls timed per file size")
    parser.add_argument("--postgres-dsn", default=None, help="PostgreSQL to measure (default: start one on "
                                                             "127.0.0.1 in a temporary directory)")
    parser.add_argument("--no-postgres", action="store_true", help="skip the postgres measurements")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="sf-bench-control-") as directory:
        pool = sample_refs(args.pool, run_id="bench")
        sqlite_rates = {batch: bench_sqlite(directory, pool, batch, args.seconds) for batch in (1, 64)}
        if not args.no_postgres:
            bench_postgres(directory, args.postgres_dsn, pool, sqlite_rates, args.seconds)
        bench_channel("file", FileChannel(os.path.join(directory, "channel"), role="both"), pool, 64, args.seconds)
        bench_channel("queue", QueueChannel(), pool, 64, args.seconds)
        bench_poll_vs_size(directory, pool, sizes, args.repeats)


if __name__ == "__main__":
    main()
