"""ControlPlaneConformance: the control-plane contract as tests any plugin can run.

A control-plane plugin subclasses it in its tests and says how to build one::

    class TestMyControlPlane(ControlPlaneConformance):
        dedups, durable, cross_process = True, True, False

        def make_control_plane(self, tmp_path, role="colocated", **channel_options):
            return MyControlPlane(MyOptions(path=str(tmp_path), **channel_options),
                                  BuildContext(role=role))

``channel_options`` are the channel settings a test needs (``idle_timeout_s``,
``poll_interval_s``, ``high_watermark``, ``low_watermark``); a plane must honour them.
Class attributes declare what the plane promises:

* ``dedups`` — per-sample bookkeeping: commit dedups, ack rejects unknown ids, reconcile
  and the durable step work (False for a no-op plane, which gets the pass-through tests);
* ``durable`` — metadata, markers and published refs survive closing and reopening on the
  same ``tmp_path``;
* ``cross_process`` — two handles on one ``tmp_path`` (``role="producer"`` and
  ``role="consumer"``) see each other's commits, acks, refs and consumption.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest

from ..contracts import FeatureSpec, SampleRef
from ..errors import (
    ChannelClosedError,
    ChannelFailedError,
    ChannelTimeoutError,
    ControlPlaneError,
    RecordError,
)

#: Fast channel settings for tests: a broken test fails in seconds instead of hanging.
TEST_CHANNEL_OPTIONS = {"idle_timeout_s": 5.0, "poll_interval_s": 0.01}


def sample_refs(n: int, start: int = 0, run_id: str = "conformance") -> list[SampleRef]:
    """``n`` distinct refs ``s<start>`` .. ``s<start+n-1>`` (metadata only, no store behind them)."""
    return [
        SampleRef(sample_id=f"s{i}", run_id=run_id, store="memory://conformance",
                  features={"hidden_states": FeatureSpec((16 + i % 7, 64), "bfloat16")},
                  strategy="conformance", num_tokens=16 + i % 7, meta={"index": i})
        for i in range(start, start + n)
    ]


def ids(refs: list[SampleRef]) -> list[str]:
    return [ref.sample_id for ref in refs]


class Background:
    """Run ``fn`` on a daemon thread; ``result()`` joins and returns or re-raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as exc:  # handed to the test thread by result()
                self._error = exc
            finally:
                self.done.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = 5.0) -> Any:
        assert self.done.wait(timeout), f"background call did not finish within {timeout}s"
        if self._error is not None:
            raise self._error
        return self._value


class ControlPlaneConformance:
    """Subclass and override ``make_control_plane`` to run the control plane contract tests."""

    dedups = True
    durable = False
    cross_process = False

    def make_control_plane(self, tmp_path, role: str = "colocated", **channel_options: Any) -> Any:
        raise NotImplementedError("override make_control_plane(tmp_path, role, **channel_options)")

    @pytest.fixture
    def plane(self, tmp_path):
        plane = self.make_control_plane(tmp_path, **TEST_CHANNEL_OPTIONS)
        yield plane
        plane.close()

    def _open(self, tmp_path, **options: Any) -> Any:
        return self.make_control_plane(tmp_path, **{**TEST_CHANNEL_OPTIONS, **options})

    def _require(self, flag: str) -> None:
        if not getattr(self, flag):
            pytest.skip(f"this control plane does not promise `{flag}`")

    # ---- metadata: commit ----------------------------------------------------------------
    def test_commit_returns_only_fresh_refs_and_counts_duplicates(self, plane):
        self._require("dedups")
        a, b, c = sample_refs(3)
        assert plane.metadata.commit([a, b, a]) == [a, b]  # a repeat inside one batch is a duplicate too
        assert plane.metadata.commit([b, c]) == [c]
        assert plane.metadata.commit([]) == []
        assert plane.metadata.stats() == {"committed": 3, "acked": 0, "duplicates": 2, "pending": 3}

    def test_noop_commit_passes_every_ref_through(self, plane):
        if self.dedups:
            pytest.skip("this control plane dedups")
        a, b = sample_refs(2)
        assert plane.metadata.commit([a, b, a]) == [a, b, a]
        assert plane.metadata.stats()["duplicates"] == 0

    def test_commit_rejects_a_tensor_record_and_keeps_nothing_of_the_batch(self, plane):
        torch = pytest.importorskip("torch")
        good = sample_refs(2)
        with pytest.raises(RecordError, match=r"refs\[2\]\.hidden holds a torch\.Tensor.*metadata only"):
            plane.metadata.commit([*good, {"hidden": torch.zeros(4)}])
        assert plane.metadata.stats()["committed"] == 0
        assert plane.metadata.commit(good) == good  # still fresh: nothing of the bad batch was kept

    def test_commit_rejects_what_is_not_a_list_of_refs(self, plane):
        ref = sample_refs(1)[0]
        with pytest.raises(RecordError, match=r"refs\[1\] is a dict, not a SampleRef"):
            plane.metadata.commit([ref, ref.to_dict()])
        with pytest.raises(RecordError, match="got a single SampleRef; wrap it in a list"):
            plane.metadata.commit(ref)
        assert plane.metadata.stats()["committed"] == 0

    # ---- metadata: ack ---------------------------------------------------------------------
    def test_ack_marks_samples_and_records_the_durable_step(self, plane):
        self._require("dedups")
        refs = sample_refs(4)
        plane.metadata.commit(refs)
        assert plane.metadata.durable_step() == 0
        plane.metadata.ack(["s0", "s1"], 1)
        assert plane.metadata.durable_step() == 1
        plane.metadata.ack(["s2"], 2)
        assert plane.metadata.durable_step() == 2
        assert plane.metadata.stats() == {"committed": 4, "acked": 3, "duplicates": 0, "pending": 1}

    def test_durable_step_is_the_highest_step_acked(self, plane):
        self._require("dedups")
        plane.metadata.commit(sample_refs(2))
        plane.metadata.ack(["s0"], 5)
        plane.metadata.ack(["s1"], 4)  # a late rank acking an older step must not move it back
        assert plane.metadata.durable_step() == 5

    def test_acking_again_is_harmless(self, plane):
        self._require("dedups")
        plane.metadata.commit(sample_refs(2))
        plane.metadata.ack(["s0"], 1)
        plane.metadata.ack(["s0", "s0"], 2)
        assert plane.metadata.stats()["acked"] == 1
        assert plane.metadata.durable_step() == 2

    def test_ack_of_an_unknown_id_is_rejected_and_applies_nothing(self, plane):
        self._require("dedups")
        plane.metadata.commit(sample_refs(2))
        with pytest.raises(ControlPlaneError, match=r"never committed: 'ghost'.*Nothing of this ack was applied"):
            plane.metadata.ack(["s0", "ghost"], 3)
        assert plane.metadata.stats()["acked"] == 0
        assert plane.metadata.durable_step() == 0
        assert ids(plane.metadata.reconcile().pending) == ["s0", "s1"]

    def test_ack_rejects_malformed_arguments(self, plane):
        plane.metadata.commit(sample_refs(1))
        with pytest.raises(ControlPlaneError, match="single string 's0'; wrap it in a list"):
            plane.metadata.ack("s0", 1)
        with pytest.raises(ControlPlaneError, match="global_step must be an int >= 0, got -1"):
            plane.metadata.ack(["s0"], -1)
        with pytest.raises(ControlPlaneError, match="sample ids must be strings"):
            plane.metadata.ack([0], 1)
        assert plane.metadata.stats()["acked"] == 0

    # ---- metadata: reconcile and markers ------------------------------------------------------
    def test_reconcile_splits_acked_and_pending_in_commit_order(self, plane):
        self._require("dedups")
        refs = sample_refs(5)
        plane.metadata.commit(refs[3:] + refs[:3])
        plane.metadata.ack(["s4", "s1"], 9)
        result = plane.metadata.reconcile()
        assert list(result.acked) == [refs[4], refs[1]]
        assert list(result.pending) == [refs[3], refs[0], refs[2]]
        assert result.durable_step == 9

    def test_noop_reconcile_is_empty(self, plane):
        if self.dedups:
            pytest.skip("this control plane keeps bookkeeping")
        plane.metadata.commit(sample_refs(2))
        plane.metadata.ack(["s0"], 3)
        result = plane.metadata.reconcile()
        assert (result.acked, result.pending, plane.metadata.durable_step()) == ((), (), 0)

    def test_markers_round_trip_json_values(self, plane):
        assert plane.metadata.get_marker("data_position", default={"epoch": 0}) == {"epoch": 0}
        plane.metadata.set_marker("data_position", {"epoch": 2, "offset": 17, "files": ["a", "b"]})
        plane.metadata.set_marker("data_position", {"epoch": 3, "offset": 0, "files": []})
        assert plane.metadata.get_marker("data_position") == {"epoch": 3, "offset": 0, "files": []}

    def test_marker_holding_a_tensor_is_rejected_and_the_old_value_kept(self, plane):
        torch = pytest.importorskip("torch")
        plane.metadata.set_marker("position", 4)
        with pytest.raises(RecordError, match=r"marker 'position'\.t holds a torch\.Tensor"):
            plane.metadata.set_marker("position", {"t": torch.ones(1)})
        assert plane.metadata.get_marker("position") == 4

    def test_closed_metadata_store_refuses_work_with_a_clear_error(self, tmp_path):
        plane = self._open(tmp_path)
        plane.close()
        with pytest.raises(ControlPlaneError, match="is closed; open a new control plane"):
            plane.metadata.commit(sample_refs(1))

    # ---- durability and several handles ------------------------------------------------------
    def test_durable_plane_survives_reopen(self, tmp_path):
        self._require("durable")
        refs = sample_refs(3)
        first = self._open(tmp_path)
        first.metadata.commit(refs)
        first.metadata.ack(["s1"], 7)
        first.metadata.set_marker("data_position", 3)
        first.channel.publish(refs)
        first.close()

        again = self._open(tmp_path)
        try:
            assert again.metadata.durable_step() == 7
            assert again.metadata.get_marker("data_position") == 3
            result = again.metadata.reconcile()
            assert (list(result.acked), list(result.pending)) == ([refs[1]], [refs[0], refs[2]])
            assert again.metadata.commit(refs[:1]) == []  # still known: a duplicate
            assert again.metadata.stats() == {"committed": 3, "acked": 1, "duplicates": 1, "pending": 2}
            assert again.channel.poll(10, timeout=0) == refs  # published refs are durable too
            assert again.channel.backlog() == 3
        finally:
            again.close()

    def test_producer_and_consumer_handles_see_each_other(self, tmp_path):
        self._require("cross_process")
        producer = self._open(tmp_path, role="producer")
        consumer = self._open(tmp_path, role="consumer")
        try:
            refs = sample_refs(4)
            producer.channel.publish(producer.metadata.commit(refs))
            got = consumer.channel.poll(10, timeout=2)
            assert got == refs
            assert consumer.metadata.commit(refs[:1]) == []  # one database: the consumer sees the commit
            consumer.metadata.ack(ids(got), 1)
            consumer.channel.report_consumed(len(got))
            assert producer.metadata.stats()["acked"] == 4
            assert producer.channel.consumed() == 4
            producer.channel.close()
            assert consumer.channel.poll(1, timeout=2) == [] and consumer.channel.finished
        finally:
            producer.close()
            consumer.close()

    # ---- channel: delivery -------------------------------------------------------------------
    def test_poll_returns_published_refs_in_order_exactly_once(self, plane):
        refs = sample_refs(10)
        plane.channel.publish(refs[:4])
        plane.channel.publish(refs[4:])
        got = []
        while len(got) < 10:
            got += plane.channel.poll(3, timeout=1)
        assert got == refs
        assert plane.channel.poll(5, timeout=0) == []

    def test_poll_hands_out_at_most_max_n(self, plane):
        plane.channel.publish(sample_refs(5))
        assert ids(plane.channel.poll(2)) == ["s0", "s1"]
        assert ids(plane.channel.poll(2)) == ["s2", "s3"]
        assert ids(plane.channel.poll(2)) == ["s4"]

    def test_poll_rejects_a_bad_max_n(self, plane):
        with pytest.raises(ControlPlaneError, match=r"poll\(max_n\) needs an int >= 1, got 0"):
            plane.channel.poll(0)

    def test_poll_with_timeout_returns_empty_when_nothing_arrives(self, plane):
        start = time.monotonic()
        assert plane.channel.poll(4, timeout=0.1) == []
        assert 0.09 <= time.monotonic() - start < 2
        assert not plane.channel.finished

    def test_poll_waits_for_a_ref_published_meanwhile(self, plane):
        refs = sample_refs(1)
        waiting = Background(lambda: plane.channel.poll(4))  # timeout=None: wait for a ref or the end
        time.sleep(0.05)
        plane.channel.publish(refs)
        assert waiting.result() == refs

    def test_publish_rejects_non_refs_and_publishes_nothing(self, plane):
        torch = pytest.importorskip("torch")
        with pytest.raises(RecordError, match=r"refs\[1\]\.x holds a torch\.Tensor"):
            plane.channel.publish([sample_refs(1)[0], {"x": torch.zeros(1)}])
        plane.channel.close()
        assert plane.channel.poll(5, timeout=1) == [] and plane.channel.finished

    # ---- channel: end of stream --------------------------------------------------------------
    def test_close_lets_consumers_drain_then_finish(self, plane):
        refs = sample_refs(3)
        plane.channel.publish(refs)
        plane.channel.close()
        assert not plane.channel.finished
        assert plane.channel.poll(2) == refs[:2]
        assert plane.channel.poll(2) == refs[2:]
        assert plane.channel.poll(2) == [] and plane.channel.finished
        assert plane.channel.poll(2, timeout=None) == []  # stays finished, never blocks

    def test_fail_hands_out_earlier_refs_then_raises_the_reason(self, plane):
        refs = sample_refs(2)
        plane.channel.publish(refs)
        plane.channel.fail("target engine crashed: CUDA OOM")
        assert plane.channel.poll(10) == refs  # committed before the failure: still trained on
        for _ in range(2):  # the failure is sticky
            with pytest.raises(ChannelFailedError, match="target engine crashed: CUDA OOM"):
                plane.channel.poll(10, timeout=0)
        assert not plane.channel.finished

    @pytest.mark.parametrize("end", ["close", "fail"])
    def test_publish_after_the_end_is_rejected(self, plane, end):
        refs = sample_refs(2)
        plane.channel.publish(refs[:1])
        plane.channel.close() if end == "close" else plane.channel.fail("boom")
        with pytest.raises(ChannelClosedError, match=r"cannot publish: the ref channel was (closed|failed: boom)"):
            plane.channel.publish(refs[1:])
        assert plane.channel.poll(10) == refs[:1]  # nothing lost, nothing extra

    def test_close_and_fail_are_idempotent_and_the_first_wins(self, plane):
        plane.channel.close()
        plane.channel.close()
        plane.channel.fail("too late")
        assert plane.channel.poll(1) == [] and plane.channel.finished

    # ---- channel: liveness -------------------------------------------------------------------
    def test_idle_consumer_gets_a_timeout_error_instead_of_hanging(self, tmp_path):
        plane = self._open(tmp_path, idle_timeout_s=0.2)
        try:
            start = time.monotonic()
            with pytest.raises(ChannelTimeoutError, match=r"for 0\.\d+s \(idle_timeout_s=0\.2\).*producer"):
                plane.channel.poll(1)
            assert time.monotonic() - start < 2
        finally:
            plane.close()

    def test_heartbeats_keep_an_idle_consumer_waiting(self, tmp_path):
        plane = self._open(tmp_path, idle_timeout_s=0.6)  # six heartbeat intervals: slack for a loaded machine
        try:
            waiting = Background(lambda: plane.channel.poll(1))
            for _ in range(12):  # 1.2 s of silence but for heartbeats: twice the idle timeout
                time.sleep(0.1)
                plane.channel.heartbeat()
            refs = sample_refs(1)
            plane.channel.publish(refs)
            assert waiting.result() == refs
        finally:
            plane.close()

    # ---- channel: backpressure -----------------------------------------------------------------
    def test_consumed_counts_what_consumers_report(self, plane):
        plane.channel.publish(sample_refs(5))
        assert (plane.channel.consumed(), plane.channel.backlog()) == (0, 5)
        plane.channel.poll(3)
        assert plane.channel.consumed() == 0  # polled is not consumed
        plane.channel.report_consumed(2)
        plane.channel.report_consumed(1)
        assert (plane.channel.consumed(), plane.channel.backlog()) == (3, 2)

    def test_reporting_more_than_was_polled_is_rejected(self, plane):
        plane.channel.publish(sample_refs(2))
        plane.channel.poll(1)
        with pytest.raises(ControlPlaneError, match=r"report 2 refs consumed, but this consumer was handed only 1"):
            plane.channel.report_consumed(2)
        assert plane.channel.consumed() == 0

    def test_producer_pauses_at_the_high_watermark_until_the_backlog_falls_to_low(self, tmp_path):
        plane = self._open(tmp_path, high_watermark=4, low_watermark=2)
        try:
            refs = sample_refs(5)
            for ref in refs[:4]:
                plane.channel.publish([ref])
            blocked = Background(lambda: plane.channel.publish(refs[4:]))
            assert not blocked.done.wait(0.2)
            assert plane.channel.poll(4) == refs[:4]
            plane.channel.report_consumed(1)  # backlog 3: above low, still paused
            assert not blocked.done.wait(0.2)
            plane.channel.report_consumed(1)  # backlog 2 == low: resume
            blocked.result(timeout=3)
            assert plane.channel.poll(4, timeout=1) == refs[4:]
            assert plane.channel.backlog() == 3
            assert plane.channel.wait_for_capacity(timeout=0) is True
        finally:
            plane.close()

    def test_wait_for_capacity_returns_false_after_its_timeout(self, tmp_path):
        plane = self._open(tmp_path, high_watermark=2, low_watermark=0)
        try:
            plane.channel.publish(sample_refs(2))
            start = time.monotonic()
            assert plane.channel.wait_for_capacity(timeout=0.1) is False
            assert 0.09 <= time.monotonic() - start < 2
        finally:
            plane.close()

    def test_paused_producer_stops_waiting_when_the_channel_fails(self, tmp_path):
        plane = self._open(tmp_path, high_watermark=2, low_watermark=1)
        try:
            refs = sample_refs(3)
            plane.channel.publish(refs[:2])
            blocked = Background(lambda: plane.channel.publish(refs[2:]))
            assert not blocked.done.wait(0.1)
            plane.channel.fail("trainer diverged")
            with pytest.raises(ChannelClosedError, match="failed: trainer diverged"):
                blocked.result(timeout=3)
            assert plane.channel.poll(5) == refs[:2]
        finally:
            plane.close()

    def test_paused_producer_gives_up_when_consumers_make_no_progress(self, tmp_path):
        plane = self._open(tmp_path, high_watermark=1, low_watermark=0, idle_timeout_s=0.2)
        try:
            plane.channel.publish(sample_refs(1))
            with pytest.raises(ChannelTimeoutError, match=r"consumers reported no progress.*report_consumed"):
                plane.channel.publish(sample_refs(1, start=1))
            assert plane.channel.backlog() == 1  # the refused ref was not published
        finally:
            plane.close()
