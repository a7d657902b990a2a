"""A ``mooncake_master`` on loopback, started and stopped by Python: for tests and benchmarks.

::

    with LocalMaster(lease_ttl_ms=500) as master:
        store = MooncakeStore(master.options(namespace="demo"), BuildContext())

Every socket it opens (RPC, HTTP metadata server, metrics) binds 127.0.0.1 on a free port.
Production runs start their master themselves (see the plugin's README).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .errors import MooncakeUnavailableError


def master_binary() -> str:
    """Path of the ``mooncake_master`` executable shipped with the mooncake wheel."""
    try:
        import mooncake
    except ImportError as exc:
        raise MooncakeUnavailableError(
            f"the mooncake package is not installed ({exc}); pip install mooncake-transfer-engine-non-cuda"
        ) from None
    shipped = Path(mooncake.__file__).parent / "mooncake_master"
    if shipped.is_file() and os.access(shipped, os.X_OK):
        return str(shipped)
    on_path = shutil.which("mooncake_master")
    if on_path is None:
        raise MooncakeUnavailableError(f"no mooncake_master next to {mooncake.__file__} nor on PATH")
    return on_path


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


class LocalMaster:
    """One ``mooncake_master`` process with its HTTP metadata server, on 127.0.0.1.

    ``lease_ttl_ms`` is the read lease (``--default_kv_lease_ttl``): how long after a get
    the master refuses to delete the object. ``extra_flags`` go to the command line as is.
    ``stop()`` (or leaving the ``with`` block) terminates it, killing it if it lingers.
    """

    def __init__(self, *, lease_ttl_ms: int = 10_000, extra_flags: tuple[str, ...] = (),
                 start_timeout_s: float = 30.0) -> None:
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_flags = tuple(extra_flags)
        self.start_timeout_s = start_timeout_s
        self.rpc_port = self.http_port = 0
        self._process: subprocess.Popen | None = None
        self._log: Any = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def options(self, **overrides: Any) -> Any:
        """:class:`MooncakeStoreOptions` pointing at this master (plus ``overrides``)."""
        from . import MooncakeStoreOptions

        return MooncakeStoreOptions(master_address=self.master_address, metadata_server=self.metadata_server,
                                    **overrides)

    def start(self) -> LocalMaster:
        binary = master_binary()
        for _attempt in range(3):  # a free port can be taken between probe and bind: try others
            self.rpc_port, self.http_port = free_port(), free_port()
            self._log = tempfile.TemporaryFile(prefix="mooncake-master-")
            command = [
                binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}", *self.extra_flags,
            ]
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                              stderr=subprocess.STDOUT)
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and self._process.poll() is None:
                if accepts("127.0.0.1", self.rpc_port) and accepts("127.0.0.1", self.http_port):
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

    def stop(self) -> None:
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

    def __enter__(self) -> LocalMaster:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()
