"""The mooncake feature store against a real mooncake_master on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from specforge_core.contracts import SampleRef
from specforge_core.errors import CorruptFeatureError, FeatureStoreError, SampleNotFoundError, StaleRefError, \
    StoreFullError
from specforge_core.plugins import PluginManager
from specforge_core.protocols import BuildContext
from specforge_core.testing.feature_store_suite import FeatureStoreConformance, assert_same_tensors, sample_tensors
from specforge_plugin_mooncake.errors import MooncakeUnavailableError
from specforge_plugin_mooncake.master import LocalMaster, LocalSegmentHolder, free_port
from specforge_plugin_mooncake.store import LEASE_EXPIRED, READ_ATTEMPTS, close_idle_clients, key_prefix

PRODUCER = Path(__file__).with_name("producer.py")


@pytest.fixture
def store(master, namespace, open_store):
    return open_store(master, namespace)


def wait_for_deletions(store, master) -> None:
    """Until the store has no pending deletion, bounded by a few read leases."""
    deadline = time.monotonic() + 10 * master.lease_ttl_ms / 1000
    while store.stats()["pending_deletions"] and time.monotonic() < deadline:
        time.sleep(0.05)


class TestMooncakeStoreStreaming(FeatureStoreConformance):
    """The contract for the default, consume-once store."""

    consume_once = True

    @pytest.fixture(autouse=True)
    def _opener(self, master, open_store):
        self.open = lambda: open_store(master, f"c-{uuid.uuid4().hex[:12]}")

    def make_store(self, tmp_path):
        return self.open()


class TestMooncakeStoreRetaining(FeatureStoreConformance):
    """The contract for a store that keeps samples until abort (several epochs)."""

    consume_once = False

    @pytest.fixture(autouse=True)
    def _opener(self, master, open_store):
        self.open = lambda: open_store(master, f"r-{uuid.uuid4().hex[:12]}", consume_once=False)

    def make_store(self, tmp_path):
        return self.open()


# -- discovery --------------------------------------------------------------------------------


def test_the_store_is_found_through_the_specforge_entry_point():
    spec = PluginManager().load().get("feature_store", "mooncake")
    assert spec.provenance.distribution == "specforge-plugin-mooncake"
    assert spec.factory == "specforge_plugin_mooncake.store:MooncakeStore"
    assert {"cross_process", "consume_once"} <= spec.capabilities


def test_the_uri_names_the_master_and_the_namespace(master, namespace, store):
    assert store.uri == f"mooncake://{master.master_address}/{namespace}"
    assert store.put("s", sample_tensors()).store == store.uri


# -- an unreachable master -------------------------------------------------------------------


def test_a_master_that_is_not_running_fails_fast_naming_its_address(needs_mooncake):
    from specforge_plugin_mooncake import MooncakeStoreOptions
    from specforge_plugin_mooncake.store import MooncakeStore

    port = free_port()
    options = MooncakeStoreOptions(master_address=f"127.0.0.1:{port}", connect_timeout_s=2.0,
                                   global_segment_size=0, local_buffer_size=2**20)
    started = time.monotonic()
    with pytest.raises(MooncakeUnavailableError, match=rf"cannot reach the Mooncake master at 127\.0\.0\.1:{port} "
                                                       r"\(.*refused.*\); start one \(mooncake_master"):
        MooncakeStore(options, BuildContext())
    assert time.monotonic() - started < 5


def test_a_metadata_server_that_is_not_running_fails_fast_naming_its_url(master):
    from specforge_plugin_mooncake import MooncakeStoreOptions
    from specforge_plugin_mooncake.store import MooncakeStore

    url = f"http://127.0.0.1:{free_port()}/metadata"
    options = MooncakeStoreOptions(master_address=master.master_address, metadata_server=url,
                                   global_segment_size=0, local_buffer_size=2**20)
    with pytest.raises(MooncakeUnavailableError, match=rf"cannot reach the Mooncake metadata server at {url} "):
        MooncakeStore(options, BuildContext())


# -- generations ------------------------------------------------------------------------------


@pytest.mark.parametrize("sample_id", ["s", "s" * 700])  # a head record of 766 bytes is read again at its size
def test_a_store_in_another_process_role_sees_a_re_put_as_stale_through_the_head(master, namespace, open_store,
                                                                                 sample_id):
    with open_store(master, namespace) as producer, open_store(master, namespace) as consumer:
        old = producer.put(sample_id, sample_tensors(seed=1))
        assert_same_tensors(consumer.get(old), sample_tensors(seed=1))
        new = producer.put(sample_id, sample_tensors(seed=2))
        wait_for_deletions(producer, master)  # the old generation stays readable for one read lease
        with pytest.raises(StaleRefError, match=rf"generation {old.generation}, but the sample was put again as "
                                                rf"generation {new.generation}"):
            consumer.get(old)
        assert_same_tensors(consumer.get(new), sample_tensors(seed=2))


# -- leases -----------------------------------------------------------------------------------


def test_a_release_refused_by_the_read_lease_is_pending_then_done(store, master):
    ref = store.put("s", {"hidden_states": torch.randn(256, 64)})
    store.get(ref)
    key = store.key_of(ref)
    assert store._client.remove(key) == -706  # the master's answer right after a get: OBJECT_HAS_LEASE
    store.release(ref)
    stats = store.stats()
    assert (stats["samples"], stats["bytes_resident"], stats["releases"], stats["pending_deletions"]) == (0, 0, 1, 1)
    assert store._client.is_exist(key) == 1  # still in Mooncake, under the lease
    with pytest.raises(SampleNotFoundError, match="'s' .*it was released"):
        store.get(ref)
    wait_for_deletions(store, master)
    assert store.stats()["pending_deletions"] == 0
    assert store._client.is_exist(key) == 0


def test_close_waits_for_leased_deletions(master, namespace, open_store):
    store = open_store(master, namespace)
    refs = [store.put(f"s{i}", sample_tensors(seed=i)) for i in range(3)]
    keys = [store.key_of(ref) for ref in refs]
    for ref in refs:
        store.get(ref)
        store.release(ref)  # refused under the get's lease
    assert store.stats()["pending_deletions"] == 3
    assert store._client.batch_is_exist(keys) == [1, 1, 1]
    store.close()
    assert store._client.batch_is_exist(keys) == [0, 0, 0]


def test_a_re_put_of_a_leased_sample_deletes_the_old_generation_once_the_lease_ends(store, master):
    old = store.put("s", sample_tensors(seed=1))
    store.get(old)
    new = store.put("s", sample_tensors(seed=2))
    assert store.stats()["pending_deletions"] == 1
    with pytest.raises(StaleRefError, match=f"generation {old.generation}, but .* generation {new.generation}"):
        store.get(old)
    wait_for_deletions(store, master)
    assert store._client.is_exist(store.key_of(old)) == 0
    assert_same_tensors(store.get(new), sample_tensors(seed=2))


# -- corrupt and missing objects ----------------------------------------------------------------


def test_a_truncated_object_is_a_corrupt_feature_error_naming_the_sample(store):
    ref = store.put("victim", {"hidden_states": torch.randn(64, 32)})
    key = store.key_of(ref)
    whole = store._client.get(key)
    assert store._client.upsert(key, whole[:-100]) == 0  # what a short transfer would leave
    with pytest.raises(CorruptFeatureError, match=rf"sample 'victim' \(generation {ref.generation}\) in "
                                                  rf".*object {key}: .*truncated"):
        store.get(ref)


def test_a_changed_byte_fails_the_checksum(store):
    ref = store.put("victim", {"hidden_states": torch.randn(64, 32)})
    key = store.key_of(ref)
    damaged = bytearray(store._client.get(key))
    damaged[-1] ^= 0x40
    assert store._client.upsert(key, bytes(damaged)) == 0
    with pytest.raises(CorruptFeatureError, match="'victim'.*'hidden_states' fails its xxh3-64 check"):
        store.get(ref)


def test_an_object_that_vanished_is_a_clear_error_naming_the_sample_and_key(store):
    ref = store.put("lost", sample_tensors())
    key = store.key_of(ref)
    assert store._client.remove(key) == 0  # as eviction would: behind the store's back
    with pytest.raises(SampleNotFoundError, match=rf"sample 'lost' \(generation {ref.generation}\) is not in "
                                                  rf".*Mooncake has no object {key}; .*evicted"):
        store.get(ref)


class _CountingReads:
    """The store's real Mooncake client, with its ``get_into`` calls counted; the first ``expire``
    of them answer LEASE_EXPIRED instead of reading. That answer is a stand-in: a real master gives
    it when a read outlasts the lease, a moment no test can time on a loaded machine (the test
    beside this one gets real ones from a master whose lease every read outlasts)."""

    def __init__(self, client, expire: int = 0) -> None:
        self._client, self.expire, self.reads = client, expire, 0

    def get_into(self, key, pointer, size):
        self.reads += 1
        if self.reads <= self.expire:
            return LEASE_EXPIRED
        return self._client.get_into(key, pointer, size)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_read_that_outlasts_its_lease_is_made_again_and_returns_the_sample(store):
    tensors = sample_tensors(tokens=5, seed=7)
    ref = store.put("slow", tensors)
    store._client = reads = _CountingReads(store._client, expire=2)
    assert_same_tensors(store.get(ref), tensors)
    assert reads.reads == 3  # two reads whose lease ran out, then one whole


def test_reads_that_always_outlast_the_lease_are_a_clear_error_and_the_sample_stays(needs_mooncake, namespace,
                                                                                   open_store):
    """A real master whose lease (1 ms) is shorter than any read of a 32 MiB sample (about 20 ms here)."""
    with LocalMaster(lease_ttl_ms=1) as short_lease:
        store = open_store(short_lease, namespace)
        ref = store.put("big", {"hidden_states": torch.ones(8 * 2**20)})
        store._client = reads = _CountingReads(store._client)
        with pytest.raises(FeatureStoreError, match=rf"get of sample 'big' \(generation {ref.generation}\) from "
                                                    rf"mooncake://.*/{namespace}: the read lease ran out before the "
                                                    rf"transfer ended, {READ_ATTEMPTS} times in a row \(Mooncake "
                                                    r"error -707, key .*\); the sample is still stored\. .*start "
                                                    r"mooncake_master with a longer one \(its "
                                                    r"default_kv_lease_ttl flag, in milliseconds\)"):
            store.get(ref)
        assert reads.reads == READ_ATTEMPTS
        assert store._client.is_exist(store.key_of(ref)) == 1 and store.stats()["samples"] == 1
        store.close()  # with its client, while the master is up
        close_idle_clients(short_lease.master_address)


def test_unpinned_samples_are_evicted_when_the_segment_fills_and_their_get_names_the_sample(fresh_master, namespace, open_store):
    # One 64 MiB segment, 4 MiB samples: Mooncake evicts the oldest ones as it fills.
    with open_store(fresh_master, namespace, pin=False) as store:
        refs = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                refs.append(store.put(f"s{len(refs)}", {"hidden_states": torch.full((2**20,), float(len(refs)))}))
            except StoreFullError:  # eviction runs behind the puts: wait for it
                time.sleep(0.05)
            if len(refs) > 24 and store._client.is_exist(store.key_of(refs[0])) == 0:
                break
        gone = refs[0]
        assert store._client.is_exist(store.key_of(gone)) == 0, "nothing was evicted"
        with pytest.raises(SampleNotFoundError, match=r"sample 's0' .*evicted"):
            store.get(gone)
        assert store.get(refs[-1])["hidden_states"][0].item() == float(len(refs) - 1)
        assert store.stats()["samples"] < len(refs)


def test_pinned_samples_are_never_evicted_a_full_segment_refuses_the_put(fresh_master, namespace, open_store):
    with open_store(fresh_master, namespace) as store:
        refs = []
        with pytest.raises(StoreFullError, match=r"put\('s\d+'\) into mooncake://.*no Mooncake segment has room "
                                                 r"for 4\d{6} bytes \(4\.0 MiB\); nothing was stored"):
            for i in range(40):
                refs.append(store.put(f"s{i}", {"hidden_states": torch.full((2**20,), float(i))}))
        assert 10 <= len(refs) < 16
        for i, ref in enumerate(refs):
            assert store.get(ref)["hidden_states"][-1].item() == float(i)
        for ref in refs[:4]:  # the consumer catches up: room again for the producer
            store.release(ref)
        wait_for_deletions(store, fresh_master)
        again = store.put("after-release", {"hidden_states": torch.zeros(2**20)})
        assert store.get(again)["hidden_states"].sum().item() == 0


# -- tokens -----------------------------------------------------------------------------------


def test_a_token_mismatch_is_refused_on_attach(master, namespace, open_store):
    with open_store(master, namespace, token="alpha") as first:
        ref = first.put("s", sample_tensors())
        with pytest.raises(FeatureStoreError, match=rf"the token does not match the one mooncake://.*/{namespace} "
                                                    r"was created with"):
            open_store(master, namespace, token="beta")
        with pytest.raises(FeatureStoreError, match="is protected by a token and none was given"):
            open_store(master, namespace)
        with open_store(master, namespace, token="alpha") as second:
            assert_same_tensors(second.get(ref), sample_tensors())


def test_a_token_given_to_a_namespace_created_without_one_is_refused(master, namespace, open_store):
    with open_store(master, namespace):
        with pytest.raises(FeatureStoreError, match="was created without a token, but a token was given"):
            open_store(master, namespace, token="alpha")


# -- two processes ----------------------------------------------------------------------------


def test_a_producer_process_puts_while_this_process_gets_and_releases(master, namespace, open_store):
    count = 12
    command = [sys.executable, str(PRODUCER), master.master_address, master.metadata_server, namespace, str(count)]
    producer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with open_store(master, namespace, global_segment_size=32 * 2**20) as consumer:
            consumed = 0
            stale = None
            for line in producer.stdout:
                message = json.loads(line)
                if message["kind"] == "ready":
                    break
                ref = SampleRef.from_json(message["ref"])
                if message["kind"] == "stale":
                    stale = ref
                    continue
                index = int(ref.sample_id[1:])
                assert_same_tensors(consumer.get(ref), sample_tensors(tokens=3 + index, seed=index))
                consumer.release(ref)
                consumed += 1
            assert consumed == count
            with pytest.raises(StaleRefError, match=rf"'s0' is stale: it names generation {stale.generation}"):
                consumer.get(stale)
            assert consumer.stats()["samples"] == 0
        producer.stdin.write("done\n")
        producer.stdin.flush()
        final = json.loads(producer.stdout.readline())
        assert final == {"kind": "stats", "samples": 0, "puts": count + 1}
        assert producer.wait(timeout=30) == 0
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()


def test_samples_of_a_process_that_lends_no_memory_outlive_its_sigkill(fresh_master, namespace, open_store):
    """With a segment holder lending the memory, a killed producer takes no sample with it."""
    with LocalSegmentHolder(fresh_master, 64 * 2**20):
        command = [sys.executable, str(PRODUCER), fresh_master.master_address, fresh_master.metadata_server,
                   namespace, "3", "0"]
        producer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            messages = []
            while not messages or messages[-1]["kind"] != "ready":
                messages.append(json.loads(producer.stdout.readline()))
        finally:
            producer.kill()
            producer.wait()
        refs = [SampleRef.from_json(m["ref"]) for m in messages if m["kind"] == "ref"]
        consumer = open_store(fresh_master, namespace, global_segment_size=0)
        assert consumer.lends_memory is False and len(refs) == 3
        for index, ref in enumerate(refs):
            assert_same_tensors(consumer.get(ref), sample_tensors(tokens=3 + index, seed=index))


def test_destroy_removes_every_object_of_its_namespace_and_no_other(fresh_master, namespace, open_store):
    ours, other = open_store(fresh_master, namespace), open_store(fresh_master, namespace + "-other")
    first = ours.put("a", sample_tensors(tokens=2, seed=1))
    ours.get(first)  # a read lease does not stop the end of a stream
    second = ours.put("b", sample_tensors(tokens=2, seed=2))
    kept = other.put("a", sample_tensors(tokens=2, seed=3))
    before = fresh_master.key_count()
    # the master lists each namespace's objects apart (a prefix that is a name and its "/")
    assert fresh_master.keys(key_prefix(namespace)) == sorted(
        [ours.key_of(first), ours.key_of(second), ours._head_key("a"), ours._head_key("b"),
         key_prefix(namespace) + "STORE"])
    assert fresh_master.keys(key_prefix(namespace + "-other")) == sorted(
        [other.key_of(kept), other._head_key("a"), key_prefix(namespace + "-other") + "STORE"])
    assert ours.destroy() == 5  # two samples, their two heads and the namespace's manifest
    assert fresh_master.key_count() == before - 5
    assert fresh_master.keys(key_prefix(namespace)) == []
    assert len(fresh_master.keys(key_prefix(namespace + "-other"))) == 3
    assert_same_tensors(other.get(kept), sample_tensors(tokens=2, seed=3))
    with pytest.raises(SampleNotFoundError, match=r"'a'"):
        ours.get(first)


def test_stores_attaching_to_a_new_namespace_at_once_all_read_one_manifest(master, open_store):
    """A get of the manifest while another store's put of it is under way reads nothing; each store waits for
    it instead of taking it for a foreign object (6 stores at once over 10 namespaces: before the wait, 12 of
    30 such trials refused a store)."""
    import threading

    for _ in range(10):
        namespace = f"race-{uuid.uuid4().hex[:12]}"
        start, errors = threading.Barrier(6), []

        def attach():
            start.wait()
            try:
                open_store(master, namespace)
            except FeatureStoreError as exc:
                errors.append(str(exc))

        threads = [threading.Thread(target=attach) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []


def test_a_manifest_that_cannot_be_recorded_is_a_clear_error(fresh_master, namespace, open_store, monkeypatch):
    """No segment anywhere to hold the manifest: the put fails and nothing becomes readable."""
    from specforge_plugin_mooncake import store as mooncake_store

    monkeypatch.setattr(mooncake_store, "MANIFEST_WAIT_S", 0.2)
    with pytest.raises(FeatureStoreError, match=rf"cannot record the manifest of mooncake://.*/{namespace}: the put "
                                                r"returned Mooncake code -\d+ and nothing was readable under "
                                                rf"specforge/{namespace}/STORE after 0.2 s; check the master's log"):
        open_store(fresh_master, namespace, global_segment_size=0)
