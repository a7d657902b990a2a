"""The disk store's packs: a finished store's sample files moved into a few large files read through kept maps."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from specforge_core.builtin import DiskStoreOptions
from specforge_core.checksums import copy_checked
from specforge_core.errors import CorruptFeatureError, FeatureStoreError, SampleNotFoundError, StaleRefError
from specforge_core.feature_stores.disk import DiskFeatureStore
from specforge_core.protocols import BuildContext
from specforge_core.testing.feature_store_suite import assert_same_tensors

CONTEXT = BuildContext(run_id="test-run")


def disk_store(path, **options) -> DiskFeatureStore:
    return DiskFeatureStore(DiskStoreOptions(path=str(path), **options), CONTEXT)


def tensors_of(index: int) -> dict[str, torch.Tensor]:
    """A sample of several dtypes, odd sizes and an empty tensor: index i has 5 + i tokens."""
    gen = torch.Generator().manual_seed(index)
    tokens = 5 + index
    return {"input_ids": torch.arange(tokens) + 1000 * index,
            "hidden_states": torch.randn(tokens, 12, generator=gen).to(torch.bfloat16),
            "scores": torch.randn(tokens, 3, generator=gen),
            "flags": torch.ones(tokens, dtype=torch.bool),
            "nothing": torch.zeros(0, 4)}


def sample_files(root) -> list[str]:
    return sorted(name for _dir, _subdirs, names in os.walk(root) for name in names if name.endswith(".safetensors"))


def packs_of(root) -> list[str]:
    return sorted(os.listdir(os.path.join(root, "packs"))) if os.path.isdir(os.path.join(root, "packs")) else []


@pytest.fixture
def filled(tmp_path):
    store = disk_store(tmp_path / "store", verify_checksums=True)
    refs = [store.put(f"s{i}", tensors_of(i), meta={"split": "train"}) for i in range(6)]
    return store, refs, tmp_path / "store"


def test_pack_moves_every_file_into_one_pack_and_reads_back_the_same_tensors(filled):
    store, refs, root = filled
    file_bytes = sum(os.path.getsize(store.path_of(ref)) for ref in refs)
    before = store.stats()
    counts = store.pack()
    assert counts == {"packs": 1, "samples": 6, "bytes": file_bytes}
    assert sample_files(root) == []
    assert sorted(os.listdir(root)) == ["STORE.json", "packs"]  # the emptied shard directories are gone too
    data, index = packs_of(root)
    assert data.endswith(".data") and index == data[:-len(".data")] + ".json"
    assert store.scan() == refs  # the same refs, generations and all
    for i, ref in enumerate(refs):
        assert_same_tensors(store.get(ref), tensors_of(i))
        assert store.path_of(ref) == str(root / "packs" / data)
    assert store.stats()["samples"] == before["samples"] == 6
    # a store opened afterwards reads the pack, with and without checksums, and in batches
    for verify in (True, False):
        again = disk_store(root, verify_checksums=verify)
        assert again.scan() == refs
        assert again.get_batch(refs, ["input_ids", "scores"], lambda samples: [
            (s["input_ids"][0].item(), s["scores"].shape[0]) for s in samples]) == [(1000 * i, 5 + i) for i in range(6)]
        assert_same_tensors(again.get(refs[3]), tensors_of(3))


def test_every_packed_file_starts_on_64_bytes_and_its_bytes_are_the_files(filled):
    store, refs, root = filled
    files = {ref.sample_id: open(store.path_of(ref), "rb").read() for ref in refs}
    store.pack()
    index = json.loads((root / "packs" / packs_of(root)[1]).read_text())
    data = (root / "packs" / index["data"]).read_bytes()
    assert index["format"] == "specforge-disk-pack" and index["version"] == 1 and index["bytes"] == len(data)
    for sample_id, generation, offset, size, _ref in index["samples"]:
        assert offset % 64 == 0
        assert data[offset:offset + size] == files[sample_id]
    assert [entry[0] for entry in index["samples"]] == [f"s{i}" for i in range(6)]


def test_max_bytes_splits_the_samples_and_a_larger_sample_gets_a_pack_of_its_own(tmp_path):
    store = disk_store(tmp_path / "store")
    refs = [store.put(f"s{i}", {"x": torch.zeros(100 if i != 2 else 3000)}) for i in range(5)]
    size = os.path.getsize(store.path_of(refs[0]))
    counts = store.pack(max_bytes=2 * size + 100)  # two small samples per pack; s2 (12 KB) alone
    assert counts["packs"] == 3 and counts["samples"] == 5
    indexes = [json.loads((tmp_path / "store" / "packs" / name).read_text())
               for name in packs_of(tmp_path / "store") if name.endswith(".json")]
    assert sorted(sorted(entry[0] for entry in index["samples"]) for index in indexes) == [
        ["s0", "s1"], ["s2"], ["s3", "s4"]]
    for ref in refs:
        assert store.get(ref)["x"].shape == (100 if ref.sample_id != "s2" else 3000,)


def test_packing_again_packs_only_new_samples_and_capture_can_add_more(filled):
    store, refs, root = filled
    store.pack()
    assert store.pack() == {"packs": 0, "samples": 0, "bytes": 0}
    new = store.put("s9", tensors_of(9))
    assert sample_files(root) and store.scan() == refs + [new]
    assert store.pack()["samples"] == 1
    assert len(packs_of(root)) == 4 and sample_files(root) == []
    assert_same_tensors(disk_store(root).get(new), tensors_of(9))


def test_a_reader_opened_before_the_pack_finds_its_samples_in_it(filled):
    store, refs, root = filled
    reader = disk_store(root, verify_checksums=True)
    assert_same_tensors(reader.get(refs[1]), tensors_of(1))  # from the file
    store.pack()
    assert_same_tensors(reader.get(refs[1]), tensors_of(1))  # the file is gone: from the pack
    assert reader.scan() == refs


def test_packed_samples_refuse_put_and_abort_and_nothing_changes(filled):
    store, refs, root = filled
    store.pack()
    listing = packs_of(root)
    for call, op in ((lambda: store.put("s2", tensors_of(7)), "put"), (lambda: store.abort("s2"), "abort")):
        with pytest.raises(FeatureStoreError, match=rf"{op}\('s2'\): the sample is packed in .*pack-[0-9a-f]{{12}}\.data, "
                                                    r"and packs are read-only; nothing was changed"):
            call()
    assert packs_of(root) == listing and sample_files(root) == []
    assert_same_tensors(store.get(refs[2]), tensors_of(2))
    assert store.stats()["puts"] == 6 and store.stats()["aborts"] == 0


def test_release_of_a_packed_sample_keeps_it_even_in_a_consume_once_store(filled):
    _store, refs, root = filled
    _store.pack()
    consumer = disk_store(root, consume_once=True)
    consumer.release(refs[0])
    assert consumer.stats()["releases"] == 1
    assert_same_tensors(consumer.get(refs[0]), tensors_of(0))


def test_a_stale_ref_to_an_older_generation_than_the_packed_one_says_so(filled):
    store, refs, root = filled
    newer = store.put("s0", tensors_of(5))  # before packing: the older file is replaced
    store.pack()
    with pytest.raises(StaleRefError, match=rf"names generation {refs[0].generation}, but the sample was put again "
                                            rf"as generation {newer.generation}"):
        store.get(refs[0])
    assert_same_tensors(store.get(newer), tensors_of(5))


def test_a_generation_newer_than_the_packed_one_is_not_found(filled):
    import attrs

    store, refs, _root = filled
    store.pack()
    with pytest.raises(SampleNotFoundError, match="'s1'"):
        store.get(attrs.evolve(refs[1], generation=refs[1].generation + 1))


def test_a_flipped_byte_in_a_pack_fails_its_sample_only_and_names_the_pack(filled):
    store, refs, root = filled
    store.pack()
    index = json.loads((root / "packs" / packs_of(root)[1]).read_text())
    data_path = root / "packs" / index["data"]
    _sid, _gen, offset, size, _ref = index["samples"][3]
    data = bytearray(data_path.read_bytes())
    data[offset + size - 5] ^= 0x40  # the last tensor's bytes of s3
    data_path.write_bytes(bytes(data))
    reader = disk_store(root, verify_checksums=True)
    with pytest.raises(CorruptFeatureError, match=rf"{index['data']} \(sample 's3'\): feature '\w+' fails its xxh3-64 "
                                                  r"check .* its bytes changed after they were written\. The pack is "
                                                  rf"damaged: delete {index['data']} and {index['data'][:-5]}\.json "
                                                  r"from .* and run the same `specforge capture` again"):
        reader.get(refs[3])
    with pytest.raises(CorruptFeatureError, match=r"\(sample 's3'\)"):
        reader.get_batch(refs, None, lambda samples: None)
    copied = []

    def collate(samples):  # copies as pad_right does
        for index, sample in enumerate(samples):
            for tensor in sample.values():
                copy_checked(torch.empty_like(tensor), tensor)
                copied.append(index)

    with pytest.raises(CorruptFeatureError, match=r"\(sample 's3'\).* fails its xxh3-64 check .* The pack is damaged"):
        reader.get_batch(refs, None, collate)
    whole = len(tensors_of(0))
    assert copied[:3 * whole] == [0] * whole + [1] * whole + [2] * whole  # each tensor checked as it was copied
    assert set(copied[3 * whole:]) <= {3} and len(copied) < 4 * whole  # and the damaged one of s3 never was
    for i in (0, 1, 2, 4, 5):
        assert_same_tensors(reader.get(refs[i]), tensors_of(i))


def test_writing_into_a_packed_sample_changes_neither_the_pack_nor_another_process_and_is_reported(filled):
    store, refs, root = filled
    store.pack()
    data_path = root / "packs" / packs_of(root)[0]
    before = data_path.read_bytes()
    store.get(refs[2])["scores"].fill_(7.0)  # a caller that should only read
    assert data_path.read_bytes() == before
    assert_same_tensors(disk_store(root).get(refs[2]), tensors_of(2))  # another store, its own map
    with pytest.raises(FeatureStoreError, match=r"\(sample 's2'\): the sample's bytes in this process's map of the "
                                                r"pack differ from the file, which is intact: a caller wrote into "
                                                r"tensors a get returned or a collate was given"):
        store.get(refs[2])
    with pytest.raises(FeatureStoreError, match=r"\(sample 's2'\): .* a caller wrote into tensors"):  # in a copy too
        store.get_batch(refs[1:3], None, lambda samples: [copy_checked(torch.empty_like(t), t)
                                                          for sample in samples for t in sample.values()])
    assert_same_tensors(store.get(refs[1]), tensors_of(1))


def test_a_damaged_file_stops_the_pack_before_it_and_nothing_is_lost(tmp_path):
    store = disk_store(tmp_path / "store", verify_checksums=True)
    refs = [store.put(f"s{i}", tensors_of(i)) for i in range(4)]
    first_two = sum(-(-os.path.getsize(store.path_of(ref)) // 64) * 64 for ref in refs[:2])
    victim = store.path_of(refs[2])
    data = bytearray(open(victim, "rb").read())
    data[-3] ^= 0x01
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CorruptFeatureError, match=rf"{os.path.basename(victim)}: feature '\w+' fails its xxh3-64"):
        store.pack(max_bytes=first_two)  # s0, s1 in the first pack; s2 is damaged
    assert len(packs_of(tmp_path / "store")) == 2  # the first pack committed, the second's data removed
    assert len(sample_files(tmp_path / "store")) == 2  # s2 and s3 stay as files
    for i in (0, 1, 3):
        assert_same_tensors(store.get(refs[i]), tensors_of(i))
    with pytest.raises(CorruptFeatureError):
        store.get(refs[2])


def test_a_crash_before_the_index_leaves_the_files_and_one_after_it_leaves_both(filled, monkeypatch):
    store, refs, root = filled
    saved = {ref.sample_id: open(store.path_of(ref), "rb").read() for ref in refs}
    paths = {ref.sample_id: store.path_of(ref) for ref in refs}
    from specforge_core.feature_stores import disk

    def crash(*_args, **_kwargs):
        raise OSError("power cut")

    monkeypatch.setattr(disk, "atomic_write_text", crash)  # the pack's data is written, its index never is
    with pytest.raises(OSError, match="power cut"):
        store.pack()
    monkeypatch.undo()
    orphan, = packs_of(root)  # its data, which no index names: ignored, and removed by the next pack
    assert orphan.endswith(".data") and len(sample_files(root)) == 6
    reader = disk_store(root)
    assert reader.scan() == refs
    reader.pack()
    assert orphan not in packs_of(root)
    # a crash after the index, before the files went: put them back
    for sample_id, path in paths.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)  # the pack removed the emptied shard directories
        open(path, "wb").write(saved[sample_id])
    again = disk_store(root, verify_checksums=True)
    assert again.scan() == refs and again.stats()["samples"] == 6
    for i, ref in enumerate(refs):
        assert_same_tensors(again.get(ref), tensors_of(i))
    assert again.pack() == {"packs": 0, "samples": 0, "bytes": 0}  # the leftovers are deleted, nothing repacked
    assert sample_files(root) == [] and len(packs_of(root)) == 2


def test_a_damaged_or_lost_pack_index_or_data_is_an_error_naming_it(filled):
    store, refs, root = filled
    store.pack()
    data, index = packs_of(root)
    shutil.copy(root / "packs" / index, root / "index.bak")
    (root / "packs" / index).write_text("{not json")
    with pytest.raises(CorruptFeatureError, match=rf"{index}: the pack index cannot be read"):
        disk_store(root)
    shutil.copy(root / "index.bak", root / "packs" / index)
    os.truncate(root / "packs" / data, 100)
    with pytest.raises(CorruptFeatureError, match=rf"{data}: it is 100 bytes, but its index says \d+"):
        disk_store(root).get(refs[0])
    index_json = json.loads((root / "packs" / index).read_text())
    index_json["samples"][2][2] = index_json["bytes"] + 64  # s2 placed past the pack's end
    (root / "packs" / index).write_text(json.dumps(index_json))
    with pytest.raises(CorruptFeatureError, match=rf"{index}: sample 's2' lies outside its pack"):
        disk_store(root)
    shutil.copy(root / "index.bak", root / "packs" / index)
    os.remove(root / "packs" / data)
    with pytest.raises(FeatureStoreError, match=rf"{data} is gone but its index {index} is still there: delete the "
                                                r"index too and run the same `specforge capture` again"):
        disk_store(root).get(refs[0])
