"""A PostgreSQL server in a temporary directory, started and stopped by Python: for tests and benches.

::

    with LocalPostgres() as server:
        plane = PostgresControlPlane(PostgresControlPlaneOptions(dsn=server.dsn), context)

``initdb`` makes a fresh cluster (passwords over TCP, scram-sha-256; its own socket trusted) in a temporary
directory and ``pg_ctl`` starts it listening on ``host`` (127.0.0.1 by default) on a free
port, with its Unix socket inside that directory. PostgreSQL refuses to run as root, so as
root every command runs as the ``postgres`` user (``runuser``). ``command_prefix`` runs
each command inside something else, e.g. ``("ip", "netns", "exec", "hostA")``: the server
then lives in that network namespace. Production runs use a server of their own (see the
plugin's README).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from typing import Any, Sequence

from .errors import PostgresUnavailableError

#: The user and password of the test cluster's superuser.
TEST_USER = "specforge"
TEST_PASSWORD = "specforge-test-password"
TEST_DATABASE = "specforge"


def postgres_bindir() -> str:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or an error saying how to get them."""
    candidates = []
    if shutil.which("pg_config"):
        try:
            candidates.append(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                                             check=True).stdout.strip())
        except (OSError, subprocess.CalledProcessError):
            pass
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(os.path.dirname(on_path))
    for directory in candidates:
        if all(os.access(os.path.join(directory, tool), os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return directory
    raise PostgresUnavailableError("no PostgreSQL server binaries (initdb, pg_ctl, postgres) found under "
                                   "/usr/lib/postgresql/*/bin nor on PATH; install them (Debian: apt-get install "
                                   "postgresql)")


def _version_key(path: str) -> int:
    try:
        return int(path.rstrip("/").split("/")[-2])
    except ValueError:
        return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class LocalPostgres:
    """One PostgreSQL cluster of its own: ``start()``, ``restart()``, ``stop()`` (or a ``with`` block).

    ``dsn`` is a ``postgresql://`` URI with the test user's password; ``port`` is chosen
    free on 127.0.0.1 unless given (inside a network namespace, give it). ``settings`` are
    extra ``-c name=value`` server settings. ``allow_from`` lists the networks (CIDR) besides
    loopback whose clients may log in with the password (``pg_hba.conf``).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None,
                 command_prefix: Sequence[str] = (), settings: dict[str, Any] | None = None,
                 start_timeout_s: int = 60, allow_from: Sequence[str] = ()) -> None:
        self.host = host
        self.port = port
        self.allow_from = tuple(allow_from)
        self.command_prefix = tuple(command_prefix)
        self.settings = dict(settings or {})
        self.start_timeout_s = start_timeout_s
        self.root: str | None = None
        self._as_postgres = os.geteuid() == 0

    # ---- addresses ---------------------------------------------------------------------
    @property
    def data_dir(self) -> str:
        assert self.root is not None, "start() the server first"
        return os.path.join(self.root, "data")

    @property
    def dsn(self) -> str:
        return self.dsn_for(TEST_DATABASE)

    @property
    def socket_dsn(self) -> str:
        """A DSN through the server's Unix socket (trusted, no password): reachable from any
        network namespace of this machine, e.g. by a test checking what the server holds."""
        return f"host={self.root} port={self.port} dbname={TEST_DATABASE} user={TEST_USER}"

    def dsn_for(self, dbname: str, *, user: str = TEST_USER, password: str | None = TEST_PASSWORD) -> str:
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{user}{secret}@{self.host}:{self.port}/{dbname}"

    # ---- life cycle --------------------------------------------------------------------
    def _run(self, *command: str) -> subprocess.CompletedProcess:
        """Run one server tool (as ``postgres`` when root); the caller reads its exit code."""
        prefix = list(self.command_prefix)
        if self._as_postgres:
            prefix += ["runuser", "-u", "postgres", "--"]
        return subprocess.run([*prefix, *command], capture_output=True, text=True, check=False,
                              stdin=subprocess.DEVNULL, cwd=self.root or "/")

    def _checked(self, what: str, *command: str) -> None:
        done = self._run(*command)
        if done.returncode != 0:
            raise PostgresUnavailableError(f"{what} failed (exit {done.returncode}): "
                                           f"{(done.stderr or done.stdout).strip()[-2000:]}{self._log_tail()}")

    def start(self) -> LocalPostgres:
        bindir = postgres_bindir()
        self.root = tempfile.mkdtemp(prefix="specforge-pg-")
        try:
            if self._as_postgres:
                entry = pwd.getpwnam("postgres")
                os.chown(self.root, entry.pw_uid, entry.pw_gid)
            password_file = os.path.join(self.root, "password")
            with open(password_file, "w") as handle:
                handle.write(TEST_PASSWORD + "\n")
            if self._as_postgres:
                os.chown(password_file, entry.pw_uid, entry.pw_gid)
            os.chmod(password_file, 0o600)
            # --no-sync: a throwaway cluster need not be on disk before it starts (the
            # server itself still fsyncs every commit unless settings say otherwise).
            self._checked("initdb", os.path.join(bindir, "initdb"), "-D", self.data_dir, "-U", TEST_USER,
                          "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={password_file}", "-E", "UTF8", "--no-sync",
                          "--locale=C")
            if self.allow_from:
                with open(os.path.join(self.data_dir, "pg_hba.conf"), "a") as hba:
                    hba.writelines(f"host all all {network} scram-sha-256\n" for network in self.allow_from)
            if self.port is None:
                self.port = free_port(self.host)
            self._bindir = bindir
            self._pg_ctl_start()
            self._checked("createdb", os.path.join(bindir, "psql"), "-h", self.root, "-p", str(self.port),
                          "-U", TEST_USER, "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-q", "-c",
                          f"CREATE DATABASE {TEST_DATABASE}")
        except BaseException:
            self.stop()
            raise
        return self

    def _pg_ctl_start(self) -> None:
        options = [f"-c listen_addresses={self.host}", f"-p {self.port}", f"-c unix_socket_directories={self.root}"]
        options += [f"-c {name}={value}" for name, value in self.settings.items()]
        self._checked("pg_ctl start", os.path.join(self._bindir, "pg_ctl"), "-D", self.data_dir, "-w",
                      "-t", str(self.start_timeout_s), "-l", os.path.join(self.root, "server.log"),
                      "-o", " ".join(options), "start")

    def restart(self) -> None:
        """Stop the server (fast: open connections are cut) and start it again on the same port."""
        self._checked("pg_ctl stop", os.path.join(self._bindir, "pg_ctl"), "-D", self.data_dir, "-w",
                      "-m", "fast", "stop")
        self._pg_ctl_start()

    def kill(self) -> None:
        """Stop the server at once (immediate shutdown: as after a crash, recovery runs at the next start)."""
        self._checked("pg_ctl stop", os.path.join(self._bindir, "pg_ctl"), "-D", self.data_dir, "-w",
                      "-m", "immediate", "stop")

    def stop_when_sessions_end(self) -> None:
        """Begin a smart shutdown and return: until its open sessions end the server turns new
        connections away ("the database system is shutting down"), then it stops."""
        self._checked("pg_ctl stop", os.path.join(self._bindir, "pg_ctl"), "-D", self.data_dir, "-W",
                      "-m", "smart", "stop")

    def start_again(self) -> None:
        """Start a server stopped by :meth:`kill` (or :meth:`stop_when_sessions_end`) on the same port and data."""
        self._pg_ctl_start()

    def stop(self) -> None:
        root, bindir = self.root, getattr(self, "_bindir", None)
        if root is None:
            return
        if bindir is not None and os.path.exists(os.path.join(root, "data", "postmaster.pid")):
            self._run(os.path.join(bindir, "pg_ctl"), "-D", os.path.join(root, "data"), "-w", "-m", "immediate",
                      "stop")
        shutil.rmtree(root, ignore_errors=True)
        self.root = None

    def _log_tail(self, limit: int = 2000) -> str:
        if self.root is None:
            return ""
        try:
            with open(os.path.join(self.root, "server.log"), errors="replace") as handle:
                text = handle.read()[-limit:]
        except OSError:
            return ""
        return f"\nserver log ends with:\n{text}" if text else ""

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()
