"""Ref channels: the stream of :class:`SampleRef` from a producer to its consumers.

Two implementations of one API:

* :class:`QueueChannel` — thread-safe, in-process (online colocated: capture thread ->
  trainer thread);
* :class:`FileChannel` — an append-only, fsynced JSONL file on a directory both sides can
  see (disaggregated producer and consumer processes, data-parallel consumers).

The API, the same for both (the feature loader and trainer call exactly this):

Producer side
    ``publish(refs)``
        Append refs, in order. Blocks first while the channel is paused by backpressure
        (see below). Raises :class:`ChannelClosedError` after ``close()`` or ``fail()`` (by
        either side) and :class:`RecordError` if an item is not a SampleRef (nothing of
        that batch is published).
    ``close()``
        End of stream. Consumers drain every ref published before it, then ``poll``
        returns ``[]`` and ``finished`` is True. Idempotent.
    ``fail(reason)``
        Abort the stream; either side may call it. Consumers are first handed the refs
        published *before* the failure (they were committed; training on them and acking
        them is correct, and exactly-once bookkeeping stays simple because nothing is
        skipped), then every ``poll`` raises :class:`ChannelFailedError` with the reason. A
        producer paused by backpressure stops waiting. The first of close/fail wins; later
        calls of either are no-ops.
    ``heartbeat()``
        Tell consumers the producer is alive although it has no ref yet (a long capture),
        which resets their idle clock.
    ``consumed()`` / ``backlog()``
        Refs the consumers reported consumed (summed over data-parallel ranks), and
        ``published - consumed``.
    ``wait_for_capacity(timeout=None) -> bool``
        What ``publish`` does first: if ``backlog() >= high_watermark`` wait until it falls
        to ``low_watermark`` (hysteresis, so the producer does not stutter at the mark).
        Returns False if ``timeout`` passed first; raises :class:`ChannelClosedError` if the
        channel was failed or closed meanwhile, and :class:`ChannelTimeoutError` if the
        consumers reported no progress for ``idle_timeout_s``. With ``high_watermark=None``
        it never waits. A single ``publish`` of k refs may overshoot the mark by k - 1.

Consumer side
    ``poll(max_n, timeout=None) -> list[SampleRef]``
        Up to ``max_n`` refs, in publish order. ``timeout=None`` waits until at least one
        ref arrives or the stream ends; ``timeout=t`` waits at most ``t`` seconds and may
        return ``[]``; ``timeout=0`` never waits. ``[]`` with ``finished`` True means the
        stream is closed and drained. If nothing at all (no ref, no heartbeat) arrives for
        ``idle_timeout_s`` of waiting, it raises :class:`ChannelTimeoutError` so a consumer
        never hangs on a producer that vanished; time the consumer spends training between
        polls does not count.
    ``report_consumed(n)``
        The consumer finished ``n`` more refs (report at the optimizer boundary, after the
        ack, so a restart cannot double count). This is what releases a paused producer:
        refs merely polled are still backlog.
    ``finished``
        True once the stream was closed and everything was handed out.

``detach()`` releases the handle's resources (file descriptors) without ending the
stream; a control plane's ``close()`` calls it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import threading
import time
import warnings
from collections import deque
from typing import Any, Iterable, Iterator

from ..contracts import SampleRef
from ..errors import (
    ChannelClosedError,
    ChannelCorruptError,
    ChannelFailedError,
    ChannelTimeoutError,
    ControlPlaneError,
    RecordError,
)
from ..fileio import atomic_write_text, fsync_dir
from .metadata import require_sample_refs

DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_POLL_INTERVAL_S = 0.05


class RefChannelBase:
    """The poll loop, backpressure and end-of-stream rules shared by every channel.

    Subclasses say how refs travel: ``_pull`` moves newly arrived records into
    ``_ready`` / ``_stream_end`` and reports whether anything arrived, ``_append_*`` write,
    ``consumed`` / ``_store_consumed`` keep the consumption counter, and ``_wait`` sleeps
    until something may have changed (a plugin's channel over a database waits for its
    notifications there). Channel plugins subclass it.
    """

    #: Longest single sleep of a waiting poll; the queue is woken by notify, the file is not.
    _max_sleep_s = math.inf

    def __init__(self, *, high_watermark: int | None = None, low_watermark: int | None = None,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S) -> None:
        if high_watermark is not None and high_watermark <= 0:
            raise ControlPlaneError(f"high_watermark must be > 0 or None (no backpressure), got {high_watermark}")
        if low_watermark is None:
            low_watermark = 0 if high_watermark is None else high_watermark // 2
        if high_watermark is not None and not 0 <= low_watermark < high_watermark:
            raise ControlPlaneError(f"low_watermark must be >= 0 and below high_watermark={high_watermark}, "
                                    f"got {low_watermark}")
        if idle_timeout_s <= 0 or poll_interval_s <= 0:
            raise ControlPlaneError("idle_timeout_s and poll_interval_s must be > 0, got "
                                    f"{idle_timeout_s} and {poll_interval_s}")
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.idle_timeout_s = idle_timeout_s
        self.poll_interval_s = poll_interval_s
        self._cond = threading.Condition()
        # consumer side
        self._ready: deque[SampleRef] = deque()
        self._stream_end: str | None = None  # "closed" or the failure reason, in stream order
        self._stream_failed = False
        self._corrupt: ChannelCorruptError | None = None
        self._idle_since: float | None = None
        self._finished = False
        self._delivered = 0  # this handle, this session
        self._reported = 0
        # producer side
        self._published = 0
        self._terminal: str | None = None  # why this channel no longer takes refs
        self._consumed_seen = 0  # a lower bound of consumed(), which only grows

    # ---- subclass interface ----------------------------------------------------------
    def _pull(self) -> bool:
        raise NotImplementedError

    def _append_refs(self, refs: list[SampleRef]) -> None:
        raise NotImplementedError

    def _append_end(self, failed: bool, reason: str) -> None:
        raise NotImplementedError

    def _append_heartbeat(self) -> None:
        raise NotImplementedError

    def _sync_producer(self) -> None:
        """Learn about a fail() by another process (FileChannel); nothing to do in-process."""

    def _wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` s or until woken (called holding ``_cond``, which it must release)."""
        self._cond.wait(timeout)

    def _store_consumed(self) -> None:
        raise NotImplementedError

    def consumed(self) -> int:
        raise NotImplementedError

    def _idle_message(self, waited: float) -> str:
        raise NotImplementedError

    def detach(self) -> None:
        """Release this handle's resources; the stream itself is not ended."""

    # ---- consumer side ----------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """True once the stream was closed and every ref was handed out."""
        return self._finished

    def poll(self, max_n: int, timeout: float | None = None) -> list[SampleRef]:
        """Up to ``max_n`` refs in publish order; see the module docstring for waiting rules."""
        if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < 1:
            raise ControlPlaneError(f"poll(max_n) needs an int >= 1, got {max_n!r}")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                # Read more only when short of refs, so a long backlog is not parsed all at once.
                if len(self._ready) < max_n and self._pull():
                    self._idle_since = None
                if self._ready:
                    out = [self._ready.popleft() for _ in range(min(max_n, len(self._ready)))]
                    self._delivered += len(out)
                    self._idle_since = None
                    return out
                # Errors and the end come after every ref that preceded them in the stream.
                if self._corrupt is not None:
                    raise self._corrupt
                if self._stream_end is not None:
                    if self._stream_failed:
                        raise ChannelFailedError(f"the ref channel was failed: {self._stream_end}")
                    self._finished = True
                    return []
                now = time.monotonic()
                if self._idle_since is None:
                    self._idle_since = now
                waited = now - self._idle_since
                if waited >= self.idle_timeout_s:
                    raise ChannelTimeoutError(self._idle_message(waited))
                if deadline is not None and now >= deadline:
                    return []
                sleep = min(self._max_sleep_s, self.idle_timeout_s - waited,
                            math.inf if deadline is None else deadline - now)
                self._wait(sleep)

    def report_consumed(self, n: int) -> None:
        """Count ``n`` more refs as finished by this consumer (releases a paused producer)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ControlPlaneError(f"report_consumed(n) needs an int >= 0, got {n!r}")
        with self._cond:
            if self._reported + n > self._delivered:
                raise ControlPlaneError(
                    f"report_consumed({n}) would report {self._reported + n} refs consumed, but this consumer "
                    f"was handed only {self._delivered} by poll(); report each polled ref once")
            self._reported += n
            self._store_consumed()
            self._cond.notify_all()

    # ---- producer side ----------------------------------------------------------------
    def _check_publishable(self) -> None:
        self._sync_producer()
        if self._terminal is not None:
            raise ChannelClosedError(f"cannot publish: the ref channel {self._terminal}. Open a new channel "
                                     "(a fresh directory for a file channel) for a new stream")

    def publish(self, refs: Iterable[SampleRef]) -> None:
        """Append ``refs`` in order, first waiting while paused by backpressure."""
        items = require_sample_refs(refs)
        with self._cond:
            self._check_publishable()
            if not items:
                return
            self._wait_for_capacity(None)
            self._append_refs(items)
            self._published += len(items)
            self._cond.notify_all()

    def backlog(self) -> int:
        """Refs published and not yet reported consumed."""
        return self._published - self.consumed()

    def wait_for_capacity(self, timeout: float | None = None) -> bool:
        """Wait while the backlog is at the high watermark; see the module docstring."""
        with self._cond:
            self._check_publishable()
            return self._wait_for_capacity(timeout)

    def _wait_for_capacity(self, timeout: float | None) -> bool:
        if self.high_watermark is None or self._published - self._consumed_seen < self.high_watermark:
            return True  # consumed() only grows, so the cached value suffices on the fast path
        consumed = self._consumed_seen = self.consumed()
        if self._published - consumed < self.high_watermark:
            return True
        start = progress_at = time.monotonic()
        while True:
            self._check_publishable()
            consumed = self.consumed()
            now = time.monotonic()
            if consumed != self._consumed_seen:
                self._consumed_seen, progress_at = consumed, now
            if self._published - consumed <= self.low_watermark:
                return True
            if now - progress_at >= self.idle_timeout_s:
                raise ChannelTimeoutError(
                    f"the producer waited {now - progress_at:.1f}s with {self._published - consumed} refs "
                    f"unconsumed (high_watermark={self.high_watermark}) and the consumers reported no progress: "
                    "are they running, and do they call report_consumed() after training on refs?")
            if timeout is not None and now - start >= timeout:
                return False
            remaining = math.inf if timeout is None else timeout - (now - start)
            self._wait(min(self.poll_interval_s, remaining, self.idle_timeout_s - (now - progress_at)))

    def heartbeat(self) -> None:
        """Reset the consumers' idle clock without publishing a ref."""
        with self._cond:
            self._check_publishable()
            self._append_heartbeat()
            self._cond.notify_all()

    def close(self) -> None:
        """End the stream after the refs published so far (idempotent)."""
        self._end(failed=False, reason="was closed")

    def fail(self, reason: str) -> None:
        """Abort the stream with ``reason`` (either side may call it; idempotent)."""
        self._end(failed=True, reason=str(reason))

    def _end(self, failed: bool, reason: str) -> None:
        with self._cond:
            self._sync_producer()
            if self._terminal is not None:
                return  # the first of close/fail wins
            self._terminal = f"was failed: {reason}" if failed else reason
            self._append_end(failed, reason)
            self._cond.notify_all()


class QueueChannel(RefChannelBase):
    """Thread-safe in-process ref channel (online colocated: producer thread -> trainer).

    One object is shared by both threads; see the module docstring for the API.
    ``high_watermark=None`` (the default) means no backpressure.
    """

    def _pull(self) -> bool:
        return False  # publish() puts refs straight into _ready and resets the idle clock

    def _append_refs(self, refs: list[SampleRef]) -> None:
        self._ready.extend(refs)
        self._idle_since = None

    def _append_end(self, failed: bool, reason: str) -> None:
        self._stream_end, self._stream_failed = reason, failed

    def _append_heartbeat(self) -> None:
        self._idle_since = None

    def _store_consumed(self) -> None:
        pass  # _reported is the counter

    def consumed(self) -> int:
        return self._reported

    def _idle_message(self, waited: float) -> str:
        return (f"no ref or heartbeat from the producer thread for {waited:.1f}s "
                f"(idle_timeout_s={self.idle_timeout_s}): it may have died without calling fail() (look for its "
                "traceback) or be paused because consumption is not reported with report_consumed(). "
                "Call heartbeat() from the producer during long captures, or raise idle_timeout_s.")


REFS_FILE = "refs.jsonl"
_REF_PREFIX = b'{"kind":"ref",'


class _JsonlTail:
    """Reads a growing file from a remembered offset and hands out its complete lines.

    The offset is the end of the last complete line, so each read costs only the bytes
    appended since. A trailing line without its newline is a record still being written:
    it is never parsed and not consumed, and it is read again from its start once more
    bytes arrive. It is re-read rather than kept in memory because a restarted producer
    cuts off the torn record its crashed predecessor left, and the bytes at that offset
    then belong to a new record: spliced onto held-back old bytes they would make garbage.
    ``bytes_read`` counts what was read, for tests and benchmarks.
    """

    def __init__(self, path: str, chunk_bytes: int = 1 << 20) -> None:
        self.path = path
        self.chunk_bytes = chunk_bytes  # bounds memory when a consumer starts on a long file
        self.line_no = 0  # number of complete lines handed out
        self.bytes_read = 0
        self._fd: int | None = None
        self._offset = 0  # end of the last complete line
        self._stalled_at = -1  # file size when only a partial line was left, so it is not re-read

    def read_lines(self) -> list[tuple[int, bytes]]:
        """The next complete lines with their 1-based numbers (about ``chunk_bytes`` at most)."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return []  # the producer has not created it yet
        size = os.fstat(self._fd).st_size
        if size < self._offset:
            raise ChannelCorruptError(f"{self.path} shrank below the {self._offset} bytes already read; the "
                                      "channel file was truncated or replaced, which is never done to a live "
                                      "stream. Start the run again on a fresh directory.")
        available = size - self._offset
        if available == 0 or size == self._stalled_at:
            return []
        want = min(available, self.chunk_bytes)
        while True:
            data = os.pread(self._fd, want, self._offset)
            self.bytes_read += len(data)
            end = data.rfind(b"\n")
            if end >= 0 or want >= available:
                break
            want = min(available, want * 2)  # one line longer than a chunk
        if end < 0:
            self._stalled_at = size
            return []
        self._offset += end + 1
        first, lines = self.line_no + 1, data[:end].split(b"\n")
        self.line_no += len(lines)
        return list(enumerate(lines, first))

    def read_all(self) -> Iterator[tuple[int, bytes]]:
        """Every complete line not read yet, chunk by chunk."""
        while lines := self.read_lines():
            yield from lines

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _decode(line: bytes, path: str, line_no: int) -> dict:
    """Parse one channel line, or raise :class:`ChannelCorruptError` naming file and line."""
    where = f"{path}:{line_no}"
    try:
        record = json.loads(line)
    except ValueError as exc:
        record, problem = None, f"not JSON ({exc})"
    else:
        kind = record.get("kind") if isinstance(record, dict) else None
        problem = None if kind in ("ref", "close", "fail", "heartbeat") else f"unknown record {line[:80]!r}"
    if problem is None and record["kind"] == "ref":
        try:
            record["ref"] = SampleRef.from_dict(record["ref"])
        except (KeyError, TypeError, AttributeError, RecordError) as exc:
            problem = f"bad ref record ({exc})"
    if problem is not None:
        raise ChannelCorruptError(
            f"{where}: {problem}. The ref channel file is corrupt (only specforge appends to it); refs before "
            "this line were delivered. Restart the producer on a fresh channel directory; reconcile() of the "
            "metadata store tells which samples are still pending.")
    return record


def _write_all(fd: int, data: bytes) -> None:
    # One write() per batch: with O_APPEND, Linux places it whole at the end, so a
    # consumer's fail line can never land inside the producer's records.
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class RestartableChannel(RefChannelBase):
    """A channel whose consumers can restart: they skip acked ids and restate their consumed count.

    Subclasses keep ``_consumed_base`` (this rank's count from before the restart) in
    ``_store_consumed`` and drop ids in ``_skip`` when they pull refs. A handle has a
    ``role`` (``"producer"`` publishes, ``"consumer"`` polls its ``shard=(rank, world_size)``,
    ``"both"`` does both) and names itself in errors by :attr:`where`.
    """

    def __init__(self, *, role: str = "both", shard: tuple[int, int] = (0, 1), **channel_options: Any) -> None:
        super().__init__(**channel_options)
        if role not in ("producer", "consumer", "both"):
            raise ControlPlaneError(f"channel role must be 'producer', 'consumer' or 'both', got {role!r}")
        rank, world_size = shard
        if not 0 <= rank < world_size:
            raise ControlPlaneError(f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard}")
        self.role = role
        self.rank, self.world_size = rank, world_size
        self._skip: set[str] = set()
        self._consumed_base = 0

    @property
    def where(self) -> str:
        """This channel, as errors name it."""
        return type(self).__name__

    def _check_publishable(self) -> None:
        if self.role == "consumer":
            raise ControlPlaneError(f"this handle of {self.where} was opened with role='consumer'; open it with "
                                    "role='producer' to publish, heartbeat or wait for capacity")
        super()._check_publishable()

    def reset_consumed(self, count: int) -> None:
        """Set this rank's consumed count to ``count`` (a restarted consumer whose earlier
        reports included samples it must train again)."""
        with self._cond:
            self._consumed_base, self._reported, self._delivered = count, 0, 0
            self._store_consumed()
            self._cond.notify_all()

    def skip(self, sample_ids: Iterable[str]) -> None:
        """Never hand out refs with these sample ids (already acked before a restart)."""
        with self._cond:
            self._skip.update(sample_ids)


class FileChannel(RestartableChannel):
    """A ref channel in a shared directory: ``refs.jsonl`` plus one consumed file per rank.

    Each line of ``refs.jsonl`` is one record: ``{"kind":"ref","ref":{...}}``,
    ``{"kind":"heartbeat"}``, ``{"kind":"close"}`` or ``{"kind":"fail","reason":...}``.
    ``publish`` appends with one write and fsyncs before returning, so a published ref
    survives a crash of either side. ``poll`` reads only the bytes appended since its last
    read (the cost does not grow with the file), never parses a half-written trailing line
    (see :class:`_JsonlTail`), and a garbage line raises :class:`ChannelCorruptError`
    naming the file and 1-based line.

    ``role``: ``"producer"`` (creates the directory, recovers a torn tail left by a crashed
    producer, counts what is already published), ``"consumer"`` (reads only; never truncates)
    or ``"both"`` (one process doing both, e.g. tests). One producer per directory.

    ``shard=(rank, world_size)``: this consumer is handed only the ref records whose index
    in the file satisfies ``index % world_size == rank``, so data-parallel ranks get
    disjoint samples that together are the whole stream. Close, fail and heartbeats reach
    every rank. Each rank writes its own ``consumed.<rank>.json`` (atomically: temp file +
    rename) and the producer's ``consumed()`` is their sum.

    ``read_chunk_bytes`` bounds how much one poll reads (and parses) when the consumer is
    far behind, e.g. a restart re-reading a long file.

    ``skip(sample_ids)`` drops refs with those ids (a restarted consumer skips what the
    metadata store says is acked; see ``SqliteControlPlane.resume_consumer``).
    """

    def __init__(self, path: str, *, role: str = "both", shard: tuple[int, int] = (0, 1), fsync: bool = True,
                 high_watermark: int | None = None, low_watermark: int | None = None,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 skip_ids: Iterable[str] = (), read_chunk_bytes: int = 1 << 20) -> None:
        super().__init__(role=role, shard=shard, high_watermark=high_watermark, low_watermark=low_watermark,
                         idle_timeout_s=idle_timeout_s, poll_interval_s=poll_interval_s)
        self.path = os.path.abspath(path)
        self.refs_path = os.path.join(self.path, REFS_FILE)
        self.fsync = fsync
        self._max_sleep_s = poll_interval_s
        self._skip.update(skip_ids)
        self._read_chunk_bytes = read_chunk_bytes
        self._tail = _JsonlTail(self.refs_path, read_chunk_bytes)  # the consumer's view
        self._ref_index = 0  # index of the next ref record in the file, over all shards
        self._write_fd: int | None = None
        self._producer_tail: _JsonlTail | None = None  # the producer's view: counts refs, sees fail lines
        consumed_path = os.path.join(self.path, f"consumed.{self.rank}.json")
        self._consumed_path = consumed_path
        self._consumed_base = self._load_consumed(consumed_path) if role != "producer" else 0
        if role != "consumer":
            self._open_producer()

    # ---- producer ----------------------------------------------------------------------
    def _open_producer(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        created = not os.path.exists(self.refs_path)
        self._write_fd = os.open(self.refs_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        if created and self.fsync:
            fsync_dir(self.path)
        self._recover_torn_tail()
        self._producer_tail = _JsonlTail(self.refs_path, self._read_chunk_bytes)
        self._sync_producer(count_own_refs=True)

    def _recover_torn_tail(self) -> None:
        """Cut off a record a crashed producer left half-written (never delivered: no newline)."""
        size = os.fstat(self._write_fd).st_size
        if size == 0 or os.pread(self._write_fd, 1, size - 1) == b"\n":
            return
        start = max(0, size - (1 << 20))
        cut = os.pread(self._write_fd, size - start, start).rfind(b"\n")
        if cut < 0 and start > 0:
            raise ChannelCorruptError(f"{self.refs_path} ends with a line over 1 MiB without a newline; this is not "
                                      "a ref channel file. Use a fresh directory.")
        keep = start + cut + 1
        warnings.warn(f"{self.refs_path}: dropping {size - keep} bytes of a record a crashed producer left "
                      "half-written (it was never delivered)", RuntimeWarning, stacklevel=3)
        os.truncate(self.refs_path, keep)

    def _sync_producer(self, count_own_refs: bool = False) -> None:
        """Read what was appended since the last look: a fail() by a consumer, or (at open) the
        refs and the end record an earlier producer left."""
        tail = self._producer_tail
        if tail is None:
            return
        for line_no, line in tail.read_all():
            if line.startswith(_REF_PREFIX):
                # Our own refs were counted when published; only an earlier producer's are new.
                self._published += int(count_own_refs)
                continue
            record = _decode(line, tail.path, line_no)
            if record["kind"] == "ref":
                self._published += 1
            elif record["kind"] != "heartbeat" and self._terminal is None:
                self._terminal = ("was closed" if record["kind"] == "close"
                                  else f"was failed: {record.get('reason')}")

    @property
    def where(self) -> str:
        return self.refs_path

    def _write(self, data: bytes, durable: bool) -> None:
        if self._write_fd is None:
            if self.role == "consumer" and not os.path.isdir(self.path):
                raise ControlPlaneError(f"channel directory {self.path} does not exist; is this the directory the "
                                        "producer writes to?")
            self._write_fd = os.open(self.refs_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _write_all(self._write_fd, data)
        if durable and self.fsync:
            os.fsync(self._write_fd)

    def _append_refs(self, refs: list[SampleRef]) -> None:
        data = "".join(f'{{"kind":"ref","ref":{ref.to_json()}}}\n' for ref in refs).encode()
        self._write(data, durable=True)

    def _append_end(self, failed: bool, reason: str) -> None:
        record = {"kind": "fail", "reason": reason} if failed else {"kind": "close"}
        self._write((json.dumps(record) + "\n").encode(), durable=True)

    def _append_heartbeat(self) -> None:
        # Not fsynced: a heartbeat lost in a crash only matters to a producer that is gone.
        self._write(json.dumps({"kind": "heartbeat", "t": time.time()}).encode() + b"\n", durable=False)

    def _ref_ids(self) -> Iterator[str]:
        """The sample id of every ref record in the file, in order (a full read; for restarts only)."""
        reader = _JsonlTail(self.refs_path, self._read_chunk_bytes)
        try:
            for line_no, line in reader.read_all():
                record = _decode(line, reader.path, line_no)
                if record["kind"] == "ref":
                    yield record["ref"].sample_id
        finally:
            reader.close()

    def published_sample_ids(self) -> set[str]:
        """Every sample id with a ref record in the file."""
        return set(self._ref_ids())

    def shard_sample_ids(self) -> list[str]:
        """The sample ids of this consumer's shard, in file order."""
        return [sid for index, sid in enumerate(self._ref_ids()) if index % self.world_size == self.rank]

    # ---- consumer ----------------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        """Bytes of ``refs.jsonl`` this consumer has read so far."""
        return self._tail.bytes_read

    def _pull(self) -> bool:
        if self._corrupt is not None or self._stream_end is not None:
            return False
        lines = self._tail.read_lines()
        for line_no, line in lines:
            try:
                record = _decode(line, self._tail.path, line_no)
            except ChannelCorruptError as exc:
                self._corrupt = exc  # raised by poll after the refs before it are handed out
                break
            kind = record["kind"]
            if kind == "ref":
                index, self._ref_index = self._ref_index, self._ref_index + 1
                ref = record["ref"]
                if index % self.world_size == self.rank and ref.sample_id not in self._skip:
                    self._ready.append(ref)
            elif kind in ("close", "fail"):
                self._stream_end = "closed" if kind == "close" else str(record.get("reason"))
                self._stream_failed = kind == "fail"
                break  # nothing after the end of the stream counts
        return bool(lines)

    def _load_consumed(self, path: str) -> int:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            return 0
        try:
            value = json.loads(text)["consumed"]
            if isinstance(value, int) and value >= 0:
                return value
        except (ValueError, KeyError, TypeError):
            pass
        raise ChannelCorruptError(f"{path} does not hold a consumed count ({text[:80]!r}); it is written only by "
                                  "specforge. Delete it to restart the count at 0 (backpressure is then loose "
                                  "until the consumer reports again).")

    def _store_consumed(self) -> None:
        # tmp + rename: the producer reads the old count or the new one, never half a file.
        record = json.dumps({"consumed": self._consumed_base + self._reported, "rank": self.rank})
        atomic_write_text(self._consumed_path, record, fsync=self.fsync)

    def consumed(self) -> int:
        """Refs reported consumed by every rank (sum of the ``consumed.<rank>.json`` files)."""
        total = 0
        for path in glob.glob(os.path.join(glob.escape(self.path), "consumed.*.json")):
            total += self._load_consumed(path)
        return total

    def _idle_message(self, waited: float) -> str:
        missing = "" if os.path.exists(self.refs_path) else f" ({REFS_FILE} does not exist yet)"
        return (f"no new record in {self.refs_path}{missing} for {waited:.1f}s (idle_timeout_s={self.idle_timeout_s}): "
                "is the producer running and writing to this directory? If it is paused by backpressure, the "
                "consumers are not calling report_consumed(). A producer busy with long captures should call "
                "heartbeat(); otherwise raise idle_timeout_s.")

    def detach(self) -> None:
        with self._cond:
            self._tail.close()
            if self._producer_tail is not None:
                self._producer_tail.close()
            if self._write_fd is not None:
                os.close(self._write_fd)
                self._write_fd = None
