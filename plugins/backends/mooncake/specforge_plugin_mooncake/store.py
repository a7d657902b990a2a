"""The ``mooncake`` feature store: one Mooncake Store object per sample generation.

Keys, under ``specforge/<namespace>/`` (``<digest>`` is the first 32 hex digits of the
sample id's sha256, so any sample id makes a safe key)::

    STORE                 format, version and sha256 of the token, written on first attach
    <digest>.<generation> the sample: a safetensors blob (see :mod:`.layout`)
    <digest>.head         which generation of the sample is current (sample id + generation)

Design, and why:

- **Objects are immutable.** A re-put writes a new key, so a reader can never see a
  half-replaced sample and a release of one generation can never delete another. (Mooncake's
  ``put`` of an existing key keeps the old value and reports success, another reason never
  to reuse a key.)
- **Generations** are ``max(microseconds since the epoch, head + 1, last one this process
  issued + 1)``, so they increase across processes. After the new object is stored the head
  is rewritten and older generations are deleted; a get of an older ref finds a newer head
  (or this process remembers the newer put) and raises :class:`StaleRefError`.
- **Read leases.** The master refuses (code -706) to delete an object for
  ``--default_kv_lease_ttl`` after any get of it, and a consume-once run releases right
  after its get. Such a deletion is *pending*: the sample counts as released at once (a get
  through this instance raises, ``stats`` no longer counts it) and the removal is retried on
  later calls and by ``close()``, which waits up to ``lease_wait_s``. Data objects are never
  force-deleted: the lease is what keeps another reader's transfer from reading memory that
  was freed and reused. Until the lease ends the bytes stay allocated, and another process
  that read the same generation can read it once more (a stale ref fails loudly everywhere
  once the old object is gone). The small head objects are force-deleted: a reader checks
  their content, and losing one only turns a later "stale" message into "not found".
  A read that outlasts its own lease (Mooncake's LEASE_EXPIRED: the object may have been
  freed under it) is made again whole, up to ``READ_ATTEMPTS`` times, then is an error that
  names the master's ``default_kv_lease_ttl`` flag; on a loaded machine a short lease is
  outlasted now and then.
- **Eviction.** With ``pin`` (the default) objects are hard-pinned, so a full cluster makes
  a put raise :class:`StoreFullError` (nothing stored is lost; the put stores nothing)
  instead of silently dropping samples a consumer still needs. Unpinned objects may be evicted; a get of one raises
  :class:`SampleNotFoundError` naming the sample and the key.
- **Checks.** A get fetches the whole object with one ``get_into`` into a fresh buffer sized
  from the ref, then checks header, exact size, identity and (``checksums``) xxh3-64 checksums before
  handing out tensors that are views into that buffer; anything else is
  :class:`CorruptFeatureError` naming the sample.
- **stats()** counts the samples this instance put or read that still exist in Mooncake
  (one ``batch_is_exist``), so a producer sees its samples disappear as a consumer on
  another node releases them.
- **One client per process** and connection settings, shared by its stores and kept after
  they close (see :func:`close_idle_clients`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable

import attrs
import torch

from specforge_core.contracts import SampleRef
from specforge_core.errors import CorruptFeatureError, FeatureStoreError, StoreFullError
from specforge_core.feature_stores.base import BaseFeatureStore, check_token, format_bytes, stale_error, token_hash

from . import layout
from .errors import MooncakeUnavailableError

if TYPE_CHECKING:
    from specforge_core.protocols import BuildContext

    from . import MooncakeStoreOptions

log = logging.getLogger(__name__)

# Mooncake error codes this store acts on (mooncake-store's ErrorCode).
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: no segment has room for the object
BUFFER_TOO_SMALL = -600  # INVALID_PARAMS, which get_into returns for a short buffer
NOT_FOUND = -704  # OBJECT_NOT_FOUND
LEASED = -706  # OBJECT_HAS_LEASE: read recently, the master refuses to delete it yet
LEASE_EXPIRED = -707  # the read's lease ran out before its transfer ended: the bytes may be torn
#: How many times a read whose lease ran out is made before that is an error. The master frees an
#: object only once no lease holds it, so a read that outlasts its lease may have copied freed memory;
#: it is made again whole (on a loaded machine one read in many outlasts a short lease).
READ_ATTEMPTS = 5
#: The room a head record is read into first (it is about 100 bytes; a longer one is read again).
_HEAD_ROOM = 512

_FORMAT = "specforge-mooncake-store"
_VERSION = 1
_HEAD_MAGIC = b"specforge-head/1\n"
_REMEMBERED = 65536  # sample ids whose latest generation this instance remembers
_RETRY_INTERVAL_S = 0.2  # between retries of pending deletions
#: How long a store attaching to a new namespace waits for the manifest another store is putting at the same
#: moment: the put takes milliseconds, and until it ends a get reads nothing.
MANIFEST_WAIT_S = 10.0


def key_prefix(namespace: str) -> str:
    """What every key of a namespace's objects starts with (its manifest, heads and data)."""
    return f"specforge/{namespace}/"


class MooncakeStore(BaseFeatureStore):
    """Feature tensors in Mooncake Store, shared by processes on any node that reach the master.

    Thread-safe: a producer thread may put while the training thread gets and releases.
    See the module docstring for keys, generations, leases and eviction.
    """

    def __init__(self, options: MooncakeStoreOptions, context: BuildContext) -> None:
        super().__init__(run_id=context.run_id, consume_once=options.consume_once)
        self.namespace = options.namespace or context.run_id
        if not self.namespace or "/" in self.namespace:
            raise FeatureStoreError(f"namespace must be a non-empty name without '/', got {self.namespace!r}")
        self.master_address = options.master_address
        self.uri = f"mooncake://{options.master_address}/{self.namespace}"
        self.checksums = options.checksums
        self.lease_wait_s = options.lease_wait_s
        self._prefix = key_prefix(self.namespace)
        self._latest: OrderedDict[str, int] = OrderedDict()  # sample id -> newest generation seen here
        self._known: dict[str, int] = {}  # data key -> object bytes, for samples put or read here
        self._prune_at = 4096
        self._pending: dict[str, float] = {}  # data key -> when its deletion was first refused
        self._next_retry = 0.0
        self._last_generation = 0
        #: Whether this process lends Mooncake memory: objects placed there vanish when it exits.
        self.lends_memory = options.global_segment_size > 0
        self._client_key, self._client = _acquire_client(options)
        try:
            self._config = _replicate_config(pin=options.pin)
            self._attach(options.token)
        except BaseException:
            _release_client(self._client_key)
            raise

    # -- keys -----------------------------------------------------------------------------

    def key_of(self, ref: SampleRef) -> str:
        """The Mooncake key of the object that holds (or held) ``ref``'s generation."""
        return self._data_key(ref.sample_id, ref.generation)

    def _digest(self, sample_id: str) -> str:
        return hashlib.sha256(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def _data_key(self, sample_id: str, generation: int) -> str:
        return f"{self._prefix}{self._digest(sample_id)}.{generation}"

    def _head_key(self, sample_id: str) -> str:
        return f"{self._prefix}{self._digest(sample_id)}.head"

    # -- hooks ----------------------------------------------------------------------------

    def _store(self, draft: SampleRef, tensors: dict[str, torch.Tensor]) -> SampleRef:
        self._retry_pending()
        sample_id = draft.sample_id
        head = self._read_head(sample_id)
        with self._lock:
            known = self._latest.get(sample_id, 0)
            generation = max(time.time_ns() // 1000, self._last_generation + 1, (head or 0) + 1, known + 1)
            self._last_generation = generation
        ref = attrs.evolve(draft, generation=generation)
        key = self._data_key(sample_id, generation)
        header, parts = layout.encode(sample_id, generation, {n: t.cpu() for n, t in tensors.items()},
                                      checksums=self.checksums)
        chunks = [header] + [part for part in parts if part.numel()]
        size = sum(chunk.numel() for chunk in chunks)
        code = self._client.batch_put_from_multi_buffers(
            [key], [[chunk.data_ptr() for chunk in chunks]], [[chunk.numel() for chunk in chunks]], self._config)[0]
        if code == NO_SPACE:
            raise StoreFullError(
                f"put({sample_id!r}) into {self.uri}: no Mooncake segment has room for {format_bytes(size)}; "
                "nothing was stored. Release consumed samples, shrink the producer's in-flight window, or lend "
                "more memory (global_segment_size on more processes)"
            )
        if code != 0:
            raise FeatureStoreError(f"put({sample_id!r}) into {self.uri} failed with Mooncake error {code} "
                                    f"(key {key}); nothing was stored")
        try:
            self._write_head(sample_id, generation)
        except BaseException:
            self._client.remove(key, True)  # ours, never read: nothing can hold a lease on it
            raise
        older = {g for g in (head, known or None) if g is not None and g < generation}
        with self._lock:
            self._remember(sample_id, generation)
            self._known[key] = size
        self._delete([self._data_key(sample_id, g) for g in older])
        if len(self._known) > self._prune_at:
            self._resident()
        return ref

    def _load(self, ref: SampleRef, names: list[str]) -> dict[str, torch.Tensor]:
        self._retry_pending()
        key = self._data_key(ref.sample_id, ref.generation)
        with self._lock:
            latest = self._latest.get(ref.sample_id, 0)
            pending = key in self._pending
        if latest > ref.generation:
            raise stale_error(ref, latest)
        if pending:
            raise self._not_found(ref)
        buffer, size = self._read(key, ref.nbytes + layout.header_room(ref.sample_id, ref.features))
        if size == NOT_FOUND:
            raise self._missing(ref, key)
        if size == LEASE_EXPIRED:
            raise FeatureStoreError(
                f"get of sample {ref.sample_id!r} (generation {ref.generation}) from {self.uri}: the read lease "
                f"ran out before the transfer ended, {READ_ATTEMPTS} times in a row (Mooncake error {size}, key "
                f"{key}); the sample is still stored. A read takes longer here than the master's read lease: start "
                "mooncake_master with a longer one (its default_kv_lease_ttl flag, in milliseconds)")
        if size < 0:
            raise FeatureStoreError(f"get of sample {ref.sample_id!r} (generation {ref.generation}) from {self.uri} "
                                    f"failed with Mooncake error {size} (key {key})")
        try:
            tensors = layout.decode(buffer, size, sample_id=ref.sample_id, generation=ref.generation,
                                    features=ref.features, names=names, verify=self.checksums)
        except layout.LayoutError as exc:
            raise CorruptFeatureError(
                f"sample {ref.sample_id!r} (generation {ref.generation}) in {self.uri}, object {key}: {exc}. "
                "The object is damaged or was not written by this store; abort the sample and capture it again"
            ) from None
        with self._lock:
            self._known[key] = size
            self._remember(ref.sample_id, ref.generation)  # a later get of an older ref is stale
        return tensors

    def _release(self, ref: SampleRef) -> bool:
        self._retry_pending()
        key = self._data_key(ref.sample_id, ref.generation)
        with self._lock:
            latest = self._latest.get(ref.sample_id, 0)
            if key in self._pending:
                return False
        if not self.consume_once:
            return latest <= ref.generation and self._client.is_exist(key) == 1
        existed = self._delete([key])
        head = self._read_head(ref.sample_id)
        if head == ref.generation:
            self._client.remove(self._head_key(ref.sample_id), True)
        return existed and latest <= ref.generation and (head is None or head <= ref.generation)

    def _drop(self, sample_id: str) -> bool:
        self._retry_pending()
        head = self._read_head(sample_id)
        digest_prefix = self._data_key(sample_id, 0)[:-1]
        with self._lock:
            generations = {self._latest.get(sample_id), head}
            keys = {key for key in self._known if key.startswith(digest_prefix)}
        keys |= {self._data_key(sample_id, g) for g in generations if g is not None}
        existed = self._delete(sorted(keys))
        if head is not None:
            self._client.remove(self._head_key(sample_id), True)
        return existed

    def _resident(self) -> tuple[int, int]:
        """Samples put or read through this instance that Mooncake still holds (one round trip)."""
        with self._lock:
            keys = list(self._known)
        exists = self._client.batch_is_exist(keys) if keys else []
        with self._lock:
            for key, code in zip(keys, exists):
                if code == 0:
                    self._known.pop(key, None)
            self._prune_at = max(4096, 2 * len(self._known))
            live = [size for key, size in self._known.items() if key not in self._pending]
        return len(live), sum(live)

    def stats(self) -> dict[str, int]:
        """The contract's counts, plus ``pending_deletions``: released or replaced objects
        the master has not let this instance delete yet (read leases)."""
        self._retry_pending()
        stats = super().stats()
        with self._lock:
            stats["pending_deletions"] = len(self._pending)
        return stats

    def destroy(self) -> int:
        """Delete every object of this namespace, its manifest included; how many there were.

        For the end of a stream, once no process reads the namespace any more: the deletion
        is forced (read leases protect transfers in flight, and there are none), and it also
        takes objects no ref names, such as a sample a killed producer stored but never
        published.
        """
        self._check_open("destroy")
        removed = self._client.remove_by_regex("^" + re.escape(self._prefix), True)
        if removed < 0:
            raise FeatureStoreError(f"deleting the objects of {self.uri} failed with Mooncake error {removed}")
        with self._lock:
            self._known.clear()
            self._pending.clear()
        return removed

    def _close(self) -> None:
        deadline = time.monotonic() + self.lease_wait_s
        while self._pending and time.monotonic() < deadline:
            self._retry_pending(now=True)
            if self._pending:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if self._pending:
            log.warning("%s: %d released objects were still under a read lease after %.1f s and stay in Mooncake "
                        "until deleted by hand (remove_by_regex on %r)", self.uri, len(self._pending),
                        self.lease_wait_s, self._prefix)
        _release_client(self._client_key)

    # -- deletions --------------------------------------------------------------------------

    def _delete(self, keys: Iterable[str]) -> bool:
        """Delete ``keys`` now, or mark the ones under a read lease pending; whether any existed."""
        with self._lock:  # a pending key was counted when it was first deleted
            keys = [key for key in keys if key not in self._pending]
        if not keys:
            return False
        codes = self._client.batch_remove(keys, False)
        existed = False
        with self._lock:
            for key, code in zip(keys, codes):
                if code == NOT_FOUND:
                    continue
                existed = True
                self._known.pop(key, None)
                if code != 0:
                    if code != LEASED:
                        log.warning("%s: deleting %s failed with Mooncake error %d; retrying later", self.uri, key,
                                    code)
                    self._pending.setdefault(key, time.monotonic())
        return existed

    def _retry_pending(self, now: bool = False) -> None:
        """Try the pending deletions again (at most every ``_RETRY_INTERVAL_S`` unless ``now``)."""
        with self._lock:
            if not self._pending or (not now and time.monotonic() < self._next_retry):
                return
            self._next_retry = time.monotonic() + _RETRY_INTERVAL_S
            keys = list(self._pending)
        codes = self._client.batch_remove(keys, False)
        with self._lock:
            for key, code in zip(keys, codes):
                if code in (0, NOT_FOUND):
                    self._pending.pop(key, None)

    # -- reads ------------------------------------------------------------------------------

    def _read(self, key: str, capacity: int) -> tuple[torch.Tensor, int]:
        """Object ``key`` read whole into a fresh buffer: ``(buffer, size)``, or a negative Mooncake code
        for the size. ``capacity`` is the room tried first; an object that does not fit is read again into
        a buffer of its size. A read whose lease ran out is made again, up to :data:`READ_ATTEMPTS` times."""
        for attempt in range(1, READ_ATTEMPTS + 1):
            buffer = torch.empty(capacity, dtype=torch.uint8)
            size = self._client.get_into(key, buffer.data_ptr(), capacity)
            if size == BUFFER_TOO_SMALL:  # e.g. a header larger than header_room: ask for the size
                needed = self._client.get_size(key)
                if needed > capacity:
                    capacity = needed
                    buffer = torch.empty(capacity, dtype=torch.uint8)
                    size = self._client.get_into(key, buffer.data_ptr(), capacity)
                elif needed < 0:
                    size = needed
            if size != LEASE_EXPIRED:
                break
            if attempt < READ_ATTEMPTS:
                log.info("%s: the read lease on %s ran out before its transfer ended; reading it again", self.uri,
                         key)
        return buffer, size

    # -- heads ------------------------------------------------------------------------------

    def _read_head(self, sample_id: str) -> int | None:
        """The current generation recorded for ``sample_id``, or None (no head, or an unreadable one)."""
        buffer, size = self._read(self._head_key(sample_id), _HEAD_ROOM)
        raw = buffer[:size].numpy().tobytes() if size > 0 else b""
        if not raw.startswith(_HEAD_MAGIC):
            return None
        try:
            head = json.loads(raw[len(_HEAD_MAGIC):])
            if head["sample_id"] == sample_id and type(head["generation"]) is int:
                return head["generation"]
        except (ValueError, KeyError, TypeError):
            pass
        return None

    def _write_head(self, sample_id: str, generation: int) -> None:
        body = _HEAD_MAGIC + json.dumps({"sample_id": sample_id, "generation": generation}).encode("utf-8")
        code = self._client.upsert(self._head_key(sample_id), body, self._config)
        if code == NO_SPACE:
            raise StoreFullError(f"put({sample_id!r}) into {self.uri}: no Mooncake segment has room for the "
                                 "sample's head record; nothing was stored. Release consumed samples or lend more "
                                 "memory (global_segment_size)")
        if code != 0:
            raise FeatureStoreError(f"put({sample_id!r}) into {self.uri}: writing its head record failed with "
                                    f"Mooncake error {code}; nothing was stored")

    # -- errors -----------------------------------------------------------------------------

    def _missing(self, ref: SampleRef, key: str) -> FeatureStoreError:
        head = self._read_head(ref.sample_id)
        with self._lock:
            latest = max(self._latest.get(ref.sample_id, 0), head or 0)
        if latest > ref.generation:
            return stale_error(ref, latest)
        return self._not_found(
            ref, f" (Mooncake has no object {key}; unless it was released or aborted, Mooncake evicted it, "
                 "which happens only with pin=False when segments fill, or the process whose segment held it "
                 "exited)")

    def _remember(self, sample_id: str, generation: int) -> None:
        self._latest[sample_id] = max(generation, self._latest.get(sample_id, 0))
        self._latest.move_to_end(sample_id)
        while len(self._latest) > _REMEMBERED:
            self._latest.popitem(last=False)

    # -- the namespace's manifest -----------------------------------------------------------

    def _attach(self, token: str | None) -> None:
        """Record the namespace's format and token hash on first use, or check the recorded ones."""
        key = f"{self._prefix}STORE"
        raw = self._client.get(key)
        if not raw:
            body = {"format": _FORMAT, "version": _VERSION, "token_sha256": token_hash(token)}
            code = self._client.put(key, json.dumps(body).encode("utf-8"), self._config)
            # Another store may have recorded it first, and theirs wins (a put of an existing key keeps the
            # object). A get of an object whose put is still under way reads nothing: wait for it.
            deadline = time.monotonic() + MANIFEST_WAIT_S
            while not (raw := self._client.get(key)) and time.monotonic() < deadline:
                time.sleep(0.01)
            if not raw:
                raise FeatureStoreError(f"cannot record the manifest of {self.uri}: the put returned Mooncake "
                                        f"code {code} and nothing was readable under {key} after "
                                        f"{MANIFEST_WAIT_S:g} s; check the master's log")
        try:
            info = json.loads(raw)
            if info.get("format") != _FORMAT:
                raise ValueError(f"format {info.get('format')!r}")
        except (ValueError, AttributeError) as exc:
            raise FeatureStoreError(f"{key} in {self.master_address} is not a specforge store manifest ({exc}); "
                                    "use another namespace") from None
        if info.get("version") != _VERSION:
            raise FeatureStoreError(f"namespace {self.namespace!r} was created by store version "
                                    f"{info.get('version')!r}, this plugin writes version {_VERSION}; "
                                    "use another namespace")
        check_token(info.get("token_sha256"), token, store=self.uri, place="namespace", fresh="another namespace")


def _replicate_config(*, pin: bool):
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = 1
    config.with_hard_pin = pin
    return config


# -- clients, shared per process ------------------------------------------------------------
#
# Stores of one process with the same connection settings share one Mooncake client. It
# stays up after its last store closes, until the process exits or close_idle_clients():
# objects placed in the segment a client lends vanish when it shuts down (a producer that
# closes its store must not take unconsumed samples with it), and a shutdown costs Mooncake
# one to two seconds.

_clients: dict[tuple, list] = {}  # settings -> [client, number of open stores using it]
_clients_lock = threading.Lock()


def _acquire_client(options: MooncakeStoreOptions) -> tuple[tuple, object]:
    key = (options.master_address, options.metadata_server, options.local_hostname, options.protocol,
           options.global_segment_size, options.local_buffer_size)
    with _clients_lock:
        entry = _clients.get(key)
        if entry is None:
            entry = _clients[key] = [_connect(options), 0]
        entry[1] += 1
        return key, entry[0]


def _release_client(key: tuple) -> None:
    with _clients_lock:
        _clients[key][1] -= 1


def close_idle_clients(master_address: str | None = None) -> int:
    """Shut down the Mooncake clients no open store uses (of one master, or all); how many.

    Their lent segments, and any objects placed there, leave the cluster. Call it before
    stopping a master, or to give the memory back without exiting the process.
    """
    with _clients_lock:
        idle = [key for key, (_client, users) in _clients.items()
                if users == 0 and master_address in (None, key[0])]
        clients = [_clients.pop(key)[0] for key in idle]
    for client in clients:
        client.close()
    return len(clients)


def _connect(options: MooncakeStoreOptions):
    """A set-up Mooncake client, or :class:`MooncakeUnavailableError` within ``connect_timeout_s``."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MooncakeUnavailableError(
            f"the Mooncake store client cannot be loaded ({exc}); install it with pip install "
            "mooncake-transfer-engine-non-cuda, and on Debian/Ubuntu apt-get install libibverbs1"
        ) from None
    # Mooncake's setup retries an unreachable master for about 90 s; a refused or silent
    # port is reported here, at once, naming the address.
    _check_reachable("Mooncake master", options.master_address, _host_port(options.master_address),
                     options.connect_timeout_s, "start one (mooncake_master --rpc_port PORT "
                     "--enable_http_metadata_server=true ...) or set feature_store.master_address")
    metadata = urllib.parse.urlsplit(options.metadata_server)
    if metadata.scheme in ("http", "https") and metadata.hostname:
        port = metadata.port or (443 if metadata.scheme == "https" else 80)
        _check_reachable("Mooncake metadata server", options.metadata_server, (metadata.hostname, port),
                         options.connect_timeout_s, "start the master with --enable_http_metadata_server=true "
                         "--http_metadata_server_port PORT, or set feature_store.metadata_server")
    client = MooncakeDistributedStore()
    code = client.setup(options.local_hostname, options.metadata_server, options.global_segment_size,
                        options.local_buffer_size, options.protocol, "", options.master_address)
    if code != 0:
        client.close()
        raise MooncakeUnavailableError(
            f"the Mooncake client could not join master {options.master_address} (metadata server "
            f"{options.metadata_server}, error {code}); check both addresses, that local_hostname "
            f"({options.local_hostname}) is reachable from other nodes, and that this machine can spare "
            f"global_segment_size + local_buffer_size ({format_bytes(options.global_segment_size + options.local_buffer_size)})"
        )
    return client


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise FeatureStoreError(f"master_address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _check_reachable(what: str, shown: str, address: tuple[str, int], timeout: float, hint: str) -> None:
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError as exc:
        raise MooncakeUnavailableError(f"cannot reach the {what} at {shown} ({exc}); {hint}") from None
