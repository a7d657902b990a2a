"""The producer of a disaggregated run: capture target features into a shared directory.

``specforge run --role producer --features DIR`` and ``specforge run --role consumer
--features DIR`` are two processes that share ``DIR`` (on one host: the sqlite control
plane's WAL needs local locks and shared memory)::

    DIR/manifest.json               a features directory (see :mod:`.features`), plus a
    DIR/frozen_parts.safetensors    ``stream`` record the consumer waits for: sample counts,
    DIR/token_counts.safetensors    epochs and the seed of the stream's sample order
    DIR/store/                      the disk store: eval samples (kept) and, unless the run
                                    names another cross-process feature store (mooncake),
                                    the training stream (deleted once a consumer checkpoint
                                    covers them)
    DIR/control/                    the sqlite control plane: metadata.sqlite (commits, acks
                                    with their global step) and refs.jsonl (the ref channel)

The producer captures the eval split once, then the training samples epoch by epoch in the
order an online run would train them (shuffled per epoch with ``train.seed``), and for each
captured batch: puts the features, commits the refs (deduplicated by sample id) and
publishes the fresh ones, pausing while the consumers are ``high_watermark`` refs behind.

A producer that crashed or was stopped is started again with the same command: refs it
committed but never published are published, samples already committed are not captured
again, and the stream goes on where it stopped (a finished stream publishes nothing). A
producer that fails with an error fails the channel, so the consumers stop with that error
instead of waiting for more samples. One producer runs per stream (``control/producer.lock``),
as one process. With a store that is not persistent (Mooncake) the producer stays until the
consumers finished training, since samples may live in memory it lends.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs

from .config import RunPlan
from .errors import SpecforgeError
from .protocols import BuildContext

CONTROL_DIR = "control"
STREAM_KEY = "stream"
#: Control-plane markers: the highest step whose samples a consumer deleted after a checkpoint
#: covered them, and the step a consumer finished training at.
RELEASED_MARKER = "stream.released_through_step"
FINISHED_MARKER = "stream.consumer_finished"


class StreamError(SpecforgeError):
    """A disaggregated stream cannot be produced or consumed as asked."""


def stream_control(plan: RunPlan, context: BuildContext) -> Any:
    """The sqlite control plane in ``FEATURES/control`` (or its ``path`` option), opened in ``context.role``."""
    from .control_planes.sqlite import SqliteControlPlane

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
    from .runtime import build_component

    if plan["feature_store"].spec.name == "disk":
        return None
    assert plan.features is not None
    return build_component(plan, "feature_store", attrs.evolve(context, run_id=stream_id(plan.features)))


def read_stream_record(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``stream`` record of a features directory's manifest, or None before a producer wrote it."""
    from .features import MANIFEST

    try:
        manifest = json.loads((Path(root) / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    record = manifest.get(STREAM_KEY)
    return record if isinstance(record, dict) else None


def _write_stream_record(root: Path, record: dict[str, Any]) -> None:
    """Add the ``stream`` record to the manifest: from now on consumers may start."""
    from .features import MANIFEST
    from .fileio import atomic_write_text

    manifest = json.loads((root / MANIFEST).read_text())
    manifest[STREAM_KEY] = record
    atomic_write_text(root / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))


def _stay_until_trained(metadata: Any, idle_timeout_s: float) -> None:
    """Wait until the consumers finished training (their last checkpoint written).

    A store without the ``persistent`` capability (Mooncake) may hold samples in memory
    this process lends to the cluster; they would vanish with it, and a consumer resuming
    from its last checkpoint needs every sample acked after it. Gives up with an error when
    the consumers ack nothing for ``idle_timeout_s``.
    """
    import time

    seen, progress_at = metadata.durable_step(), time.monotonic()  # moves with every optimizer step's ack
    while metadata.get_marker(FINISHED_MARKER) is None:
        step = metadata.durable_step()
        if step != seen:
            seen, progress_at = step, time.monotonic()
        elif time.monotonic() - progress_at > idle_timeout_s:
            raise StreamError(f"the consumers acked no sample for {idle_timeout_s:g}s and have not finished; this "
                              "producer exits now, and the samples held in the memory it lends to the store go "
                              "with it")
        time.sleep(0.5)


def run_producer(plan: RunPlan, manager: Any) -> dict[str, Any]:
    """Capture ``plan``'s data into the shared ``plan.features`` directory and stream it; resumable."""
    assert plan.features is not None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise StreamError("a producer runs as one process (it captures the whole stream; consumers split it); "
                          "start it without torchrun")
    lock = hold_lock(os.path.join(str(plan.features), CONTROL_DIR, "producer.lock"), "producer")
    try:
        return _produce(plan)
    finally:
        os.close(lock)


def _produce(plan: RunPlan) -> dict[str, Any]:
    from tqdm import tqdm

    from .capture import capture_batch, capture_components, capture_into, supervised_token_counts
    from .features import create_feature_set, save_token_counts
    from .options import options_to_dict
    from .sources import capture_batch_size, epoch_order, prepared_samples, put_captured, stream_sample_id

    assert plan.features is not None
    context, _strategy, engine, target, capture_plan = capture_components(plan, role="producer")
    name = plan["strategy"].spec.name
    samples, eval_samples, report, _files = prepared_samples(plan, engine)
    batch_size = capture_batch_size(plan)
    epochs, seed = plan.train.epochs, plan.train.seed
    suggest = getattr(engine, "suggested_train_options", None)
    # The consumer has no target engine: it applies the engine's suggested train defaults from here.
    record = {"train_samples": len(samples), "eval_samples": len(eval_samples), "epochs": epochs, "seed": seed,
              "suggested_train_options": dict(suggest()) if suggest is not None else {}}
    previous = read_stream_record(plan.features)
    if previous is not None and previous != record:
        changed = sorted(k for k in record if previous.get(k) != record.get(k))
        raise StreamError(f"{plan.features} already streams {previous}; this producer would stream {record} "
                          f"({', '.join(changed)} differ). A stream cannot change under its consumers: use the same "
                          "data and train options, or a new --features directory")
    root, store = create_feature_set(plan.features, strategy=name,
                                     strategy_options=options_to_dict(plan["strategy"].options), plan=capture_plan,
                                     target=target, frozen_parts=engine.frozen_parts(), context=context)
    control = train_store = None
    try:
        train_store = stream_store(plan, context) or store
        captured_eval = {ref.sample_id for ref in store.scan() if ref.meta.get("split") == "eval"}
        with tqdm(desc="capture eval", unit="sample", dynamic_ncols=True, mininterval=0.5) as progress:
            for _ in capture_into(store, engine, capture_plan, eval_samples, batch_size=batch_size, split="eval",
                                  strategy=name, skip=captured_eval, progress=progress):
                pass
        save_token_counts(root, supervised_token_counts(((s.input_ids, s.loss_mask) for s in samples),
                                                        target.vocab_size))
        _write_stream_record(root, record)
        control = stream_control(plan, context)
        channel, metadata = control.channel, control.metadata
        republished = control.resume_producer()
        known = metadata.reconcile()
        committed = {ref.sample_id for ref in (*known.acked, *known.pending)}
        published = 0
        total = epochs * len(samples)
        with tqdm(desc="capture train", total=total, initial=len(committed), unit="sample", dynamic_ncols=True,
                  mininterval=0.5) as progress:
            for epoch in range(epochs):
                order = [samples[i] for i in epoch_order(len(samples), epoch, seed)]
                todo = [s for s in order if stream_sample_id(s, epoch) not in committed]
                for start in range(0, len(todo), batch_size):
                    batch = todo[start:start + batch_size]
                    refs = put_captured(train_store, batch, capture_batch(engine, capture_plan, batch), epoch=epoch,
                                        strategy=name)
                    fresh = metadata.commit(refs)
                    channel.publish(fresh)  # waits while the consumers are high_watermark refs behind
                    published += len(fresh)
                    progress.update(len(batch))
        channel.close()
        if train_store is not store and "persistent" not in plan["feature_store"].spec.capabilities:
            _stay_until_trained(metadata, channel.idle_timeout_s)
    except Exception as exc:
        if control is not None:  # the consumers stop with this error rather than wait for samples
            control.channel.fail(f"the producer failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        if control is not None:
            control.close()
        if train_store is not None and train_store is not store:
            train_store.close()
        store.close()
    result = {"features": str(root), "published": published + republished, "reused": len(committed),
              "train_samples": len(samples), "eval_samples": len(eval_samples), "epochs": epochs,
              "data": report.summary()}
    Path(plan.output).mkdir(parents=True, exist_ok=True)
    from .fileio import atomic_write_text

    atomic_write_text(Path(plan.output) / "producer_summary.json", json.dumps(result, indent=2, sort_keys=True))
    return result
