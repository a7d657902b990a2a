"""A stream across hosts on one machine, for tests and benches: its servers, its processes, its audit.

::

    with TwoHosts() as hosts, LocalStreamCluster(hosts.a, clients=hosts.subnet) as cluster:
        producer = cluster.launch(["run", "--role", "producer", *args, *cluster.stream_args("s1", hosts.a)],
                                  host=hosts.a, cwd=producer_dir)
        ...
        cluster.audit("s1")        # the ledger in PostgreSQL and the objects left in Mooncake

:class:`LocalStreamCluster` starts what a stream needs besides its producers and consumers,
on one host (``LOOPBACK``, or a network namespace of :mod:`specforge_core.testing.netns`):
a PostgreSQL server, a ``mooncake_master`` and a segment holder (Mooncake's standalone
client lending the memory the samples live in, so that a killed producer or consumer takes
no sample with it). :meth:`~LocalStreamCluster.stream_args` are the command-line options of
a process on a given host, :meth:`~LocalStreamCluster.launch` starts ``specforge`` (under
``torchrun`` for several ranks) there, and every process it started is killed by
:meth:`~LocalStreamCluster.stop`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from specforge_core.testing.netns import LOOPBACK, Host

from .server import LocalPostgres

MIB = 2**20
#: The environment of every process: one thread each (the machine is shared), strict plugins,
#: and leases short enough that a dead holder's expire within a test.
CLUSTER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "SPECFORGE_STRICT_PLUGINS": "1",
               "GLOG_minloglevel": "1", "SPECFORGE_LEASE_TTL_S": "3"}
#: A put interrupted by the death of its process leaves an object Mooncake can neither
#: complete nor delete until the master frees it, after put_start_release_timeout_sec (10
#: minutes by default): the test master frees them after 12 s (longer than any stall a test
#: makes), and :meth:`LocalStreamCluster.audit` waits for that before it counts what is left.
INTERRUPTED_PUTS = ("--put_start_discard_timeout_sec=10", "--put_start_release_timeout_sec=12")
RELEASE_WAIT_S = 30.0
#: Producers stay at most 4 refs ahead of the consumers, so that a fault lands mid-run.
PACED = ["--set", "control_plane.high_watermark=4", "--set", "control_plane.low_watermark=2"]


def train_args(samples: int, batch: int = 2) -> list[str]:
    """The training both sides and the colocated reference share: eagle3, ``samples`` samples,
    a checkpoint every 2 steps, no export and no real-acceptance check; captures of ``batch``
    samples, so that producers claim small pieces of the stream all through a run."""
    return ["--strategy", "eagle3", "--set", f"data.max_samples={samples}", "--set", f"train.batch_size={batch}",
            "--set", "train.real_eval_prompts=0", "--set", "train.export=false", "--set", "train.save_every=2",
            "--set", f"target_engine.capture_batch_size={batch}"]


def reference_losses(model: Path, samples: int, run: Path, ranks: int = 2) -> list[tuple[int, float]]:
    """The per-step losses of the same training online colocated on ``ranks`` ranks (what a
    stream must reproduce), run into ``run``."""
    command = specforge_command(["run", "--output", str(run), *train_args(samples),
                                 "--set", f"target_engine.model={model}"], ranks=ranks)
    done = subprocess.run(command, env={**os.environ, **CLUSTER_ENV}, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise AssertionError(f"the colocated reference run failed:\n{done.stderr[-4000:]}")
    return losses(run)


class LocalStreamCluster:
    """PostgreSQL, a mooncake_master and a segment holder on ``host`` (see the module docstring).

    ``clients`` is the network (CIDR) whose processes may log in to PostgreSQL besides
    loopback; ``segment_bytes`` the memory the segment holder lends.
    """

    def __init__(self, host: Host = LOOPBACK, *, clients: str | None = None, segment_bytes: int = 256 * MIB,
                 lease_ttl_ms: int = 500, idle_timeout_s: float = 120.0) -> None:
        self.host = host
        self.clients = clients
        self.segment_bytes = segment_bytes
        self.lease_ttl_ms = lease_ttl_ms
        self.idle_timeout_s = idle_timeout_s
        self.postgres: LocalPostgres | None = None
        self.master: Any = None
        self.holder: Any = None
        self.processes: list[subprocess.Popen] = []

    def start(self) -> LocalStreamCluster:
        from specforge_plugin_mooncake.master import LocalMaster, LocalSegmentHolder

        try:
            # Inside a namespace every port is free; on loopback the server picks a free one.
            port = None if self.host is LOOPBACK else 5432
            self.postgres = LocalPostgres(host=self.host.address, port=port, command_prefix=self.host.prefix,
                                          allow_from=[self.clients] if self.clients else ()).start()
            self.master = LocalMaster(lease_ttl_ms=self.lease_ttl_ms, host=self.host.address,
                                      command_prefix=self.host.prefix, extra_flags=INTERRUPTED_PUTS).start()
            self.holder = LocalSegmentHolder(self.master, self.segment_bytes).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every process launched here, then stop the servers; safe to call twice."""
        self.kill_processes()
        for service in ("holder", "master", "postgres"):
            running = getattr(self, service)
            if running is not None:
                running.stop()
                setattr(self, service, None)

    def kill_processes(self) -> None:
        """SIGKILL every process launched here that still runs (with what it started)."""
        while self.processes:
            kill_tree(self.processes.pop())

    def __enter__(self) -> LocalStreamCluster:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()

    # ---- processes -------------------------------------------------------------------------
    def stream_args(self, schema: str, host: Host) -> list[str]:
        """The control-plane and feature-store options of a producer or consumer on ``host``.

        Its Mooncake client lends no memory (the segment holder does) and tells the others
        ``host``'s address.
        """
        assert self.postgres is not None and self.master is not None, "start() the cluster first"
        return ["--control-plane", "postgres", "--set", f"control_plane.dsn={self.postgres.dsn}",
                "--set", f"control_plane.schema={schema}", "--set", f"control_plane.idle_timeout_s={self.idle_timeout_s}",
                "--set", "control_plane.reconnect_timeout_s=60",
                "--feature-store", "mooncake",
                "--set", f"feature_store.master_address={self.master.master_address}",
                "--set", f"feature_store.metadata_server={self.master.metadata_server}",
                "--set", f"feature_store.local_hostname={host.address}",
                "--set", "feature_store.global_segment_size=0",
                "--set", f"feature_store.local_buffer_size={16 * MIB}", "--set", "feature_store.lease_wait_s=5"]

    def producer_args(self, schema: str, host: Host, model: Path, samples: int) -> list[str]:
        """``run --role producer`` of :func:`train_args` on ``host``, paced (:data:`PACED`), output ``out``."""
        return ["run", "--role", "producer", *train_args(samples), "--set", f"target_engine.model={model}", *PACED,
                *self.stream_args(schema, host), "--output", "out"]

    def consumer_args(self, schema: str, host: Host, samples: int, output: str = "out", *extra: str) -> list[str]:
        """``run --role consumer`` of :func:`train_args` on ``host``: no target model (it has none to read)."""
        return ["run", "--role", "consumer", *train_args(samples), *self.stream_args(schema, host), "--output", output,
                *extra]

    def launch(self, args: Sequence[str], *, host: Host, cwd: Path, ranks: int = 1, name: str = "specforge",
               env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``specforge ARGS`` on ``host`` in ``cwd`` (under torchrun with ``ranks`` gloo ranks
        when > 1); its output goes to ``cwd/NAME.out`` and ``cwd/NAME.err``."""
        cwd.mkdir(parents=True, exist_ok=True)
        command = [*host.prefix, *specforge_command(args, ranks)]
        with open(cwd / f"{name}.out", "w") as out, open(cwd / f"{name}.err", "w") as err:
            process = subprocess.Popen(command, cwd=cwd, env={**os.environ, **CLUSTER_ENV, **(env or {})},
                                       stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        process.name, process.cwd = name, cwd  # type: ignore[attr-defined]
        self.processes.append(process)
        return process

    def wait(self, process: subprocess.Popen, timeout: float) -> int:
        """Its exit code; a process still running after ``timeout`` s is killed and reported with its output."""
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process)
            raise AssertionError(f"{process.name} did not finish within {timeout:.0f}s:\n{output(process)}") from None

    # ---- what the servers hold ---------------------------------------------------------------
    def open_plane(self, schema: str) -> Any:
        """A handle on ``schema`` through the server's Unix socket (works from outside the namespace)."""
        from specforge_core.protocols import BuildContext

        from . import PostgresControlPlaneOptions
        from .plane import PostgresControlPlane

        assert self.postgres is not None
        return PostgresControlPlane(PostgresControlPlaneOptions(dsn=self.postgres.socket_dsn, schema=schema),
                                    BuildContext(role="consumer"))

    def audit(self, schema: str) -> dict[str, Any]:
        """The stream's ledger (committed, acked, duplicates, pending, durable step, distinct acked
        ids, how many of them a producer captured again after a claim expired) and the stream's
        objects left in Mooncake once the master freed interrupted puts (waiting up to RELEASE_WAIT_S)."""
        plane = self.open_plane(schema)
        try:
            stats = plane.metadata.stats()
            acked = plane.metadata.acked_steps()
            durable_step = plane.metadata.durable_step()
        finally:
            plane.close()
        deadline = time.monotonic() + RELEASE_WAIT_S  # interrupted puts of killed processes: see INTERRUPTED_PUTS
        while (left := self.objects(schema)) and time.monotonic() < deadline:
            time.sleep(1.0)
        return {**stats, "durable_step": durable_step, "acked_ids": len(acked),
                "recaptured": sum("#" in sample_id for sample_id in acked), "mooncake_objects": len(left)}

    def objects(self, schema: str) -> list[str]:
        """The keys of the objects the stream of ``schema`` has in Mooncake (its store's namespace
        is the stream's name, the schema): another stream's leftovers on the master do not count."""
        from specforge_plugin_mooncake.store import key_prefix

        return self.master.keys(key_prefix(schema))

    def marker(self, schema: str, key: str) -> Any:
        """The stream's marker ``key`` (None when unset)."""
        plane = self.open_plane(schema)
        try:
            return plane.metadata.get_marker(key)
        finally:
            plane.close()

    def acked_ids(self, schema: str) -> list[str]:
        """Every sample id in the stream's ack ledger."""
        plane = self.open_plane(schema)
        try:
            return sorted(plane.metadata.acked_steps())
        finally:
            plane.close()

    def durable_step(self, schema: str) -> int:
        """The stream's durable global step now (0 before its tables exist)."""
        return self._count(schema, "SELECT value FROM {}.counters WHERE name = 'durable_step'")

    def committed(self, schema: str) -> int:
        """How many samples the stream committed so far."""
        return self._count(schema, "SELECT count(*) FROM {}.samples")

    def ended(self, schema: str) -> int:
        """How many of the stream's ref channels were closed or failed."""
        return self._count(schema, "SELECT count(*) FROM {}.channel_state WHERE end_kind IS NOT NULL")

    def claims_held(self, schema: str, pid: int) -> int:
        """Open claims of the stream held by the producer with process id ``pid`` (0 before its tables exist)."""
        return self._count(schema, "SELECT count(*) FROM {}.claims WHERE NOT done AND holder LIKE %s",
                           (f"%:pid{pid}:%",))

    def freeze_holding_claim(self, schema: str, processes: Sequence[subprocess.Popen],
                             timeout: float = 240.0) -> subprocess.Popen:
        """SIGSTOP one of the producers ``processes`` at a moment it holds an open claim, and return it.

        On a fast machine a claim lasts a few milliseconds, so the claims are watched on one
        connection kept open, and a producer seen holding one is stopped at once. It must then
        hold a claim whose rows no transaction of its own keeps locked, also after a pause that
        lets an answer already on its way arrive: a producer frozen inside a transaction would
        keep its rows from the producers that must take them over, so it is resumed and the
        watch goes on.
        """
        import psycopg
        from psycopg import sql

        assert self.postgres is not None
        claims = sql.Identifier(schema, "claims")
        holders = sql.SQL("SELECT DISTINCT holder FROM {} WHERE NOT done AND holder IS NOT NULL").format(claims)
        locked = sql.SQL("SELECT position FROM {} WHERE NOT done AND holder LIKE %s FOR UPDATE NOWAIT").format(claims)

        def holds_cleanly(conn: Any, pid: int) -> bool:
            try:
                with conn.transaction(force_rollback=True):
                    return bool(conn.execute(locked, (f"%:pid{pid}:%",)).fetchall())
            except psycopg.errors.LockNotAvailable:
                return False

        deadline = time.monotonic() + timeout
        with psycopg.connect(self.postgres.socket_dsn, autocommit=True) as conn:
            while time.monotonic() < deadline and any(process.poll() is None for process in processes):
                try:
                    held = " ".join(row[0] for row in conn.execute(holders).fetchall())
                except psycopg.errors.UndefinedTable:  # the stream is not set up yet
                    held = ""
                for process in processes:
                    if f":pid{process.pid}:" not in held or process.poll() is not None:
                        continue
                    os.kill(process.pid, signal.SIGSTOP)
                    if holds_cleanly(conn, process.pid):
                        time.sleep(0.3)  # an answer sent just before the stop is applied by now
                        if holds_cleanly(conn, process.pid):
                            return process
                    os.kill(process.pid, signal.SIGCONT)
                time.sleep(0.001)
        names = ", ".join(process.name for process in processes)  # type: ignore[attr-defined]
        raise AssertionError(f"none of {names} was seen holding a claim within {timeout:.0f}s:\n"
                             + "\n".join(output(process) for process in processes))

    def _count(self, schema: str, query: str, params: tuple = ()) -> int:
        import psycopg
        from psycopg import sql

        assert self.postgres is not None
        with psycopg.connect(self.postgres.socket_dsn, autocommit=True) as conn:
            try:
                row = conn.execute(sql.SQL(query).format(sql.Identifier(schema)), params).fetchone()
            except psycopg.errors.UndefinedTable:
                return 0
        return int(row[0]) if row else 0


def specforge_command(args: Sequence[str], ranks: int = 1) -> list[str]:
    """The command line of ``specforge ARGS`` with this interpreter (under torchrun for ``ranks`` > 1)."""
    if ranks == 1:
        return [str(Path(sys.executable).parent / "specforge"), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "specforge_core.cli", *args]


def rank_pids(process: subprocess.Popen) -> dict[int, int]:
    """The pids of a torchrun ``process``'s ranks, by rank (from their environments)."""
    ranks = {}
    for pid in _descendants(process.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                ranks[int(entry[5:])] = pid
    return ranks


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += map(int, children)
        todo += map(int, children)
    return found


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and everything it started (its own session), then reap it."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def output(process: subprocess.Popen, limit: int = 20000) -> str:
    """The tail of what a launched process wrote to stderr (and stdout)."""
    texts = []
    for stream in ("err", "out"):
        try:
            texts.append((process.cwd / f"{process.name}.{stream}").read_text()[-limit:])  # type: ignore[attr-defined]
        except OSError:
            continue
    return "\n".join(texts)


def losses(run: Path) -> list[tuple[int, float]]:
    """The per-step training losses of a run's ``metrics.jsonl``."""
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def wait_until(condition: Any, timeout: float, what: str, poll_s: float = 0.2) -> None:
    """Poll ``condition()`` until true, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(poll_s)
