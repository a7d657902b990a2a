"""The tensorboard tracker writes a real run's scalars, eval points, checkpoints and config (read back)."""

import json

import pytest

from sf_helpers import run_specforge


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


def events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_a_run_is_written_as_tensorboard_events_through_the_lifecycle_hooks(tiny, tmp_path):
    out = tmp_path / "run"
    run_specforge("run", "--strategy", "eagle3", "--target-model", str(tiny), "--output", str(out),
                  "--set", "data.max_samples=16", "--set", "train.max_steps=4", "--set", "train.batch_size=4",
                  "--set", "train.eval_every=2", "--set", "train.save_every=2", "--set", "strategy.ttt_length=2",
                  "--set", "train.real_eval_prompts=2", "--set", "train.real_eval_max_new_tokens=8")
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = events(out / "tensorboard")
    tags = acc.Tags()
    train_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert train_loss == [(r["step"], pytest.approx(r["loss"])) for r in metrics if "loss" in r]
    eval_points = [(e.step, e.value) for e in acc.Scalars("eval/accept_len_sim")]
    assert eval_points == [(r["step"], pytest.approx(r["eval/accept_len_sim"])) for r in metrics
                           if "eval/accept_len_sim" in r] and [s for s, _ in eval_points] == [2, 4]
    assert [e.value for e in acc.Scalars("final/accept_len_real")] == [pytest.approx(summary["accept_len_real"])]
    assert "train/tokens_per_s" in tags["scalars"]
    texts = {tag: [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)] for tag in tags["tensors"]}
    config_text = texts["config/text_summary"][0]
    assert '"name": "eagle3"' in config_text and '"max_steps": 4' in config_text
    assert [t.split(":")[0] for t in texts["checkpoints/text_summary"]] == ["step 2", "step 4"]


def test_the_plugin_is_listed_and_can_be_disabled(tiny, tmp_path):
    plugins = json.loads(run_specforge("plugins", "--json").stdout)
    entry = next(p for p in plugins if p["name"] == "tensorboard")
    assert (entry["distribution"], entry["status"]) == ("specforge-plugin-tensorboard", "active")
    out = tmp_path / "quiet"
    env = dict(__import__("os").environ, SPECFORGE_DISABLE_PLUGINS="tensorboard")
    run_specforge("run", "--strategy", "eagle3", "--target-model", str(tiny), "--output", str(out),
                  "--set", "data.max_samples=8", "--set", "train.max_steps=1", "--set", "train.batch_size=4",
                  "--set", "strategy.ttt_length=2", "--set", "train.real_eval_prompts=0", env=env)
    assert (out / "summary.json").exists() and not (out / "tensorboard").exists()
