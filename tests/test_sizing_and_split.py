"""Run sizing (threads, recipe defaults, warmup) and the eval split that always exists when it can."""

import json

import pytest

from data_tokenizers import chatml_tokenizer
from sf_helpers import run_cli

from specforge_core.config import TrainOptions, resolve_plan
from specforge_core.data.prepare import prepare_file
from specforge_core.data.split import resolve_data_files
from specforge_core.errors import OptionError
from specforge_core.plugins import get_plugin_manager
from specforge_core.threads import available_cores, resolve_threads
from specforge_core.training.optim import lr_factor, warmup_steps


# --------------------------------------------------------------------------- threads


def test_threads_come_from_the_option_then_omp_num_threads_then_the_usable_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_threads(5) == (5, "train.threads")
    assert resolve_threads(None) == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert resolve_threads(None) == (available_cores(), "the cores this process may use")


@pytest.mark.parametrize("value", ["two", "0"])
def test_a_bad_omp_num_threads_is_an_option_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(OptionError, match=f"OMP_NUM_THREADS='{value}'"):
        resolve_threads(None)


# --------------------------------------------------------------------------- recipe defaults and warmup


@pytest.mark.parametrize("strategy, lr, ratio", [("eagle3", 1e-4, 0.015), ("dflash", 6e-4, 0.04),
                                                 ("domino", 6e-4, 0.04)])
def test_a_strategys_published_recipe_fills_unset_train_options(strategy, lr, ratio):
    plan = resolve_plan(get_plugin_manager(), {"strategy": strategy})
    assert (plan.train.lr, plan.train.warmup_ratio, plan.train.warmup_steps) == (lr, ratio, 0)
    mine = resolve_plan(get_plugin_manager(), {"strategy": strategy, "train": {"lr": 2e-3}})
    assert (mine.train.lr, mine.train.warmup_ratio) == (2e-3, ratio)


def test_warmup_ratio_is_a_share_of_the_planned_steps_and_warmup_steps_wins():
    ratio = TrainOptions(warmup_ratio=0.04)
    assert warmup_steps(ratio, 1000) == 40
    assert [lr_factor(s, ratio, 1000) for s in (0, 19, 39)] == [1 / 40, 20 / 40, 1.0]
    assert warmup_steps(TrainOptions(warmup_ratio=0.04, warmup_steps=5), 1000) == 5


def test_dry_run_shows_the_recipe_defaults_under_the_engines_suggestions(tmp_path):
    # a target that is not the toy: the strategy's published recipe (--dry-run checks the folder holds a config)
    (tmp_path / "config.json").write_text("{}")
    plan = json.loads(run_cli("run", "--strategy", "dflash", "--target-model", str(tmp_path), "--dry-run",
                              check=True).stdout)
    assert (plan["train"]["lr"], plan["train"]["warmup_ratio"], plan["train"]["warmup_steps"]) == (6e-4, 0.04, 0)
    assert plan["train_options_suggested_by_engine"] == {}
    # the toy target: the hf engine's toy suggestion wins over the recipe; the user wins over both
    plan = json.loads(run_cli("run", "--strategy", "dflash", "--dry-run", check=True).stdout)
    assert (plan["train"]["lr"], plan["train"]["warmup_steps"]) == (1e-3, 50)
    assert plan["train_options_suggested_by_engine"] == {"lr": 1e-3, "warmup_steps": 50}
    plan = json.loads(run_cli("run", "--strategy", "dflash", "--set", "train.lr=2e-4", "--dry-run", check=True).stdout)
    assert (plan["train"]["lr"], plan["train"]["warmup_steps"]) == (2e-4, 50)


# --------------------------------------------------------------------------- eval split


class _Plan:
    def __init__(self, **data):
        defaults = dict(path=None, eval_path=None, eval_holdout=0.05, eval_holdout_max=200)
        self.data = type("Data", (), {**defaults, **data})()


def _rows(tmp_path, n, name="chats.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": f"question {i}?", "response": f"answer {i}."}) + "\n"
                            for i in range(n)))
    return path


def test_without_an_eval_file_a_deterministic_share_of_the_rows_is_held_out(tmp_path):
    path = _rows(tmp_path, 100)
    files = resolve_data_files(_Plan(path=str(path)), None)
    assert len(files.holdout) == 5 and files.holdout <= set(range(1, 101))
    assert files == resolve_data_files(_Plan(path=str(path)), None)  # the same rows every time
    assert files.eval_note == (f"eval split: 5 of the 100 rows of {path} held out (data.eval_holdout=0.05, "
                               "at most 200)")
    train = [n for n in range(1, 101) if files.is_train_line(n)]
    held = [n for n in range(1, 101) if files.is_eval_line(n)]
    assert sorted(train + held) == list(range(1, 101)) and set(held) == files.holdout


def test_the_holdout_is_at_least_one_row_and_at_most_the_cap(tmp_path):
    assert len(resolve_data_files(_Plan(path=str(_rows(tmp_path, 3))), None).holdout) == 1
    assert len(resolve_data_files(_Plan(path=str(_rows(tmp_path, 100)), eval_holdout_max=2), None).holdout) == 2


def test_no_eval_split_is_said_plainly(tmp_path):
    off = resolve_data_files(_Plan(path=str(_rows(tmp_path, 10)), eval_holdout=0.0), None)
    assert (off.eval_path, off.eval_note) == (None, "no eval split: data.eval_holdout=0 and no data.eval_path")
    one = resolve_data_files(_Plan(path=str(_rows(tmp_path, 1, "one.jsonl"))), None)
    assert one.eval_path is None and "has 1 row(s), too few to hold one out; pass --eval-data FILE" in one.eval_note


def test_an_eval_file_of_its_own_evaluates_every_row(tmp_path):
    files = resolve_data_files(_Plan(path=str(_rows(tmp_path, 10)), eval_path="held.jsonl"), None)
    assert files.holdout == frozenset() and files.is_eval_line(7) and files.is_train_line(7)


def test_held_out_rows_never_train(tmp_path):
    chatml = chatml_tokenizer()
    path = _rows(tmp_path, 40)
    files = resolve_data_files(_Plan(path=str(path)), None)
    train, _ = prepare_file(path, chatml, keep_line=files.is_train_line)
    held, report = prepare_file(path, chatml, keep_line=files.is_eval_line)
    assert (len(train), len(held), report.rows) == (38, 2, 2)
    assert {s.source for s in train}.isdisjoint({s.source for s in held})


def test_no_training_data_names_flags_that_exist(tmp_path):
    with pytest.raises(OptionError, match="pass --data FILE"):
        resolve_data_files(_Plan(), None)
    assert "--data" in run_cli("run", "--help", check=True).stdout
