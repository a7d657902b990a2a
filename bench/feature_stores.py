"""Feature store throughput, as a ratio to the physical limit it runs into.

For each store and sample size this prints one JSON line:

- ``put_gbps``: put of one sample (the memory store keeps owned tensors without copying;
  the disk store writes a file and, by default, fsyncs it and its directory);
- ``get_gbps``: get plus copying every returned byte into a preallocated buffer, as a
  collate does, so bytes a store maps lazily are really read;
- ``memcpy_gbps`` and ``get_vs_memcpy``: ``Tensor.copy_`` of the same bytes, measured in
  the same run (target for memory: >= 0.8);
- disk only, ``raw_read_gbps`` and ``get_vs_raw_read`` (target: >= 0.7): get+copy against a
  plain ``readinto`` of a sample file into a preallocated buffer, over a pool of distinct
  sample files of at least 256 MiB, read round robin (get and raw read on different files
  at each step, at least 40 timed steps), as an epoch reads samples: every byte comes from
  the page cache in DRAM, never from a CPU cache still warm from the previous repeat. ``get_vs_raw_read`` takes one
  sample at a time, each get followed by its copy: the least favourable order for the
  get's fixed cost, since each copy flushes the CPU caches the next get runs from.
  ``batch_get_vs_raw_read`` reads ``batch`` samples at a time the way the feature loader
  does (``get_batch``: the batch's gets, then the collate's copies, a verifying store's
  checksum of each tensor just before its copy, ``copy_checked``) against raw reads of as many files;
  samples so large that four batches would not fit the pool are read one at a time
  (``batch`` says how many were used). ``get_batch`` waits for its checksums and unmaps its
  samples before it returns, so no part of a get runs on beside the raw read that follows.
  ``*_same_file`` is the one-sample comparison
  re-reading one file into one buffer: at 1 MiB that raw read runs at CPU-cache speed, a
  limit no read of fresh samples meets. Every read is warm in the page cache (files were
  just written). Disk lines come with ``verify_checksums`` true and false (the default),
  and name the checksum new files record (``xxh3-64``, on the CPU's vector units: SSE2,
  AVX2 or AVX-512 on x86-64, NEON on ARM; the same on CUDA hosts, whose checksums run on
  the host CPU) with ``checksum_gbps``, its speed here over a DRAM-resident sample, next
  to ``crc32c_gbps`` (the checksum of files from earlier releases; ``crc32c_in_hardware``:
  on the CPU's CRC instructions).
- disk only, ``loader_vs_raw_read``: the feature loader end to end (``FeatureDataLoader`` over the
  pool, ``batch`` samples a batch, its background thread reading through ``get_batch`` and
  collating with ``pad_features``, as every strategy's collate does, into a new batch each time,
  whose memory, from 32 MiB up, an earlier batch nothing holds any more left) against raw reads of
  the same files, an epoch each, alternately. ``loader_vs_raw_read_into_batches`` compares it with a
  third epoch, raw reads of the same files into the rows of a new batch each time, made as the
  collate makes its batches, while the batch before it is still held (as this bench's loop holds the
  loader's): a loader has to hand out new memory, whose cache state a raw read into the same few
  buffers never sees; ``raw_read_into_batches_gbps`` is its speed.
- ``fixed_cost`` lines: the per-sample cost that does not scale with bytes, the get of a
  one-token sample against an open + read + close of its file. At 1 MiB this fixed cost,
  plus mapping the pages, is of the order of the data movement itself, which is why small
  samples stay below the large-sample ratio.

The process keeps its C heap as the trainer does (``train.keep_heap``; ``heap`` in each line).

Usage: ``python bench/feature_stores.py --sizes 1,8,64 --repeats 11``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Callable

import torch

from specforge_core.builtin import DiskStoreOptions, MemoryStoreOptions
from specforge_core.checksums import CRC32C, CRC32C_IN_HARDWARE, DEFAULT_CHECKSUM, ChecksumKind, checksum, copy_checked
from specforge_core.feature_stores.disk import DiskFeatureStore
from specforge_core.feature_stores.memory import MemoryFeatureStore
from specforge_core.heap import empty_reused, keep_heap
from specforge_core.protocols import BuildContext

HIDDEN = 4096  # a typical target hidden size; one bf16 row is 8 KiB
POOL_BYTES = 256 * 2**20  # the distinct-sample pool: larger than any CPU cache
MIN_POOL_STEPS = 40  # timed steps over the pool at least (large samples fill it in a few)
CONTEXT = BuildContext(run_id="bench")


def make_sample(mib: int) -> dict[str, torch.Tensor]:
    tokens = max(1, mib * 2**20 // (HIDDEN * 2 + 8))
    return {"hidden_states": torch.randn(tokens, HIDDEN).to(torch.bfloat16),
            "input_ids": torch.randint(0, 32000, (tokens,))}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired_medians(first: Callable[[], object], second: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of two operations timed alternately, so that load from other processes
    or clock changes hit both alike; each runs once untimed first (page faults, page cache)."""
    first(), second()
    times = [(seconds(first), seconds(second)) for _ in range(repeats)]
    return statistics.median(t for t, _ in times), statistics.median(t for _, t in times)


def copy_into(dest: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        copy_checked(dest[name], tensor)  # as a collate copies (pad_right): a verifying store checks each first


def read_into(path: str, buffer: bytearray) -> None:
    """The raw sequential read: the whole file into a preallocated buffer."""
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while view:
            got = fh.readinto(view)
            if not got:
                raise OSError(f"{path} ended early")
            view = view[got:]


def measure(store, sample: dict[str, torch.Tensor], repeats: int, batch: int) -> dict:
    size = nbytes(sample)
    dest = {name: torch.empty_like(t) for name, t in sample.items()}
    counter = iter(range(10**9))

    def put_one():
        sample_id = f"put-{next(counter)}"
        store.put(sample_id, sample)
        store.abort(sample_id)  # one sample stays resident, and the disk does not fill up

    put_one()
    put_s = statistics.median(seconds(put_one) for _ in range(repeats))
    ref = store.put("read-me", sample)

    def get():
        copy_into(dest, store.get(ref))

    get_s, memcpy_s = paired_medians(get, lambda: copy_into(dest, sample), repeats)
    assert all(torch.equal(dest[name], sample[name]) for name in sample)
    result = {"bytes": size, "put_gbps": size / put_s / 1e9, "get_gbps": size / get_s / 1e9,
              "memcpy_gbps": size / memcpy_s / 1e9, "get_vs_memcpy": memcpy_s / get_s}
    if isinstance(store, DiskFeatureStore):
        path = store.path_of(ref)
        buffer = bytearray(os.path.getsize(path))  # the file: tensor bytes plus the header
        disk_get_s, raw_s = paired_medians(get, lambda: read_into(path, buffer), repeats)
        raw_gbps, get_gbps = len(buffer) / raw_s / 1e9, size / disk_get_s / 1e9
        result.update(raw_read_gbps_same_file=raw_gbps, get_vs_raw_read_same_file=get_gbps / raw_gbps)
        result.update(distinct_samples(store, sample, repeats, batch))
    return result


def distinct_samples(store: DiskFeatureStore, sample: dict[str, torch.Tensor], repeats: int,
                     batch: int, packed: str | None = None) -> dict:
    """get+copy against a raw read over a pool of distinct sample files, as an epoch reads them.

    The pool holds at least ``POOL_BYTES`` (beyond any CPU cache), so neither side re-reads
    bytes that are still cached from its previous repeat; get and raw read take different
    files of the pool at each step, round robin. Measured twice: one sample at a time (each
    get followed by its copy, the least favourable order: the copy flushes the CPU caches
    the next get's Python code and data ran from), and ``batch`` samples at a time. Both read
    through ``get_batch`` as the feature loader does (the gets, then the collate's copies;
    with ``verify_checksums`` each tensor's checksum runs just before its copy).
    """
    batch = max(1, min(batch, POOL_BYTES // (4 * nbytes(sample))))  # the pool holds >= 4 batches
    count = max(4 * batch, -(-POOL_BYTES // nbytes(sample)))
    refs = [store.put(f"pool-{i}", sample) for i in range(count)]
    paths = [store.path_of(ref) for ref in refs]
    file_bytes = os.path.getsize(paths[0])
    result = {"pool_samples": count, "batch": batch, "file_bytes": file_bytes}
    if packed is not None:  # the raw reads keep reading each sample's own file, through a second link to it
        os.makedirs(packed, exist_ok=True)
        for index, path in enumerate(paths):
            os.link(path, os.path.join(packed, f"{index}.safetensors"))
        paths = [os.path.join(packed, f"{index}.safetensors") for index in range(count)]
        result["pack"] = store.pack()
        store.get_batch(refs, None, lambda samples: None)  # the untimed first epoch: the pack's pages mapped
        result.update(pack_preads(store, refs, file_bytes, batch, repeats))
    for size, prefix in ((1, ""), (batch, "batch_")):
        dests = [{name: torch.empty_like(t) for name, t in sample.items()} for _ in range(size)]
        buffers = [bytearray(file_bytes) for _ in range(size)]

        def copy_all(samples: list[dict[str, torch.Tensor]]) -> None:
            for dest, tensors in zip(dests, samples):
                copy_into(dest, tensors)

        def get_batch(first: int) -> None:  # as the loader reads: with checksums, each just before its copy
            store.get_batch([refs[(first + k) % count] for k in range(size)], None, copy_all)

        def read_batch(first: int) -> None:
            for k, buffer in enumerate(buffers):
                read_into(paths[(first + k) % count], buffer)

        times = []
        for step in range(max(repeats, 2 * count // size, MIN_POOL_STEPS)):
            first = step * size
            times.append((seconds(lambda: get_batch(first)), seconds(lambda: read_batch(first + count // 2))))
        get_s, raw_s = statistics.median(t for t, _ in times), statistics.median(t for _, t in times)
        raw_gbps, get_gbps = size * file_bytes / raw_s / 1e9, size * nbytes(sample) / get_s / 1e9
        result.update({f"{prefix}raw_read_gbps": raw_gbps, f"{prefix}get_vs_raw_read": get_gbps / raw_gbps})
    result.update(loader_epochs(store, refs, paths, file_bytes, sample, batch, repeats))
    if packed is None:
        for ref in refs:
            store.abort(ref.sample_id)
    return result


def pack_preads(store: DiskFeatureStore, refs: list, file_bytes: int, batch: int, repeats: int) -> dict:
    """Raw reads of packed samples' bytes out of their pack (one ``preadv`` each at its offset, no open) into
    reused buffers, one sample and ``batch`` samples at a time, round robin over the pool: the packed layout's
    own physical read."""
    places = []
    for ref in refs:
        packed = store._packs.find(ref)
        places.append((packed.pack.path, packed.offset))
    fds = {path: os.open(path, os.O_RDONLY) for path in {path for path, _ in places}}
    try:
        result = {}
        for size, prefix in ((1, ""), (batch, "batch_")):
            buffers = [bytearray(file_bytes) for _ in range(size)]

            def read(first: int) -> None:
                for k, buffer in enumerate(buffers):
                    path, offset = places[(first + k) % len(places)]
                    os.preadv(fds[path], [buffer], offset)

            times = [seconds(lambda: read(step * size)) for step in range(max(repeats, 2 * len(refs) // size))]
            result[f"{prefix}raw_pread_pack_gbps"] = size * file_bytes / statistics.median(times) / 1e9
        return result
    finally:
        for fd in fds.values():
            os.close(fd)


def loader_epochs(store: DiskFeatureStore, refs: list, paths: list[str], file_bytes: int,
                  sample: dict[str, torch.Tensor], batch: int, repeats: int) -> dict:
    """The feature loader end to end against raw reads: a ``FeatureDataLoader`` epoch over the pool (its
    background thread reading ``batch`` samples at a time, the collate every strategy runs,
    ``pad_features``, a new batch each time, as in training) against a raw read of the same files, one epoch each,
    alternately, ``repeats`` times."""
    from specforge_core.data.collate import pad_features
    from specforge_core.data.loader import FeatureDataLoader

    names = list(sample)
    loader = FeatureDataLoader(store, lambda samples, ids: pad_features(samples, ids, names, strategy="bench"),
                               batch_size=batch, refs=refs, shuffle=False, release="never")
    read = paths[:len(loader) * batch]
    buffers = [bytearray(file_bytes) for _ in range(batch)]

    def epoch() -> None:
        for _batch in loader:
            pass

    def raw_epoch() -> None:
        for index, path in enumerate(read):
            read_into(path, buffers[index % batch])

    def raw_batches_epoch() -> None:
        held = None  # the batch before, still held while the next is read, as the loop above holds the loader's
        for first in range(0, len(read), batch):
            rows = empty_reused((batch, file_bytes), torch.uint8, "cpu")
            for row, path in zip(rows.numpy(), read[first:first + batch]):
                read_into(path, row)
            held = rows
        del held

    epoch()
    raw_batches_epoch()
    times = []
    for _ in range(repeats):
        times.append((seconds(epoch), seconds(raw_epoch), seconds(raw_batches_epoch)))
    loader_s, raw_s, batches_s = (statistics.median(t[k] for t in times) for k in range(3))
    loader_gbps = len(read) * nbytes(sample) / loader_s / 1e9
    raw_gbps, batches_gbps = (len(read) * file_bytes / t / 1e9 for t in (raw_s, batches_s))
    return {"loader_gbps": loader_gbps, "loader_vs_raw_read": loader_gbps / raw_gbps,
            "raw_read_into_batches_gbps": batches_gbps, "loader_vs_raw_read_into_batches": loader_gbps / batches_gbps}


def fixed_cost(store, repeats: int) -> dict:
    ref = store.put("tiny", {"input_ids": torch.arange(1)})
    path = store.path_of(ref)
    buffer = bytearray(os.path.getsize(path))
    get_s, raw_s = paired_medians(lambda: store.get(ref), lambda: read_into(path, buffer), repeats * 10)
    return {"get_us": get_s * 1e6, "raw_open_read_us": raw_s * 1e6}


def checksum_gbps(kind: ChecksumKind, sample: dict[str, torch.Tensor], repeats: int) -> float:
    """``kind``'s speed over a sample's bytes, on distinct copies so that they come from DRAM, not a CPU cache."""
    copies = [{name: tensor.clone() for name, tensor in sample.items()}
              for _ in range(max(2, -(-POOL_BYTES // 4 // nbytes(sample))))]
    times = []
    for index in range(max(repeats, len(copies))):
        tensors = copies[index % len(copies)]
        times.append(seconds(lambda: [checksum(tensor, kind) for tensor in tensors.values()]))
    return nbytes(sample) / statistics.median(times) / 1e9


def emit(record: dict) -> None:
    record = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items()}
    print(json.dumps({"bench": "feature_stores", "threads": torch.get_num_threads(), **record}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,64", help="sample sizes in MiB, comma separated")
    parser.add_argument("--repeats", type=int, default=11, help="timed repeats per measurement (median reported)")
    parser.add_argument("--batch", type=int, default=8,
                        help="samples per batch for the disk read measured as the feature loader reads (default 8)")
    parser.add_argument("--dir", default=None, help="directory for the disk store (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the copies (default 1: the raw read is one thread too, and "
                             "multi-threaded copies turn erratic when other processes share the cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heap = keep_heap()  # as the trainer keeps it (train.keep_heap): the loader's batches come from that heap
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    for mib in sizes:
        sample = make_sample(mib)
        with MemoryFeatureStore(MemoryStoreOptions(consume_once=False), CONTEXT) as store:
            emit({"store": "memory", "size_mib": mib, "heap": heap, **measure(store, sample, args.repeats, args.batch)})
        speeds = {"checksum_gbps": checksum_gbps(DEFAULT_CHECKSUM, sample, args.repeats),
                  "crc32c_gbps": checksum_gbps(CRC32C, sample, args.repeats)}
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            with DiskFeatureStore(DiskStoreOptions(path=os.path.join(root, "store")), CONTEXT) as store:
                for verify in (True, False):
                    store.verify_checksums = verify
                    emit({"store": "disk", "size_mib": mib, "heap": heap, "verify_checksums": verify,
                          "fsync": store.fsync,
                          "checksum": DEFAULT_CHECKSUM.name, **speeds, "crc32c_in_hardware": CRC32C_IN_HARDWARE,
                          **measure(store, sample, args.repeats, args.batch)})
        for verify in (True, False):  # a packed store (DiskFeatureStore.pack): its samples read out of kept maps
            with tempfile.TemporaryDirectory(dir=args.dir) as root:
                with DiskFeatureStore(DiskStoreOptions(path=os.path.join(root, "store"),
                                                       verify_checksums=verify), CONTEXT) as store:
                    emit({"store": "disk-packed", "size_mib": mib, "heap": heap, "verify_checksums": verify,
                          "bytes": nbytes(sample),
                          "checksum": DEFAULT_CHECKSUM.name,
                          **distinct_samples(store, sample, args.repeats, args.batch,
                                             packed=os.path.join(root, "raw"))})

    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        with DiskFeatureStore(DiskStoreOptions(path=os.path.join(root, "store")), CONTEXT) as store:
            emit({"store": "disk", "measure": "fixed_cost", **fixed_cost(store, args.repeats)})


if __name__ == "__main__":
    main()
