"""The output-directory guard: what counts as a run, and --overwrite's move aside."""

import pytest

from specforge_core.errors import OptionError
from specforge_core.run_directory import OutputDirectoryError, check_output, existing_run, move_aside


def make_run(path, marker="metrics.jsonl"):
    (path / "run-step2").mkdir(parents=True)
    (path / "run-step2" / "trainer_state.json").write_text("{}")
    (path / marker).write_text("x\n")
    return path


def test_a_run_is_recognised_by_its_files_and_complete_checkpoints_only(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "half-step4").mkdir()  # no trainer_state.json: not a checkpoint
    assert existing_run(tmp_path) == [] and existing_run(tmp_path / "missing") == []
    check_output(tmp_path, resume=None, overwrite=False)  # a directory of other files is fine
    make_run(tmp_path)
    assert existing_run(tmp_path) == ["metrics.jsonl", "run-step2"]
    with pytest.raises(OutputDirectoryError, match="already holds a run \\(metrics.jsonl, run-step2\\); continue it "
                                                   "with --resume latest"):
        check_output(tmp_path, resume=None, overwrite=False)
    check_output(tmp_path, resume="latest", overwrite=False)
    check_output(tmp_path, resume=None, overwrite=True)
    with pytest.raises(OptionError, match="pass one of them"):
        check_output(tmp_path, resume="latest", overwrite=True)


def test_a_run_that_stopped_before_its_first_checkpoint_is_said_to_hold_nothing_to_resume(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "tensorboard").mkdir()
    with pytest.raises(OutputDirectoryError, match=r"holds a run that stopped before its first checkpoint "
                                                   r"\(metrics.jsonl, run.json\): there is nothing to resume. Pass "
                                                   r"--overwrite to move it aside"):
        check_output(tmp_path, resume=None, overwrite=False)
    check_output(tmp_path, resume=None, overwrite=True)


def test_overwrite_moves_each_old_run_aside_whole_under_its_own_name(tmp_path, monkeypatch):
    import specforge_core.run_directory as run_directory

    monkeypatch.setattr(run_directory.time, "strftime", lambda _format: "20260101-000000")  # both in one second
    out = tmp_path / "out"
    assert move_aside(out) is None  # nothing there: nothing moved
    first = move_aside(make_run(out, "summary.json"))
    second = move_aside(make_run(out, "run.json"))
    assert not out.exists() and first != second
    assert (first.name, second.name) == ("out.old-20260101-000000", "out.old-20260101-000000-1")
    assert existing_run(first) == ["run-step2", "summary.json"] and existing_run(second) == ["run-step2", "run.json"]
    (tmp_path / "empty").mkdir()
    assert move_aside(tmp_path / "empty") is None and (tmp_path / "empty").exists()
