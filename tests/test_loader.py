"""FeatureDataLoader over real stores and channels."""

import re
import threading
import time

import pytest
import torch

from specforge_core.builtin import DiskStoreOptions, LocalControlPlaneOptions, MemoryStoreOptions
from specforge_core.contracts import TrainBatch
from specforge_core.control_planes.local import LocalControlPlane
from specforge_core.data.loader import FeatureDataLoader, LoaderError
from specforge_core.errors import ChannelFailedError, CorruptFeatureError, SampleNotFoundError
from specforge_core.feature_stores.disk import DiskFeatureStore
from specforge_core.feature_stores.memory import MemoryFeatureStore
from specforge_core.protocols import BuildContext


def collate(samples, sample_ids):
    return TrainBatch(tensors={"v": torch.stack([s["v"] for s in samples])}, sample_ids=sample_ids,
                      num_tokens=len(samples))


def fill(store, n):
    return [store.put(f"s{i:03d}", {"v": torch.tensor([float(i)])}) for i in range(n)]


def ids(batches):
    return [list(b.sample_ids) for b in batches]


@pytest.fixture
def memory():
    return MemoryFeatureStore(MemoryStoreOptions(consume_once=False), BuildContext())


def test_fixed_mode_shuffles_per_epoch_with_a_seed_and_drops_the_short_final_batch(memory):
    refs = fill(memory, 10)
    loader = FeatureDataLoader(memory, collate, refs=refs, batch_size=3, seed=5)
    first = ids(loader)
    assert len(first) == len(loader) == 3 and all(len(b) == 3 for b in first)
    assert ids(loader) == first  # same epoch, same order
    loader.set_epoch(1)
    second = ids(loader)
    assert second != first
    again = FeatureDataLoader(memory, collate, refs=refs, batch_size=3, seed=5)
    again.set_epoch(1)
    assert ids(again) == second
    for batch in FeatureDataLoader(memory, collate, refs=refs, batch_size=3, seed=5):
        assert torch.equal(batch["v"].flatten(), torch.tensor([float(s[1:]) for s in batch.sample_ids]))


def test_fixed_mode_keeps_the_short_batch_without_drop_last(memory):
    loader = FeatureDataLoader(memory, collate, refs=fill(memory, 10), batch_size=4, shuffle=False, drop_last=False)
    assert [len(b) for b in ids(loader)] == [4, 4, 2] and len(loader) == 3


def test_seek_skips_batches_for_resume(memory):
    refs = fill(memory, 12)
    loader = FeatureDataLoader(memory, collate, refs=refs, batch_size=3, seed=1)
    full = ids(loader)
    loader.seek(2)
    assert ids(loader) == full[2:]
    assert ids(loader) == full  # seek applies to the next iteration only
    with pytest.raises(LoaderError, match="cannot seek to batch 5: an epoch has 4 batches on this rank"):
        loader.seek(5)


def test_ranks_get_disjoint_equal_shares(memory):
    refs = fill(memory, 11)
    shares = [sum(ids(FeatureDataLoader(memory, collate, refs=refs, batch_size=1, seed=3, rank=r, world_size=2)), [])
              for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 5
    assert not set(shares[0]) & set(shares[1])
    every = [sum(ids(FeatureDataLoader(memory, collate, refs=refs, batch_size=2, rank=r, world_size=2,
                                       drop_last=False, equal_shares=False)), []) for r in range(2)]
    assert sorted(every[0] + every[1]) == sorted(r.sample_id for r in refs)


def test_channel_mode_yields_the_short_final_batch_and_releases_only_on_complete():
    store = MemoryFeatureStore(MemoryStoreOptions(consume_once=True), BuildContext())
    plane = LocalControlPlane(LocalControlPlaneOptions(), BuildContext())
    refs = fill(store, 7)
    plane.channel.publish(refs)
    plane.channel.close()
    loader = FeatureDataLoader(store, collate, channel=plane.channel, batch_size=3, poll_timeout_s=0.05)
    batches = list(loader)
    assert [len(b.sample_ids) for b in batches] == [3, 3, 1]
    assert store.stats()["samples"] == 7  # nothing released before the trainer acks
    assert sorted(loader.in_flight) == [r.sample_id for r in refs]
    loader.complete(batches[0].sample_ids)
    assert store.stats()["samples"] == 4
    with pytest.raises(SampleNotFoundError):
        store.get(refs[[r.sample_id for r in refs].index(batches[0].sample_ids[0])])


def test_channel_mode_streams_while_a_producer_thread_publishes():
    store = MemoryFeatureStore(MemoryStoreOptions(consume_once=True), BuildContext())
    plane = LocalControlPlane(LocalControlPlaneOptions(), BuildContext())

    def produce():
        for i in range(9):
            plane.channel.publish([store.put(f"p{i}", {"v": torch.tensor([float(i)])})])
            time.sleep(0.005)
        plane.channel.close()

    thread = threading.Thread(target=produce)
    thread.start()
    loader = FeatureDataLoader(store, collate, channel=plane.channel, batch_size=2, release="after_collate",
                               poll_timeout_s=0.05)
    seen = sum(ids(loader), [])
    thread.join()
    assert seen == [f"p{i}" for i in range(9)]
    assert store.stats()["samples"] == 0


def test_a_failed_channel_surfaces_in_the_training_thread():
    store = MemoryFeatureStore(MemoryStoreOptions(), BuildContext())
    plane = LocalControlPlane(LocalControlPlaneOptions(), BuildContext())
    plane.channel.publish(fill(store, 2))
    plane.channel.fail("target engine crashed: CUDA OOM")
    loader = FeatureDataLoader(store, collate, channel=plane.channel, batch_size=2, poll_timeout_s=0.05)
    with pytest.raises(ChannelFailedError, match="target engine crashed: CUDA OOM"):
        list(loader)


def test_a_corrupt_sample_surfaces_with_its_file_name(tmp_path):
    store = DiskFeatureStore(DiskStoreOptions(path=str(tmp_path)), BuildContext())
    refs = fill(store, 4)
    victim = next(p for p in tmp_path.rglob("*.safetensors"))
    victim.write_bytes(victim.read_bytes()[:-3])
    loader = FeatureDataLoader(store, collate, refs=refs, batch_size=2, shuffle=False)
    with pytest.raises(CorruptFeatureError, match=victim.name):
        list(loader)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 4  # nothing deleted


@pytest.mark.parametrize("padded", [False, True], ids=["stacked", "pad_features"])
def test_a_flipped_byte_in_a_verified_store_stops_its_batch_before_training_sees_it(tmp_path, padded):
    """With verify_checksums the loader reads batches through get_batch; whether the collate's copies check each
    tensor (pad_features) or the checks run after a collate that copies otherwise, a sample that fails stops its
    batch."""
    from specforge_core.data.collate import pad_features

    def padding(samples, sample_ids):
        padded_features, _lengths = pad_features(samples, sample_ids, ["v"], strategy="test")
        return TrainBatch(tensors=padded_features, sample_ids=sample_ids, num_tokens=len(samples))

    store = DiskFeatureStore(DiskStoreOptions(path=str(tmp_path), verify_checksums=True), BuildContext())
    refs = fill(store, 4)
    victim = store.path_of(refs[3])
    data = bytearray(open(victim, "rb").read())
    data[-2] ^= 0x10
    open(victim, "wb").write(bytes(data))
    loader = FeatureDataLoader(store, padding if padded else collate, refs=refs, batch_size=2, shuffle=False)
    seen = []
    with pytest.raises(CorruptFeatureError, match=re.escape(victim) + r".*fails its xxh3-64 check"):
        for batch in loader:
            seen.append((list(batch.sample_ids), batch.tensors["v"].view(-1).tolist()))
    assert seen == [(["s000", "s001"], [0.0, 1.0])]  # the first batch trained, the damaged one never
    assert loader.stats["batches"] == 1 and loader.stats["collate_s"] > 0 and loader.stats["get_s"] > 0
    assert len(list(tmp_path.rglob("*.safetensors"))) == 4  # nothing deleted


def test_loader_needs_exactly_one_source(memory):
    with pytest.raises(LoaderError, match="exactly one source"):
        FeatureDataLoader(memory, collate, batch_size=2)
    with pytest.raises(LoaderError, match="release must be one of on_complete, after_collate, never"):
        FeatureDataLoader(memory, collate, refs=[], batch_size=2, release="sometimes")


def test_breaking_out_early_stops_the_prefetch_thread(memory):
    loader = FeatureDataLoader(memory, collate, refs=fill(memory, 40), batch_size=1, prefetch=2)
    for _batch in loader:
        break

    def prefetch_alive() -> bool:
        return any(t.name == "specforge-loader" and t.is_alive() for t in threading.enumerate())

    deadline = time.monotonic() + 10  # generous: a loaded CI machine may be slow to schedule it
    while prefetch_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not prefetch_alive()


def test_large_batches_a_training_loop_still_holds_are_never_reused_and_dropped_ones_are():
    """A collate's batches of 32 MiB or more come from a pool of reused memory (specforge_core.heap): a batch
    the loop keeps, or any view of it, keeps its values while the loader builds the next ones."""
    from specforge_core import heap
    from specforge_core.data.collate import pad_features

    heap.BATCHES.clear()
    reused_before = heap.BATCHES.stats["reused"]  # counts since the process began (other tests reuse too)
    store = MemoryFeatureStore(MemoryStoreOptions(consume_once=False), BuildContext())
    rows = 2100  # about 16 MiB of bf16 4096-wide rows a sample: batches of two over 32 MiB
    refs = [store.put(f"s{i}", {"input_ids": torch.full((rows - i,), i),
                                "hidden_states": torch.full((rows - i, 4096), float(i + 1), dtype=torch.bfloat16)})
            for i in range(8)]
    loader = FeatureDataLoader(store, lambda samples, ids: pad_features(samples, ids, ["hidden_states", "input_ids"],
                                                                        strategy="test")[0],
                               batch_size=2, refs=refs, shuffle=False, prefetch=2)
    kept = [batch["hidden_states"][1] for batch in loader]  # a view of each batch's second row, kept
    assert len(kept) == 4 and heap.BATCHES.stats["reused"] == reused_before
    for index, row in enumerate(kept):  # sample 2*index+1: its rows, then one row of padding per missing row
        length = rows - (2 * index + 1)
        assert row[:length].eq(2 * index + 2).all() and row[length:].eq(0).all()
    del kept
    seen = set()
    for batch in loader:  # each batch dropped before the next is read: the pool hands blocks out again
        assert batch["hidden_states"][0, : rows - 8].eq(float(batch["input_ids"][0, 0]) + 1).all()
        seen.add(batch["hidden_states"].data_ptr())
    assert heap.BATCHES.stats["reused"] >= reused_before + 1 and len(seen) <= heap.BATCHES.keep
    heap.BATCHES.clear()
