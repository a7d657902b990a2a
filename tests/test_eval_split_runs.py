"""Runs on the tiny toy target always evaluate when they can, and say so plainly when they cannot."""

import json

import pytest

from sf_helpers import run_specforge


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


def args(tiny, out, *extra):
    return ["run", "--strategy", "eagle3", "--target-model", str(tiny), "--data", str(tiny / "train.jsonl"),
            "--output", str(out), "--set", "data.max_samples=16", "--set", "train.max_steps=2",
            "--set", "train.batch_size=4", "--set", "strategy.ttt_length=2", "--set", "train.real_eval_prompts=2",
            "--set", "train.real_eval_max_new_tokens=8", *extra]


def test_without_an_eval_file_a_share_of_the_data_evaluates(tiny, tmp_path):
    rows = sum(1 for line in (tiny / "train.jsonl").read_text().splitlines() if line.strip())
    held = min(200, max(1, round(0.05 * rows)))
    proc = run_specforge(*args(tiny, tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_split"] == (f"eval split: {held} of the {rows} rows of {tiny / 'train.jsonl'} held out "
                                     "(data.eval_holdout=0.05, at most 200)")
    assert summary["accept_len_sim"] >= 1.0 and summary["accept_len_real"] >= 1.0
    assert f"train data {tiny / 'train.jsonl'}: {rows - held} rows read" in proc.stderr
    assert f"eval data {tiny / 'train.jsonl'}: {held} rows read" in proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert "accept_len_sim" in last and "accept_len_real" in last and "best checkpoint run-step2" in last


def test_a_run_with_nothing_to_evaluate_says_so_on_its_last_line(tiny, tmp_path):
    proc = run_specforge(*args(tiny, tmp_path / "run", "--set", "data.eval_holdout=0"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    last = proc.stdout.strip().splitlines()[-1]
    assert "nothing evaluated (no eval split: data.eval_holdout=0 and no data.eval_path)" in last
    assert "best checkpoint run-step2 (loss" in last and "0.0 at step 1" not in last
    assert summary["best"]["metric"] == "loss" and summary["accept_len_sim"] is None
    assert summary["real_eval"]["skipped"].startswith("no held-out prompts (no eval split")


def test_an_eval_file_without_a_usable_row_is_refused_naming_it(tiny, tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"text": "no conversation here"}\n')
    proc = run_specforge(*args(tiny, tmp_path / "run", "--eval-data", str(bad)), expect=1)
    assert f"error: {bad} gave no usable sample for the eval split: 1 rows read: 0 kept" in proc.stderr
    assert f"e.g. {bad}:1: unknown row format" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_capture_reports_its_data_first_and_refuses_an_empty_eval_split_before_writing(tiny, tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"messages": []}\n')
    features = tmp_path / "features"
    proc = run_specforge("capture", "--strategy", "eagle3", "--target-model", str(tiny), "--data",
                         str(tiny / "train.jsonl"), "--eval-data", str(bad), "--output", str(features),
                         "--set", "strategy.ttt_length=2", expect=1)
    assert f"train data {tiny / 'train.jsonl'}: " in proc.stderr and "distinct)" in proc.stderr
    assert f"error: {bad} gave no usable sample for the eval split" in proc.stderr
    assert "skipped 1: empty conversation" in proc.stderr and not features.exists()


def test_a_run_whose_data_ends_before_max_steps_evaluates_and_saves_its_last_step(tiny, tmp_path):
    out = tmp_path / "run"
    proc = run_specforge(*args(tiny, out, "--set", "data.max_samples=8", "--set", "train.max_steps=5"))
    summary = json.loads((out / "summary.json").read_text())
    evals = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "eval/accept_len_sim" in line]
    assert summary["steps"] == 2 and evals == [2]  # one epoch of 8 samples in batches of 4
    assert summary["best"]["checkpoint"] == "run-step2" and "best checkpoint run-step2" in proc.stdout
