"""Mooncake feature store throughput, as a ratio to the raw Mooncake transfer rate.

Starts a ``mooncake_master`` on loopback and a second Mooncake client in this process that
lends the only memory segment, while the store under test lends none: every put and get
crosses Mooncake's TCP transport, as between a producer and a consumer on two nodes (here
over loopback). For each sample size this prints one JSON line:

- ``put_gbps`` / ``get_gbps``: ``MooncakeStore.put`` and ``get`` of one sample (a bf16
  ``hidden_states`` plus ``input_ids``) with the default options (xxh3-64 checksums on);
  ``*_no_checksums``: the same with ``checksums=False``;
- ``raw_put_gbps`` / ``raw_get_gbps``: the physical limit, measured in the same run: a plain
  ``put_from`` / ``get_into`` of an object of the same size through the same client, from
  and into preallocated memory, without our layout, checks or bookkeeping;
- ``put_vs_raw`` / ``get_vs_raw`` (and ``*_no_checksums``): the ratios.

Each figure is the median of ``--repeats`` runs, the store's and the raw transfers
interleaved. Usage: ``python bench/mooncake_store.py --sizes 1,8,64 --repeats 7``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from specforge_core.protocols import BuildContext

HIDDEN = 4096  # a typical target hidden size; one bf16 row is 8 KiB


def make_sample(mib: int) -> dict[str, torch.Tensor]:
    tokens = max(1, mib * 2**20 // (HIDDEN * 2 + 8))
    return {"hidden_states": torch.randn(tokens, HIDDEN).to(torch.bfloat16),
            "input_ids": torch.randint(0, 32000, (tokens,))}


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def check(code: int, what: str) -> None:
    if code < 0:
        raise SystemExit(f"{what} failed with Mooncake error {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,64", help="sample sizes in MiB, comma separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--segment-mib", type=int, default=3072, help="memory the holder client lends")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]

    from mooncake.store import MooncakeDistributedStore

    from specforge_plugin_mooncake.master import LocalMaster
    from specforge_plugin_mooncake.store import MooncakeStore, close_idle_clients

    with LocalMaster(lease_ttl_ms=1000) as master:
        holder = MooncakeDistributedStore()  # the "remote node" whose memory holds every object
        check(holder.setup("127.0.0.1", master.metadata_server, args.segment_mib * 2**20, 16 * 2**20, "tcp", "",
                           master.master_address), "holder setup")
        context = BuildContext(run_id="bench")
        common = {"global_segment_size": 0, "local_buffer_size": 128 * 2**20}
        checked = MooncakeStore(master.options(namespace="bench-checked", **common), context)
        unchecked = MooncakeStore(master.options(namespace="bench-unchecked", checksums=False, **common), context)
        client = checked._client  # the raw path uses the very client the store uses
        try:
            for mib in sizes:
                sample = make_sample(mib)
                times: dict[str, list[float]] = {}
                for repeat in range(args.repeats):
                    for label, store in (("", checked), ("_no_checksums", unchecked)):
                        sample_id = f"s{mib}-{repeat}"
                        refs = []
                        times.setdefault(f"put{label}", []).append(timed(lambda: refs.append(store.put(sample_id, sample))))
                        times.setdefault(f"get{label}", []).append(timed(lambda: store.get(refs[0])))
                        store.abort(sample_id)
                    # an object of the store's size: the tensors plus a header of a few hundred bytes
                    payload = torch.randint(0, 255, (refs[0].nbytes + 512,), dtype=torch.uint8)
                    into = torch.empty_like(payload)
                    key = f"raw/{mib}/{repeat}"
                    times.setdefault("raw_put", []).append(
                        timed(lambda: check(client.put_from(key, payload.data_ptr(), payload.numel()), "raw put")))
                    times.setdefault("raw_get", []).append(
                        timed(lambda: check(client.get_into(key, into.data_ptr(), into.numel()), "raw get")))
                    if not torch.equal(payload, into):
                        raise SystemExit("raw get returned other bytes than the raw put wrote")
                    client.remove(key, True)  # the bench's own object, read by nobody else
                nbytes = refs[0].nbytes
                gbps = {name: nbytes / statistics.median(values) / 1e9 for name, values in times.items()}
                record = {"bench": "mooncake_store", "sample_mib": mib, "sample_bytes": nbytes,
                          "transport": "tcp over loopback, object held by another client", "repeats": args.repeats}
                for name, value in gbps.items():
                    record[f"{name}_gbps"] = round(value, 3)
                for op in ("put", "get"):
                    record[f"{op}_vs_raw"] = round(gbps[op] / gbps[f"raw_{op}"], 3)
                    record[f"{op}_vs_raw_no_checksums"] = round(gbps[f"{op}_no_checksums"] / gbps[f"raw_{op}"], 3)
                print(json.dumps(record), flush=True)
        finally:
            checked.close()
            unchecked.close()
            close_idle_clients(master.master_address)
            holder.close()


if __name__ == "__main__":
    main()
