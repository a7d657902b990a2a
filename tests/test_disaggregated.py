"""The disaggregated topology: a producer process and a consumer process sharing a directory.

Real processes through the public CLI, a real (tiny toy) target, the real sqlite control
plane and disk store. The ``example`` strategy and the ``linear`` test plugin (for its
crash hook: ``SF_TEST_CRASH_AT`` hard-exits at that step) are installed into a fake site.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from sf_helpers import SPECFORGE, example_site, run_specforge
from specforge_core.control_planes.sqlite import SqliteMetadataStore
from specforge_core.errors import ControlPlaneError

SAMPLES, BATCH = 24, 2
STEPS = SAMPLES // BATCH


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = example_site(tmp_path_factory.mktemp("disaggregated-site"), "sf_linear_plugin_dis")
    yield site
    site.cleanup()


def common(tiny, *extra):
    return ["--strategy", "example", "--set", f"target_engine.model={tiny}", "--set", f"data.max_samples={SAMPLES}",
            "--set", f"train.batch_size={BATCH}", "--set", "train.real_eval_prompts=0", "--set", "train.export=false",
            *extra]


def start_producer(site, tiny, shared, out, *extra):
    env = site.env()
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", SPECFORGE_STRICT_PLUGINS="1")
    return subprocess.Popen([SPECFORGE, "run", "--role", "producer", "--features", str(shared), "--output", str(out),
                             *common(tiny, *extra)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc, timeout=300):
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"producer exited {proc.returncode}\n{stdout}\n{stderr[-4000:]}"
    return stdout


def consume(site, tiny, shared, out, *extra, env_extra=None, expect=0):
    return run_specforge("run", "--role", "consumer", "--features", str(shared), "--output", str(out),
                         *common(tiny, *extra), env=site.env(**(env_extra or {})), expect=expect)


def losses(run):
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def stats(shared):
    store = SqliteMetadataStore(str(shared / "control" / "metadata.sqlite"))
    try:
        return {**store.stats(), "durable_step": store.durable_step()}
    finally:
        store.close()


def sample_files(shared):
    return sorted(p.name for p in (shared / "store").rglob("*.safetensors"))


def published_ids(shared):
    records = [json.loads(line) for line in (shared / "control" / "refs.jsonl").read_text().splitlines()]
    return [r["ref"]["sample_id"] for r in records if r["kind"] == "ref"]


@pytest.fixture(scope="module")
def reference(site, tiny, tmp_path_factory):
    """The same training as an online colocated run: what a disaggregated run must reproduce."""
    run = tmp_path_factory.mktemp("reference") / "online"
    run_specforge("run", "--output", str(run), *common(tiny, "--set", "train.save_every=2"), env=site.env())
    return losses(run)


@pytest.fixture(scope="module")
def streamed(site, tiny, reference, tmp_path_factory):
    """One finished producer + consumer pair."""
    base = tmp_path_factory.mktemp("streamed")
    shared = base / "shared"
    producer = start_producer(site, tiny, shared, base / "producer")
    proc = consume(site, tiny, shared, base / "consumer")
    return shared, base, finish(producer), proc


def test_producer_and_consumer_train_every_sample_once_as_an_online_run_would(streamed, reference):
    shared, base, producer_out, consumer = streamed
    summary = json.loads((base / "consumer" / "summary.json").read_text())
    assert summary["topology"] == "disaggregated-consumer" and summary["steps"] == STEPS
    # the producer's engine suggestions reach the consumer, and the samples come in the online order
    assert summary["train_options_suggested_by_engine"] == {"warmup_steps": 50, "lr": 0.001}
    assert losses(base / "consumer") == reference
    assert stats(shared) == {"committed": SAMPLES, "acked": SAMPLES, "duplicates": 0, "pending": 0,
                             "durable_step": STEPS}
    stream = json.loads((shared / "manifest.json").read_text())["stream"]
    assert stream["train_samples"] == SAMPLES and stream["train.epochs"] == 1 and stream["strategy"] == "example"
    # every training file was deleted once a checkpoint covered it; the eval split is kept
    assert len(sample_files(shared)) == stream["eval_samples"] > 0
    assert sorted(published_ids(shared)) == sorted(set(published_ids(shared)))
    assert len(published_ids(shared)) == SAMPLES
    assert json.loads((base / "producer" / "producer_summary.json").read_text())["published"] == SAMPLES
    assert f"done: published {SAMPLES} samples (0 already committed before this start)" in producer_out


def test_a_crashed_consumer_resumes_without_losing_or_repeating_a_sample(site, tiny, reference, tmp_path):
    shared = tmp_path / "shared"
    producer = start_producer(site, tiny, shared, tmp_path / "producer")
    crashed = consume(site, tiny, shared, tmp_path / "consumer", "--set", "train.save_every=2",
                      env_extra={"SF_TEST_CRASH_AT": "5"}, expect=None)
    finish(producer)
    assert crashed.returncode == 17
    assert (tmp_path / "consumer" / "latest").read_text().strip() == "run-step4"
    # step 5 was acked durably, but its training died with the process: its files must still be there
    assert stats(shared)["acked"] == 5 * BATCH and stats(shared)["durable_step"] == 5
    eval_samples = json.loads((shared / "manifest.json").read_text())["stream"]["eval_samples"]
    assert len(sample_files(shared)) == eval_samples + SAMPLES - 4 * BATCH  # steps 1-4 freed by checkpoint 4
    consume(site, tiny, shared, tmp_path / "consumer", "--set", "train.save_every=2", "--resume", "latest")
    assert losses(tmp_path / "consumer") == reference
    assert stats(shared) == {"committed": SAMPLES, "acked": SAMPLES, "duplicates": 0, "pending": 0,
                             "durable_step": STEPS}
    assert len(sample_files(shared)) == eval_samples
    # the requeued step-5 samples are counted consumed once, not twice (producer backpressure)
    assert json.loads((shared / "control" / "consumed.0.json").read_text())["consumed"] == SAMPLES


def test_a_killed_producer_restarts_and_publishes_each_sample_once(site, tiny, reference, tmp_path):
    shared = tmp_path / "shared"
    # capture batches of 4; publishing pauses while 4 refs are unconsumed
    backpressure = ("--set", "target_engine.capture_batch_size=4", "--set", "control_plane.high_watermark=4",
                    "--set", "control_plane.low_watermark=2")
    producer = start_producer(site, tiny, shared, tmp_path / "producer", *backpressure)
    refs = shared / "control" / "refs.jsonl"
    deadline = time.monotonic() + 240
    while not (refs.exists() and len(published_ids(shared)) >= 4):  # then it waits for a consumer
        assert producer.poll() is None, producer.communicate()
        assert time.monotonic() < deadline, "the producer published nothing"
        time.sleep(0.2)
    time.sleep(1.0)
    assert len(published_ids(shared)) == 4  # paused at the high watermark
    producer.send_signal(signal.SIGKILL)
    producer.wait()
    restarted = start_producer(site, tiny, shared, tmp_path / "producer", *backpressure)
    consume(site, tiny, shared, tmp_path / "consumer")
    out = finish(restarted)
    assert "already committed before this start" in out
    ids = published_ids(shared)
    assert len(ids) == len(set(ids)) == SAMPLES
    assert stats(shared) == {"committed": SAMPLES, "acked": SAMPLES, "duplicates": 0, "pending": 0,
                             "durable_step": STEPS}
    assert losses(tmp_path / "consumer") == reference


def test_two_consumer_ranks_share_the_stream_and_train_each_sample_once(site, tiny, tmp_path):
    shared = tmp_path / "shared"
    producer = start_producer(site, tiny, shared, tmp_path / "producer")
    run_specforge("run", "--role", "consumer", "--features", str(shared), "--output", str(tmp_path / "consumer"),
                  *common(tiny), env=site.env(), ranks=2)
    finish(producer)
    summary = json.loads((tmp_path / "consumer" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == SAMPLES // 2 // BATCH
    assert stats(shared) == {"committed": SAMPLES, "acked": SAMPLES, "duplicates": 0, "pending": 0,
                             "durable_step": SAMPLES // 2 // BATCH}
    eval_samples = json.loads((shared / "manifest.json").read_text())["stream"]["eval_samples"]
    assert len(sample_files(shared)) == eval_samples


def test_a_consumer_with_no_producer_stops_with_a_clear_error(site, tiny, tmp_path):
    proc = consume(site, tiny, tmp_path / "nobody", tmp_path / "consumer", "--set", "control_plane.idle_timeout_s=1",
                   expect=None)
    assert proc.returncode == 1
    assert (f"no producer started a stream in {tmp_path / 'nobody'} within 1s (control_plane.idle_timeout_s): "
            f"start `specforge run --role producer --features {tmp_path / 'nobody'}`") in proc.stderr
    assert not (tmp_path / "consumer" / "summary.json").exists()


@pytest.mark.parametrize("extra", [(), ("--set", f"train.max_steps={STEPS}")])
def test_a_consumer_planning_other_epochs_than_the_stream_is_refused(site, tiny, streamed, extra):
    shared, base, _, _ = streamed
    proc = consume(site, tiny, shared, base / "other", "--set", "train.epochs=2", *extra, expect=None)
    assert proc.returncode == 1
    assert (f"the producer streams into {shared} with train.epochs=1, but this consumer has train.epochs=2; a "
            "consumer trains exactly what is streamed: start it with the stream's settings (--set train.epochs=1)"
            ) in proc.stderr
    assert stats(shared)["acked"] == SAMPLES  # nothing requeued or changed
    assert not (base / "other").exists()


def test_a_producer_restarted_with_other_data_is_refused(site, tiny, streamed):
    shared, base, _, _ = streamed
    producer = subprocess.run([SPECFORGE, "run", "--role", "producer", "--features", str(shared), "--output",
                               str(base / "again"), *common(tiny, "--set", "data.max_samples=10")],
                              env={**site.env(), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                              capture_output=True, text=True, timeout=300)
    assert producer.returncode == 1
    assert (f"{shared} already streams with data.max_samples={SAMPLES}, but this producer has data.max_samples=10"
            in producer.stderr)
    assert len(published_ids(shared)) == SAMPLES


def test_a_fresh_consumer_on_a_stream_whose_samples_were_deleted_is_refused(site, tiny, streamed):
    shared, base, _, _ = streamed
    before = stats(shared)
    proc = consume(site, tiny, shared, base / "fresh", expect=None)
    assert proc.returncode == 1
    assert (f"the samples trained up to step {STEPS} of the stream in {shared} were deleted after a checkpoint "
            "covered them, so this consumer cannot start from the beginning: resume from the latest checkpoint "
            "(--resume latest)") in proc.stderr
    assert stats(shared) == before  # no ack was undone


def test_a_finished_producer_started_again_publishes_nothing_and_exits_cleanly(site, tiny, streamed):
    shared, base, _, _ = streamed
    out = finish(start_producer(site, tiny, shared, base / "producer-again"))
    assert f"done: published 0 samples ({SAMPLES} already committed before this start)" in out
    assert len(published_ids(shared)) == SAMPLES


def test_a_second_producer_or_consumer_of_one_stream_is_refused(site, tiny, streamed):
    from specforge_core.topologies.stream.record import hold_lock

    shared, base, _, _ = streamed
    for role, lock in (("producer", "producer.lock"), ("consumer", "consumer.rank0.lock")):
        held = hold_lock(str(shared / "control" / lock), "test")  # as a running process would
        try:
            proc = run_specforge("run", "--role", role, "--features", str(shared), "--output", str(base / f"second-{role}"),
                                 *common(tiny), env=site.env(), expect=None)
        finally:
            os.close(held)
        assert proc.returncode == 1
        holder = "producer" if role == "producer" else "consumer (rank 0)"
        assert f"another {holder} is running on this stream (it holds {shared / 'control' / lock})" in proc.stderr
    assert len(published_ids(shared)) == SAMPLES


def test_a_producer_under_torchrun_is_refused(site, tiny, tmp_path):
    proc = run_specforge("run", "--role", "producer", "--features", str(tmp_path / "shared"), "--output",
                         str(tmp_path / "p"), *common(tiny), env=site.env(WORLD_SIZE="2"), expect=None)
    assert proc.returncode == 1
    assert "a producer runs as one process" in proc.stderr
    assert not (tmp_path / "shared").exists()


@pytest.mark.parametrize("args, message", [
    (["--role", "consumer"], "--role consumer needs --features DIR: the directory the producer and the consumer share"),
    (["--role", "producer", "--features", "x", "--feature-store", "memory"],
     "--role producer needs a feature store that separate processes share (capability cross_process); "
     "feature_store='memory' keeps tensors inside one process"),
    (["--role", "consumer", "--features", "x", "--control-plane", "local"],
     "--role consumer exchanges refs through the shared directory's sqlite control plane; "
     "control_plane='local' cannot be shared"),
])
def test_role_options_that_cannot_work_are_refused_before_anything_runs(site, args, message, tmp_path):
    proc = run_specforge("run", "--strategy", "example", *args, "--dry-run", env=site.env(), expect=2)
    assert message in proc.stderr


def test_an_unknown_role_in_a_config_file_and_a_resumed_producer_are_refused(site, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("role: trainer\nfeatures: x\nstrategy: {name: example}\n")
    proc = run_specforge("run", "--config", str(config), "--dry-run", env=site.env(), expect=2)
    assert "unknown role 'trainer'; choose producer (captures features) or consumer (trains)" in proc.stderr
    proc = run_specforge("run", "--strategy", "example", "--role", "producer", "--features", str(tmp_path / "x"),
                         "--resume", "latest", env=site.env(), expect=2)
    assert "a producer resumes by itself from its features directory; drop --resume" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_requeue_acked_after_makes_later_acks_pending_again(tmp_path):
    from specforge_core.contracts import SampleRef

    store = SqliteMetadataStore(str(tmp_path / "m.sqlite"))
    refs = [SampleRef(sample_id=f"s{i}", run_id="r", store="memory://x", features={}) for i in range(6)]
    store.commit(refs)
    for step in (1, 2, 3):
        store.ack([f"s{2 * step - 2}", f"s{2 * step - 1}"], step)
    assert store.requeue_acked_after(1) == 4
    reconciled = store.reconcile()
    assert [r.sample_id for r in reconciled.acked] == ["s0", "s1"]
    assert [r.sample_id for r in reconciled.pending] == ["s2", "s3", "s4", "s5"]
    assert store.durable_step() == 1 and store.requeue_acked_after(1) == 0
    with pytest.raises(ControlPlaneError, match="requeue_acked_after needs a global step >= 0, got -1"):
        store.requeue_acked_after(-1)
    assert store.stats()["acked"] == 2
    store.close()


def test_the_stream_contract_covers_every_option_that_changes_the_samples(tmp_path):
    from specforge_core.config import DataOptions, resolve_plan
    from specforge_core.options import options_to_dict
    from specforge_core.plugins import PluginManager
    from specforge_core.topologies.stream.record import StreamError, check_stream_contract, stream_contract

    plan = resolve_plan(PluginManager().load(), {"strategy": {"name": "eagle3"}, "features": str(tmp_path),
                                                 "role": "consumer", "data": {"path": "chats.jsonl"}})
    contract = stream_contract(plan)
    data_keys = {f"data.{key}" for key in options_to_dict(DataOptions())} - {"data.strict", "data.missing_samples"}
    strategy_keys = {f"strategy.{key}" for key in options_to_dict(plan["strategy"].options)}
    assert strategy_keys and data_keys >= {"data.path", "data.max_length", "data.max_samples", "data.last_turn_only"}
    assert set(contract) == {"strategy", "train.epochs", "train.seed", *strategy_keys, *data_keys}
    assert contract["data.path"] == os.path.abspath("chats.jsonl")  # processes in other directories compare files
    check_stream_contract(contract, contract, features="F", side="consumer")
    for key in sorted(contract):
        changed = {**contract, key: "other"}
        said = ("the producer streams features for strategy 'other' into F, but this consumer runs strategy 'eagle3' "
                r"\(field strategy\)") if key == "strategy" else f"with {key}='other', but this consumer has {key}="
        with pytest.raises(StreamError, match=said):
            check_stream_contract(changed, contract, features="F", side="consumer")


def test_a_run_that_reads_its_data_records_it_and_the_seed_in_its_resume_contract(tmp_path):
    from specforge_core.config import resolve_plan
    from specforge_core.plugins import PluginManager
    from specforge_core.runtime import run_contract
    from specforge_core.config import data_contract

    manager = PluginManager().load()
    online = resolve_plan(manager, {"strategy": {"name": "eagle3"}, "data": {"path": "chats.jsonl", "max_length": 512},
                                    "train": {"seed": 3}})
    contract = run_contract(online, 1, 10, "fp")
    assert contract["seed"] == 3 and contract["data"] == data_contract(online.data)
    assert contract["data"]["path"] == os.path.abspath("chats.jsonl") and contract["data"]["max_length"] == 512
    assert "strict" not in contract["data"]  # whether a bad row stops the run changes no sample
    offline = resolve_plan(manager, {"strategy": {"name": "eagle3"}, "features": str(tmp_path)})
    assert "data" not in run_contract(offline, 1, 10, "fp")  # a feature set is its own identity (the target's)


def test_a_consumer_that_names_no_data_trains_the_streams_and_one_that_names_other_data_is_refused(tmp_path):
    """On another host the producer's data paths mean nothing: a consumer without --data is not refused for
    them; a consumer that names a data file must name the producer's."""
    from specforge_core.config import resolve_plan
    from specforge_core.plugins import PluginManager
    from specforge_core.topologies.stream.record import StreamError, check_consumer_fits, stream_contract

    manager = PluginManager().load()

    def plan(role, **data):
        return resolve_plan(manager, {"strategy": {"name": "eagle3"}, "features": str(tmp_path), "role": role,
                                      "data": data})

    record = {**stream_contract(plan("producer", path=str(tmp_path / "chats.jsonl"))), "train_samples": 8}
    check_consumer_fits(plan("consumer"), record, "F")  # no data named: accepted
    check_consumer_fits(plan("consumer", path=str(tmp_path / "chats.jsonl")), record, "F")
    with pytest.raises(StreamError, match=r"with data.path='.*chats.jsonl', but this consumer has "
                                          r"data.path='.*other.jsonl'.*--set data.path="):
        check_consumer_fits(plan("consumer", path=str(tmp_path / "other.jsonl")), record, "F")
    with pytest.raises(StreamError, match=r"with data.max_length=2048, but this consumer has data.max_length=64"):
        check_consumer_fits(plan("consumer", max_length=64), record, "F")
