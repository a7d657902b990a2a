"""Capture and both topologies against a real (tiny toy) target, through the public CLI.

The ``example`` strategy (examples/specforge-plugin-example) and the ``linear`` test plugin
(for its crash hook) are installed into a fake site; the target is the tiny toy target
built by the hf plugin.
"""

import json
import shutil

import pytest

from sf_helpers import example_site, run_specforge



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = example_site(tmp_path_factory.mktemp("example-site"), "sf_linear_plugin_online")
    yield site
    site.cleanup()


def specforge(site, *args, ranks=1, env_extra=None, expect=0):
    return run_specforge(*args, env=site.env(**(env_extra or {})), ranks=ranks, expect=expect)


@pytest.fixture(scope="module")
def features(site, tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("captured") / "feats"
    proc = specforge(site, "capture", "--strategy", "example", "--target-model", str(tiny), "--output", str(out),
                     "--batch-size", "4", "--set", "data.max_samples=40")
    return out, proc


def test_capture_writes_a_complete_feature_set_at_the_unpadded_minimum(features, tiny):
    out, proc = features
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["strategy"] == "example"
    assert manifest["samples"]["train"] == 40 and manifest["samples"]["eval"] > 0
    capture = manifest["capture"]
    assert 1.0 <= capture["ratio_to_unpadded_minimum"] < 1.2  # unpadded tensors plus small headers
    assert f"{capture['ratio_to_unpadded_minimum']:.3f}x the unpadded minimum" in proc.stdout
    assert (out / "frozen_parts.safetensors").exists() and (out / "token_counts.safetensors").exists()
    assert "train: 40 samples (40 new, 0 reused)" in proc.stdout
    assert "train: the first 40 of these are captured (data.max_samples)" in proc.stderr
    assert "40/40" in proc.stderr  # the progress bar knew its total
    # the sample files went into one pack at the end
    samples = manifest["samples"]["train"] + manifest["samples"]["eval"]
    assert f"packed {samples} sample files (" in proc.stdout and " into 1 pack\n" in proc.stdout
    assert "pack features" in proc.stderr
    assert list((out / "store").rglob("*.safetensors")) == []
    assert sorted(p.suffix for p in (out / "store" / "packs").iterdir()) == [".data", ".json"]
    assert capture["bytes"] == sum(p.stat().st_size for p in (out / "store" / "packs").glob("*.data"))


def test_capture_resumes_without_recapturing(site, tiny, features):
    out, _ = features
    proc = specforge(site, "capture", "--strategy", "example", "--target-model", str(tiny), "--output", str(out),
                     "--set", "data.max_samples=40")
    assert "train: 40 samples (0 new, 40 reused)" in proc.stdout
    assert "40/40" in proc.stderr  # the samples captured before count on the bar
    assert "packed" not in proc.stdout  # nothing new to pack
    assert len(list((out / "store" / "packs").iterdir())) == 2


def test_ctrl_c_during_a_capture_keeps_what_it_captured_and_the_same_command_finishes_it(site, tiny, tmp_path):
    from sf_helpers import interrupt_when

    out = tmp_path / "feats"
    args = ["capture", "--strategy", "example", "--target-model", str(tiny), "--output", str(out), "--batch-size", "1",
            "--set", "data.max_samples=200"]
    returncode, stderr = interrupt_when(args, {**site.env(), "OMP_NUM_THREADS": "1"},
                                        lambda: len(list((out / "store").rglob("*.safetensors"))) >= 5)
    assert returncode == 130, stderr[-3000:]
    assert (f"interrupted: the samples captured so far stay in {out}; run the same command again to finish (it skips "
            "them)") in stderr
    assert "Traceback" not in stderr and "Aborted!" not in stderr
    kept = len(list((out / "store").rglob("*.safetensors")))
    assert kept >= 5 and json.loads((out / "manifest.json").read_text())["complete"] is False
    again = specforge(site, *args)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["samples"]["train"] == 200
    reused = int(again.stdout.split("train: 200 samples (")[1].split(" new, ")[1].split(" reused")[0])
    assert reused == min(kept, 200)  # every sample file the interrupted capture published (train comes first)


def test_capture_no_pack_leaves_one_file_per_sample_and_a_later_capture_packs_them(site, tiny, tmp_path):
    out = tmp_path / "feats"
    args = ["capture", "--strategy", "example", "--target-model", str(tiny), "--output", str(out),
            "--set", "data.max_samples=6"]
    proc = specforge(site, *args, "--no-pack")
    assert "packed" not in proc.stdout and not (out / "store" / "packs").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    samples = manifest["samples"]["train"] + manifest["samples"]["eval"]
    assert manifest["samples"]["train"] == 6 and len(list((out / "store").rglob("*.safetensors"))) == samples
    proc = specforge(site, *args)
    assert "train: 6 samples (0 new, 6 reused)" in proc.stdout and f"packed {samples} sample files (" in proc.stdout
    assert list((out / "store").rglob("*.safetensors")) == []


def test_a_capture_with_other_options_lists_its_own_samples_only(site, tiny, features, tmp_path):
    """The same directory captured again with fewer samples, then with another max_length: each manifest lists the
    samples that capture selected (a sample of other options has another id), not every file the store holds."""
    out = tmp_path / "feats"
    shutil.copytree(features[0], out)
    proc = specforge(site, "capture", "--strategy", "example", "--target-model", str(tiny), "--output", str(out),
                     "--set", "data.max_samples=20")
    assert "train: 20 samples (0 new, 20 reused)" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"]["train"] == len(manifest["sample_ids"]["train"]) == 20
    proc = specforge(site, "capture", "--strategy", "example", "--target-model", str(tiny), "--output", str(out),
                     "--set", "data.max_samples=20", "--set", "data.max_length=16")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"]["train"] == 20 and "train: 20 samples (20 new, 0 reused)" in proc.stdout


def test_capture_into_a_folder_of_another_strategy_is_refused(site, tiny, features):
    out, _ = features
    proc = specforge(site, "capture", "--strategy", "linear", "--target-model", str(tiny), "--output", str(out),
                     expect=None)
    assert proc.returncode != 0
    assert "already holds features of another target or strategy (example)" in proc.stderr


def test_offline_run_from_captured_features(site, features, tmp_path):
    out, _ = features
    run = tmp_path / "run"
    proc = specforge(site, "run", "--strategy", "example", "--features", str(out), "--output", str(run),
                     "--set", "train.max_steps=4", "--set", "train.batch_size=4")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["topology"] == "offline"
    assert "eval/acc_0" in summary["final_eval"]  # the example strategy: one accuracy per head
    assert "done: 4 steps" in proc.stdout


def test_a_run_stopped_in_its_export_finishes_the_export_when_resumed(site, features, tiny, tmp_path):
    out, _ = features
    run = tmp_path / "run"
    args = ["run", "--strategy", "example", "--features", str(out), "--output", str(run), "--set", "train.max_steps=2",
            "--set", "train.batch_size=4", "--set", f"target_engine.model={tiny}", "--set", "train.real_eval_prompts=2"]
    specforge(site, *args)
    finished = json.loads((run / "summary.json").read_text())
    assert finished["export"] == str(run / "export") and finished["accept_len_real"] is not None
    # what a crash inside the export leaves: the summary the training loop wrote, and no export
    trained = {k: v for k, v in finished.items() if k not in {
        "accept_len_sim", "accept_len_convention", "tau_sim", "tau_sim_convention", "export", "export_format",
        "accept_len_real", "tau_real", "speedup", "real_eval"}}
    (run / "summary.json").write_text(json.dumps(trained))
    shutil.rmtree(run / "export")
    checkpoints = sorted(p.name for p in run.iterdir() if p.name.startswith("run-step"))
    proc = specforge(site, *args, "--resume", "latest")
    assert "trained to step 2 but stopped before its export and acceptance check finished; doing them now" \
        in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["export"] == str(run / "export") and (run / "export" / "config.json").exists()
    assert summary["accept_len_real"] == finished["accept_len_real"] and summary["steps"] == 2
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("run-step")) == checkpoints  # nothing trained
    proc = specforge(site, *args, "--resume", "latest")
    assert "already finished: step 2 of 2; nothing trained, nothing written" in proc.stderr


def online_args(tiny, run, *extra, steps=6):
    return ["run", "--strategy", "example", "--output", str(run), "--run-id", "on",
            "--set", f"target_engine.model={tiny}", "--set", "data.max_samples=48",
            "--set", f"train.max_steps={steps}", "--set", "train.batch_size=2", "--set", "train.lr=0.01", *extra]


def test_online_colocated_run_captures_while_training(site, tiny, tmp_path):
    run = tmp_path / "online"
    specforge(site, *online_args(tiny, run))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["topology"] == "online-colocated"
    assert summary["steps"] == 6
    # the toy target suggests a warmup; the lr the user set is kept
    assert summary["train_options_suggested_by_engine"] == {"warmup_steps": 50}
    assert summary["config"]["train"]["lr"] == 0.01
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert "eval/acc_0" in summary["final_eval"]  # the example strategy: one accuracy per head


@pytest.mark.parametrize("ranks", [1, 2])
def test_online_run_resumes_bit_exactly(site, tiny, tmp_path, ranks):
    full, broken = tmp_path / "full", tmp_path / "broken"
    extra = ("--set", "train.save_every=2")
    specforge(site, *online_args(tiny, full, *extra, steps=8), ranks=ranks)
    crashed = specforge(site, *online_args(tiny, broken, *extra, steps=8), ranks=ranks,
                        env_extra={"SF_TEST_CRASH_AT": "5"}, expect=None)
    assert crashed.returncode != 0
    specforge(site, *online_args(tiny, broken, *extra, "--resume", "latest", steps=8), ranks=ranks)

    def losses(run):
        return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "loss" in r]

    assert losses(broken) == losses(full)


def test_resume_after_the_data_file_was_edited_in_place_is_refused(site, tiny, tmp_path):
    # the same path and options: only the resume contract's samples (ids hashing each row's tokens) can tell
    data = tmp_path / "chats.jsonl"
    rows = [json.loads(line) for line in (tiny / "train.jsonl").read_text().splitlines()[:48]]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    specforge(site, *online_args(tiny, run, "--data", str(data), steps=2))
    before = sorted(p.name for p in run.iterdir())
    reply = next(m for m in rows[5]["messages"] if m["role"] == "assistant")
    reply["content"] += " Indeed."
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = specforge(site, *online_args(tiny, run, "--data", str(data), "--resume", "latest", steps=4), expect=1)
    assert "samples.digest changed" in proc.stderr and "a data file edited in place" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == before
