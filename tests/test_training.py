"""The training spine end to end: a test strategy plugin trained offline through `specforge run`.

Everything runs as real processes: the CLI in a subprocess, two ranks under torchrun with
gloo. The "linear" strategy comes from a fake installed distribution (tests/fixtures).
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.linear_plugin import make_features
from sf_helpers import run_specforge
from specforge_core import heap
from specforge_core.testing import FakeSite

PLUGIN_SOURCE = (Path(__file__).parent / "fixtures" / "linear_plugin.py").read_text()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = FakeSite(tmp_path_factory.mktemp("linear-site"))
    site.add("specforge-plugin-linear", "0.0.7", entry_points={"linear": "sf_linear_plugin"},
             modules={"sf_linear_plugin": PLUGIN_SOURCE})
    yield site
    site.cleanup()


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    return make_features(tmp_path_factory.mktemp("features") / "feats")


def specforge(site, *args, ranks=1, env_extra=None, expect=0):
    return run_specforge(*args, env=site.env(**(env_extra or {})), ranks=ranks, expect=expect, timeout=300)


def train_args(features, out, *extra, steps=8, batch=2):
    return ["run", "--strategy", "linear", "--features", str(features), "--output", str(out), "--run-id", "lin",
            "--set", f"train.max_steps={steps}", "--set", f"train.batch_size={batch}", "--set", "train.lr=0.05",
            "--set", "train.warmup_steps=2", *extra]


def losses(out):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(out) if "loss" in r]


def read_metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_metrics_summary_curves_and_checkpoints(site, features, tmp_path):
    out = tmp_path / "out"
    hook_log = tmp_path / "hooks.log"
    proc = specforge(site, *train_args(features, out, "--set", "train.save_every=2", "--set", "train.eval_every=4",
                                       "--set", "train.keep_last=2"),
                     env_extra={"SF_TEST_HOOK_LOG": str(hook_log)})
    assert "done: 8 steps" in proc.stdout
    records = read_metrics(out)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    for r in train:
        assert set(r) >= {"loss", "lr", "grad_norm", "tokens_per_s", "data_wait_fraction", "acc", "ce", "epoch"}
        assert r["tokens_per_s"] > 0 and 0 <= r["data_wait_fraction"] <= 1
        assert r["ctx_step"] == r["step"] - 1  # forward_loss saw the number of completed updates
        assert r["ctx_total"] == 8
    assert train[0]["lr"] == pytest.approx(0.025)  # warmup step 1 of 2
    assert train[1]["lr"] == pytest.approx(0.05)
    assert [r["step"] for r in records if "eval/acc" in r] == [4, 8]
    assert train[-1]["loss"] < train[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["total_steps"] == 8
    assert summary["best"]["metric"] == "acc" and summary["best"]["mode"] == "max"
    assert summary["final_eval"]["eval/acc"] == [r for r in records if "eval/acc" in r][-1]["eval/acc"]
    assert {p["name"]: p["version"] for p in summary["plugins"]}["linear"] == "0.0.7"
    assert summary["config"]["strategy"]["name"] == "linear"
    if heap._glibc() is not None:  # train.keep_heap's default reached the process (tests/test_heap.py: what it does)
        assert summary["heap"] == "the heap kept between steps (blocks up to 32 MiB, trimmed above 1024 MiB free)"
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # rotation kept the newest two plus best; latest points at the final step
    assert (out / "latest").read_text().strip() == "lin-step8"
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("lin-step"))
    best = (out / "best").read_text().strip()
    assert set(kept) == {"lin-step6", "lin-step8", best}
    ckpt = out / "lin-step8"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert sorted(weights) == ["body.0.bias", "body.0.weight", "head.bias", "head.weight"]  # frozen proj not saved
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["contract"]["target"] == json.loads((features / "manifest.json").read_text())["frozen_fingerprint"]
    assert state["state"]["global_step"] == 8
    assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "optim.rank0.json",
                                                       "optim.rank0.safetensors", "rng.rank0.safetensors",
                                                       "trainer_state.json"]
    lines = hook_log.read_text().splitlines()
    assert [l for l in lines if l.startswith("step_end")] == [f"step_end {i}" for i in range(1, 9)]
    assert [l for l in lines if l.startswith("checkpoint")][:2] == ["checkpoint 2 lin-step2", "checkpoint 4 lin-step4"]


def test_recompute_mlp_says_when_the_draft_has_no_gated_mlp(site, features, tmp_path):
    out = tmp_path / "out"
    proc = specforge(site, *train_args(features, out, "--set", "train.recompute_mlp=true", steps=2))
    assert "train.recompute_mlp: the draft has no gated MLP (specforge_core.nn.SwiGLU); nothing is recomputed" \
        in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recomputed_mlps"] == 0 and summary["steps"] == 2


def test_keep_heap_false_leaves_the_c_librarys_heap_policy(site, features, tmp_path):
    out = tmp_path / "out"
    specforge(site, *train_args(features, out, "--set", "train.keep_heap=false", steps=2))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heap"] == "the C library's default heap policy (train.keep_heap is off)"
    assert summary["steps"] == 2 and summary["config"]["train"]["keep_heap"] is False


@pytest.mark.parametrize("broken, message", [
    ("dict_batch", "strategy 'linear': collate returned a dict, not a specforge_core.contracts.TrainBatch"),
    ("tensor", "strategy 'linear': forward_loss returned a Tensor, not a specforge_core.contracts.StepOutput; "
               "return StepOutput(loss=..., metrics=..., ratio_metrics=...)"),
    ("per_token", "strategy 'linear': forward_loss's StepOutput.loss is a tensor of shape [14], not a scalar tensor"),
    ("detached", "strategy 'linear': forward_loss's StepOutput.loss has no gradient"),
    ("ratio_float", "strategy 'linear': forward_loss's ratio_metrics['acc'] is 0.3, not a (numerator, denominator) "
                    "pair"),
])
def test_a_strategy_breaking_the_step_contract_is_named_before_anything_is_saved(site, features, tmp_path, broken,
                                                                                 message):
    out = tmp_path / "out"
    proc = specforge(site, *train_args(features, out, "--set", "train.save_every=1"),
                     env_extra={"SF_TEST_BREAK": broken}, expect=2)  # a plugin error, as at load
    assert f"error: {message}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "latest").exists() and list(out.glob("lin-step*")) == []


def test_verify_checksums_is_honoured_by_an_offline_run_of_a_packed_features_directory(site, features, tmp_path):
    from specforge_core.features import FeatureSet
    from specforge_core.protocols import BuildContext

    packed = Path(shutil.copytree(features, tmp_path / "feats"))
    with FeatureSet.open(packed).open_store(BuildContext(run_id="pack")) as store:
        assert store.pack()["samples"] == 34
    index = json.loads(next((packed / "store" / "packs").glob("*.json")).read_text())
    sample_id, _generation, offset, size, _ref = next(entry for entry in index["samples"] if entry[0] == "train-0005")
    data = packed / "store" / "packs" / index["data"]
    damaged = bytearray(data.read_bytes())
    damaged[offset + size - 3] ^= 0x10  # a byte of train-0005's labels
    data.write_bytes(bytes(damaged))
    proc = specforge(site, *train_args(packed, tmp_path / "out", "--set", "feature_store.verify_checksums=true"),
                     expect=1)
    assert re.search(rf"\(sample '{sample_id}'\): feature '[xy]' fails its xxh3-64 check .* The pack is damaged: "
                     rf"delete {index['data']} and {index['data'][:-5]}.json from .* and run the same `specforge "
                     "capture` again", proc.stderr)
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_warmup_longer_than_the_run_and_a_best_metric_never_reported_are_said_once(site, features, tmp_path):
    out = tmp_path / "out"
    proc = specforge(site, *train_args(features, out, "--set", "train.warmup_steps=20", "--set", "train.eval_every=2"),
                     env_extra={"SF_TEST_BEST_METRIC": "eval/acc"})
    assert ("note: the warmup is 20 steps but the run has 8: the learning rate rises all run and ends at 0.02, not "
            "train.lr 0.05. Set train.warmup_steps below 8 to reach it.") in proc.stderr
    warning = ("warning: the best checkpoint is chosen by eval metric 'eval/acc' (the strategy's best_metric), which "
               "the strategy does not report (eval metrics: acc, ce); no checkpoint will be marked best")
    assert proc.stderr.count(warning) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["best"]["checkpoint"] is None and not (out / "best").exists()
    good = specforge(site, *train_args(features, tmp_path / "good", "--set", "train.eval_every=2"))  # warmup 2 of 8
    assert "note: the warmup" not in good.stderr and "warning: the best checkpoint" not in good.stderr
    assert (tmp_path / "good" / "best").exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_non_finite_loss_stops_the_run_before_the_update_and_keeps_the_last_checkpoint(site, features, tmp_path,
                                                                                        ranks):
    out = tmp_path / "out"
    proc = specforge(site, *train_args(features, out, "--set", "train.save_every=2"), ranks=ranks,
                     env_extra={"SF_TEST_BREAK": "nan@5"}, expect=None)
    assert proc.returncode != 0
    assert ("error: step 5: the gradient norm is nan (the loss nan on this rank), so training stopped before this "
            "update: no weight took it, and the latest checkpoint, lin-step4, is intact (--resume latest)") in proc.stderr
    assert [step for step, _loss, _norm in losses(out)] == [1, 2, 3, 4]  # no NaN record
    assert (out / "latest").read_text().strip() == "lin-step4" and not (out / "lin-step5").exists()
    weights = load_file(str(out / "lin-step4" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (out / "summary.json").exists() and not (out / "export").exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_interrupted_and_resumed_run_matches_the_uninterrupted_one_bit_for_bit(site, features, tmp_path, ranks):
    full, broken = tmp_path / "full", tmp_path / "broken"
    args = ("--set", "train.save_every=2", "--set", "train.epochs=100")
    specforge(site, *train_args(features, full, *args, steps=10), ranks=ranks)
    crashed = specforge(site, *train_args(features, broken, *args, steps=10), ranks=ranks,
                        env_extra={"SF_TEST_CRASH_AT": "7"}, expect=None)
    assert crashed.returncode != 0
    assert (broken / "latest").read_text().strip() == "lin-step6"
    assert len(losses(broken)) == 7  # the crashed run logged step 7 before dying
    specforge(site, *train_args(features, broken, *args, "--resume", "latest", steps=10), ranks=ranks)
    assert losses(broken) == losses(full)
    a = load_file(str(full / "lin-step10" / "model.safetensors"))
    b = load_file(str(broken / "lin-step10" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change, field", [
    (["--set", "train.batch_size=3"], "batch_size changed (checkpoint: 2, now: 3)"),
    (["--set", "train.accumulation_steps=2"], "accumulation_steps changed (checkpoint: 1, now: 2)"),
    (["--set", "train.seed=5"], "seed changed (checkpoint: 0, now: 5)"),
    (["--set", "strategy.hidden=8"], "strategy_options.hidden changed (checkpoint: 16, now: 8)"),
    (["--set", "train.max_steps=3"], "it has already trained 4 optimizer steps, more than the 3 this run plans; "
                                     "raise train.max_steps (or train.epochs) to at least 4"),
])
def test_resume_with_a_changed_contract_is_refused_naming_the_field(site, features, tmp_path, change, field):
    out = tmp_path / "out"
    specforge(site, *train_args(features, out, steps=4))
    before = sorted(p.name for p in out.iterdir())
    proc = specforge(site, *train_args(features, out, "--resume", "latest", *change, steps=4), expect=1)
    assert field in proc.stderr
    assert "cannot resume from" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written, nothing lost
    if "strategy_options" in field:  # --dry-run says the same before anything is built (the others: test_bad_inputs)
        proc = specforge(site, *train_args(features, out, "--resume", "latest", *change, "--dry-run", steps=4), expect=1)
        assert field in proc.stderr and "cannot resume from" in proc.stderr


def test_a_finished_run_is_extended_by_resuming_with_more_steps(site, features, tmp_path):
    # A constant schedule: the extended run then trains exactly like one planned for 10 steps.
    args = ("--set", "train.epochs=100", "--set", "train.schedule=constant")
    full, extended = tmp_path / "full", tmp_path / "extended"
    specforge(site, *train_args(features, full, *args, steps=10))
    specforge(site, *train_args(features, extended, *args, steps=6))
    proc = specforge(site, *train_args(features, extended, *args, "--resume", "latest", steps=10))
    assert "done: 10 steps" in proc.stdout
    assert losses(extended) == losses(full)
    summary = json.loads((extended / "summary.json").read_text())
    assert summary["steps"] == summary["total_steps"] == 10
    state = json.loads((extended / "lin-step10" / "trainer_state.json").read_text())
    assert state["contract"]["total_steps"] == 10  # the next extension starts from the new horizon


def test_resuming_a_finished_run_trains_nothing_and_leaves_its_files_as_they_were(site, features, tmp_path):
    out = tmp_path / "out"
    specforge(site, *train_args(features, out, steps=4))
    files = {path: path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file()}
    assert json.loads((out / "summary.json").read_text())["tokens_per_s"] > 0
    proc = specforge(site, *train_args(features, out, "--resume", "latest", steps=4))
    assert f"the run in {out} already finished: step 4 of 4; nothing trained, nothing written. To train longer, " \
           "raise train.max_steps (and train.epochs to match)" in proc.stderr
    assert "done: 4 steps" in proc.stdout
    assert {path: path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file()} == files


def test_max_steps_beyond_the_epochs_says_where_the_run_will_stop(site, features, tmp_path):
    out = tmp_path / "out"  # 24 samples in batches of 2: 12 optimizer steps an epoch
    proc = specforge(site, *train_args(features, out, steps=14))
    assert "train.max_steps is 14, but train.epochs=1 pass(es) over the data hold 12 optimizer steps: the run " \
           "will stop at step 12. Set train.epochs=2 to reach max_steps." in proc.stderr
    assert "done: 12 steps" in proc.stdout
    proc = specforge(site, *train_args(features, tmp_path / "two", "--set", "train.epochs=2", steps=14))
    assert "train.max_steps is" not in proc.stderr and "done: 14 steps" in proc.stdout


def test_resume_latest_into_an_output_without_a_run_creates_nothing(site, features, tmp_path):
    out = tmp_path / "never"
    proc = specforge(site, *train_args(features, out, "--resume", "latest", steps=4), expect=1)
    assert f"no 'latest' checkpoint in {out}: nothing to resume (run without --resume to start fresh)" in proc.stderr
    assert not out.exists()


def test_ctrl_c_during_a_run_names_the_checkpoint_to_resume_from(site, features, tmp_path):
    from sf_helpers import interrupt_when

    out = tmp_path / "out"
    returncode, stderr = interrupt_when(train_args(features, out, "--set", "train.epochs=100000", "--set",
                                                   "train.save_every=2", steps=1000000),
                                        {**site.env(), "OMP_NUM_THREADS": "1"}, (out / "latest").exists)
    assert returncode == 130, stderr[-3000:]
    latest = (out / "latest").read_text().strip()
    assert f"interrupted; the run's latest checkpoint is {out / latest}: continue it with the same command and " \
           "--resume latest" in stderr
    assert "Traceback" not in stderr and "Aborted!" not in stderr
    resumed = specforge(site, *train_args(features, out, "--set", "train.epochs=100000", "--set", "train.save_every=2",
                                          "--resume", "latest", steps=int(latest.rsplit("step", 1)[1]) + 2))
    assert "done:" in resumed.stdout


def test_resume_against_a_different_target_is_refused(site, features, tmp_path):
    out = tmp_path / "out"
    specforge(site, *train_args(features, out, steps=4))
    other = make_features(tmp_path / "other", proj_seed=1)
    proc = specforge(site, *train_args(other, out, "--resume", "latest", steps=4), expect=1)
    assert "cannot resume from" in proc.stderr and "target changed" in proc.stderr


def test_resume_on_features_captured_again_with_other_samples_is_refused(site, features, tmp_path):
    # the same target (frozen parts) and options: only the samples differ, as after a capture with other data
    out = tmp_path / "out"
    specforge(site, *train_args(features, out, steps=4))
    before = sorted(p.name for p in out.iterdir())
    fewer = make_features(tmp_path / "fewer", n_train=22)
    proc = specforge(site, *train_args(fewer, out, "--resume", "latest", steps=4), expect=1)
    assert "samples.count changed (checkpoint: 24, now: 22): the training samples are not those" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == before
    other = make_features(tmp_path / "other", seed=1)  # as many samples, other contents
    proc = specforge(site, *train_args(other, out, "--resume", "latest", steps=4), expect=1)
    assert "samples.digest changed" in proc.stderr


def test_resume_with_a_different_world_size_is_refused(site, features, tmp_path):
    out = tmp_path / "out"
    specforge(site, *train_args(features, out, steps=4))
    proc = specforge(site, *train_args(features, out, "--resume", "latest", steps=4), ranks=2, expect=None)
    assert proc.returncode != 0
    assert "world_size changed (checkpoint: 1, now: 2)" in proc.stderr


def test_half_written_checkpoint_is_never_picked_up(site, features, tmp_path):
    out = tmp_path / "out"
    specforge(site, *train_args(features, out, "--set", "train.save_every=2", steps=4))
    junk = out / ".tmp-lin-step6"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"half")
    assert (out / "latest").read_text().strip() == "lin-step4"
    proc = specforge(site, *train_args(features, out, "--resume", str(junk), steps=4), expect=1)
    assert "is not a complete checkpoint" in proc.stderr


def test_resume_without_a_checkpoint_says_so(site, features, tmp_path):
    proc = specforge(site, *train_args(features, tmp_path / "empty", "--resume", "latest", steps=2), expect=1)
    assert "no 'latest' checkpoint in" in proc.stderr


def eval_acc(out):
    return [r["eval/acc"] for r in read_metrics(out) if "eval/acc" in r]


def test_eval_metrics_do_not_depend_on_batch_size_or_rank_count(site, features, tmp_path):
    """Same weights (lr=0), different eval batch sizes and rank counts: identical pooled metrics."""
    runs = {}
    for name, batch, ranks in (("b1", 1, 1), ("b4", 4, 1), ("r2", 1, 2)):
        out = tmp_path / name
        specforge(site, *train_args(features, out, "--set", "train.lr=1e-30", "--set", "train.warmup_steps=0",
                                    steps=2, batch=batch), ranks=ranks)
        runs[name] = eval_acc(out)
    assert runs["b1"] == runs["b4"] == runs["r2"]
    assert len(runs["b1"]) == 1 and 0 < runs["b1"][0] < 1


def test_two_ranks_see_distinct_samples(site, features, tmp_path):
    out = tmp_path / "out"
    specforge(site, *train_args(features, out, steps=6, batch=2), ranks=2)
    train = [r for r in read_metrics(out) if "loss" in r]
    assert len(train) == 6
    # 24 samples, 2 ranks x 2 per batch: one epoch is 6 steps and every step sees 4 distinct samples
    assert all(r["epoch"] == 0 for r in train)


def test_launched_ranks_leave_without_interpreter_teardown(site, features, tmp_path):
    """A rank whose run is over exits at once: a teardown that would abort it (here an atexit
    handler calling abort, standing in for the process group's threads) never runs, in success
    and in failure, and each rank's last words still reach the launcher."""
    hooks = tmp_path / "abort-at-exit"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import atexit, os\nif 'RANK' in os.environ:\n    atexit.register(os.abort)\n")
    path = {"PYTHONPATH": f"{hooks}{os.pathsep}{site.env()['PYTHONPATH']}"}
    out = tmp_path / "out"
    proc = specforge(site, *train_args(features, out, steps=2, batch=2), ranks=2, env_extra=path)
    assert proc.stdout.count("done: 2 steps") == 1  # rank 0's result line, flushed before it left
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    proc = specforge(site, *train_args(tmp_path / "nowhere", tmp_path / "o"), ranks=2, env_extra=path, expect=1)
    assert proc.stderr.count("is not a features directory") == 2  # both ranks' errors, exit status 1


def test_unknown_features_dir_is_a_clear_error(site, tmp_path):
    proc = specforge(site, *train_args(tmp_path / "nowhere", tmp_path / "o"), expect=1)
    assert "is not a features directory (no manifest.json); create one with `specforge capture`" in proc.stderr
