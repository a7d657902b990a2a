"""bench/feature_stores.py in small: one 1 MiB sample size, two repeats, its JSON lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

from specforge_core import heap

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "feature_stores.py"


def test_one_size_prints_the_memory_and_disk_lines_with_their_ratios(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--sizes", "1", "--repeats", "2", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [(r["store"], r.get("verify_checksums"), r.get("measure")) for r in records] == [
        ("memory", None, None), ("disk", True, None), ("disk", False, None), ("disk-packed", True, None),
        ("disk-packed", False, None), ("disk", None, "fixed_cost")]
    memory, verified, unverified, packed_verified, packed_unverified, fixed = records
    assert memory["size_mib"] == 1 and memory["get_vs_memcpy"] > 0
    for record in (verified, unverified):
        # 127 tokens of 4096 bf16 plus an int64 id each; 258 of them hold the 256 MiB pool
        assert (record["bytes"], record["checksum"], record["batch"], record["pool_samples"]) == (
            127 * (4096 * 2 + 8), "xxh3-64", 8, 258)
        if heap._glibc() is not None and not any(name.startswith("MALLOC_") for name in os.environ):
            assert record["heap"] == "the heap kept between steps (blocks up to 32 MiB, trimmed above 1024 MiB free)"
        for key in ("get_vs_raw_read", "batch_get_vs_raw_read", "get_vs_raw_read_same_file", "loader_vs_raw_read",
                    "loader_vs_raw_read_into_batches"):
            assert 0.01 < record[key] < 100, (key, record[key])
        assert record["raw_read_into_batches_gbps"] > 0
    for record in (packed_verified, packed_unverified):  # the same pool, packed: one pack of 258 samples
        assert (record["bytes"], record["batch"], record["pool_samples"]) == (verified["bytes"], 8, 258)
        pack = record["pack"]  # the files' sizes differ by the digits of their ids ("pool-7", "pool-257")
        assert (pack["packs"], pack["samples"]) == (1, 258)
        assert 258 * (verified["file_bytes"] - 8) <= pack["bytes"] <= 258 * (verified["file_bytes"] + 8)
        for key in ("get_vs_raw_read", "batch_get_vs_raw_read", "loader_vs_raw_read", "loader_vs_raw_read_into_batches"):
            assert 0.01 < record[key] < 100, (key, record[key])
        assert record["raw_pread_pack_gbps"] > 0 and record["batch_raw_pread_pack_gbps"] > 0
    assert fixed["get_us"] > 0 and fixed["raw_open_read_us"] > 0
    assert os.listdir(tmp_path) == []  # its temporary stores are gone
