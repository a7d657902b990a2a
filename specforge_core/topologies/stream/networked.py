"""A stream across hosts that share no directory: state in a networked control plane, tensors in a store.

With a control plane whose spec has the ``networked`` capability (the ``postgres`` plugin)
and a cross-process feature store (``mooncake``), ``--role producer`` and ``--role
consumer`` need no ``--features`` directory: both sides reach the stream through two
addresses. What the directory holds in the shared-directory mode lives here::

    marker  stream.manifest     the features manifest (target info, capture plan, strategy,
                                frozen-parts fingerprint) plus the refs of the objects below
    marker  stream.record       the stream record (sample counts, epochs, seed, the engine's
                                suggested train options): consumers start once it exists
    object  stream.frozen_parts the target's embed / lm_head / norm weights
    object  stream.token_counts supervised token counts of the training split
    objects <eval sample ids>   the eval split (never released by a consumer)
    lease   stream.setup        the one producer that captures the above
    lease   consumer.rank<r>    one consumer per rank
    claims  one per position    the training stream, shared out among a producer pool
    marker  stream.cleaned      written by the consumer that freed the objects above at the end

Several producers (``--role producer`` started any number of times, e.g. one per inference
GPU) feed one stream: each claims the lowest open positions of the epoch order, captures
and puts them, then completes the claim (commit + publish at those positions, one
transaction). A producer that dies stops renewing its claims; they expire and another
producer captures them again. Consumers hand out refs by position, waiting at a gap, so the
samples are trained in the same order whatever the number of producers or which one died.

The control plane provides ``stream_name``, ``metadata`` markers (``set_marker_once``) and
``pool`` (:class:`~specforge_plugin_postgres.pool.PoolTables`: ``take_lease``,
``release_leases``, ``renew``, ``open_positions``, ``claim``, ``complete``,
``open_claims``).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

import attrs

from ...config import RunPlan
from ...contracts import SampleRef
from ...features import FeatureSet
from ...protocols import BuildContext
from .record import NETWORKED_REMEDY, wait_for

MANIFEST_MARKER = "stream.manifest"
RECORD_MARKER = "stream.record"
CLEANED_MARKER = "stream.cleaned"
FROZEN_ID = "stream.frozen_parts"
TOKEN_COUNTS_ID = "stream.token_counts"
SETUP_LEASE = "stream.setup"
#: Seconds a lease or claim lives without renewal; holders renew every third of it.
LEASE_TTL_S = float(os.environ.get("SPECFORGE_LEASE_TTL_S", "15"))


def is_networked(plan: RunPlan) -> bool:
    """True when the plan's control plane keeps the stream itself (no shared directory)."""
    return plan.role is not None and "networked" in plan["control_plane"].spec.capabilities


def holder_id(role: str) -> str:
    """A name for this process in leases and claims: readable in an error, unique per start."""
    return f"{role}@{socket.gethostname()}:pid{os.getpid()}:{uuid.uuid4().hex[:6]}"


def open_control(plan: RunPlan, context: BuildContext) -> Any:
    from ...components import build_component

    return build_component(plan, "control_plane", context)


class LeaseKeeper:
    """Renews a holder's leases and claims every ``ttl / 3`` s on a daemon thread until :meth:`stop`.

    ``lost`` is set when a lease the holder took is gone (it was too slow to renew and
    another process took it over): the holder must stop.
    """

    def __init__(self, control: Any, holder: str, ttl_s: float = LEASE_TTL_S) -> None:
        self.control, self.holder, self.ttl_s = control, holder, ttl_s
        self.leases = 0
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def take(self, name: str, wait_s: float | None = None) -> None:
        """Take lease ``name``, waiting up to ``wait_s`` (default: one lease ttl and a second)
        for a holder that died to let it expire; a live holder keeps it (LeaseHeldError)."""
        from ...errors import LeaseHeldError

        deadline = time.monotonic() + (self.ttl_s + 1.0 if wait_s is None else wait_s)
        while True:
            try:
                self.control.pool.take_lease(name, self.holder, self.ttl_s)
                break
            except LeaseHeldError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        self.leases += 1

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.control.pool.renew(self.holder, self.ttl_s) < self.leases:
                    self.lost.set()
            except Exception as exc:  # noqa: BLE001 - the holder's own calls report the failure
                print(f"lease renewal failed: {exc}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Stop renewing and give up the leases and open claims (a clean exit)."""
        self._stop.set()
        self._thread.join()
        try:
            self.control.pool.release_leases(self.holder)
        except Exception:  # noqa: BLE001 - they expire by themselves
            pass


class NetworkedStream:
    """The shared state of a stream in a networked control plane and a cross-process store
    (see the module docstring), with the interface of :class:`.record.DirectoryStream`.

    ``role`` names this process in leases and claims; a :class:`LeaseKeeper` renews what
    it holds until :meth:`close`.
    """

    def __init__(self, plan: RunPlan, context: BuildContext, role: str) -> None:
        self.plan, self.context = plan, context
        self.control = open_control(plan, context)
        self.where = describe(self.control)
        self.remedy = NETWORKED_REMEDY  # what to do about a stream of other settings
        self.keeper = LeaseKeeper(self.control, holder_id(role))

    @property
    def holder(self) -> str:
        return self.keeper.holder

    def hold(self, name: str, what: str, wait_s: float | None = None) -> None:
        """Be the one ``what`` of the stream (lease ``name``) until :meth:`close`, waiting up to
        ``wait_s`` (default: one lease) for a dead holder's lease to expire."""
        self.keeper.take(name, wait_s)

    def wait_for_record(self, wait_s: float) -> dict[str, Any]:
        return wait_for(lambda: self.control.metadata.get_marker(RECORD_MARKER), wait_s,
                        f"for a producer to set up {self.where}",
                        f"no producer started {self.where} {{within}}: start `specforge run --role producer` with "
                        "the same control plane, feature store and data")

    def open_store(self) -> Any:
        """The stream's feature store, named after the stream so two streams on one server stay apart."""
        from ...components import build_component

        return build_component(self.plan, "feature_store",
                               attrs.evolve(self.context, run_id=self.control.stream_name))

    def consumer_features(self) -> tuple[Any, Any, Any, list[SampleRef]]:
        """(feature set, store, eval store, eval refs) of a consumer: the eval split lives in the
        training store (never released), so there is no eval store of its own."""
        store = self.open_store()
        features = StreamFeatureSet(path=self.where, manifest=self.control.metadata.get_marker(MANIFEST_MARKER),
                                    store=store)
        return features, store, None, features.eval_refs()

    def end(self, store: Any, manifest: dict[str, Any]) -> None:
        """Training finished: free what the stream kept in the store (see :func:`end_stream`)."""
        end_stream(self.control, store, manifest)

    def close(self) -> None:
        """Stop renewing and give up the leases and open claims, then close the control plane."""
        try:
            self.keeper.stop()
        finally:
            self.control.close()


@attrs.define
class StreamFeatureSet(FeatureSet):
    """The features manifest of a networked stream, its frozen parts and token counts in the store.

    ``path`` is a description of the stream (used in messages); ``manifest`` is the
    ``stream.manifest`` marker.
    """

    store: Any = None

    def frozen_parts(self) -> dict[str, Any]:
        return self.store.get(SampleRef.from_dict(self.manifest["frozen_parts_ref"]))

    def stats(self) -> Any:
        from ...protocols import DataStats

        counts = self.store.get(SampleRef.from_dict(self.manifest["token_counts_ref"]))["token_counts"]
        return DataStats(token_counts=counts, num_samples=int(self.manifest.get("train_samples", 0)))

    def eval_refs(self) -> list[SampleRef]:
        return [SampleRef.from_dict(ref) for ref in self.manifest.get("eval_refs", [])]


def stream_manifest(strategy: str, strategy_options: dict[str, Any], capture_plan: Any, target: Any,
                    frozen_parts: dict[str, Any]) -> dict[str, Any]:
    """The manifest fields a consumer checks (the same as a features directory's)."""
    from ...features import FORMAT, VERSION, frozen_fingerprint, plan_to_dict

    return {"format": FORMAT, "version": VERSION, "strategy": strategy, "strategy_options": dict(strategy_options),
            "capture_plan": plan_to_dict(capture_plan), "target": attrs.asdict(target),
            "frozen_fingerprint": frozen_fingerprint(frozen_parts)}


def lends_memory(plan: RunPlan, store: Any) -> bool:
    """Whether samples put through ``store`` may live in this process's memory and vanish with it.

    True for a store that is not persistent unless it says otherwise: a Mooncake client with
    ``global_segment_size=0`` lends nothing, its samples live in a segment holder's memory.
    """
    if "persistent" in plan["feature_store"].spec.capabilities:
        return False
    return bool(getattr(store, "lends_memory", True))


def end_stream(control: Any, store: Any, manifest: dict[str, Any]) -> None:
    """Free what the stream kept in the store for its whole life, once training finished.

    Every training sample was released by the consumers; what is left is the eval split,
    the frozen parts and the token counts, plus anything a killed producer stored and never
    published. A store that can drop its whole namespace (``destroy()``) does that.
    """
    destroy = getattr(store, "destroy", None)
    if destroy is not None:
        destroy()
    else:
        for ref in manifest.get("eval_refs", []):
            store.abort(SampleRef.from_dict(ref).sample_id)
        for sample_id in (FROZEN_ID, TOKEN_COUNTS_ID):
            store.abort(sample_id)
    control.metadata.set_marker(CLEANED_MARKER, {"by": holder_id("consumer")})


def describe(control: Any) -> str:
    return f"stream {control.stream_name!r} at {control.address}"
