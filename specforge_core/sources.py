"""Where training samples come from: the two sources the runtime can hand the trainer.

* :class:`OfflineSource` — a features directory written by ``specforge capture``: a fixed
  list of refs in a disk store, re-iterated for many epochs.
* :class:`OnlineSource` — the online colocated topology: the target engine captures on a
  producer thread into the feature store, refs go through the control plane (commit with
  dedup, then the channel), the loader consumes them, and the trainer's ack at each
  optimizer boundary marks them durable and releases them. A bounded window of samples in
  flight keeps the memory use flat and lets capture run ahead of training.

Both expose the same small surface: ``target``, ``frozen_parts``, ``fingerprint``,
``train_loader(...)``, ``eval_loader_factory(...)``, ``ack``, ``start(skip)``, ``close()``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .config import RunPlan
from .data.loader import FeatureDataLoader
from .errors import SpecforgeError
from .protocols import BuildContext


class OfflineSource:
    """Samples from a features directory (``--features DIR``)."""

    streaming = False

    def __init__(self, plan: RunPlan, strategy: Any, context: BuildContext) -> None:
        from .features import FeatureSet

        self.features = FeatureSet.open(plan.features)
        self.target = self.features.target
        self.features.check_plan(strategy.capture_plan(self.target), plan["strategy"].spec.name)
        self.store = self.features.open_store(context)
        splits = self.features.refs_by_split(self.store)
        self.refs, self.eval_refs = splits["train"], splits["eval"]
        if not self.refs:
            raise SpecforgeError(f"{plan.features} holds no training samples")
        self.fingerprint = self.features.fingerprint
        self.ack = None

    def frozen_parts(self) -> dict[str, Any]:
        return self.features.frozen_parts()

    def stats(self) -> Any:
        return self.features.stats()

    def train_loader(self, collate: Callable, *, batch_size: int, seed: int, rank: int, world_size: int) -> Any:
        return FeatureDataLoader(self.store, collate, refs=self.refs, batch_size=batch_size, shuffle=True, seed=seed,
                                 drop_last=True, rank=rank, world_size=world_size)

    def samples_per_rank(self, world_size: int) -> int:
        return len(self.refs) // world_size

    def eval_loader_factory(self, collate: Callable, *, batch_size: int, rank: int, world_size: int) -> Any:
        if not self.eval_refs:
            return None
        return lambda: FeatureDataLoader(self.store, collate, refs=self.eval_refs, batch_size=batch_size,
                                         shuffle=False, drop_last=False, rank=rank, world_size=world_size,
                                         equal_shares=False)

    def start(self, skip_samples: int = 0) -> None:
        """Nothing to start: the loader seeks by itself on resume."""

    def close(self) -> None:
        self.store.close()


def capture_batch_size(plan: RunPlan) -> int:
    """Sequences per target forward: the engine's own option when it has one."""
    return int(getattr(plan["target_engine"].options, "capture_batch_size", 8))


def _share(n: int, epoch: int, seed: int, rank: int, world_size: int, equal: bool = True) -> list[int]:
    """This rank's sample indices for an epoch: the same split rule as the fixed-refs loader."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    end = (n // world_size) * world_size if equal else n
    return order[rank:end:world_size]


class OnlineSource:
    """Capture on a producer thread while training (the default topology)."""

    streaming = True

    def __init__(self, plan: RunPlan, strategy: Any, context: BuildContext, *, build: Callable[[str], Any],
                 window: int) -> None:
        from .capture import data_paths
        from .data.prepare import prepare_file
        from .features import frozen_fingerprint

        self.plan = plan
        self.context = context
        self.engine = build("target_engine")
        self.target = self.engine.info()
        self.capture_plan = strategy.capture_plan(self.target)
        self._frozen = self.engine.frozen_parts()
        self.fingerprint = frozen_fingerprint(self._frozen)
        train_path, eval_path = data_paths(plan, self.engine)
        options = dict(max_length=plan.data.max_length, last_turn_only=plan.data.last_turn_only,
                       strict=plan.data.strict)
        self.samples, self.report = prepare_file(train_path, self.engine.tokenizer, **options)
        if plan.data.max_samples:
            self.samples = self.samples[: plan.data.max_samples]
        self.eval_samples = prepare_file(eval_path, self.engine.tokenizer, **options)[0] if eval_path else []
        if not self.samples:
            raise SpecforgeError(f"{train_path} gave no usable training sample: {self.report.summary()}")
        self.store = build("feature_store")
        self.control = build("control_plane")
        self.window = threading.BoundedSemaphore(window)
        self._window_size = window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.loader: Any = None

    def frozen_parts(self) -> dict[str, Any]:
        return self._frozen

    def stats(self) -> Any:
        from .capture import supervised_token_counts
        from .protocols import DataStats

        counts = supervised_token_counts(((s.input_ids, s.loss_mask) for s in self.samples), self.target.vocab_size)
        return DataStats(token_counts=counts, num_samples=len(self.samples))

    def samples_per_rank(self, world_size: int) -> int:
        return len(self.samples) // world_size

    def train_loader(self, collate: Callable, *, batch_size: int, seed: int, rank: int, world_size: int) -> Any:
        self._seed, self._rank, self._world = seed, rank, world_size
        self.loader = FeatureDataLoader(self.store, collate, channel=self.control.channel, batch_size=batch_size,
                                        release="on_complete", poll_timeout_s=0.5)
        return self.loader

    def eval_loader_factory(self, collate: Callable, *, batch_size: int, rank: int, world_size: int) -> Any:
        """Eval samples are captured once, up front, into a retained in-memory store."""
        if not self.eval_samples:
            return None
        from .builtin import MemoryStoreOptions
        from .capture import capture_into
        from .feature_stores.memory import MemoryFeatureStore

        store = MemoryFeatureStore(MemoryStoreOptions(consume_once=False), self.context)
        mine = [self.eval_samples[i] for i in range(rank, len(self.eval_samples), world_size)]
        refs = list(capture_into(store, self.engine, self.capture_plan, mine,
                                 batch_size=capture_batch_size(self.plan), split="eval",
                                 strategy=self.plan["strategy"].spec.name))
        return lambda: FeatureDataLoader(store, collate, refs=refs, batch_size=batch_size, shuffle=False,
                                         drop_last=False)

    # ------------------------------------------------------------------ producer
    def start(self, skip_samples: int = 0) -> None:
        """Start capturing this rank's share, epoch after epoch, after ``skip_samples`` (resume)."""
        self._thread = threading.Thread(target=self._produce, args=(skip_samples,), name="specforge-capture",
                                        daemon=True)
        self._thread.start()

    def _produce(self, skip: int) -> None:
        from .capture import capture_batch

        channel, metadata = self.control.channel, self.control.metadata
        name = self.plan["strategy"].spec.name
        per_epoch = self.samples_per_rank(self._world)
        batch_size = capture_batch_size(self.plan)
        try:
            for epoch in range(skip // per_epoch, self.plan.train.epochs):
                share = _share(len(self.samples), epoch, self._seed, self._rank, self._world)
                if epoch == skip // per_epoch:
                    share = share[skip % per_epoch:]
                for start in range(0, len(share), batch_size):
                    batch = [self.samples[i] for i in share[start:start + batch_size]]
                    for _ in batch:  # bounded window: wait for the trainer to ack older samples
                        while not self.window.acquire(timeout=0.2):
                            if self._stop.is_set():
                                return
                    if self._stop.is_set():
                        return
                    refs = []
                    for sample, features in zip(batch, capture_batch(self.engine, self.capture_plan, batch)):
                        meta = {"split": "train", "source": sample.source, "num_tokens": len(sample.input_ids),
                                "epoch": epoch, "strategy": name}
                        # One sample seen in two epochs is two training events: distinct ids.
                        refs.append(self.store.put(f"{sample.sample_id}@e{epoch}", features, meta))
                    channel.publish(metadata.commit(refs))
            channel.close()
        except BaseException as exc:  # noqa: BLE001 - the trainer sees it through the channel
            self._error = exc
            channel.fail(f"capture failed: {type(exc).__name__}: {exc}")

    def ack(self, sample_ids: list[str], global_step: int) -> None:
        """Durable ack of one optimizer window, then free those samples and their window slots."""
        self.control.metadata.ack(sample_ids, global_step)
        self.loader.complete(sample_ids)
        self.control.channel.report_consumed(len(sample_ids))
        for _ in sample_ids:
            try:
                self.window.release()
            except ValueError:
                break

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.control.close()
        self.store.close()
