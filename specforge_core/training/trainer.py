"""The training loop — one loop for offline, online and disaggregated runs.

Read it top to bottom in :meth:`Trainer.fit`: a batch comes from the loader, the strategy
computes the loss, gradients accumulate, and at each optimizer boundary we clip, step, ack
the window's samples durably, log, evaluate and checkpoint. Topologies differ only in the
loader (and so the ref source and feature store) this loop is handed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

from ..config import TrainOptions
from ..contracts import StepContext, StepOutput, TrainBatch
from ..errors import NonFiniteTrainingError, SpecforgeError, StrategyContractError
from ..fileio import atomic_write_text
from .checkpoint import CheckpointManager, check_contract
from .distributed import DistInfo, gather_objects, set_gradient_sync, shard_model
from .evaluator import derived_metrics
from .metrics import MetricsLog, RatioPool
from .optim import build_optimizer, build_scheduler, trainable_parameters


@attrs.define
class TrainerState:
    """Where training stands; saved in every checkpoint."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0  # every token of the trained samples (prompts included)
    supervised_tokens: int = 0  # the target tokens trained on (loss_mask == 1)
    best_value: float | None = None
    best_step: int | None = None


def _is_better(value: float, best: float | None, mode: str) -> bool:
    if value is None or math.isnan(value):
        return False
    if best is None:
        return True
    return value > best if mode == "max" else value < best


class Trainer:
    """Trains ``model`` with ``strategy.forward_loss`` over ``loader``.

    ``ack(sample_ids, global_step)`` is called once per optimizer update with that window's
    samples, after the update: the durable acknowledgement (then the loader releases them).
    ``contract`` is what a resume must match (strategy and options, world size, batch,
    accumulation, target fingerprint); its total steps may grow, which extends a run.
    """

    def __init__(self, *, strategy: Any, model: torch.nn.Module, loader: Any, train: TrainOptions, info: DistInfo,
                 output_dir: str | Path, run_id: str, total_steps: int, contract: dict[str, Any],
                 hooks: Any = None, ack: Callable[[Sequence[str], int], None] | None = None,
                 evaluator: Any = None, best_metric: str = "loss", best_mode: str = "min",
                 summary_extra: dict[str, Any] | None = None,
                 on_checkpoint: Callable[[int], None] | None = None) -> None:
        self.strategy = strategy
        self.info = info
        self.train = train
        self.loader = loader
        self.output_dir = Path(output_dir)
        self.run_id = run_id
        self.total_steps = total_steps
        self.contract = contract
        self.hooks = hooks
        self.ack = ack
        self.on_checkpoint = on_checkpoint  # told the global step of each checkpoint once it is durable
        self.evaluator = evaluator
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.summary_extra = dict(summary_extra or {})
        self.model = shard_model(model.to(info.device), info)
        self.params = trainable_parameters(self.model)
        self.optimizer = build_optimizer(self.model, train)
        self.scheduler = build_scheduler(self.optimizer, train, total_steps)
        self.checkpoints = CheckpointManager(self.output_dir, run_id, info, keep_last=train.keep_last)
        self.metrics = MetricsLog(self.output_dir, info)
        self.state = TrainerState()
        self.last_train: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self._names: list[str] | None = None
        self._resumed = False
        self._best_metric_checked = False
        self._evaluated_at = self._saved_at = -1  # the global step of the last evaluation and checkpoint
        self.output_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ resume
    def resume(self, which: str) -> Path:
        """Restore weights, optimizer, scheduler, RNG and data position from a checkpoint."""
        path = self.checkpoints.resolve(which)
        saved = json.loads((path / "trainer_state.json").read_text())
        check_contract(saved["contract"], self.contract, path, completed=saved["state"]["global_step"])
        saved = self.checkpoints.load(path, model=self.model, optimizer=self.optimizer)
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state = TrainerState(**saved["state"])
        if not getattr(self.loader, "streaming", True):
            self.loader.set_epoch(self.state.epoch)
            self.loader.seek(self.state.batch_in_epoch)
        self._resumed = True  # metrics a crash left after this checkpoint are dropped when training starts
        return path

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        train, state, info = self.train, self.state, self.info
        if self._resumed:
            self.metrics.truncate_after(state.global_step)
        accumulation = train.accumulation_steps
        self.model.train()
        progress = self._progress()
        started = time.perf_counter()
        tokens_at_start = state.supervised_tokens, state.tokens
        window = _Window()
        done = state.global_step >= self.total_steps
        while not done:
            streaming = getattr(self.loader, "streaming", True)
            if not streaming:
                self.loader.set_epoch(state.epoch)
            batches = iter(self.loader)
            while True:
                waited = time.perf_counter()
                batch = next(batches, None)
                window.wait_s += time.perf_counter() - waited
                if batch is None:
                    break
                state.batch_in_epoch += 1
                boundary = window.micro_steps + 1 == accumulation
                set_gradient_sync(self.model, boundary)
                ctx = StepContext(global_step=state.global_step, total_steps=self.total_steps, epoch=state.epoch)
                self._check_batch(batch)
                out = self._check_output(self.strategy.forward_loss(self.model, batch.to(info.device), ctx))
                (out.loss / accumulation).backward()
                window.add(out, batch)
                if boundary:
                    self._optimizer_step(window, progress)
                    window = _Window()
                    if state.global_step >= self.total_steps:
                        done = True
                        break
            if done or streaming:
                break
            state.epoch += 1
            state.batch_in_epoch = 0
            if state.epoch >= train.epochs:
                break
        if progress is not None:
            progress.close()
        if 0 < state.global_step < self.total_steps:
            self._close_early_end()
        return self._finish(time.perf_counter() - started, state.supervised_tokens - tokens_at_start[0],
                            state.tokens - tokens_at_start[1])

    def _check_batch(self, batch: Any) -> None:
        if not isinstance(batch, TrainBatch):
            raise StrategyContractError(
                f"strategy {self._strategy_name()!r}: collate returned a {type(batch).__name__}, not a "
                "specforge_core.contracts.TrainBatch (its tensors, the batch's sample_ids and num_tokens); "
                "see docs/writing-plugins.md")

    def _check_output(self, out: Any) -> StepOutput:
        """``out`` if it is a :class:`StepOutput` with a scalar loss that has a gradient, and ratio metrics of
        pairs; else a :class:`StrategyContractError` saying what is wrong (a few isinstance checks a step)."""
        name = self._strategy_name()
        if not isinstance(out, StepOutput):
            raise StrategyContractError(
                f"strategy {name!r}: forward_loss returned a {type(out).__name__}, not a "
                "specforge_core.contracts.StepOutput; return StepOutput(loss=..., metrics=..., ratio_metrics=...)")
        loss = out.loss
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else \
                f"a {type(loss).__name__}"
            raise StrategyContractError(
                f"strategy {name!r}: forward_loss's StepOutput.loss is {what}, not a scalar tensor; reduce it "
                "(a sum or mean over tokens) to the one number to backpropagate")
        if not loss.requires_grad:
            raise StrategyContractError(
                f"strategy {name!r}: forward_loss's StepOutput.loss has no gradient: compute it from the model's "
                "outputs, not under torch.no_grad() and not detached")
        for key, value in out.ratio_metrics.items():
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise StrategyContractError(
                    f"strategy {name!r}: forward_loss's ratio_metrics[{key!r}] is {value!r}, not a (numerator, "
                    "denominator) pair; pass plain values in StepOutput.metrics instead")
        return out

    def _strategy_name(self) -> str:
        return str(self.contract.get("strategy") or type(self.strategy).__name__)

    def _optimizer_step(self, window: _Window, progress: Any) -> None:
        state, train = self.state, self.train
        max_norm = train.max_grad_norm if train.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # the pre-clip norm
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not math.isfinite(float(grad_norm)):  # the same on every rank: the norm of the synchronised gradients
            raise self._non_finite(float(grad_norm), window)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.global_step += 1
        if self.ack is not None:
            self.ack(window.sample_ids, state.global_step)
        record = self._reduce(window, float(grad_norm), lr)
        state.tokens += int(record.pop("_tokens"))
        state.supervised_tokens += int(record.pop("_supervised"))
        self.last_train = record
        if state.global_step % train.log_every == 0 or state.global_step == self.total_steps:
            self.metrics.write(record)
        if self.info.is_main and self.hooks is not None:
            self.hooks.specforge_step_end(run_id=self.run_id, global_step=state.global_step, metrics=record)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        final = state.global_step >= self.total_steps
        evaluate = self.evaluator is not None and (final or (train.eval_every and state.global_step % train.eval_every == 0))
        is_best = False
        scheduled = final or bool(train.save_every and state.global_step % train.save_every == 0)
        if evaluate:
            is_best = self._evaluate()
        elif self.evaluator is None and scheduled:
            is_best = self._training_best(record)
        if scheduled or (evaluate and is_best):
            self.save(is_best=is_best)

    def _non_finite(self, grad_norm: float, window: _Window) -> NonFiniteTrainingError:
        step = self.state.global_step + 1
        loss = window.loss_sum / max(window.micro_steps, 1)
        try:
            saved = f"the latest checkpoint, {self.checkpoints.resolve('latest').name}, is intact (--resume latest)"
        except SpecforgeError:
            saved = "no checkpoint was saved before it"
        return NonFiniteTrainingError(
            f"step {step}: the gradient norm is {grad_norm} (the loss {loss:.6g} on this rank), so training stopped "
            f"before this update: no weight took it, and {saved}. A lower train.lr or train.max_grad_norm, or the "
            "strategy's dtype float32, may help; a loss that is non-finite from the first step points at the "
            "strategy's forward_loss or the data")

    def _training_best(self, record: Mapping[str, Any]) -> bool:
        """Without an eval split, whether the checkpoint about to be saved is the best by the training
        metric so far (only saved steps compete: the best names a checkpoint)."""
        state = self.state
        self._check_best_metric(record, "training")
        is_best = _is_better(record.get(self.best_metric, float("nan")), state.best_value, self.best_mode)
        if is_best:
            state.best_value, state.best_step = record[self.best_metric], state.global_step
        return is_best

    def _check_best_metric(self, values: Mapping[str, Any], kind: str) -> None:
        """Warn once if the metric that picks the best checkpoint is not among those the strategy reports."""
        if self.best_metric in values or self._best_metric_checked or not self.info.is_main:
            self._best_metric_checked = True
            return
        self._best_metric_checked = True
        reported = ", ".join(sorted(name for name in values if name != "step")) or "none"
        from tqdm import tqdm

        tqdm.write(f"warning: the best checkpoint is chosen by {kind} metric {self.best_metric!r} (the strategy's "
                   f"best_metric), which the strategy does not report ({kind} metrics: {reported}); no checkpoint "
                   "will be marked best", file=sys.stderr)  # above the progress bar, not inside its line

    def _close_early_end(self) -> None:
        """The data ran out before ``total_steps`` (e.g. max_steps above what one stream holds): evaluate and
        checkpoint the last step as a planned end would, so the summary's figures describe the weights that
        are exported."""
        step = self.state.global_step
        is_best = False
        if self.evaluator is not None and self._evaluated_at != step:
            is_best = self._evaluate()
        elif self.evaluator is None and self._saved_at != step and self.last_train:
            is_best = self._training_best(self.last_train)
        if self._saved_at != step:
            self.save(is_best=is_best)

    def _reduce(self, window: _Window, grad_norm: float, lr: float) -> dict[str, Any]:
        """One all-reduce for every metric of the window: Σnum / Σden across micro-batches and ranks."""
        pool = window.pool
        # Per-rank totals are pooled as (x, 1): the pooled value is their mean over ranks.
        pool.add({"_loss": (window.loss_sum, window.micro_steps), "_tokens": (window.tokens, 1.0),
                  "_supervised": (window.supervised, 1.0),
                  "_wait_s": (window.wait_s, 1.0), "_elapsed_s": (time.perf_counter() - window.start, 1.0)})
        pool.add({name: (num, den) for name, (num, den) in window.plain.items()})
        if self._names is None:
            local = sorted(pool.sums)
            self._names = sorted({n for names in gather_objects(local, self.info) for n in names})
        values = pool.reduce(self.info, self._names)
        # The mean of the backpropagated losses, unless the strategy pools its loss exactly.
        values.setdefault("loss", values["_loss"])
        values.pop("_loss")
        total_tokens = values.pop("_tokens") * self.info.world_size
        supervised = values.pop("_supervised") * self.info.world_size
        wait, elapsed = values.pop("_wait_s"), max(values.pop("_elapsed_s"), 1e-9)
        # tokens_per_s counts the supervised target tokens trained on, all ranks together;
        # sequence_tokens_per_s every token of the samples (prompts included).
        record = {"step": self.state.global_step, "epoch": self.state.epoch, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": supervised / elapsed, "sequence_tokens_per_s": total_tokens / elapsed,
                  "data_wait_fraction": wait / elapsed, "_tokens": total_tokens, "_supervised": supervised}
        record.update(values)
        record.update(derived_metrics(self.strategy, values))
        return record

    def _evaluate(self) -> bool:
        state = self.state
        self._evaluated_at = state.global_step
        values = self.evaluator.run(self.model, global_step=state.global_step, total_steps=self.total_steps)
        self.last_eval = {f"eval/{k}": v for k, v in values.items()}
        self.metrics.write({"step": state.global_step, **self.last_eval})
        if self.info.is_main and self.hooks is not None:
            self.hooks.specforge_eval_end(run_id=self.run_id, global_step=state.global_step, metrics=dict(values))
        self._check_best_metric(values, "eval")
        value = values.get(self.best_metric, float("nan"))
        if _is_better(value, state.best_value, self.best_mode):
            state.best_value, state.best_step = value, state.global_step
            return True
        return False

    def save(self, *, is_best: bool = False) -> Path:
        trainer_state = {
            "state": attrs.asdict(self.state),
            "scheduler": self.scheduler.state_dict(),
            "contract": self.contract,
            "run_id": self.run_id,
            "best_metric": self.best_metric,
        }
        path = self.checkpoints.save(global_step=self.state.global_step, model=self.model, optimizer=self.optimizer,
                                     trainer_state=trainer_state, is_best=is_best)
        self._saved_at = self.state.global_step
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.state.global_step)
        if self.info.is_main and self.hooks is not None:
            self.hooks.specforge_checkpoint_saved(run_id=self.run_id, global_step=self.state.global_step, path=str(path))
        return path

    def _progress(self) -> Any:
        if not self.info.is_main:
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.state.global_step, desc=f"train {self.run_id}",
                    unit="step", dynamic_ncols=True, mininterval=0.5)

    def _finish(self, elapsed: float, supervised: int, tokens: int) -> dict[str, Any]:
        state = self.state
        summary = {
            "run_id": self.run_id,
            "steps": state.global_step,
            "total_steps": self.total_steps,
            "epochs_completed": state.epoch,
            "tokens": state.tokens,
            "supervised_tokens": state.supervised_tokens,
            "tokens_per_s": supervised / elapsed if elapsed > 0 else 0.0,
            "sequence_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "final": {k: v for k, v in self.last_train.items()},
            "final_eval": dict(self.last_eval),
            "best": {"metric": self.best_metric, "mode": self.best_mode, "value": state.best_value,
                     "step": state.best_step, "checkpoint": self.checkpoints.pointer("best")},
            "latest_checkpoint": self.checkpoints.pointer("latest"),
        }
        summary.update(self.summary_extra)
        if self.info.is_main:
            write_summary(self.output_dir, summary)
            from .plot import plot_curves

            plot_curves(self.metrics.records(), self.output_dir / "curves.png")
        return summary


def write_summary(output_dir: str | os.PathLike[str], summary: dict[str, Any]) -> None:
    """Write ``summary.json`` atomically: a run's result file is never seen half written."""
    text = json.dumps(summary, indent=2, sort_keys=True, default=str)
    atomic_write_text(Path(output_dir) / "summary.json", text)


class _Window:
    """What accumulates between two optimizer updates."""

    def __init__(self) -> None:
        self.micro_steps = 0
        self.loss_sum = 0.0
        self.tokens = 0
        self.supervised = 0
        self.wait_s = 0.0
        self.start = time.perf_counter()
        self.sample_ids: list[str] = []
        self.pool = RatioPool()
        self.plain: dict[str, list[float]] = {}

    def add(self, out: Any, batch: Any) -> None:
        self.micro_steps += 1
        self.loss_sum += float(out.loss.detach())
        self.tokens += int(batch.num_tokens)
        mask = batch.tensors.get("loss_mask")
        self.supervised += int(mask.sum()) if mask is not None else int(batch.num_tokens)
        self.sample_ids.extend(batch.sample_ids)
        self.pool.add(out.ratio_metrics)
        for name, value in out.metrics.items():
            acc = self.plain.setdefault(name, [0.0, 0.0])
            acc[0] += float(value)
            acc[1] += 1.0
