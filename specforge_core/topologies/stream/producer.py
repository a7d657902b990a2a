"""The producer of a disaggregated run: capture target features into a shared directory.

``specforge run --role producer --features DIR`` and ``specforge run --role consumer
--features DIR`` are two processes that share ``DIR`` (its layout: :mod:`.record`).

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
from .record import (
    CONTROL_DIR,
    FINISHED_MARKER,
    StreamError,
    hold_lock,
    read_stream_record,
    stream_control,
    stream_store,
    write_stream_record,
)


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

    from ...features import create_feature_set, save_token_counts
    from ...options import options_to_dict

    assert plan.features is not None
    context, _strategy, engine, target, capture_plan = capture_components(plan, role="producer")
    name = plan["strategy"].spec.name
    samples, eval_samples, report = prepared_samples(plan, engine)
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
        write_stream_record(root, record)
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
    from ...fileio import atomic_write_text

    atomic_write_text(Path(plan.output) / "producer_summary.json", json.dumps(result, indent=2, sort_keys=True))
    return result
