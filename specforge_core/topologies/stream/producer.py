"""The producer of a disaggregated run: capture target features into a stream.

``specforge run --role producer --features DIR`` and ``specforge run --role consumer
--features DIR`` are two processes that share ``DIR`` (its layout: :mod:`.record`). With a
networked control plane and a cross-process store instead (``--control-plane postgres
--feature-store mooncake``), any number of producers form a pool that shares the stream
out by position, on hosts that share nothing with the consumers (see :mod:`.networked`).
Both kinds reach the stream through :func:`.state.open_stream`.

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
consumers finished training if samples may live in memory it lends (a Mooncake client with
``global_segment_size`` > 0; with 0 they live in a segment holder's memory).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ...config import RunPlan
from ..capture import (
    capture_batch,
    capture_batch_size,
    capture_components,
    capture_into,
    epoch_order,
    prepared_samples,
    put_captured,
    stream_sample_id,
    supervised_token_counts,
)
from ...protocols import BuildContext
from .networked import (
    FROZEN_ID,
    MANIFEST_MARKER,
    RECORD_MARKER,
    SETUP_LEASE,
    TOKEN_COUNTS_ID,
    is_networked,
    lends_memory,
    stream_manifest,
)
from .record import (
    FINISHED_MARKER,
    StreamError,
    check_same_stream,
    read_stream_record,
    NETWORKED_REMEDY,
    stream_record,
    stream_store,
    write_stream_record,
)
from .state import open_stream


def _stay_until_trained(metadata: Any, idle_timeout_s: float) -> None:
    """Wait until the consumers finished training (their last checkpoint written).

    A store that is not persistent may hold samples in memory this process lends to the
    cluster (see :func:`.networked.lends_memory`); they would vanish with it, and a consumer
    resuming from its last checkpoint needs every sample acked after it. Gives up with an
    error when the consumers ack nothing for ``idle_timeout_s``.
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
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise StreamError("a producer runs as one process (it captures the whole stream; consumers split it); "
                          "start it without torchrun (with a networked control plane, start several producers "
                          "for a pool)")
    stream = open_stream(plan, BuildContext(run_id=plan.run_id, output_dir=plan.output, role="producer"), "producer")
    try:
        if is_networked(plan):
            return _produce_networked(plan, stream)
        stream.hold("producer", "producer")
        return _produce(plan, stream)
    finally:
        stream.close()


def _producer_inputs(plan: RunPlan) -> tuple[Any, ...]:
    """What both kinds of producer start from: (context, engine, target, capture plan, strategy
    name, train samples, eval samples, preparation report, stream record)."""
    context, _strategy, engine, target, capture_plan = capture_components(plan, role="producer")
    samples, eval_samples, report, _files = prepared_samples(plan, engine)
    record = stream_record(plan, samples, eval_samples)
    return (context, engine, target, capture_plan, plan["strategy"].spec.name, samples, eval_samples, report,
            record)


def _produce(plan: RunPlan, stream: Any) -> dict[str, Any]:
    """The one producer of a directory stream (see the module docstring)."""
    from tqdm import tqdm

    from ...features import create_feature_set, save_token_counts
    from ...options import options_to_dict

    assert plan.features is not None
    context, engine, target, capture_plan, name, samples, eval_samples, report, record = _producer_inputs(plan)
    batch_size = capture_batch_size(plan)
    epochs, seed = plan.train.epochs, plan.train.seed
    check_same_stream(read_stream_record(plan.features), record, str(plan.features))
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
        write_stream_record(root, record)
        control = stream.control
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
        if train_store is not store and lends_memory(plan, train_store):
            _stay_until_trained(metadata, channel.idle_timeout_s)
    except Exception as exc:
        if control is not None:  # the consumers stop with this error rather than wait for samples
            control.channel.fail(f"the producer failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        if train_store is not None and train_store is not store:
            train_store.close()
        store.close()
    result = {"features": str(root), "published": published + republished, "reused": len(committed),
              "train_samples": len(samples), "eval_samples": len(eval_samples), "epochs": epochs,
              "data": report.summary()}
    return _write_summary(plan, result)


def _write_summary(plan: RunPlan, result: dict[str, Any]) -> dict[str, Any]:
    from ...fileio import atomic_write_text

    Path(plan.output).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(plan.output) / "producer_summary.json", json.dumps(result, indent=2, sort_keys=True))
    return result


def _produce_networked(plan: RunPlan, stream: Any) -> dict[str, Any]:
    """One member of a producer pool of a networked stream (see :mod:`.networked`)."""
    import time

    from tqdm import tqdm

    from ...errors import ChannelClosedError, ClaimLostError, LeaseHeldError
    from ...options import options_to_dict

    context, engine, target, capture_plan, name, samples, eval_samples, report, record = _producer_inputs(plan)
    batch_size = capture_batch_size(plan)
    epochs, seed = plan.train.epochs, plan.train.seed
    control, holder, keeper, where = stream.control, stream.holder, stream.keeper, stream.where
    store = None
    streaming = False
    try:
        metadata, channel, pool = control.metadata, control.channel, control.pool
        check_same_stream(metadata.get_marker(RECORD_MARKER), record, where, NETWORKED_REMEDY)
        frozen = engine.frozen_parts()
        manifest = stream_manifest(name, options_to_dict(plan["strategy"].options), capture_plan, target, frozen)
        store = stream.open_store()
        # One producer of the pool captures the eval split and stores the target parts; the
        # others wait for its stream record (or take over if it dies: its lease expires).
        deadline = time.monotonic() + channel.idle_timeout_s
        while metadata.get_marker(RECORD_MARKER) is None:
            try:
                stream.hold(SETUP_LEASE, "setup producer", wait_s=0)
            except LeaseHeldError:
                if time.monotonic() > deadline:
                    raise StreamError(f"another producer has been setting up {where} for {channel.idle_timeout_s:g}s "
                                      "(control_plane.idle_timeout_s) without finishing; is it stuck?") from None
                time.sleep(0.5)
                continue
            if metadata.get_marker(RECORD_MARKER) is None:
                _set_up_stream(plan, control, store, engine, capture_plan, samples, eval_samples,
                               {**manifest, "train_samples": len(samples)}, frozen, record)
        stored = metadata.get_marker(MANIFEST_MARKER)
        check_same_stream({k: stored.get(k) for k in manifest}, manifest, where, NETWORKED_REMEDY)
        check_same_stream(metadata.get_marker(RECORD_MARKER), record, where, NETWORKED_REMEDY)
        orders: dict[int, list[int]] = {}

        def sample_at(position: int) -> tuple[Any, int]:
            epoch = position // len(samples)
            order = orders.setdefault(epoch, epoch_order(len(samples), epoch, seed))
            return samples[order[position % len(samples)]], epoch

        published, total = 0, epochs * len(samples)
        streaming = True
        with tqdm(desc="capture train", total=total, unit="sample", dynamic_ncols=True, mininterval=0.5) as progress:
            while True:
                if keeper.lost.is_set():
                    raise StreamError(f"this producer lost its lease on {where} (it renewed too late); stopping")
                # Paused by backpressure, a producer still fills gaps dead producers left: the
                # consumers wait for those positions before anything behind them.
                if pool.open_claims() == 0:
                    break  # the pool published every position; the last completion closed the stream
                try:
                    has_room = channel.wait_for_capacity(timeout=keeper.ttl_s / 3)
                except ChannelClosedError:
                    if pool.open_claims() == 0:
                        break  # another producer completed the last position meanwhile
                    raise
                claims = pool.claim(holder, batch_size, keeper.ttl_s, expired_only=not has_room)
                if not claims:
                    time.sleep(0.2 if has_room else 0)  # the rest is claimed by live producers
                    continue
                batch = [(*sample_at(position), attempt) for position, attempt in claims]
                captured = capture_batch(engine, capture_plan, [sample for sample, _, _ in batch])
                refs = [put_captured(store, [sample], [features], epoch=epoch, strategy=name, attempt=attempt)[0]
                        for (sample, epoch, attempt), features in zip(batch, captured)]
                try:
                    pool.complete(holder, [position for position, _ in claims], refs)
                except ClaimLostError as exc:
                    # This producer stalled past its claims' expiry and another one took them;
                    # the objects of this attempt are its own (ids per attempt): drop them.
                    for ref in refs:
                        store.abort(ref.sample_id)
                    print(f"warning: {exc}", file=sys.stderr, flush=True)
                    continue
                published += len(refs)
                progress.update(len(refs))
        if lends_memory(plan, store):  # samples may live in memory this process lends: stay for them
            _stay_until_trained(metadata, channel.idle_timeout_s)
    except Exception as exc:
        if streaming:  # the consumers stop with this error rather than wait for samples
            control.channel.fail(f"a producer failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        if store is not None:
            store.close()
    return _write_summary(plan, {"stream": where, "published": published, "reused": 0, "train_samples": len(samples),
                                 "eval_samples": len(eval_samples), "epochs": epochs, "holder": holder,
                                 "data": report.summary()})


def _set_up_stream(plan: RunPlan, control: Any, store: Any, engine: Any, capture_plan: Any, samples: list[Any],
                   eval_samples: list[Any], manifest: dict[str, Any], frozen: dict[str, Any],
                   record: dict[str, Any]) -> None:
    """Store the eval split, target parts and token counts, open the claims, then write the record."""
    from tqdm import tqdm

    name = plan["strategy"].spec.name
    with tqdm(desc="capture eval", unit="sample", dynamic_ncols=True, mininterval=0.5) as progress:
        eval_refs = list(capture_into(store, engine, capture_plan, eval_samples, batch_size=capture_batch_size(plan),
                                      split="eval", strategy=name, progress=progress))
    frozen_ref = store.put(FROZEN_ID, {k: v.detach().cpu().contiguous() for k, v in frozen.items()})
    counts = supervised_token_counts(((s.input_ids, s.loss_mask) for s in samples), manifest["target"]["vocab_size"])
    counts_ref = store.put(TOKEN_COUNTS_ID, {"token_counts": counts})
    control.metadata.set_marker(MANIFEST_MARKER, {**manifest, "frozen_parts_ref": frozen_ref.to_dict(),
                                                  "token_counts_ref": counts_ref.to_dict(),
                                                  "eval_refs": [ref.to_dict() for ref in eval_refs]})
    control.pool.open_positions(plan.train.epochs * len(samples))
    control.metadata.set_marker(RECORD_MARKER, record)  # last: consumers and other producers start on it
