"""The sqlite control plane between real processes: a producer and a consumer started with
``sys.executable`` running at the same time, a consumer killed with SIGKILL and restarted,
and backpressure across the process boundary.

Run as a script, this file is the worker those tests start::

    python test_channel_crossprocess.py producer DIR --n 400 --batch 8
    python test_channel_crossprocess.py consumer DIR --batch 16 [--resume] [--delay 0.01]

Workers print one JSON object per line on stdout (flushed) so the test can follow them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time

from specforge_core.builtin import SqliteControlPlaneOptions
from specforge_core.control_planes.channel import FileChannel
from specforge_core.control_planes.sqlite import METADATA_FILE, SqliteControlPlane, SqliteMetadataStore
from specforge_core.protocols import BuildContext
from specforge_core.testing.control_plane_suite import ids, sample_refs

WORKER_TIMEOUT_S = 25


# ---- the worker ----------------------------------------------------------------------------------
def _emit(**record) -> None:
    print(json.dumps(record), flush=True)


def _plane(args, role: str) -> SqliteControlPlane:
    options = SqliteControlPlaneOptions(path=args.dir, high_watermark=args.high, low_watermark=args.low,
                                        idle_timeout_s=10.0, poll_interval_s=0.005)
    return SqliteControlPlane(options, BuildContext(role=role))


def _produce(args) -> None:
    plane = _plane(args, "producer")
    previous: list = []
    for start in range(0, args.n, args.batch):
        refs = sample_refs(min(args.batch, args.n - start), start=start)
        fresh = plane.metadata.commit(refs)
        assert plane.metadata.commit(previous) == []  # a re-run producer's repeats are dropped
        plane.channel.publish(fresh)
        _emit(published=len(fresh), backlog=plane.channel.backlog())
        previous = refs
    plane.channel.close()
    plane.close()


def _consume(args) -> None:
    plane = _plane(args, "consumer")
    step = plane.resume_consumer().durable_step if args.resume else 0
    while True:
        refs = plane.channel.poll(args.batch)
        if not refs:
            break  # poll() without a timeout returns [] only once the stream is finished
        step += 1
        plane.metadata.ack(ids(refs), step)  # the optimizer boundary
        plane.channel.report_consumed(len(refs))
        _emit(acked=ids(refs), step=step)
        time.sleep(args.delay)
    _emit(done=step)
    plane.close()


def _worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["producer", "consumer"])
    parser.add_argument("dir")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--high", type=int, default=1024)
    parser.add_argument("--low", type=int, default=256)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    (_produce if args.role == "producer" else _consume)(args)


# ---- the tests ---------------------------------------------------------------------------------------
def _start(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
    assert proc.returncode == 0, f"worker exited {proc.returncode}:\n{err}"
    return [json.loads(line) for line in out.splitlines()]


def _acked_by(records: list[dict]) -> list[str]:
    return [sid for record in records for sid in record.get("acked", [])]


def _store(control) -> SqliteMetadataStore:
    return SqliteMetadataStore(os.path.join(control, METADATA_FILE))


def _ref_lines(control) -> int:
    try:
        with open(os.path.join(control, "refs.jsonl"), "rb") as handle:
            return handle.read().count(b'"kind":"ref"')
    except FileNotFoundError:
        return 0


def _wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_concurrent_producer_and_consumer_processes_ack_every_sample_exactly_once(tmp_path):
    control = tmp_path / "control"
    consumer = _start("consumer", control, "--batch", 16)  # first: it waits for the producer
    producer = _start("producer", control, "--n", 400, "--batch", 8)
    produced, consumed = _finish(producer), _finish(consumer)

    acked = _acked_by(consumed)
    assert collections.Counter(acked) == collections.Counter(ids(sample_refs(400)))
    assert sum(r["published"] for r in produced) == 400
    store = _store(control)
    try:
        assert store.stats() == {"committed": 400, "acked": 400, "duplicates": 392, "pending": 0}
        assert store.durable_step() == consumed[-1]["done"] == sum("acked" in r for r in consumed)
    finally:
        store.close()


def test_a_killed_consumer_restarts_and_acks_exactly_the_pending_samples(tmp_path):
    control = tmp_path / "control"
    _finish(_start("producer", control, "--n", 200, "--batch", 10))
    everything = ids(sample_refs(200))

    victim = _start("consumer", control, "--batch", 10, "--delay", 0.02)
    logged = []
    while len(logged) < 5:
        logged.append(json.loads(victim.stdout.readline()))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=WORKER_TIMEOUT_S)
    victim.stdout.close()
    victim.stderr.close()

    store = _store(control)
    try:
        reconciliation = store.reconcile()
    finally:
        store.close()
    acked_before = ids(reconciliation.acked)
    assert set(_acked_by(logged)) <= set(acked_before)
    assert len(acked_before) % 10 == 0  # an ack batch is applied whole or not at all
    assert ids(reconciliation.pending) == [sid for sid in everything if sid not in set(acked_before)]

    resumed = _finish(_start("consumer", control, "--batch", 10, "--resume"))
    acked_after = _acked_by(resumed)
    assert sorted(acked_after) == sorted(ids(reconciliation.pending))  # each pending one once, nothing twice
    store = _store(control)
    try:
        assert store.stats() == {"committed": 200, "acked": 200, "duplicates": 190, "pending": 0}
        assert store.durable_step() == resumed[-1]["done"] == 20
    finally:
        store.close()


def test_the_producer_process_pauses_at_the_high_watermark_until_the_consumer_reports(tmp_path):
    control = tmp_path / "control"
    producer = _start("producer", control, "--n", 40, "--batch", 1, "--high", 8, "--low", 4)
    _wait_until(lambda: _ref_lines(control) == 8)
    time.sleep(0.5)
    assert _ref_lines(control) == 8 and producer.poll() is None  # alive, and paused
    consumer = _start("consumer", control, "--batch", 2, "--delay", 0.005)
    produced, consumed = _finish(producer), _finish(consumer)
    assert sorted(_acked_by(consumed)) == sorted(ids(sample_refs(40)))
    assert max(r["backlog"] for r in produced) <= 8


def test_a_paused_producer_process_stops_when_a_consumer_fails_the_channel(tmp_path):
    control = tmp_path / "control"
    producer = _start("producer", control, "--n", 40, "--batch", 1, "--high", 4, "--low", 2)
    _wait_until(lambda: _ref_lines(control) == 4)
    consumer = FileChannel(str(control), role="consumer")
    consumer.fail("trainer diverged; stopping the run")
    consumer.detach()
    _, err = producer.communicate(timeout=WORKER_TIMEOUT_S)
    assert producer.returncode != 0
    assert "ChannelClosedError: cannot publish: the ref channel was failed: trainer diverged" in err
    assert _ref_lines(control) == 4  # nothing published after the failure


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
