"""FeatureDataLoader overhead per batch over the raw store gets + collate it performs.

For each store (memory, disk) the same batches are built twice in one process: once by a
plain loop calling ``store.get`` and ``collate``, once by iterating the loader (background
thread, bounded buffer). Prints one JSON line per store with both per-batch times and the
ratio (loader / raw; 1.0 means the thread and queue cost nothing).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from specforge_core.builtin import DiskStoreOptions, MemoryStoreOptions
from specforge_core.contracts import TrainBatch
from specforge_core.data.loader import FeatureDataLoader
from specforge_core.feature_stores.disk import DiskFeatureStore
from specforge_core.feature_stores.memory import MemoryFeatureStore
from specforge_core.protocols import BuildContext


def collate(samples, sample_ids):
    length = max(s["hidden"].shape[0] for s in samples)
    out = torch.zeros(len(samples), length, samples[0]["hidden"].shape[1], dtype=samples[0]["hidden"].dtype)
    for row, sample in enumerate(samples):
        out[row, : sample["hidden"].shape[0]] = sample["hidden"]
    return TrainBatch(tensors={"hidden": out}, sample_ids=sample_ids, num_tokens=out.shape[0] * length)


def run(store, refs, batch: int, rounds: int) -> dict:
    raw, looped = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(0, len(refs) - batch + 1, batch):
            chunk = refs[i:i + batch]
            collate([store.get(r) for r in chunk], [r.sample_id for r in chunk])
        raw.append((time.perf_counter() - start) / (len(refs) // batch))
        loader = FeatureDataLoader(store, collate, refs=refs, batch_size=batch, shuffle=False)
        start = time.perf_counter()
        count = sum(1 for _ in loader)
        looped.append((time.perf_counter() - start) / count)
    return {"raw_batch_ms": min(raw) * 1e3, "loader_batch_ms": min(looped) * 1e3,
            "overhead_ms_per_batch": (min(looped) - min(raw)) * 1e3, "overhead_ratio": min(looped) / min(raw)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=768, help="per-token feature width (e.g. 3*H for EAGLE3)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stores = {"memory": MemoryFeatureStore(MemoryStoreOptions(consume_once=False), BuildContext()),
                  "disk": DiskFeatureStore(DiskStoreOptions(path=tmp, fsync=False), BuildContext())}
        for name, store in stores.items():
            gen = torch.Generator().manual_seed(0)
            refs = [store.put(f"s{i}", {"hidden": torch.randn(args.tokens, args.hidden, generator=gen)
                                        .to(torch.bfloat16)}) for i in range(args.samples)]
            result = {"bench": "loader", "store": name, "batch": args.batch, "tokens": args.tokens,
                      "hidden": args.hidden, **run(store, refs, args.batch, args.rounds)}
            print(json.dumps(result), flush=True)
            store.close()


if __name__ == "__main__":
    main()
