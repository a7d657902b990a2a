"""A disaggregated run whose training stream goes through Mooncake, end to end.

A producer process and a consumer process (the public CLI, a tiny toy target, the eagle3
strategy) share a features directory for the target parts, the eval split and the sqlite
control plane, while every training sample travels through a real ``mooncake_master``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specforge_core.control_planes.sqlite import SqliteMetadataStore
from specforge_core.topologies.stream.record import stream_id

SPECFORGE = str(Path(sys.executable).parent / "specforge")
SAMPLES, BATCH = 16, 2


def cli_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "SPECFORGE_STRICT_PLUGINS": "1"}


def test_producer_and_consumer_stream_training_samples_through_mooncake(master, tmp_path):
    from specforge_plugin_hf.toy import build_toy_target

    tiny = build_toy_target(tmp_path / "tiny", "tiny", progress=False)
    shared = tmp_path / "shared"
    common = ["--strategy", "eagle3", "--features", str(shared), "--feature-store", "mooncake",
              "--set", f"feature_store.master_address={master.master_address}",
              "--set", f"feature_store.metadata_server={master.metadata_server}",
              "--set", f"feature_store.global_segment_size={64 * 2**20}",
              "--set", f"feature_store.local_buffer_size={16 * 2**20}",
              "--set", f"target_engine.model={tiny}", "--set", f"data.max_samples={SAMPLES}",
              "--set", f"train.batch_size={BATCH}", "--set", "train.real_eval_prompts=0", "--set", "train.export=false"]
    producer = subprocess.Popen([SPECFORGE, "run", "--role", "producer", *common, "--output", str(tmp_path / "prod")],
                                env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    consumer = subprocess.run([SPECFORGE, "run", "--role", "consumer", *common, "--output", str(tmp_path / "cons")],
                              env=cli_env(), capture_output=True, text=True, timeout=600)
    out, err = producer.communicate(timeout=600)
    assert consumer.returncode == 0, consumer.stderr[-4000:]
    assert producer.returncode == 0, err[-4000:]
    assert f"done: published {SAMPLES} samples" in out
    summary = json.loads((tmp_path / "cons" / "summary.json").read_text())
    assert summary["topology"] == "disaggregated-consumer" and summary["steps"] == SAMPLES // BATCH
    assert summary["config"]["feature_store"]["name"] == "mooncake"
    metadata = SqliteMetadataStore(str(shared / "control" / "metadata.sqlite"))
    try:
        assert metadata.stats() == {"committed": SAMPLES, "acked": SAMPLES, "duplicates": 0, "pending": 0}
        refs = metadata.reconcile().acked
    finally:
        metadata.close()
    # with no namespace set, both sides named the stream after the shared directory
    assert {ref.store for ref in refs} == {f"mooncake://{master.master_address}/{stream_id(shared)}"}
    # only the eval split went to the directory's disk store; the training samples went through Mooncake
    stream = json.loads((shared / "manifest.json").read_text())["stream"]
    assert len(list((shared / "store").rglob("*.safetensors"))) == stream["eval_samples"]
