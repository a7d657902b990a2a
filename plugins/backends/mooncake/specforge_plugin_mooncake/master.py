"""A ``mooncake_master`` (and a segment holder) started and stopped by Python: for tests and benchmarks.

::

    with LocalMaster(lease_ttl_ms=500) as master, LocalSegmentHolder(master, 256 * 2**20):
        store = MooncakeStore(master.options(namespace="demo", global_segment_size=0), BuildContext())

Every socket the master opens (RPC, HTTP metadata server, metrics) binds ``host``
(127.0.0.1 by default) on a free port. ``command_prefix`` runs the processes inside
something else, e.g. ``("ip", "netns", "exec", "hostA")``: they then live in that network
namespace, and the readiness probes run there too. :class:`LocalSegmentHolder` runs
Mooncake's standalone client (``mooncake_client``), a process that only lends memory, so
that samples outlive the processes that put them. Production runs start these themselves
(see the plugin's README).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from .errors import MooncakeUnavailableError


def client_missing() -> str | None:
    """Why the Mooncake client cannot be loaded here (no wheel, or no libibverbs1), or None.

    ``import mooncake`` succeeds without the native library; ``mooncake.store`` is what loads it.
    """
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any load failure means the same thing, with its text
        return (f"Mooncake client unavailable ({type(exc).__name__}: {exc}); pip install "
                "mooncake-transfer-engine-non-cuda and apt-get install libibverbs1 to use it")
    return None


def mooncake_binary(name: str = "mooncake_master") -> str:
    """Path of a Mooncake executable shipped with the mooncake wheel (``mooncake_master``, ``mooncake_client``)."""
    try:
        import mooncake
    except ImportError as exc:
        raise MooncakeUnavailableError(
            f"the mooncake package is not installed ({exc}); pip install mooncake-transfer-engine-non-cuda"
        ) from None
    shipped = Path(mooncake.__file__).parent / name
    if shipped.is_file() and os.access(shipped, os.X_OK):
        return str(shipped)
    on_path = shutil.which(name)
    if on_path is None:
        raise MooncakeUnavailableError(f"no {name} next to {mooncake.__file__} nor on PATH")
    return on_path


def master_binary() -> str:
    """Path of the ``mooncake_master`` executable shipped with the mooncake wheel."""
    return mooncake_binary("mooncake_master")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def accepts(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


_PROBE = """import socket, sys
host = sys.argv[1]
for port in sys.argv[2:]:
    socket.create_connection((host, int(port)), timeout=0.5).close()
"""
_FETCH = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def accepts_all(host: str, ports: Sequence[int], command_prefix: Sequence[str] = ()) -> bool:
    """Whether ``host`` accepts TCP connections on every port, seen from inside ``command_prefix``."""
    if not command_prefix:
        return all(accepts(host, port) for port in ports)
    probe = subprocess.run([*command_prefix, sys.executable, "-c", _PROBE, host, *map(str, ports)],
                           capture_output=True, check=False, stdin=subprocess.DEVNULL)
    return probe.returncode == 0


def fetch_text(url: str, command_prefix: Sequence[str] = ()) -> str:
    """The body of an HTTP GET of ``url``, made from inside ``command_prefix``."""
    if not command_prefix:
        import urllib.request

        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.read().decode()
    return subprocess.run([*command_prefix, sys.executable, "-c", _FETCH, url], capture_output=True, text=True,
                          check=True, stdin=subprocess.DEVNULL).stdout


class _LocalProcess:
    """One child process with its log in a temporary file; ``stop()`` or leaving a ``with`` block ends it."""

    _process: subprocess.Popen | None = None
    _log: Any = None

    def start(self) -> Any:  # pragma: no cover - every subclass starts its own program
        raise NotImplementedError

    def stop(self) -> None:
        """Terminate the process, killing it if it lingers."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _log_tail(self, limit: int = 2000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-limit:]

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()


class LocalMaster(_LocalProcess):
    """One ``mooncake_master`` process with its HTTP metadata server, on ``host`` (default 127.0.0.1).

    ``lease_ttl_ms`` is the read lease (``--default_kv_lease_ttl``): how long after a get
    the master refuses to delete the object. ``extra_flags`` go to the command line as is.
    ``command_prefix`` runs it inside e.g. a network namespace (see the module docstring).
    ``stop()`` (or leaving the ``with`` block) terminates it, killing it if it lingers.
    """

    def __init__(self, *, lease_ttl_ms: int = 10_000, extra_flags: tuple[str, ...] = (),
                 start_timeout_s: float = 30.0, host: str = "127.0.0.1",
                 command_prefix: Sequence[str] = ()) -> None:
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_flags = tuple(extra_flags)
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.command_prefix = tuple(command_prefix)
        self.rpc_port = self.http_port = self.metrics_port = 0

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def options(self, **overrides: Any) -> Any:
        """:class:`MooncakeStoreOptions` pointing at this master (plus ``overrides``)."""
        from . import MooncakeStoreOptions

        return MooncakeStoreOptions(master_address=self.master_address, metadata_server=self.metadata_server,
                                    **overrides)

    def metrics(self) -> dict[str, float]:
        """The master's unlabelled Prometheus metrics (``master_key_count``, ``master_total_capacity_bytes``...)."""
        values = {}
        for line in fetch_text(f"http://{self.host}:{self.metrics_port}/metrics", self.command_prefix).splitlines():
            name, _sep, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values

    def key_count(self) -> int:
        """How many objects the master holds, of every namespace."""
        return int(self.metrics()["master_key_count"])

    def keys(self, prefix: str = "") -> list[str]:
        """The keys of the objects the master holds that start with ``prefix``, sorted (the
        metrics server's ``/get_all_keys``: for tests and audits, not for a large store)."""
        listed = fetch_text(f"http://{self.host}:{self.metrics_port}/get_all_keys", self.command_prefix)
        return sorted(key for key in listed.splitlines() if key and key.startswith(prefix))

    def start(self) -> LocalMaster:
        binary = master_binary()
        for _attempt in range(3):  # a free port can be taken between probe and bind: try others
            self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
            self._log = tempfile.TemporaryFile(prefix="mooncake-master-")
            command = [
                *self.command_prefix,
                binary, f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={self.http_port}",
                f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}", *self.extra_flags,
            ]
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                              stderr=subprocess.STDOUT)
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and self._process.poll() is None:
                if accepts_all(self.host, (self.rpc_port, self.http_port), self.command_prefix):
                    return self
                time.sleep(0.02)
            if self._process.poll() is None:
                self.stop()
                raise MooncakeUnavailableError(
                    f"mooncake_master did not accept connections on {self.master_address} within "
                    f"{self.start_timeout_s:.0f} s; its log ends with:\n{self._log_tail()}")
            tail = self._log_tail()
            self.stop()
            if "address already in use" not in tail.lower():
                break
        raise MooncakeUnavailableError(f"mooncake_master exited at start; its log ends with:\n{tail}")



class LocalSegmentHolder(_LocalProcess):
    """Mooncake's standalone client (``mooncake_client``) lending ``segment_bytes`` to ``master``'s cluster.

    It is neither a producer nor a consumer: when those lend no memory themselves
    (``global_segment_size=0``), every object lives in this process's segment, so a
    producer or consumer that dies takes no sample with it. ``host`` is the address other
    processes reach its transfer engine at (the master's host by default); it runs inside
    the master's ``command_prefix``. ``start()`` returns once the master counts the segment.
    """

    def __init__(self, master: LocalMaster, segment_bytes: int, *, host: str | None = None,
                 start_timeout_s: float = 30.0) -> None:
        self.master = master
        self.segment_bytes = segment_bytes
        self.host = host or master.host
        self.start_timeout_s = start_timeout_s

    def start(self) -> LocalSegmentHolder:
        before = self.master.metrics().get("master_total_capacity_bytes", 0)
        self._log = tempfile.TemporaryFile(prefix="mooncake-client-")
        command = [*self.master.command_prefix, mooncake_binary("mooncake_client"),
                   f"--master_server_address={self.master.master_address}",
                   f"--metadata_server={self.master.metadata_server}", f"--host={self.host}",
                   f"--port={free_port()}", f"--global_segment_size={self.segment_bytes}", "--protocol=tcp"]
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                          stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and self._process.poll() is None:
            if self.master.metrics().get("master_total_capacity_bytes", 0) >= before + self.segment_bytes:
                return self
            time.sleep(0.1)
        tail = self._log_tail()
        self.stop()
        raise MooncakeUnavailableError(f"mooncake_client did not mount its {self.segment_bytes}-byte segment on "
                                       f"{self.master.master_address} within {self.start_timeout_s:.0f} s; its log "
                                       f"ends with:\n{tail}")

