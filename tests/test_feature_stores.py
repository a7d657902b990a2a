"""The built-in feature stores: the shared contract, then what only memory or only disk does."""

from __future__ import annotations

import gc
import json
import os
import re
import threading
import weakref
import zlib

import crc32c
import xxhash

import attrs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specforge_core.builtin import DiskStoreOptions, MemoryStoreOptions
from specforge_core.contracts import FeatureSpec
from specforge_core.errors import (
    CorruptFeatureError,
    FeatureStoreError,
    SampleNotFoundError,
    StaleRefError,
    StoreFullError,
)
from specforge_core.checksums import CRC32C
from specforge_core.feature_stores.disk import DiskFeatureStore
from specforge_core.feature_stores.memory import MemoryFeatureStore
from specforge_core.protocols import BuildContext, FeatureStore
from specforge_core.testing.feature_store_suite import (
    FeatureStoreConformance,
    assert_same_tensors,
    counts,
    sample_tensors,
)

CONTEXT = BuildContext(run_id="test-run")


def memory_store(**options) -> MemoryFeatureStore:
    return MemoryFeatureStore(MemoryStoreOptions(**options), CONTEXT)


def disk_store(path, **options) -> DiskFeatureStore:
    return DiskFeatureStore(DiskStoreOptions(path=str(path), **options), CONTEXT)


# -- the contract, for each store in each mode ----------------------------------------------


class TestMemoryStoreConsumeOnce(FeatureStoreConformance):
    consume_once = True

    def make_store(self, tmp_path):
        return memory_store(consume_once=True)


class TestMemoryStoreRetaining(FeatureStoreConformance):
    consume_once = False

    def make_store(self, tmp_path):
        return memory_store(consume_once=False)


class TestDiskStoreConsumeOnce(FeatureStoreConformance):
    consume_once = True
    persistent = True

    def make_store(self, tmp_path):
        return disk_store(tmp_path / "store", consume_once=True)


class TestDiskStoreRetaining(FeatureStoreConformance):
    consume_once = False
    persistent = True

    def make_store(self, tmp_path):
        # fsync off here (it is on in every other disk test) so the retained-mode run stays fast
        return disk_store(tmp_path / "store", consume_once=False, fsync=False)


def test_both_stores_satisfy_the_feature_store_protocol(tmp_path):
    assert isinstance(memory_store(), FeatureStore)
    assert isinstance(disk_store(tmp_path / "store"), FeatureStore)


# -- memory ---------------------------------------------------------------------------------


def test_memory_uri_names_the_run_and_differs_per_instance():
    first, second = memory_store(), memory_store()
    assert re.fullmatch(r"memory://test-run/[0-9a-f]{12}", first.uri)
    assert first.uri != second.uri


def test_memory_put_beyond_max_bytes_raises_store_full_and_loses_nothing():
    store = memory_store(max_bytes=600)
    kept = store.put("a", {"x": torch.arange(50, dtype=torch.int64)})  # 400 bytes
    before = counts(store.stats())
    with pytest.raises(StoreFullError, match=r"400 bytes .*resident.*max_bytes=600.*'b' needs 400 bytes.*raise "
                                              r"max_bytes"):
        store.put("b", {"x": torch.arange(50, dtype=torch.int64)})
    assert counts(store.stats()) == before
    assert_same_tensors(store.get(kept), {"x": torch.arange(50, dtype=torch.int64)})
    with pytest.raises(SampleNotFoundError, match="'b'.*never stored"):
        store.get(attrs.evolve(kept, sample_id="b"))


def test_memory_refused_reput_keeps_the_current_generation():
    store = memory_store(max_bytes=600)
    kept = store.put("a", {"x": torch.zeros(100)})  # 400 bytes
    with pytest.raises(StoreFullError):
        store.put("a", {"x": torch.zeros(200)})  # would be 800 bytes once the old copy is gone
    assert_same_tensors(store.get(kept), {"x": torch.zeros(100)})


def test_memory_reput_counts_only_the_newest_generation_against_the_cap():
    store = memory_store(max_bytes=600)
    store.put("a", {"x": torch.zeros(100)})
    ref = store.put("a", {"x": torch.ones(150)})  # 600 bytes: fits once the old 400 are dropped
    assert store.stats()["bytes_resident"] == 600
    store.release(ref)
    assert store.put("b", {"x": torch.zeros(150)}).nbytes == 600


def test_memory_bytes_resident_is_exactly_the_tensor_bytes():
    store = memory_store()
    ref = store.put("s", sample_tensors(tokens=6, width=4))
    assert store.stats()["bytes_resident"] == ref.nbytes == 6 * 8 + 6 * 4 * 2 + 6


def test_memory_slice_of_a_padded_batch_does_not_pin_the_batch():
    batch = torch.zeros(8, 1024, 16)
    alive = weakref.ref(batch)
    store = memory_store()
    ref = store.put("s", {"hidden_states": batch[3, :10]})
    stored = store.get(ref)["hidden_states"]
    assert stored.untyped_storage().nbytes() == 10 * 16 * 4
    del batch
    gc.collect()
    assert alive() is None


def test_memory_owned_tensor_is_kept_without_a_copy():
    tensor = torch.randn(10, 4)
    store = memory_store()
    ref = store.put("s", {"h": tensor})
    assert store.get(ref)["h"].data_ptr() == tensor.data_ptr()


def test_memory_non_contiguous_tensor_is_stored_as_a_compact_copy():
    base = torch.arange(12.0).reshape(3, 4)
    store = memory_store()
    got = store.get(store.put("s", {"t": base.t()}))["t"]
    assert got.is_contiguous()
    assert torch.equal(got, base.t())


# -- disk: layout, naming, atomicity --------------------------------------------------------


def sample_file(store: DiskFeatureStore, sample_id: str):
    """The one published file of ``sample_id`` (found by listing, as an operator would)."""
    slug = re.sub(r"[^A-Za-z0-9_-]", "_", sample_id)[:40]
    files = [p for p in _published(store) if p.name.startswith(slug + ".")]
    assert len(files) == 1, files
    return files[0]


def _published(store: DiskFeatureStore):
    from pathlib import Path

    return sorted(Path(store.root).rglob("*.safetensors"))


def test_disk_creates_a_manifest_and_one_sharded_file_per_sample(tmp_path):
    store = disk_store(tmp_path / "store")
    store.put("s", sample_tensors())
    manifest = json.loads((tmp_path / "store" / "STORE.json").read_text())
    assert manifest == {"format": "specforge-disk-store", "version": 1, "token_sha256": None}
    path = sample_file(store, "s")
    assert path.parent.parent.parent == tmp_path / "store"
    assert re.fullmatch(r"[0-9a-f]{2}", path.parent.name) and re.fullmatch(r"[0-9a-f]{2}", path.parent.parent.name)
    assert store.uri == f"disk://{tmp_path / 'store'}"


def test_disk_relative_path_gives_an_absolute_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = disk_store("relative")
    assert store.uri == f"disk://{tmp_path / 'relative'}"


def test_disk_path_defaults_to_the_run_output_directory(tmp_path):
    store = DiskFeatureStore(DiskStoreOptions(), BuildContext(run_id="r", output_dir=str(tmp_path / "out")))
    assert store.root == str(tmp_path / "out" / "features")


def test_disk_without_path_or_output_directory_says_what_to_set():
    with pytest.raises(FeatureStoreError, match=r"needs a directory.*feature_store\.path"):
        DiskFeatureStore(DiskStoreOptions(), BuildContext(run_id="r"))


def test_disk_puts_leave_no_temporary_files_and_reput_removes_the_older_file(tmp_path):
    store = disk_store(tmp_path / "store")
    for seed in range(3):
        ref = store.put("s", sample_tensors(seed=seed))
    store.put("t", sample_tensors())
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert sorted(p.name.split(".")[0] for p in files) == ["STORE", "s", "t"]
    assert sample_file(store, "s").name.endswith(f".{ref.generation}.safetensors")


def test_disk_leftover_temporary_file_of_a_crashed_put_is_ignored(tmp_path):
    store = disk_store(tmp_path / "store")
    ref = store.put("s", sample_tensors())
    shard = sample_file(store, "s").parent
    stem = sample_file(store, "s").name.rsplit(".", 2)[0]
    (shard / f".{stem}.0123456789ab.tmp").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"trunc")
    assert store.scan() == [ref]
    assert_same_tensors(store.get(ref), sample_tensors())
    assert counts(store.stats())["samples"] == 1
    assert (shard / f".{stem}.0123456789ab.tmp").exists()  # left for the operator, never read


def test_disk_consume_once_release_deletes_the_file(tmp_path):
    store = disk_store(tmp_path / "store", consume_once=True)
    ref = store.put("s", sample_tensors())
    store.release(ref)
    assert _published(store) == []


WEIRD_IDS = ["a/../b", "a_.._b", "../../etc/passwd", "/abs/path", "日本語 サンプル", "with.dots and spaces",
             "x" * 500, "back\\slash:colon*?", ".hidden", "nul\x00byte", "lone\udcffsurrogate", "S", "s"]


def test_disk_weird_sample_ids_stay_inside_the_store_and_roundtrip(tmp_path):
    store = disk_store(tmp_path / "store", fsync=False)
    refs = {sample_id: store.put(sample_id, sample_tensors(seed=i)) for i, sample_id in enumerate(WEIRD_IDS)}
    for i, sample_id in enumerate(WEIRD_IDS):
        assert_same_tensors(store.get(refs[sample_id]), sample_tensors(seed=i))
    root = (tmp_path / "store").resolve()
    for path in (tmp_path / "store").rglob("*"):
        assert path.resolve().is_relative_to(root)
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", path.name), path.name
    assert sorted(ref.sample_id for ref in store.scan()) == sorted(WEIRD_IDS)
    assert len(_published(store)) == len(WEIRD_IDS)


def test_disk_scan_lists_the_newest_generation_of_every_sample(tmp_path):
    store = disk_store(tmp_path / "store")
    store.put("b", sample_tensors(seed=1))
    newest_b = store.put("b", sample_tensors(seed=2), {"line": 2})
    a = store.put("a", sample_tensors(seed=3))
    released = store.put("c", sample_tensors(seed=4))
    store.abort("c")
    assert store.scan() == [a, newest_b]
    assert disk_store(tmp_path / "store").scan() == [a, newest_b]
    assert released not in store.scan()


def test_disk_scan_reads_a_header_longer_than_its_first_read(tmp_path):
    # scan reads 16 KiB of each file first; a larger header (long metadata) needs a second read
    store = disk_store(tmp_path / "store")
    ref = store.put("long", sample_tensors(), {"notes": "x" * 40_000})
    assert store.scan() == [ref]
    assert store.scan()[0].meta["notes"] == "x" * 40_000


def test_disk_generations_increase_across_store_instances_sharing_a_directory(tmp_path):
    first = disk_store(tmp_path / "store")
    second = disk_store(tmp_path / "store")
    old = first.put("s", sample_tensors(seed=1))
    new = second.put("s", sample_tensors(seed=2))
    assert new.generation > old.generation
    with pytest.raises(StaleRefError, match=rf"'s'.*{old.generation}.*{new.generation}"):
        first.get(old)
    assert_same_tensors(first.get(new), sample_tensors(seed=2))


def test_disk_stats_count_files_on_disk(tmp_path):
    store = disk_store(tmp_path / "store")
    store.put("a", sample_tensors())
    store.put("b", sample_tensors())
    stats = store.stats()
    assert stats["samples"] == 2
    assert stats["bytes_resident"] == sum(p.stat().st_size for p in _published(store))


def test_disk_one_tensor_under_two_feature_names_is_stored_twice(tmp_path):
    store = disk_store(tmp_path / "store")
    shared = torch.arange(6)
    got = store.get(store.put("s", {"input_ids": shared, "labels": shared}))
    assert_same_tensors(got, {"input_ids": torch.arange(6), "labels": torch.arange(6)})


def test_disk_put_without_fsync_reads_back(tmp_path):
    store = disk_store(tmp_path / "store", fsync=False)
    assert_same_tensors(store.get(store.put("s", sample_tensors())), sample_tensors())


# -- disk: damaged files are errors, never wrong tensors -------------------------------------


@pytest.fixture
def damaged(tmp_path):
    """A store with a ``victim`` sample to damage and a ``bystander`` that must survive it."""
    store = disk_store(tmp_path / "store", verify_checksums=True)
    victim = store.put("victim", {"hidden_states": torch.randn(64, 32)})
    bystander = store.put("bystander", sample_tensors())
    return store, victim, bystander, sample_file(store, "victim")


def _bystander_unharmed(store, bystander) -> None:
    assert_same_tensors(store.get(bystander), sample_tensors())


@pytest.mark.parametrize(("keep", "why"), [
    (0, "it is 0 bytes, shorter than a safetensors header"),
    (7, "it is 7 bytes, shorter than a safetensors header"),
    (100, r"its header claims \d+ bytes but the file is 100"),
    (-1, r"its header describes 8192 bytes of tensor data but the file holds 8191 \(truncated"),
], ids=["empty", "in-length-prefix", "in-header", "one-byte-short"])
def test_disk_truncated_file_is_corrupt_and_named(damaged, keep, why):
    store, victim, bystander, path = damaged
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + ": " + why + r".*delete it and capture"):
        store.get(victim)
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path))):
        store.scan()
    assert path.exists()  # kept for inspection; the store never deletes evidence
    _bystander_unharmed(store, bystander)


def test_disk_truncation_is_caught_even_without_checksums(damaged):
    store, victim, bystander, path = damaged
    store.verify_checksums = False
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path))):
        store.get(victim)


def test_disk_corrupted_header_is_corrupt_and_named(damaged):
    store, victim, bystander, path = damaged
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16  # the JSON header starts after the 8-byte length
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + ": its header is not JSON"):
        store.get(victim)
    _bystander_unharmed(store, bystander)


def _rewrite_header(path, edit) -> None:
    """Rewrite a sample file's safetensors header through ``edit(header_dict)``, keeping its data."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])


@pytest.mark.parametrize(("edit", "why"), [
    (lambda h: h["hidden_states"].update(dtype="Q7"), r"its header entry for 'hidden_states' is malformed \(unknown safetensors dtype 'Q7'"),
    (lambda h: h["hidden_states"].update(shape=[64, -32]), "its header entry for 'hidden_states' is malformed .*non-negative"),
    (lambda h: h["hidden_states"].pop("data_offsets"), "its header entry for 'hidden_states' is malformed"),
    (lambda h: h["hidden_states"].update(shape=[64, 16]), r"feature 'hidden_states' spans bytes 0..8192 but float32\[64, 16\] needs 4096"),
    (lambda h: h["hidden_states"].update(data_offsets=[4, 8196]), "its tensors leave a gap or overlap at byte 4"),
    (lambda h: h.update(__metadata__={"specforge.ref": 3}), "its __metadata__ is not a map of strings"),
    (lambda h: h.pop("__metadata__"), "its specforge metadata is missing or malformed"),
    (lambda h: h.update(__metadata__={**h["__metadata__"], "specforge.checksums": "[]"}),
     "its recorded xxh3-64 checksums are not a map"),
    (lambda h: h["__metadata__"].pop("specforge.checksums"),
     r"its specforge metadata is missing or malformed \(KeyError"),
    (lambda h: h["__metadata__"].update({"specforge.checksum": "sha3"}),
     r"it records checksums of kind 'sha3', which this specforge does not know \(known: crc32, crc32c, xxh3-64\); "
     "read it with the release that wrote it, or turn verify_checksums off"),
    (lambda h: h.update(other=h.pop("hidden_states")), "it has no tensor 'hidden_states', which the ref lists"),
], ids=["dtype", "negative-dim", "no-offsets", "size-vs-shape", "gap", "metadata-type", "no-metadata", "crc-not-map",
        "no-crc", "unknown-checksum-kind", "missing-tensor"])
def test_disk_malformed_header_entries_are_corrupt_and_named(damaged, edit, why):
    store, victim, bystander, path = damaged
    _rewrite_header(path, edit)
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + ": " + why):
        store.get(victim)
    assert path.exists()
    _bystander_unharmed(store, bystander)


def test_disk_header_that_is_not_an_object_is_corrupt(damaged):
    store, victim, bystander, path = damaged
    text = b"[1, 2]"
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + ": its header is not a JSON object"):
        store.get(victim)
    _bystander_unharmed(store, bystander)


def test_disk_bytes_appended_after_the_tensors_are_corrupt(damaged):
    store, victim, bystander, path = damaged
    path.write_bytes(path.read_bytes() + b"\0" * 16)
    with pytest.raises(CorruptFeatureError, match="describes 8192 bytes of tensor data but the file holds 8208"):
        store.get(victim)
    _bystander_unharmed(store, bystander)


def test_disk_get_returns_writable_tensors_that_outlive_the_file_and_never_write_to_it(tmp_path):
    store = disk_store(tmp_path / "store", consume_once=True)
    ref = store.put("s", sample_tensors())
    path = sample_file(store, "s")
    first, second = store.get(ref), store.get(ref)
    for tensor in first.values():
        tensor.zero_()  # private copy-on-write pages: the file and other gets keep their bytes
    assert all(int(t.count_nonzero()) == 0 for t in first.values())
    assert_same_tensors(second, sample_tensors())
    store.release(ref)
    assert not path.exists()
    assert_same_tensors(second, sample_tensors())  # still readable after the file is gone


def test_disk_flipped_data_byte_fails_the_checksum(damaged):
    store, victim, bystander, path = damaged
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + r".*'hidden_states' fails its xxh3-64 check"):
        store.get(victim)
    _bystander_unharmed(store, bystander)


def test_disk_batch_read_checks_each_tensor_just_before_the_collate_copies_it_and_the_rest_after(damaged):
    """xxh3-64 files: get_batch hands each tensor's check to the copy that reads it (copy_checked, as pad_right
    copies), in the reading thread; what the collate did not copy is checked after it, before anything returns."""
    from specforge_core import checksums

    store, victim, bystander, _path = damaged
    events, real = [], checksums.checksum_bytes

    def logged(data, kind=checksums.DEFAULT_CHECKSUM):
        events.append(("hash", len(data), threading.current_thread().name))
        return real(data, kind)

    def then(samples):
        dest = torch.empty(64, 32)
        checksums.copy_checked(dest, samples[0]["hidden_states"])
        events.append(("copy", "victim"))
        checksums.copy_checked(torch.empty(6, 4), samples[1]["hidden_states"][:6])  # a slice: not the checked tensor
        events.append(("copy", "a slice"))
        return dest

    me = threading.current_thread().name
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checksums, "checksum_bytes", logged)
        got = store.get_batch([victim, bystander], None, then)
    assert torch.equal(got, store.get(victim)["hidden_states"])
    sizes = {name: t.numel() * t.element_size() for name, t in sample_tensors().items()}
    assert events[:3] == [("hash", 64 * 32 * 4, me), ("copy", "victim"), ("copy", "a slice")]
    assert sorted(events[3:]) == sorted(("hash", size, me) for size in sizes.values())  # after then, this thread
    # outside a batch read copy_checked is a plain copy, and a store without checksums leaves nothing to check
    events.clear()
    dest = torch.empty(64, 32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checksums, "checksum_bytes", logged)
        checksums.copy_checked(dest, store.get(victim)["hidden_states"])
        events.clear()
        plain = disk_store(store.root, verify_checksums=False)
        assert plain.get_batch([bystander], ["input_ids"], lambda samples: list(samples[0])) == ["input_ids"]
    assert events == []


def test_disk_batch_read_of_a_pre_crc32c_file_checks_it_in_the_collates_copies_too(tmp_path):
    """A zlib-crc32 file's tensors are checked as the collate copies them, like newer files' (the crc of a large
    tensor split over the block threads); a flipped byte raises at that copy, naming the crc32 check."""
    from specforge_core.checksums import copy_checked

    store = disk_store(tmp_path / "store", verify_checksums=True)
    tensors = {"hidden_states": torch.randn(64, 32), "input_ids": torch.arange(64)}
    ref, path = _write_pre_crc32c_file(store, "old", tensors)
    copied = []

    def collate(samples):
        for name, tensor in samples[0].items():
            copy_checked(torch.empty_like(tensor), tensor)
            copied.append(name)
        return [dict(s) for s in samples]

    gets_before = store.stats()["gets"]
    assert_same_tensors(store.get_batch([ref], None, collate)[0], tensors)
    assert store.stats()["gets"] == gets_before + 1
    data = bytearray(path.read_bytes())
    data[data.find(tensors["hidden_states"][-1].numpy().tobytes()) + 3] ^= 0x01
    path.write_bytes(bytes(data))
    copied.clear()
    with pytest.raises(CorruptFeatureError, match="'hidden_states' fails its crc32 check"):
        store.get_batch([ref], None, collate)
    assert "hidden_states" not in copied  # raised before its copy


@pytest.mark.parametrize("verify", [True, False])
def test_disk_batch_read_drops_its_samples_on_the_readers_thread_and_keeps_what_then_returned(tmp_path, verify):
    store = disk_store(tmp_path / "store", verify_checksums=verify)
    refs = [store.put(f"s{i}", sample_tensors(seed=i)) for i in range(3)]
    freed_on = []

    def then(samples):
        for sample in samples:
            weakref.finalize(sample["hidden_states"], lambda: freed_on.append(threading.current_thread().name))
        return samples[1]["input_ids"]  # then keeps one tensor over one file's map

    # every map but the one then kept is gone as get_batch returns, unmapped on the reader's thread
    kept = store.get_batch(refs, None, then)
    assert freed_on == [threading.current_thread().name] * 3
    assert torch.equal(kept, sample_tensors(seed=1)["input_ids"])  # its map outlives the others
    # a get_batch that fails drops what it had read, and the store reads on
    freed_on.clear()
    store.abort("s2")
    with pytest.raises(SampleNotFoundError):
        store.get_batch(refs, None, then)
    assert freed_on == []  # then never ran
    assert store.get_batch(refs[:2], ["input_ids"], lambda samples: [s["input_ids"].tolist() for s in samples]) == [
        sample_tensors(seed=i)["input_ids"].tolist() for i in range(2)]
    # a then that keeps the very list it was handed gets it whole
    kept_list = store.get_batch(refs[:2], None, lambda samples: samples)
    assert len(kept_list) == 2 and torch.equal(kept_list[0]["hidden_states"], sample_tensors(seed=0)["hidden_states"])


def _flip_a_byte(path) -> tuple[bytearray, str]:
    """Flip a bit of the victim's hidden_states: the file's bytes now, and the error that names them."""
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    return data, re.escape(str(path)) + r".*'hidden_states' fails its xxh3-64 check"


def test_disk_batch_read_of_a_flipped_byte_raises_at_its_copy_or_after_then_and_drops_its_result(damaged):
    from specforge_core.checksums import copy_checked

    store, victim, bystander, path = damaged
    data, fails = _flip_a_byte(path)
    copied = []

    def then(samples):  # copies the bystander, then the victim
        for sample in samples:
            for name, tensor in sample.items():
                copy_checked(torch.empty_like(tensor), tensor)
                copied.append((len(sample), name))
        return "batch"

    with pytest.raises(CorruptFeatureError, match=fails):  # at the victim's copy, before it
        store.get_batch([bystander, victim], None, then)
    assert copied == [(3, name) for name in sample_tensors()]
    calls = []
    with pytest.raises(CorruptFeatureError, match=fails):  # a collate that copies nothing: after it
        store.get_batch([bystander, victim], None, lambda samples: calls.append(len(samples)) or "batch")
    assert calls == [2]  # the collate ran, its batch was never returned
    with pytest.raises(CorruptFeatureError, match="delete it and capture"):  # a synchronous error stays one
        path.write_bytes(bytes(data[:7]))
        store.get_batch([victim], None, lambda samples: calls.append(len(samples)))
    assert calls == [2]
    _bystander_unharmed(store, bystander)


def test_a_collate_that_catches_a_failed_check_or_fails_on_damaged_bytes_still_gets_the_check_failure(damaged):
    """A failed check is raised after a collate that caught it (its batch is never returned); a collate that fails
    on its own while a tensor it had not copied yet is damaged gets the check's error, from its own."""
    from specforge_core.data.collate import pad_right

    store, victim, bystander, path = damaged
    _data, fails = _flip_a_byte(path)
    caught = []

    def forgiving(samples):
        try:
            return pad_right([s["hidden_states"] for s in samples])
        except CorruptFeatureError as exc:  # a collate that falls back, and tries again
            caught.append(type(exc).__name__)
            return pad_right([s["hidden_states"] for s in samples])

    with pytest.raises(CorruptFeatureError, match=fails):
        store.get_batch([victim], ["hidden_states"], forgiving)
    assert caught == ["CorruptFeatureError"]

    def indexing(samples):  # reads the damaged bytes as values before any copy checks them
        raise IndexError("index 18014398509481999 is out of bounds")

    with pytest.raises(CorruptFeatureError, match=fails) as raised:
        store.get_batch([bystander, victim], None, indexing)
    assert isinstance(raised.value.__cause__, IndexError)
    with pytest.raises(IndexError, match="out of bounds"):  # nothing damaged: the collate's own error stays
        store.get_batch([bystander], None, indexing)
    _bystander_unharmed(store, bystander)


def test_a_collate_that_writes_into_a_sample_file_is_told_from_a_damaged_file(damaged):
    from specforge_core.checksums import copy_checked

    store, victim, bystander, path = damaged
    before = path.read_bytes()

    def scribbling(samples):
        samples[0]["hidden_states"][0, 0] = 7.0  # a collate that should only read
        return [copy_checked(torch.empty_like(t), t) for s in samples for t in s.values()]

    with pytest.raises(FeatureStoreError, match=re.escape(str(path)) + r": the sample's bytes in this process's map "
                                                r"of the file differ from the file, which is intact: a caller wrote "
                                                r"into tensors a get returned or a collate was given"):
        store.get_batch([victim, bystander], None, scribbling)
    assert path.read_bytes() == before
    assert store.get(victim)["hidden_states"][0, 0] != 7.0  # a private map: the file and the next get never see it


def test_a_failed_check_of_a_sample_whose_file_is_gone_says_what_its_map_read(damaged):
    """The check is told apart in the file; a file deleted meanwhile leaves the map's reading as the error."""
    from specforge_core.checksums import copy_checked

    store, victim, _bystander, path = damaged

    def scribbling_after_a_delete(samples):
        path.unlink()  # as another process's release would
        samples[0]["hidden_states"][0, 0] += 1.0
        return [copy_checked(torch.empty_like(t), t) for t in samples[0].values()]

    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + r": feature 'hidden_states' fails its "
                                                  r"xxh3-64 check \(recorded \d+, read \d+\)"):
        store.get_batch([victim], None, scribbling_after_a_delete)


def test_copies_checking_keeps_a_second_check_of_one_tensor_and_parts_a_single_huge_row(monkeypatch):
    from specforge_core import checksums
    from specforge_core.checksums import XXH3_64, TensorCheck, copies_checking, copy_checked, checksum

    monkeypatch.setattr(checksums, "FUSED_PART", 512)
    row = torch.randn(1, 1000)  # one row of 4000 bytes: parts of 512 bytes all the same
    ran = []

    def check(expected, label):
        return TensorCheck(row, row.view(-1).view(torch.uint8).numpy().data, XXH3_64, expected,
                           lambda actual: ValueError(f"{label} failed"))

    good, wrong = checksum(row), checksum(row) ^ 1
    with copies_checking([check(good, "first"), check(wrong, "second")]) as copies:
        dest = torch.zeros(1, 1000)
        copy_checked(dest, row)
        ran.append(torch.equal(dest, row))
    assert ran == [True] and [c.expected for c in copies.unchecked()] == [wrong]  # the second is kept, not lost
    streamed = []
    real_stream = XXH3_64.stream

    class Counting:
        def __init__(self):
            self.hasher = real_stream()

        def update(self, data):
            streamed.append(len(data))
            self.hasher.update(data)

        def intdigest(self):
            return self.hasher.intdigest()

    with copies_checking([TensorCheck(row, row.view(-1).view(torch.uint8).numpy().data,
                                      attrs.evolve(XXH3_64, stream=Counting), good, ValueError)]):
        dest = torch.zeros(1, 1000)
        copy_checked(dest, row)
    assert streamed == [512] * 7 + [416] and torch.equal(dest, row)


def test_disk_records_the_plain_xxh3_64_of_large_tensors_and_catches_a_flip_anywhere(tmp_path):
    store = disk_store(tmp_path / "store", verify_checksums=True)
    big = torch.randint(0, 256, (9 * 2**20 + 3,), dtype=torch.uint8)
    ref = store.put("big", {"hidden_states": big})
    path = sample_file(store, "big")
    with safe_open(str(path), framework="pt") as reader:
        metadata = reader.metadata()
    assert metadata["specforge.checksum"] == "xxh3-64"
    assert json.loads(metadata["specforge.checksums"]) == {"hidden_states": xxhash.xxh3_64_intdigest(big.numpy())}
    assert "specforge.crc32" not in metadata
    for offset in (5 * 2**20, 1):  # the middle of the tensor, its last byte
        data = bytearray(path.read_bytes())
        data[len(data) - offset] ^= 0x80
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptFeatureError, match="'hidden_states' fails its xxh3-64 check"):
            store.get(ref)
        data[len(data) - offset] ^= 0x80
        path.write_bytes(bytes(data))
        assert torch.equal(store.get(ref)["hidden_states"], big)  # the mended file reads again


def test_disk_reads_and_verifies_files_of_the_release_that_recorded_crc32c(tmp_path, monkeypatch):
    from specforge_core.feature_stores import disk

    store = disk_store(tmp_path / "store", verify_checksums=True)
    big = torch.randint(0, 256, (9 * 2**20 + 3,), dtype=torch.uint8)  # three crc blocks, the last one short
    tensors = {"hidden_states": big, "input_ids": torch.arange(64)}
    with monkeypatch.context() as patch:  # a put as that release made it
        patch.setattr(disk, "DEFAULT_CHECKSUM", CRC32C)
        ref = store.put("crc32c-era", tensors)
    path = sample_file(store, "crc32c-era")
    with safe_open(str(path), framework="pt") as reader:
        metadata = reader.metadata()
    assert metadata["specforge.checksum"] == "crc32c"
    assert json.loads(metadata["specforge.checksums"]) == {
        name: crc32c.crc32c(tensor.numpy().tobytes()) for name, tensor in tensors.items()}
    assert_same_tensors(store.get(ref), tensors)
    assert [r.sample_id for r in store.scan()] == ["crc32c-era"]
    data = bytearray(path.read_bytes())
    data[len(data) - 5 * 2**20] ^= 0x80  # inside big's middle crc block
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFeatureError, match="'hidden_states' fails its crc32c check"):
        store.get(ref)
    assert path.exists()


@pytest.mark.parametrize("kind", ["xxh3-64", "crc32c"])
def test_a_large_tensor_is_checked_and_copied_a_part_at_a_time_and_a_flip_in_its_last_part_fails(tmp_path, kind,
                                                                                                monkeypatch):
    """Above 2 * FUSED_PART bytes (1 KiB here) copy_checked hashes and copies a tensor a part at a time, in one pass,
    and raises after its last part; a smaller tensor is checked whole before its copy, which then never happens."""
    from specforge_core import checksums
    from specforge_core.checksums import copy_checked
    from specforge_core.feature_stores import disk

    if kind == "crc32c" and not checksums.CRC32C_IN_HARDWARE:
        pytest.skip("crc32c in software is split over threads: checked whole before the copy instead")
    monkeypatch.setattr(checksums, "FUSED_PART", 512)
    store = disk_store(tmp_path / "store", verify_checksums=True)
    large, small = torch.randn(64, 33), torch.randn(4, 32)  # 33 floats a row: parts of 3 rows, the last one short
    with monkeypatch.context() as patch:  # crc32c: a put as the release that recorded it made it
        if kind == "crc32c":
            patch.setattr(disk, "DEFAULT_CHECKSUM", CRC32C)
        ref = store.put("s", {"large": large, "small": small})
    copies = {name: torch.zeros_like(t) for name, t in (("large", large), ("small", small))}

    def collate(samples):
        for name, tensor in samples[0].items():
            copy_checked(copies[name], tensor)
        return "batch"

    assert store.get_batch([ref], None, collate) == "batch"
    assert torch.equal(copies["large"], large) and torch.equal(copies["small"], small)
    path = sample_file(store, "s")
    data = bytearray(path.read_bytes())
    last_row, small_at = data.find(large[-1].numpy().tobytes()), data.find(small.numpy().tobytes())
    data[last_row + 5] ^= 0x01  # in the last part of "large"
    path.write_bytes(bytes(data))
    copies = {name: torch.zeros_like(t) for name, t in copies.items()}
    with pytest.raises(CorruptFeatureError, match=rf"'large' fails its {kind} check"):
        store.get_batch([ref], None, collate)
    assert torch.equal(copies["large"][:63], large[:63])  # every part copied as it was hashed: one pass
    data[last_row + 5] ^= 0x01
    data[small_at + 5] ^= 0x01  # now "small" only
    path.write_bytes(bytes(data))
    copies = {name: torch.zeros_like(t) for name, t in copies.items()}
    with pytest.raises(CorruptFeatureError, match=rf"'small' fails its {kind} check"):
        store.get_batch([ref], None, collate)
    assert torch.equal(copies["large"], large) and not copies["small"].any()  # checked whole, never copied


def _write_pre_crc32c_file(store: DiskFeatureStore, sample_id: str, tensors: dict) -> tuple:
    """A sample file exactly as the store wrote it before crc32c: zlib crc32s under
    ``specforge.crc32``, no ``specforge.checksum``. Returns its ref and path."""
    ref = store.put(sample_id, tensors)
    path = sample_file(store, sample_id)
    crcs = {name: zlib.crc32(tensor.numpy().tobytes()) for name, tensor in tensors.items()}
    with safe_open(str(path), framework="pt") as reader:
        recorded_ref = reader.metadata()["specforge.ref"]
    save_file(tensors, str(path), metadata={"specforge.ref": recorded_ref,
                                            "specforge.crc32": json.dumps(crcs),
                                            "specforge.key": f"{ref.generation}:{sample_id!a}"})
    return ref, path


def test_disk_reads_and_verifies_files_written_with_zlib_crc32_before_crc32c(tmp_path):
    store = disk_store(tmp_path / "store", verify_checksums=True)
    tensors = {"hidden_states": torch.randn(64, 32), "input_ids": torch.arange(64)}
    ref, path = _write_pre_crc32c_file(store, "old", tensors)
    with safe_open(str(path), framework="pt") as reader:
        assert set(reader.metadata()) == {"specforge.ref", "specforge.crc32", "specforge.key"}
    assert_same_tensors(store.get(ref), tensors)
    assert [r.sample_id for r in store.scan()] == ["old"]
    data = bytearray(path.read_bytes())
    data[-300] ^= 0x04  # a data byte; which tensor holds it depends on safetensors' layout
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + r": feature '\w+' fails its crc32 check"):
        store.get(ref)
    assert path.exists()


def test_disk_file_whose_shape_differs_from_the_ref_is_corrupt(damaged):
    store, victim, bystander, path = damaged
    lying = attrs.evolve(victim, features={"hidden_states": FeatureSpec((32, 64), "float32")})
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + r".*'hidden_states' is float32\[64, 32\] "
                                                                         r"but the ref says float32\[32, 64\]"):
        store.get(lying)
    assert store.get(victim)["hidden_states"].shape == (64, 32)


def test_disk_file_renamed_to_another_sample_is_corrupt(damaged):
    store, victim, bystander, path = damaged
    impostor = store.put("impostor", {"hidden_states": torch.zeros(64, 32)})
    os.replace(path, sample_file(store, "impostor"))
    with pytest.raises(CorruptFeatureError, match="does not match its file name"):
        store.get(impostor)


def test_disk_file_without_the_identity_key_is_read_through_its_stored_ref(damaged):
    # Files written before ``specforge.key`` existed: the get falls back to the stored ref.
    store, victim, bystander, path = damaged
    before = {name: tensor.clone() for name, tensor in store.get(victim).items()}
    _rewrite_header(path, lambda h: h["__metadata__"].pop("specforge.key"))
    assert_same_tensors(store.get(victim), before)


def test_disk_file_that_records_another_sample_id_is_corrupt(damaged):
    # What a digest collision would look like: the file name fits, the recorded identity does not.
    store, victim, bystander, path = damaged

    def other_sample(header):
        meta = header["__metadata__"]
        meta["specforge.key"] = f"{victim.generation}:'other'"
        meta["specforge.ref"] = attrs.evolve(victim, sample_id="other").to_json()

    _rewrite_header(path, other_sample)
    with pytest.raises(CorruptFeatureError, match=re.escape(str(path)) + ": it holds sample 'other', not 'victim'"):
        store.get(victim)
    _bystander_unharmed(store, bystander)


def test_disk_file_removed_behind_the_stores_back_is_not_found(damaged):
    store, victim, bystander, path = damaged
    path.unlink()
    with pytest.raises(SampleNotFoundError, match=r"'victim'.*no file .*" + re.escape(path.name)):
        store.get(victim)
    assert store.scan() == [bystander]
    _bystander_unharmed(store, bystander)


# -- disk: who may attach --------------------------------------------------------------------


def test_disk_token_is_checked_on_attach(tmp_path):
    store = disk_store(tmp_path / "store", token="s3cret")
    ref = store.put("s", sample_tensors())
    manifest = (tmp_path / "store" / "STORE.json").read_text()
    assert "s3cret" not in manifest
    with pytest.raises(FeatureStoreError, match="token does not match.*feature_store.path"):
        disk_store(tmp_path / "store", token="wrong")
    with pytest.raises(FeatureStoreError, match="protected by a token and none was given"):
        disk_store(tmp_path / "store")
    assert (tmp_path / "store" / "STORE.json").read_text() == manifest
    assert_same_tensors(disk_store(tmp_path / "store", token="s3cret").get(ref), sample_tensors())


def test_disk_token_given_for_a_store_created_without_one_is_refused(tmp_path):
    disk_store(tmp_path / "store").put("s", sample_tensors())
    with pytest.raises(FeatureStoreError, match="created without a token, but a token was given"):
        disk_store(tmp_path / "store", token="s3cret")


def test_disk_refuses_a_non_empty_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FeatureStoreError, match=r"not empty \(notes.txt\).*not a specforge disk store"):
        disk_store(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "STORE.json").exists()


@pytest.mark.parametrize("manifest, message", [
    ("{not json", "cannot be read"),
    ('{"format": "something-else", "version": 1}', "not a specforge disk store manifest"),
    ('{"format": "specforge-disk-store", "version": 99, "token_sha256": null}', "version 99.*reads version 1"),
])
def test_disk_refuses_a_manifest_it_does_not_understand(tmp_path, manifest, message):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "STORE.json").write_text(manifest)
    with pytest.raises(FeatureStoreError, match=message):
        disk_store(tmp_path / "store")
    assert (tmp_path / "store" / "STORE.json").read_text() == manifest


def test_a_feature_set_keeps_the_frozen_parts_of_a_target_with_tied_embeddings(tmp_path):
    """A target that ties lm_head to embed_tokens hands one tensor under both names; the feature set
    stores both (safetensors refuses shared memory) and reads them back equal, the caller's untouched."""
    from specforge_core.features import FeatureSet, create_feature_set
    from specforge_core.protocols import CapturePlan, TargetInfo

    embed = torch.arange(12, dtype=torch.float32).view(4, 3)
    parts = {"embed_tokens": embed, "lm_head": embed, "norm": torch.ones(3)}
    target = TargetInfo(num_layers=2, hidden_size=3, vocab_size=4, dtype="float32", model_id="tied")
    root, store = create_feature_set(tmp_path / "feats", strategy="s", strategy_options={}, plan=CapturePlan(),
                                     target=target, frozen_parts=parts, context=BuildContext())
    store.close()
    loaded = FeatureSet.open(root).frozen_parts()
    assert sorted(loaded) == ["embed_tokens", "lm_head", "norm"]
    assert torch.equal(loaded["embed_tokens"], embed) and torch.equal(loaded["lm_head"], embed)
    assert parts["lm_head"] is embed and parts["embed_tokens"] is embed


def test_a_batch_read_of_a_large_zlib_crc32_file_finishes_with_one_block_thread(tmp_path, monkeypatch):
    """A zlib-crc32 tensor checked in a batch read from a reader thread is split over the block threads (three
    blocks here), and completes even when there is a single block thread."""
    from concurrent.futures import ThreadPoolExecutor

    from specforge_core import checksums

    monkeypatch.setattr(checksums, "_pool", ThreadPoolExecutor(max_workers=1, thread_name_prefix="one-block"))
    store = disk_store(tmp_path / "store", verify_checksums=True)
    big = {"hidden_states": torch.randint(0, 256, (9 * 2**20,), dtype=torch.uint8)}
    ref, path = _write_pre_crc32c_file(store, "old-big", big)
    got = []
    reader = threading.Thread(target=lambda: got.append(store.get_batch(
        [ref], None, lambda samples: samples[0]["hidden_states"].sum().item())), daemon=True)
    reader.start()
    reader.join(timeout=60)  # a deadlock fails here instead of hanging the suite
    assert not reader.is_alive() and got == [int(big["hidden_states"].sum())]
    data = bytearray(path.read_bytes())
    data[-2**20] ^= 0x01  # in the last block
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFeatureError, match="'hidden_states' fails its crc32 check"):
        store.get_batch([ref], None, len)
