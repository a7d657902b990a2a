"""``specforge run/capture/eval --strategy domino`` through the public CLI, on the tiny toy target.

The resume test installs the plugin kit's crash-hook plugin (it kills the process after a
given optimizer step, like a lost node) into the core's ``fake_site``; everything else is the
installed distributions.
"""

import json

import pytest

from specforge_core.testing.cli import CRASH_AT, CRASH_STATUS, install_crash_hook, run_specforge

#: A small draft and a short run: block 4, 4 anchors, 8 optimizer steps (λ reaches 0 at floor(8 * 0.5) = 4).
SMALL = ("--set", "strategy.block_size=4", "--set", "strategy.num_anchors=4", "--set", "strategy.emb_dim=32",
         "--set", "train.batch_size=2", "--set", "train.lr=0.003")
STEPS = 8


def specforge(*args, site=None, env_extra=None, expect=0):
    """Run the installed ``specforge`` (seeing ``site``'s fake distributions too, when given)."""
    return run_specforge(*args, site=site, env_extra=env_extra, expect=expect, timeout=300)


def online_run(tiny, out, *extra):
    return ["run", "--strategy", "domino", "--output", str(out), "--run-id", "dom",
            "--set", f"target_engine.model={tiny}", "--set", "data.max_samples=24",
            "--set", f"train.max_steps={STEPS}", "--set", "train.save_every=2", *SMALL, *extra]


def trained(run):
    """``(step, λ, loss)`` of every logged optimizer step."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["lambda"], r["loss"]) for r in records if "lambda" in r]


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    """An uninterrupted online run, exported at the end (with a short real acceptance check)."""
    out = tmp_path_factory.mktemp("full") / "run"
    specforge(*online_run(tiny, out, "--set", "train.real_eval_prompts=2",
                                "--set", "train.real_eval_max_new_tokens=12"))
    return out


def test_a_run_logs_lambda_decaying_to_zero_at_half_the_steps(full_run):
    # The record of step n comes from forward_loss at global_step n-1: λ = 1 - (n-1)/4, then 0.
    assert [(step, lam) for step, lam, _loss in trained(full_run)] == [
        (1, 1.0), (2, 0.75), (3, 0.5), (4, 0.25), (5, 0.0), (6, 0.0), (7, 0.0), (8, 0.0)]
    config = json.loads((full_run / "export" / "config.json").read_text())
    assert config["specforge_strategy"] == "domino" and config["dflash_config"]["projector_type"] == "domino"


def test_a_resumed_run_continues_the_lambda_schedule_exactly_where_it_stopped(fake_site, tiny, full_run, tmp_path):
    install_crash_hook(fake_site)
    broken = tmp_path / "broken"
    args = online_run(tiny, broken, "--set", "train.export=false")
    crashed = specforge(*args, site=fake_site, env_extra={CRASH_AT: 3}, expect=None)
    assert crashed.returncode == CRASH_STATUS
    assert [step for step, _lam, _loss in trained(broken)] == [1, 2, 3]  # checkpoint at 2, step 3 lost
    specforge(*args, "--resume", "latest", site=fake_site)
    assert trained(broken) == trained(full_run)  # λ and the loss, step for step


def test_specforge_eval_measures_the_exported_drafts_real_acceptance(tiny, full_run):
    proc = specforge("eval", "--draft", str(full_run / "export"), "--target-model", str(tiny),
                     "--num-prompts", "3", "--max-new-tokens", "12", "--json")
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["identical_to_target_greedy"] is True and result["prompts"] == 3
    assert result["tau_real"] >= 1.0 and result["target_forwards"] > 0


def test_an_offline_run_trains_domino_from_captured_features(tiny, tmp_path):
    features, run = tmp_path / "features", tmp_path / "run"
    specforge("capture", "--strategy", "domino", "--target-model", str(tiny), "--output", str(features),
              "--batch-size", "4", "--set", "data.max_samples=12")
    proc = specforge("run", "--strategy", "domino", "--features", str(features), "--output", str(run),
                     "--set", "train.max_steps=4", "--set", "train.export=false", *SMALL)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["topology"] == "offline" and summary["steps"] == 4 and "done: 4 steps" in proc.stdout
    assert [lam for _step, lam, _loss in trained(run)] == [1.0, 0.5, 0.0, 0.0]
    assert {"eval/accept_len", "eval/base_accept_len", "eval/final_loss", "eval/base_loss"} <= set(
        summary["final_eval"])
