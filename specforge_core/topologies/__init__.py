"""The topologies a run can take: assemblies of the same parts, never forks of the training loop.

Each module is one topology, over the shared capture helpers of :mod:`.capture`:

* :mod:`.offline` — ``specforge capture`` writes a features directory; ``specforge run
  --features DIR`` trains from its fixed refs for many epochs without the target;
* :mod:`.colocated` — the default: the target engine captures on a producer thread while
  the same process trains;
* :mod:`.stream` — disaggregated: ``--role producer`` captures into a stream that
  ``--role consumer`` processes train from, exactly once across crashes of either side
  (:mod:`.stream.record` holds what both sides share, :mod:`.stream.producer` and
  :mod:`.stream.consumer` one side each).

Each training topology is a *source* the runtime (:mod:`specforge_core.runtime`) hands the
trainer: ``target``, ``frozen_parts()``, ``stats()``, ``fingerprint``, ``train_loader(...)``,
``samples_per_rank(...)``, ``eval_loader_factory(...)``, ``ack``, ``start(skip, global_step)``
and ``close()``; a stream consumer adds ``suggested_train_options()``, ``checkpointed(step)``
and ``finish(step)``, which the runtime calls when present.
"""
