"""What both sides of a disaggregated stream share: its record, markers, locks, control plane and store.

Both kinds of stream have one interface (``control``, ``where``, ``hold``,
``wait_for_record``, ``consumer_features``, ``end``, ``close``): :class:`DirectoryStream`
here, and :class:`~.networked.NetworkedStream` for hosts that share no directory;
:func:`.state.open_stream` picks the one a plan asks for. The checks that producer and
consumer agree (:func:`check_same_stream`, :func:`check_consumer_fits`) serve both.

A directory stream lives in a features directory ``DIR`` that the producer and its
consumers share (on one host: the sqlite control plane's WAL needs local locks and shared
memory)::

    DIR/manifest.json               a features directory (see :mod:`specforge_core.features`),
    DIR/frozen_parts.safetensors    plus a ``stream`` record the consumer waits for: sample
    DIR/token_counts.safetensors    counts, the stream's contract (see stream_contract) and the
                                    target engine's suggested train options
    DIR/store/                      the disk store: eval samples (kept) and, unless the run
                                    names another cross-process feature store (mooncake),
                                    the training stream (deleted once a consumer checkpoint
                                    covers them)
    DIR/control/                    the sqlite control plane: metadata.sqlite (commits, acks
                                    with their global step) and refs.jsonl (the ref channel)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from ...config import RunPlan, data_contract
from ...errors import SpecforgeError
from ...options import options_to_dict
from ...protocols import BuildContext

CONTROL_DIR = "control"
STREAM_KEY = "stream"
#: Control-plane markers: the highest step whose samples a consumer deleted after a checkpoint
#: covered them, and the step a consumer finished training at.
RELEASED_MARKER = "stream.released_through_step"
FINISHED_MARKER = "stream.consumer_finished"


class StreamError(SpecforgeError):
    """A disaggregated stream cannot be produced or consumed as asked."""


def stream_contract(plan: RunPlan) -> dict[str, Any]:
    """Every setting that changes a stream's samples or their order, as ``section.key`` -> value.

    The producer records it in the stream; a consumer (and a restarted producer) must bring
    the same: the strategy and its options, the data and how it is prepared, the epochs and
    the seed of the epoch order. Data paths are made absolute, so that two processes started
    in different directories compare the files they read.
    """
    contract: dict[str, Any] = {"strategy": plan["strategy"].spec.name}
    contract.update({f"strategy.{key}": value for key, value in options_to_dict(plan["strategy"].options).items()})
    contract.update({f"data.{key}": value for key, value in data_contract(plan.data).items()})
    contract.update({"train.epochs": plan.train.epochs, "train.seed": plan.train.seed})
    return contract



#: What to do about a stream of other settings, by mode: a directory stream, a networked one.
DIRECTORY_REMEDY = "stream into a new --features directory"
NETWORKED_REMEDY = "use another control_plane.schema for a stream of other settings"


def check_stream_contract(streamed: dict[str, Any], mine: dict[str, Any], *, features: str, side: str,
                          remedy: str = DIRECTORY_REMEDY) -> None:
    """Refuse, naming the field, when ``mine`` differs from what the stream in ``features`` records.

    ``streamed`` is the stream record (or a networked stream's manifest); ``mine`` this side's
    (a producer's holds the sample counts it prepared too). Every key of ``mine`` must match.
    """
    for key in sorted(mine):
        theirs, ours = streamed.get(key), mine[key]
        if theirs == ours:
            continue
        if key == "strategy":
            setting = f"--strategy {theirs}"
        elif "." in key:
            setting = f"--set {key}={theirs if isinstance(theirs, str) else json.dumps(theirs)}"
        elif key in ("train_samples", "eval_samples"):  # a count the data gives: the data file itself changed
            setting = "the same data files"
        else:
            setting = "the same target and strategy options"
        if side == "producer":
            raise StreamError(f"{features} already streams with {key}={theirs!r}, but this producer has "
                              f"{key}={ours!r} ({key} differs). A stream cannot change under its consumers: restart "
                              f"the producer with the stream's settings ({setting}), or {remedy}")
        if key == "strategy":
            raise StreamError(f"the producer streams features for strategy {theirs!r} into {features}, but this "
                              f"{side} runs strategy {ours!r} (field strategy); start it with {setting}, or {remedy}")
        raise StreamError(f"the producer streams into {features} with {key}={theirs!r}, but this {side} has "
                          f"{key}={ours!r}; a consumer trains exactly what is streamed: start it with the stream's "
                          f"settings ({setting}), or {remedy}")


def stream_control(plan: RunPlan, context: BuildContext) -> Any:
    """The sqlite control plane in ``FEATURES/control`` (or its ``path`` option), opened in ``context.role``."""
    from ...control_planes.sqlite import SqliteControlPlane

    options = plan["control_plane"].options
    if options.path is None:
        options = attrs.evolve(options, path=os.path.join(str(plan.features), CONTROL_DIR))
    return SqliteControlPlane(options, context)


def hold_lock(path: str, holder: str) -> int:
    """Take the exclusive lock file ``path`` for this process (released when it exits); its fd.

    Two producers of one stream would capture and put the same samples twice, and two
    consumer groups would train them twice: each side holds a lock for as long as it runs.
    """
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StreamError(f"another {holder} is running on this stream (it holds {path}); one runs at a time. "
                          "Stop it first, or use another --features directory for another run") from None
    return fd


def stream_id(features: str | os.PathLike[str]) -> str:
    """The name both sides of a stream agree on without being told: from the shared directory."""
    import hashlib

    return "stream-" + hashlib.sha256(os.path.realpath(features).encode()).hexdigest()[:16]


def stream_store(plan: RunPlan, context: BuildContext) -> Any | None:
    """The plan's own feature store for the training stream (e.g. ``mooncake``), or None for
    ``disk``: then the stream goes through the features directory's store, ``DIR/store``.

    The store is built with the stream's id as its run id, so a store that names its data
    after the run (Mooncake's default namespace) keeps two streams on one server apart.
    """
    from ...components import build_component

    if plan["feature_store"].spec.name == "disk":
        return None
    assert plan.features is not None
    return build_component(plan, "feature_store", attrs.evolve(context, run_id=stream_id(plan.features)))


def read_stream_record(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``stream`` record of a features directory's manifest, or None before a producer wrote it."""
    from ...features import MANIFEST

    try:
        manifest = json.loads((Path(root) / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    record = manifest.get(STREAM_KEY)
    return record if isinstance(record, dict) else None


def write_stream_record(root: Path, record: dict[str, Any]) -> None:
    """Add the ``stream`` record to the manifest: from now on consumers may start."""
    from ...features import MANIFEST
    from ...fileio import atomic_write_text

    manifest = json.loads((root / MANIFEST).read_text())
    manifest[STREAM_KEY] = record
    atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))


def stream_record(plan: RunPlan, samples: list[Any], eval_samples: list[Any]) -> dict[str, Any]:
    """What a producer streams, which every producer and consumer of the stream must agree on: the
    :func:`stream_contract`, the sample counts the data gave, and the engine's suggested train
    defaults (the consumer has no target engine: it applies them from here)."""
    from ...config import engine_train_suggestions

    return {**stream_contract(plan), "train_samples": len(samples), "eval_samples": len(eval_samples),
            "suggested_train_options": engine_train_suggestions(plan)}


def check_same_stream(previous: dict[str, Any] | None, record: dict[str, Any], where: str,
                      remedy: str = DIRECTORY_REMEDY) -> None:
    """Refuse a producer whose stream differs from the one ``where`` already streams, naming the field."""
    if previous is not None:
        check_stream_contract(previous, record, features=where, side="producer", remedy=remedy)


def check_consumer_fits(plan: RunPlan, record: dict[str, Any], where: str, remedy: str = DIRECTORY_REMEDY) -> None:
    """Refuse a consumer that would train something else than the stream ``where`` carries, naming the
    field (another strategy or its options, other data, epochs or seed).

    A consumer that names no data file trains the stream's (on another host the producer's
    paths mean nothing); one that names them must name the producer's.
    """
    mine = {key: value for key, value in stream_contract(plan).items()
            if not (key in ("data.path", "data.eval_path") and value is None)}
    check_stream_contract(record, mine, features=where, side="consumer", remedy=remedy)


def wait_for(read: Callable[[], Any], wait_s: float, waiting: str, failure: str) -> Any:
    """``read()``'s first value that is not None, polling for up to ``wait_s`` s (saying
    ``waiting`` once on stderr); after that, :class:`StreamError` with ``failure``, whose
    ``{within}`` says how long was waited."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        value = read()
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise StreamError(failure.replace("{within}", f"within {wait_s:g}s (control_plane.idle_timeout_s)"))
        if not told:
            print(f"waiting: {waiting} ...", file=sys.stderr, flush=True)
            told = True
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def wait_for_stream(root: str, wait_s: float) -> dict[str, Any]:
    """The producer's stream record, waiting up to ``wait_s`` for a producer to write it."""
    return wait_for(lambda: read_stream_record(root), wait_s, f"for a producer to stream into {root}",
                    f"no producer started a stream in {root} {{within}}: start `specforge run --role producer "
                    f"--features {root}` with the same strategy and data, or point --features at the directory it "
                    "writes")


class DirectoryStream:
    """The shared state of a stream in a features directory (one host; see the module docstring).

    The control plane is the sqlite one in ``DIR/control``, exclusive roles hold lock files
    there, the stream record is in the manifest. :class:`.networked.NetworkedStream` has the
    same interface for hosts that share no directory; :func:`.state.open_stream` picks one.
    """

    def __init__(self, plan: RunPlan, context: BuildContext) -> None:
        assert plan.features is not None
        self.plan, self.context = plan, context
        self.root = str(plan.features)
        self.where = self.root
        self.remedy = DIRECTORY_REMEDY  # what to do about a stream of other settings
        self._control: Any = None
        self._locks: list[int] = []

    @property
    def control(self) -> Any:
        """The stream's control plane, opened on first use."""
        if self._control is None:
            self._control = stream_control(self.plan, self.context)
        return self._control

    def hold(self, name: str, what: str, wait_s: float | None = None) -> None:
        """Be the one ``what`` of the stream (lock file ``control/NAME.lock``) until :meth:`close`.

        ``wait_s`` is unused: a lock file is free as soon as its holder exits, however it died.
        """
        self._locks.append(hold_lock(os.path.join(self.root, CONTROL_DIR, f"{name}.lock"), what))

    def wait_for_record(self, wait_s: float) -> dict[str, Any]:
        return wait_for_stream(self.root, wait_s)

    def consumer_features(self) -> tuple[Any, Any, Any, list[Any]]:
        """(feature set, training store, eval store, eval refs) of a consumer.

        The training stream goes through the plan's cross-process store, or the directory's
        disk store (consume-once there: a checkpointed sample's file is deleted). Eval
        samples always come from the directory and are never released.
        """
        from ...features import FeatureSet

        from ..offline import verify_checksums

        features = FeatureSet.open(self.root)
        store = stream_store(self.plan, self.context)
        verify = verify_checksums(self.plan)
        eval_store = features.open_store(self.context, verify_checksums=verify)
        if store is None:
            store = features.open_store(self.context, consume_once=True, verify_checksums=verify)
        return features, store, eval_store, features.refs_by_split(eval_store)["eval"]

    def end(self, store: Any, manifest: dict[str, Any]) -> None:
        """Training finished: the directory keeps its eval split and target parts for reuse."""

    def close(self) -> None:
        """Close the control plane and give up the lock files."""
        try:
            if self._control is not None:
                self._control.close()
        finally:
            while self._locks:
                os.close(self._locks.pop())
