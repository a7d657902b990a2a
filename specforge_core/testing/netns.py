"""Two hosts on one machine: network namespaces joined by a veth pair (needs root and ``ip``).

::

    with TwoHosts() as hosts:
        a, b = hosts.a, hosts.b                  # each: .namespace, .address, .prefix
        subprocess.run([*b.prefix, "ping", "-c1", a.address])

Each side has a network stack of its own (its own loopback, its own ports) and reaches
the other only over the veth pair, at an address on a private test subnet taken from
10.231.0.0/16 with a random third octet. Nothing is routed to or from any other network.
``stop()`` (or leaving the ``with`` block) deletes both namespaces, which removes the veth
pair with them; stop the processes started inside first (a namespace lives on while a
process holds it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from typing import Any

import attrs


def netns_unavailable() -> str | None:
    """Why two network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, as CI does"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"sfprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"ip netns add failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


@attrs.frozen
class Host:
    """One side: its namespace, its address on the test subnet, and the command prefix that runs
    inside it. :data:`LOOPBACK` is this machine's own stack (no namespace, no prefix)."""

    namespace: str | None
    address: str

    @property
    def prefix(self) -> tuple[str, ...]:
        return () if self.namespace is None else ("ip", "netns", "exec", self.namespace)


LOOPBACK = Host(None, "127.0.0.1")


class TwoHosts:
    """Hosts ``a`` and ``b`` (see the module docstring)."""

    def __init__(self) -> None:
        token = secrets.token_hex(3)
        octet = secrets.randbelow(256)
        self.subnet = f"10.231.{octet}.0/24"
        self.a = Host(f"sf-{token}-a", f"10.231.{octet}.1")
        self.b = Host(f"sf-{token}-b", f"10.231.{octet}.2")
        self._veth = (f"sf{token}a", f"sf{token}b")  # interface names: 15 characters at most
        self._made: list[str] = []

    def start(self) -> TwoHosts:
        try:
            for host in (self.a, self.b):
                _ip("netns", "add", host.namespace)
                self._made.append(host.namespace)
            _ip("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
            for host, device in zip((self.a, self.b), self._veth):
                _ip("link", "set", device, "netns", host.namespace)
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", device)
                _ip("-n", host.namespace, "link", "set", device, "up")
                _ip("-n", host.namespace, "link", "set", "lo", "up")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Delete the namespaces (and with them the veth pair); safe to call twice."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True, check=False)
        # A veth whose namespace move failed is still here; it goes with its name.
        subprocess.run(["ip", "link", "del", self._veth[0]], capture_output=True, check=False)

    def __enter__(self) -> TwoHosts:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
