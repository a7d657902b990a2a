"""A stream across hosts that share nothing on disk: PostgreSQL control plane, Mooncake tensors.

Real processes through the public CLI: a PostgreSQL server and a mooncake_master, a pool
of two producers and a two-rank consumer (torchrun, gloo), each process in a working
directory of its own. The losses must equal those of the same run online colocated, every
sample must be trained exactly once (the ack ledger in PostgreSQL), and no Mooncake
object of the stream may be left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_plugin_postgres.testing import open_plane

SPECFORGE = str(Path(sys.executable).parent / "specforge")
SAMPLES, BATCH = 16, 2


@pytest.fixture(scope="module")
def master():
    try:
        import mooncake.store  # noqa: F401
        from specforge_plugin_mooncake.master import LocalMaster
    except Exception as exc:  # noqa: BLE001 - any load failure means skip, with its text
        pytest.skip(f"Mooncake client unavailable ({type(exc).__name__}: {exc})")
    with LocalMaster(lease_ttl_ms=500) as running:
        yield running


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "SPECFORGE_STRICT_PLUGINS": "1",
            "GLOG_minloglevel": "1", "SPECFORGE_LEASE_TTL_S": "3"}


def common(tiny) -> list[str]:
    return ["--strategy", "eagle3", "--set", f"target_engine.model={tiny}", "--set", f"data.max_samples={SAMPLES}",
            "--set", f"train.batch_size={BATCH}", "--set", "train.real_eval_prompts=0", "--set", "train.export=false",
            "--set", "train.save_every=2"]


def stream_args(postgres, master, schema) -> list[str]:
    return ["--control-plane", "postgres", "--set", f"control_plane.dsn={postgres.dsn}",
            "--set", f"control_plane.schema={schema}", "--set", "control_plane.idle_timeout_s=120",
            "--feature-store", "mooncake",
            "--set", f"feature_store.master_address={master.master_address}",
            "--set", f"feature_store.metadata_server={master.metadata_server}",
            "--set", f"feature_store.global_segment_size={64 * 2**20}",
            "--set", f"feature_store.local_buffer_size={16 * 2**20}", "--set", "feature_store.lease_wait_s=5"]


def specforge(*args: str, ranks: int = 1) -> list[str]:
    """The command line of ``specforge ARGS`` (under torchrun with gloo when ``ranks`` > 1)."""
    cmd = [SPECFORGE, *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        "-m", "specforge_core.cli", *args]
    return cmd


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def test_two_producers_and_a_two_rank_consumer_share_only_two_addresses(postgres, master, tiny, tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(specforge("run", "--output", str(reference), *common(tiny), ranks=2), env=env(), check=True,
                   capture_output=True, text=True, timeout=600, cwd=tmp_path)
    schema = "across_hosts"
    producers = []
    for index in range(2):
        home = tmp_path / f"producer{index}"
        home.mkdir()
        producers.append(subprocess.Popen(
            specforge("run", "--role", "producer", *common(tiny), *stream_args(postgres, master, schema),
                      "--output", "out"), cwd=home, env=env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    home = tmp_path / "consumer"
    home.mkdir()
    consumer = subprocess.run(specforge("run", "--role", "consumer", *common(tiny), *stream_args(postgres, master, schema),
                                        "--output", "out", ranks=2),
                              cwd=home, env=env(), capture_output=True, text=True, timeout=600)
    outputs = [p.communicate(timeout=300) for p in producers]
    assert consumer.returncode == 0, consumer.stderr[-4000:]
    for proc, (out, err) in zip(producers, outputs):
        assert proc.returncode == 0, err[-4000:]
    published = [json.loads((tmp_path / f"producer{i}" / "out" / "producer_summary.json").read_text())["published"]
                 for i in range(2)]
    assert sum(published) == SAMPLES
    assert losses(home / "out") == losses(reference)
    plane = open_plane(postgres, schema, role="consumer")
    try:
        assert plane.metadata.stats() == {"committed": SAMPLES, "acked": SAMPLES, "duplicates": 0, "pending": 0}
        assert len(plane.metadata.acked_steps()) == SAMPLES
    finally:
        plane.close()
