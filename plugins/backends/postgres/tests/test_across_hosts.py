"""A stream across hosts that share nothing on disk: PostgreSQL control plane, Mooncake tensors.

Real processes through the public CLI. Two network namespaces joined by a veth pair stand
for two hosts: host A runs PostgreSQL, a mooncake_master, a segment holder and a pool of
two producers; host B runs a two-rank consumer (torchrun, gloo). Each process works in a
directory of its own, and the consumer is not even told where the target model is. The
losses must equal those of the same run online colocated, every sample must be trained
exactly once (the ack ledger in PostgreSQL), and no Mooncake object may be left.

The faults run on loopback (the same processes, one network stack): a producer stalled
past its claim's expiry, a producer SIGKILLed while it holds a claim, a PostgreSQL restart
mid-run, a consumer rank SIGKILLed mid-run and the consumer resumed from its checkpoint. Each run must still train every sample
exactly once, in the colocated order, and leave no object behind.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from specforge_core.testing.netns import LOOPBACK, TwoHosts, netns_unavailable
from specforge_plugin_postgres.cluster import (
    LocalStreamCluster,
    losses,
    output,
    rank_pids,
    reference_losses,
    train_args,
    wait_until,
)

SAMPLES, BATCH, RANKS = 24, 2, 2
STEPS = SAMPLES // (BATCH * RANKS)
FULL_LEDGER = {"committed": SAMPLES, "acked": SAMPLES, "duplicates": 0, "pending": 0, "durable_step": STEPS,
               "acked_ids": SAMPLES, "mooncake_objects": 0}


def ledger(cluster, schema) -> dict:
    """The audit's counts that every finished run must show (see FULL_LEDGER)."""
    audit = cluster.audit(schema)
    return {key: audit[key] for key in FULL_LEDGER}


def producer_args(cluster, schema, tiny, host=LOOPBACK) -> list[str]:
    return cluster.producer_args(schema, host, tiny, SAMPLES)


def consumer_args(cluster, schema, host=LOOPBACK, *extra) -> list[str]:
    return cluster.consumer_args(schema, host, SAMPLES, "out", *extra)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The per-step losses of the same training online colocated, on two ranks."""
    return reference_losses(tiny, SAMPLES, tmp_path_factory.mktemp("reference") / "online", RANKS)


@pytest.fixture(scope="module")
def hosts(needs_mooncake):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with TwoHosts() as two:
        yield two


@pytest.fixture(scope="module")
def two_host_cluster(hosts, needs_postgres):
    """PostgreSQL, a mooncake_master and a segment holder on host A; host B may log in."""
    with LocalStreamCluster(hosts.a, clients=hosts.subnet) as cluster:
        yield cluster


def test_two_producers_on_one_host_feed_a_two_rank_consumer_on_another(two_host_cluster, hosts, tiny, reference,
                                                                        tmp_path):
    cluster, schema = two_host_cluster, "across_hosts"
    producers = [cluster.launch(producer_args(cluster, schema, tiny, hosts.a), host=hosts.a,
                                cwd=tmp_path / "hostA" / f"producer{i}", name=f"producer{i}")
                 for i in range(2)]
    consumer = cluster.launch(consumer_args(cluster, schema, hosts.b), host=hosts.b,
                              cwd=tmp_path / "hostB" / "consumer", ranks=RANKS, name="consumer")
    assert cluster.wait(consumer, 600) == 0, output(consumer)
    for producer in producers:
        assert cluster.wait(producer, 120) == 0, output(producer)
    published = [json.loads((tmp_path / "hostA" / f"producer{i}" / "out" / "producer_summary.json").read_text())
                 ["published"] for i in range(2)]
    assert sum(published) == SAMPLES
    assert losses(tmp_path / "hostB" / "consumer" / "out") == reference
    assert ledger(cluster, schema) == FULL_LEDGER


# ---- faults, on loopback ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(needs_postgres, needs_mooncake):
    with LocalStreamCluster() as running:
        yield running


def test_a_producer_killed_mid_claim_a_stalled_one_and_a_server_restart_lose_and_repeat_nothing(
        cluster, tiny, reference, tmp_path):
    schema = "fault_producer"
    producers = [cluster.launch(producer_args(cluster, schema, tiny), host=LOOPBACK, cwd=tmp_path / f"producer{i}",
                                name=f"producer{i}") for i in range(3)]
    consumer = cluster.launch(consumer_args(cluster, schema), host=LOOPBACK, cwd=tmp_path / "consumer", ranks=RANKS,
                              name="consumer")
    # A producer dies holding a claim: another producer captures it again once it expires. (Which
    # producer plays which part is whichever is first seen holding a claim: on a fast machine a
    # claim lasts a few milliseconds, and one given producer may finish before it is caught.)
    killed = cluster.freeze_holding_claim(schema, producers)
    os.kill(killed.pid, signal.SIGKILL)
    assert cluster.wait(killed, 30) == -signal.SIGKILL
    # Another one stalls past its claim's expiry: the third captures the claim again, and the
    # stalled one, woken, finds it taken, drops its own objects and goes on
    live = [producer for producer in producers if producer is not killed]
    stalled = cluster.freeze_holding_claim(schema, live)
    # Meanwhile the server restarts mid-run: every connection is cut, and each process reconnects and goes
    # on. The consumer (launcher and ranks) is frozen across the restart, so the run is still under way
    # whatever the machine's speed: it needs the samples the stalled producer holds, which nobody has captured yet.
    consumer_pids = [consumer.pid, *rank_pids(consumer).values()]
    for pid in consumer_pids:
        os.kill(pid, signal.SIGSTOP)
    assert consumer.poll() is None and cluster.durable_step(schema) < STEPS, "the run ended before the server restart"
    cluster.postgres.restart()
    for pid in consumer_pids:
        os.kill(pid, signal.SIGCONT)
    time.sleep(3 + 2)  # SPECFORGE_LEASE_TTL_S=3 (cluster.CLUSTER_ENV), and a renewal period
    # how soon the third producer takes the expired claim over depends on where it is in its own capture: wait
    wait_until(lambda: cluster.claims_held(schema, stalled.pid) == 0, 120,
               "the third producer claiming the stalled one's expired claim")
    os.kill(stalled.pid, signal.SIGCONT)
    assert cluster.wait(consumer, 600) == 0, output(consumer)
    for producer in live:
        assert cluster.wait(producer, 120) == 0, output(producer)
    assert "are no longer claimed by producer@" in output(stalled)
    assert losses(tmp_path / "consumer" / "out") == reference
    audit = cluster.audit(schema)
    assert {key: audit[key] for key in FULL_LEDGER} == FULL_LEDGER
    assert audit["recaptured"] >= 2  # both lost claims were captured again, under ids of their own


def test_a_consumer_rank_killed_mid_run_resumes_from_its_checkpoint(cluster, tiny, reference, tmp_path):
    schema = "fault_consumer"
    producer = cluster.launch(producer_args(cluster, schema, tiny), host=LOOPBACK, cwd=tmp_path / "producer",
                              name="producer")
    consumer = cluster.launch(consumer_args(cluster, schema), host=LOOPBACK, cwd=tmp_path / "consumer", ranks=RANKS,
                              name="consumer")
    # The producer is frozen while the stream still lacks samples, so the run cannot end before the kill
    # however fast the machine: with 16-22 of the 24 committed the consumer trains 4 or 5 steps, and waits.
    wait_until(lambda: cluster.committed(schema) >= 16, 300, "the producer's first 16 samples", poll_s=0.01)
    os.kill(producer.pid, signal.SIGSTOP)
    assert cluster.committed(schema) < SAMPLES, "the producer committed every sample before it was frozen"
    wait_until(lambda: cluster.durable_step(schema) >= 3, 300, "the consumer's third optimizer step")
    os.kill(rank_pids(consumer)[1], signal.SIGKILL)
    assert cluster.wait(consumer, 120) != 0  # torchrun ends the group when a rank dies
    os.kill(producer.pid, signal.SIGCONT)
    assert (tmp_path / "consumer" / "out" / "latest").exists()
    resumed = cluster.launch(consumer_args(cluster, schema, LOOPBACK, "--resume", "latest"), host=LOOPBACK,
                             cwd=tmp_path / "consumer", ranks=RANKS, name="resumed")
    assert cluster.wait(resumed, 600) == 0, output(resumed)
    assert cluster.wait(producer, 120) == 0, output(producer)
    assert losses(tmp_path / "consumer" / "out") == reference
    assert ledger(cluster, schema) == FULL_LEDGER


def test_a_consumer_of_another_strategy_and_a_producer_of_other_data_are_refused_naming_the_field(cluster, tiny,
                                                                                                 tmp_path):
    schema = "bad_inputs"
    producer = cluster.launch(producer_args(cluster, schema, tiny), host=LOOPBACK, cwd=tmp_path / "producer",
                              name="producer")
    # with nobody consuming, the producer stops at the high watermark: the stream holds still
    wait_until(lambda: cluster.committed(schema) >= 4, 300, "the producer's first samples")
    time.sleep(1.0)
    record, committed = cluster.marker(schema, "stream.record"), cluster.committed(schema)
    other_strategy = cluster.launch(["run", "--role", "consumer", *train_args(SAMPLES)[2:], "--strategy", "dflash",
                                     *cluster.stream_args(schema, LOOPBACK), "--output", "out"], host=LOOPBACK,
                                    cwd=tmp_path / "dflash", name="consumer")
    other_data = cluster.launch([*producer_args(cluster, schema, tiny), "--set", "data.max_samples=8"],
                                host=LOOPBACK, cwd=tmp_path / "other-data", name="producer")
    assert cluster.wait(other_strategy, 300) == 1
    assert ("the producer streams features for strategy 'eagle3' into stream 'bad_inputs'" in output(other_strategy)
            and "but this consumer runs strategy 'dflash' (field strategy)" in output(other_strategy))
    assert cluster.wait(other_data, 300) == 1
    assert ("but this producer has data.max_samples=8 (data.max_samples differs)" in output(other_data)
            and "use another control_plane.schema" in output(other_data))
    # nothing of the stream changed: its record, its samples, and it was neither closed nor failed
    assert cluster.marker(schema, "stream.record") == record
    assert cluster.committed(schema) == committed and cluster.ended(schema) == 0
    assert producer.poll() is None
