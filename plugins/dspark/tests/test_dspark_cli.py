"""``specforge run --strategy dspark`` through the public CLI on the tiny toy target: metrics, export, exact resume.

The resume test installs the plugin kit's crash-hook plugin (it kills the process after a
given optimizer step, like a lost node) into the core's ``fake_site``; everything else is the
installed distributions.
"""

import json

import pytest

from specforge_core.testing.cli import CRASH_AT, CRASH_STATUS, install_crash_hook, run_specforge

SMALL = ("--set", "strategy.block_size=4", "--set", "strategy.num_anchors=4", "--set", "strategy.markov_rank=16",
         "--set", "train.batch_size=2", "--set", "train.lr=0.003")
STEPS = 6


def specforge(*args, site=None, env_extra=None, expect=0):
    """Run the installed ``specforge`` (seeing ``site``'s fake distributions too, when given)."""
    return run_specforge(*args, site=site, env_extra=env_extra, expect=expect, timeout=300)


def online_run(tiny, out, *extra):
    return ["run", "--strategy", "dspark", "--output", str(out), "--run-id", "ds",
            "--set", f"target_engine.model={tiny}", "--set", "data.max_samples=24",
            "--set", f"train.max_steps={STEPS}", "--set", "train.save_every=2", *SMALL, *extra]


def trained(run):
    """``(step, loss, ce_loss, l1_loss, confidence_loss)`` of every logged optimizer step."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["ce_loss"], r["l1_loss"], r["confidence_loss"]) for r in records if "l1_loss" in r]


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    """An uninterrupted online run, exported at the end (with a short real acceptance check)."""
    out = tmp_path_factory.mktemp("full") / "run"
    specforge(*online_run(tiny, out, "--set", "train.real_eval_prompts=2", "--set", "train.real_eval_max_new_tokens=12"))
    return out


def test_a_run_reports_every_term_probabilistic_and_real_acceptance(full_run):
    assert [step for step, *_ in trained(full_run)] == list(range(1, STEPS + 1))
    summary = json.loads((full_run / "summary.json").read_text())
    assert {"eval/accept_len", "eval/tau_probabilistic", "eval/tau_sim", "eval/confidence_error", "eval/l1_loss",
            "eval/ce_loss", "eval/confidence_loss"} <= set(summary["final_eval"])
    assert summary["tau_sim"] == pytest.approx(summary["final_eval"]["eval/accept_len"] - 1)
    assert 0 <= summary["final_eval"]["eval/tau_probabilistic"] <= 4  # at most the bs slots of a block
    assert summary["tau_real"] >= 1.0 and summary["real_eval"]["identical_to_target_greedy"] is True
    config = json.loads((full_run / "export" / "config.json").read_text())
    assert config["specforge_strategy"] == "dspark" and config["architectures"] == ["Qwen3DSparkModel"]


def test_a_resumed_run_trains_exactly_like_the_uninterrupted_one(fake_site, tiny, full_run, tmp_path):
    install_crash_hook(fake_site)
    broken = tmp_path / "broken"
    args = online_run(tiny, broken, "--set", "train.export=false")
    crashed = specforge(*args, site=fake_site, env_extra={CRASH_AT: 3}, expect=None)
    assert crashed.returncode == CRASH_STATUS
    assert [step for step, *_ in trained(broken)] == [1, 2, 3]  # checkpoint at 2, step 3 lost
    specforge(*args, "--resume", "latest", site=fake_site)
    assert trained(broken) == trained(full_run)  # every term, step for step
