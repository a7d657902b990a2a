"""The bad-input catalogue: what an adversarial user tries, and what each gets back.

Every case runs the real ``specforge`` command in a subprocess and is checked the same way:
the exit status; the message names the input and says what to do next (its fragments are
listed with the case); no traceback; and every file that existed before — the shared
fixtures (the tiny toy target, a synthetic feature set, a finished offline run, a finished
disaggregated stream and its consumer's run) and the case's own inputs — is byte-identical
afterwards (whole-tree hashes before and after). A few inputs are accepted on purpose with a
warning (rows skipped from a data file, missing samples skipped on request, an old run moved
aside by ``--overwrite``): those check the warning, and that the old files are all still there.

Fixtures are built once per module and only when a selected case needs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest

from fixtures.linear_plugin import make_features
from sf_helpers import SPECFORGE, example_site
from specforge_core.testing import FakeSite

STREAM_SAMPLES, BATCH = 8, 2

#: Roots of every shared fixture built so far: each case leaves all of them byte-identical.
SHARED: list[Path] = []


def shared(path: Path) -> Path:
    SHARED.append(Path(path))
    return Path(path)


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (or of ``root`` itself), by relative path."""
    root = Path(root)
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def environment(site: FakeSite, **extra: str) -> dict[str, str]:
    env = site.env(**extra)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               SPECFORGE_STRICT_PLUGINS=extra.get("SPECFORGE_STRICT_PLUGINS", "1"))
    return env


def specforge(site: FakeSite, *args: str, expect: int | None = 0, env_extra: dict[str, str] | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([SPECFORGE, *args], capture_output=True, text=True, timeout=timeout,
                          env=environment(site, **(env_extra or {})))
    if expect is not None and proc.returncode != expect:
        raise AssertionError(f"specforge {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc


# ----------------------------------------------------------------------------- shared fixtures
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = example_site(tmp_path_factory.mktemp("bad-inputs-site"), "sf_linear_plugin_bad")
    yield site
    site.cleanup()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from specforge_plugin_hf import HFEngineOptions
    from specforge_plugin_hf.engine import HFTargetEngine
    from specforge_plugin_hf.toy import build_toy_target

    folder = build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)
    # The toy keeps its eval split with its own greedy replies beside the bundled one, made on
    # first use: made here, so that the cases see a complete toy folder and leave it as it is.
    HFTargetEngine(HFEngineOptions(model=str(folder))).default_eval_data()
    return shared(folder)


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """A finished synthetic feature set for the ``linear`` strategy (no target needed)."""
    return shared(make_features(tmp_path_factory.mktemp("features") / "feats"))


def linear_run(features: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "--strategy", "linear", "--features", str(features), "--output", str(out),
            "--set", "train.max_steps=4", "--set", "train.batch_size=2", "--set", "train.save_every=2", *extra]


@pytest.fixture(scope="module")
def trained(site, features, tmp_path_factory):
    """A finished offline run: checkpoints, pointers, run.json, metrics and summary."""
    out = tmp_path_factory.mktemp("trained") / "run"
    specforge(site, *linear_run(features, out))
    return shared(out)


def example_args(tiny: Path, *extra: str) -> list[str]:
    return ["--strategy", "example", "--set", f"target_engine.model={tiny}", "--set",
            f"data.max_samples={STREAM_SAMPLES}", "--set", f"train.batch_size={BATCH}", "--set",
            "train.real_eval_prompts=0", "--set", "train.export=false", "--set", "train.save_every=2", *extra]


@pytest.fixture(scope="module")
def stream(site, tiny, tmp_path_factory):
    """A finished disaggregated run: (shared features directory, the consumer's run directory)."""
    base = tmp_path_factory.mktemp("stream")
    features, consumer = base / "shared", base / "consumer"
    producer = subprocess.Popen([SPECFORGE, "run", "--role", "producer", "--features", str(features), "--output",
                                 str(base / "producer"), *example_args(tiny)], env=environment(site),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    specforge(site, "run", "--role", "consumer", "--features", str(features), "--output", str(consumer),
              *example_args(tiny))
    out, err = producer.communicate(timeout=600)
    assert producer.returncode == 0, err[-4000:]
    return shared(features), shared(consumer)


@pytest.fixture(scope="module")
def unprivileged():
    """(a command prefix that runs without the right to write others' files, the uid to own such a directory).

    The user ``nobody`` where it can run specforge; else (the interpreter lives in root's
    home, say) root without the capabilities that bypass file permissions, which is what a
    non-root user is to the file system. None where neither mechanism exists.
    """
    if os.geteuid() != 0:
        return None
    runuser, setpriv = shutil.which("runuser"), shutil.which("setpriv")
    nobody = 65534
    if runuser is not None:
        prefix = [runuser, "-u", "nobody", "--"]
        if subprocess.run([*prefix, SPECFORGE, "--version"], capture_output=True, timeout=120).returncode == 0:
            return prefix, 0
    if setpriv is not None:
        drop = "-dac_override,-dac_read_search"
        prefix = [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", "--"]
        if subprocess.run([*prefix, SPECFORGE, "--version"], capture_output=True, timeout=120).returncode == 0:
            return prefix, nobody
    return None


class World:
    """The fixtures a case asks for, built on first use (so a -k selection builds only what it needs)."""

    def __init__(self, request: pytest.FixtureRequest, tmp: Path) -> None:
        self._request = request
        self.tmp = tmp

    def __getattr__(self, name: str) -> Any:
        return self._request.getfixturevalue(name)


# ----------------------------------------------------------------------------- the cases
@attrs.frozen(kw_only=True)
class Bad:
    """One bad input: the command, and what it must answer."""

    argv: list[str]
    code: int
    says: tuple[str, ...]  # fragments of the message: the input it names and the next step
    kept: tuple[Path, ...] = ()  # the case's own inputs (the shared fixtures are always checked)
    env: dict[str, str] = attrs.field(factory=dict)
    prefix: tuple[str, ...] = ()  # e.g. run as another user
    moved: Path | None = None  # --overwrite: the old run, which must turn up whole beside it


CASES: dict[str, Callable[[World], Bad]] = {}


def case(fn: Callable[[World], Bad]) -> Callable[[World], Bad]:
    CASES[fn.__name__] = fn
    return fn


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def copy_features(w: World) -> Path:
    return Path(shutil.copytree(w.features, w.tmp / "feats"))


def a_sample_file(features: Path, sample_id: str) -> Path:
    from specforge_core.feature_stores.disk import DiskFeatureStore
    from specforge_core.builtin import DiskStoreOptions
    from specforge_core.protocols import BuildContext

    store = DiskFeatureStore(DiskStoreOptions(path=str(features / "store")), BuildContext())
    try:
        ref = next(ref for ref in store.scan() if ref.sample_id == sample_id)
        return Path(store.path_of(ref))
    finally:
        store.close()


# -- options, names and config files
@case
def unknown_strategy(w):
    return Bad(argv=["run", "--strategy", "eagel3", "--dry-run"], code=2,
               says=("unknown strategy 'eagel3'", "Did you mean 'eagle3'?"))


#: ``--set`` assignments refused before anything is built, and the fragments their message must hold.
BAD_SETS = {
    "unknown_option": ("strategy.ttt_lenght=3", ("unknown option 'strategy.ttt_lenght'", "strategy accepts: ",
                                                 "ttt_length")),
    "option_of_the_wrong_type": ("train.batch_size=zero", ("option 'train.batch_size'",
                                                           "expected an integer, got 'zero'")),
    "option_out_of_range": ("train.batch_size=0", ("option 'train.batch_size'", "must be > 0")),
    "option_not_among_the_choices": ("train.schedule=linear", ("option 'train.schedule'", "'linear'", "cosine",
                                                               "constant")),
    "unknown_section": ("trian.lr=1e-3", ("--set 'trian.lr=1e-3': unknown section 'trian'", "sections: strategy")),
    "set_without_a_key": ("lr", ("--set 'lr'", "expected the form section.key=value")),
}
for _name, (_assignment, _says) in BAD_SETS.items():
    CASES[_name] = lambda w, assignment=_assignment, says=_says: Bad(
        argv=["run", "--strategy", "eagle3", "--set", assignment, "--dry-run"], code=2, says=says)


@case
def invalid_yaml(w):
    config = write(w.tmp / "run.yaml", "strategy: {name: eagle3\ntrain: [\n")
    return Bad(argv=["run", "--config", str(config), "--dry-run"], code=2, kept=(config,),
               says=(f"config file '{config}' is not valid YAML",))


@case
def config_that_is_not_a_mapping(w):
    config = write(w.tmp / "run.yaml", "- eagle3\n- dflash\n")
    return Bad(argv=["run", "--config", str(config), "--dry-run"], code=2, kept=(config,),
               says=(f"config file '{config}' must hold a mapping of sections",))


@case
def missing_config_file(w):
    return Bad(argv=["run", "--config", str(w.tmp / "nope.yaml"), "--dry-run"], code=2,
               says=(f"config file '{w.tmp / 'nope.yaml'}' does not exist",))


@case
def disabled_plugin(w):
    return Bad(argv=["run", "--strategy", "eagle3", "--dry-run"], code=2, env={"SPECFORGE_DISABLE_PLUGINS": "eagle3"},
               says=("unknown strategy 'eagle3'", "SPECFORGE_DISABLE_PLUGINS"))


@case
def resume_and_overwrite_together(w):
    return Bad(argv=["run", "--strategy", "eagle3", "--output", str(w.trained), "--resume", "latest", "--overwrite",
                     "--dry-run"], code=2, says=("--resume", "--overwrite", "pass one of them"))


@case
def producer_asked_to_resume(w):
    return Bad(argv=["run", "--strategy", "eagle3", "--role", "producer", "--features", str(w.tmp / "s"),
                     "--resume", "latest"], code=2,
               says=("a producer resumes by itself from its features directory; drop --resume",))


@case
def consumer_without_a_features_directory(w):
    return Bad(argv=["run", "--strategy", "eagle3", "--role", "consumer", "--dry-run"], code=2,
               says=("--role consumer needs --features DIR",))


# -- the output directory
@case
def rerun_into_a_finished_run(w):  # defect 1: it used to replace the old run's files and mix the two
    return Bad(argv=linear_run(w.features, w.trained, "--set", "train.seed=1"), code=1,
               says=(f"{w.trained} already holds a run", "--resume latest", "another --output", "--overwrite"))


@case
def dry_run_into_a_finished_run(w):
    return Bad(argv=[*linear_run(w.features, w.trained), "--dry-run"], code=1,
               says=(f"{w.trained} already holds a run", "--resume latest"))


@case
def overwrite_moves_the_old_run_aside(w):
    old = Path(shutil.copytree(w.trained, w.tmp / "run"))
    return Bad(argv=linear_run(w.features, old, "--set", "train.seed=1", "--overwrite"), code=0, kept=(old,),
               moved=old, says=(f"moved the previous run in {old} aside to {old}.old-",))


@case
def output_that_is_a_file(w):
    target = write(w.tmp / "out", "a file\n")
    return Bad(argv=linear_run(w.features, target), code=2, kept=(target,),
               says=(f"Invalid value for '--output': Directory '{target}' is a file", "specforge run --help"))


@case
def output_in_a_config_file_that_is_a_file(w):
    target = write(w.tmp / "out", "a file\n")
    config = write(w.tmp / "run.yaml", f"output: {target}\n")
    argv = linear_run(w.features, target)
    del argv[argv.index("--output"):argv.index("--output") + 2]
    return Bad(argv=[*argv, "--config", str(config)], code=1, kept=(target, config),
               says=(f"the output directory {target} is a file, not a directory", "choose another --output"))


@case
def output_this_user_cannot_write(w):  # defect 6: it used to end in a PermissionError traceback
    if w.unprivileged is None:
        pytest.skip("needs root and runuser or setpriv to run a command without the right to write others' files")
    prefix, owner = w.unprivileged
    parent = Path(tempfile.mkdtemp(prefix="sf-readonly-"))  # not under pytest's 0700 directories
    os.chown(parent, owner, owner)
    parent.chmod(0o755)
    w.tmp.joinpath("cleanup").write_text(str(parent))
    return Bad(argv=["run", "--strategy", "eagle3", "--output", str(parent / "out"), "--set", "train.max_steps=2"],
               code=1, prefix=tuple(prefix), env={"PYTHONPATH": ""},
               says=(f"cannot write the output directory {parent / 'out'}", f"{parent} is not writable by this user",
                     "choose an --output you can write"))


# -- resume
@case
def resume_with_a_changed_contract(w):  # defect 3: run.json used to be rewritten with the rejected options
    return Bad(argv=linear_run(w.features, w.trained, "--resume", "latest", "--set", "strategy.hidden=8"), code=1,
               says=(f"cannot resume from {w.trained / 'run-step4'}", "strategy_options.hidden changed",
                     "resume with the same setting or start a new run"))


@case
def resume_without_a_checkpoint(w):
    empty = w.tmp / "empty"
    empty.mkdir()
    return Bad(argv=linear_run(w.features, empty, "--resume", "latest"), code=1,
               says=(f"no 'latest' checkpoint in {empty}", "run without --resume to start fresh"))


@case
def resume_from_a_path_that_is_no_checkpoint(w):
    return Bad(argv=linear_run(w.features, w.trained, "--resume", str(w.features)), code=1,
               says=(f"{w.features} is not a complete checkpoint", "pass --resume latest, best, or a checkpoint"))


@case
def resume_from_a_path_that_does_not_exist(w):
    return Bad(argv=linear_run(w.features, w.tmp / "out", "--resume", str(w.tmp / "nothere")), code=1,
               says=(f"--resume {w.tmp / 'nothere'}: no such checkpoint directory",
                     "pass --resume latest, best, or a checkpoint directory"))


@case
def resume_with_another_strategy(w):  # refused before the features or a target are read
    return Bad(argv=["run", "--strategy", "eagle3", "--features", str(w.tmp / "nofeats"), "--output", str(w.trained),
                     "--resume", "latest"], code=1,
               says=(f"cannot resume from {w.trained / 'run-step4'}: strategy changed (checkpoint: 'linear', now: "
                     "'eagle3')", "resume with the same setting or start a new run"))


@case
def dry_run_resume_with_another_batch_size(w):
    return Bad(argv=[*linear_run(w.features, w.trained, "--resume", "latest", "--set", "train.batch_size=3"),
                     "--dry-run"], code=1,
               says=(f"cannot resume from {w.trained / 'run-step4'}: batch_size changed (checkpoint: 2, now: 3)",))


@case
def dry_run_without_a_features_directory(w):
    return Bad(argv=[*linear_run(w.tmp / "nofeats", w.tmp / "out"), "--dry-run"], code=1,
               says=(f"{w.tmp / 'nofeats'} is not a features directory", "create one with `specforge capture`"))


# -- target models and data files
@case
def missing_model_folder(w):
    return Bad(argv=["run", *example_args(w.tiny), "--set", f"target_engine.model={w.tmp / 'no-such-model'}",
                     "--output", str(w.tmp / "out")], code=1,
               says=(f"target model folder {w.tmp / 'no-such-model'} does not exist", "pass a folder written by save_pretrained"))


@case
def dry_run_with_a_missing_model_folder(w):  # --dry-run runs the checks the run would, the target's folder too
    return Bad(argv=["run", *example_args(w.tiny), "--set", f"target_engine.model={w.tmp / 'no-such-model'}",
                     "--output", str(w.tmp / "out"), "--dry-run"], code=1,
               says=(f"target model folder {w.tmp / 'no-such-model'} does not exist",))


@case
def foreign_model_folder(w):
    folder = w.tmp / "not-a-model"
    write(folder / "weights.bin", b"\0" * 64)
    return Bad(argv=["run", *example_args(w.tiny), "--set", f"target_engine.model={folder}", "--output",
                     str(w.tmp / "out")], code=1, kept=(folder,),
               says=(f"target model folder {folder} has no config.json", "save_pretrained"))


@case
def missing_data_file(w):
    return Bad(argv=["run", *example_args(w.tiny), "--set", f"data.path={w.tmp / 'nope.jsonl'}", "--output",
                     str(w.tmp / "out")], code=2,
               says=(f"option 'data.path': {w.tmp / 'nope.jsonl'} does not exist", "pass a JSONL file of conversations"))


@case
def data_file_without_a_usable_row(w):
    data = write(w.tmp / "bad.jsonl", 'not json\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    return Bad(argv=["run", *example_args(w.tiny), "--set", f"data.path={data}", "--set", "data.eval_holdout=0",
                     "--output", str(w.tmp / "out")],
               code=1, kept=(data,), says=(f"{data} gave no usable training sample", f"{data}:1", f"{data}:2"))


@case
def malformed_rows_are_skipped_and_reported(w):  # defect 4: run used to drop them without a word
    good = (w.tiny / "train.jsonl").read_text().splitlines()[:6]
    data = write(w.tmp / "mixed.jsonl", b"\n".join([
        good[0].encode(), b"{not json", good[1].encode(), b"\xff\xfe not utf-8", good[2].encode(),
        b'{"messages": [{"role": "user", "content": "no answer"}]}', *(line.encode() for line in good[3:])]) + b"\n")
    return Bad(argv=["run", *example_args(w.tiny), "--set", f"data.path={data}", "--set", "train.max_steps=2",
                     "--set", "data.eval_holdout=0", "--output", str(w.tmp / "out")], code=0, kept=(data,),
               says=(f"train data {data}: 9 rows read: 6 kept, 3 skipped", f"{data}:2", f"{data}:4", f"{data}:6",
                     "skipped rows are not trained: fix or remove them, or set data.strict=true"))


# -- feature sets
@case
def not_a_features_directory(w):
    return Bad(argv=linear_run(w.tmp, w.tmp / "out"), code=1,
               says=(f"{w.tmp} is not a features directory (no manifest.json)", "specforge capture"))


@case
def features_of_another_strategy(w):
    return Bad(argv=["run", "--strategy", "example", "--features", str(w.features), "--output", str(w.tmp / "out")],
               code=1, says=(f"{w.features} has no feature", "capture again with --strategy example"))


@case
def truncated_feature_file(w):
    feats = copy_features(w)
    victim = a_sample_file(feats, "train-0003")
    victim.write_bytes(victim.read_bytes()[:-10])
    return Bad(argv=linear_run(feats, w.tmp / "out"), code=1, kept=(feats,),
               says=(str(victim), "truncated", "delete it and capture the sample again"))


@case
def deleted_feature_file(w):  # defect 2: the run used to train on what was left, without a warning
    feats = copy_features(w)
    a_sample_file(feats, "train-0007").unlink()
    return Bad(argv=linear_run(feats, w.tmp / "out"), code=1, kept=(feats,),
               says=(f"{feats / 'store'} lacks 1 of the 34 samples its manifest lists (train: 1 missing, e.g. "
                     "train-0007)", "Run the same `specforge capture` command again",
                     "--set data.missing_samples=skip"))


@case
def deleted_feature_file_skipped_on_request(w):
    feats = copy_features(w)
    a_sample_file(feats, "train-0007").unlink()
    return Bad(argv=linear_run(feats, w.tmp / "out", "--set", "data.missing_samples=skip"), code=0, kept=(feats,),
               says=(f"warning: {feats / 'store'} lacks 1 of the 34 samples its manifest lists", "train-0007",
                     "training without them (data.missing_samples=skip)"))


@case
def unfinished_capture(w):
    feats = copy_features(w)
    manifest = json.loads((feats / "manifest.json").read_text())
    (feats / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    return Bad(argv=linear_run(feats, w.tmp / "out"), code=1, kept=(feats,),
               says=(f"the capture into {feats} did not finish", "run the same `specforge capture` command again"))


@case
def dry_run_of_an_unfinished_capture(w):  # --dry-run refuses what the run would
    feats = copy_features(w)
    manifest = json.loads((feats / "manifest.json").read_text())
    (feats / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    return Bad(argv=[*linear_run(feats, w.tmp / "out"), "--dry-run"], code=1, kept=(feats,),
               says=(f"the capture into {feats} did not finish", "run the same `specforge capture` command again"))


@case
def dry_run_with_features_of_another_strategy(w):
    return Bad(argv=["run", "--strategy", "example", "--features", str(w.features), "--output", str(w.tmp / "out"),
                     "--dry-run"], code=1,
               says=(f"{w.features} has no feature", "that strategy 'example' needs", "capture again with --strategy "
                     "example"))


@case
def capture_into_features_of_another_strategy(w):
    return Bad(argv=["capture", "--strategy", "example", "--target-model", str(w.tiny), "--output", str(w.features),
                     "--set", "data.max_samples=4"], code=1,
               says=(f"{w.features} already holds features of another target or strategy", "use a new --output"))


# -- export and eval
@case
def export_without_a_checkpoint(w):
    return Bad(argv=["export", str(w.features), "--output", str(w.tmp / "draft")], code=1,
               says=(f"{w.features} is neither a checkpoint", "'best' or 'latest' checkpoint"))


@case
def export_of_a_strategy_that_cannot_export(w):
    return Bad(argv=["export", str(w.trained), "--output", str(w.tmp / "draft")], code=1,
               says=("strategy 'linear' declares no serving format", "cannot be exported for a serving engine"))


@case
def export_into_a_checkpoint(w):
    checkpoint = next(p for p in sorted(w.trained.iterdir()) if (p / "trainer_state.json").exists())
    return Bad(argv=["export", str(w.trained), "--output", str(checkpoint)], code=1,
               says=(f"cannot export to {checkpoint}: it is a checkpoint (trainer_state.json), whose weights the "
                     "export would replace", f"--output {w.trained / 'export'}"))


@case
def export_into_a_run_directory(w):
    return Bad(argv=["export", str(w.trained), "--output", str(w.trained)], code=1,
               says=(f"cannot export to {w.trained}: it holds a run (", f"--output {w.trained / 'export'}"))


@case
def export_into_a_folder_of_other_files(w):
    folder = w.tmp / "notes"
    write(folder / "config.json", '{"model_type": "llama"}')
    write(folder / "model.safetensors", b"not ours")
    return Bad(argv=["export", str(w.trained), "--output", str(folder)], code=1, kept=(folder,),
               says=(f"cannot export to {folder}: the folder is not empty and holds no specforge export "
                     "(config.json naming a strategy); choose a new or empty folder",))


@case
def eval_of_a_folder_that_is_no_draft(w):
    return Bad(argv=["eval", "--draft", str(w.trained), "--target-model", str(w.tiny), "--num-prompts", "1"], code=1,
               says=(f"{w.trained} is not an exported draft (no config.json)",))


# -- disaggregated streams
@case
def consumer_with_another_seed(w):  # defect 7: it used to be accepted
    features, consumer = w.stream
    return Bad(argv=["run", "--role", "consumer", "--features", str(features), "--output", str(w.tmp / "out"),
                     *example_args(w.tiny, "--set", "train.seed=1")], code=1,
               says=(f"the producer streams into {features} with train.seed=0, but this consumer has train.seed=1",
                     "--set train.seed=0"))


@case
def consumer_with_another_strategy(w):
    features, consumer = w.stream
    return Bad(argv=["run", "--role", "consumer", "--features", str(features), "--output", str(w.tmp / "out"),
                     *example_args(w.tiny), "--strategy", "linear"], code=1,
               says=(f"the producer streams features for strategy 'example' into {features}, but this consumer runs "
                     "strategy 'linear' (field strategy)", "--strategy example"))


@case
def consumer_with_another_max_length(w):
    features, consumer = w.stream
    return Bad(argv=["run", "--role", "consumer", "--features", str(features), "--output", str(consumer),
                     "--resume", "latest", *example_args(w.tiny, "--set", "data.max_length=64")], code=1,
               says=("with data.max_length=2048, but this consumer has data.max_length=64",
                     "--set data.max_length=2048"))


@case
def producer_restarted_with_other_data(w):
    features, consumer = w.stream
    return Bad(argv=["run", "--role", "producer", "--features", str(features), "--output", str(w.tmp / "p"),
                     *example_args(w.tiny, "--set", "data.max_samples=6")], code=1,
               says=(f"{features} already streams with data.max_samples=8, but this producer has data.max_samples=6",
                     "--set data.max_samples=8", "a new --features directory"))


@case
def damaged_stream_database(w):  # defect 5: it used to end in a sqlite3.DatabaseError traceback
    features, consumer = w.stream
    copy = Path(shutil.copytree(features.parent, w.tmp / "stream", symlinks=True))
    database = copy / "shared" / "control" / "metadata.sqlite"
    damage_sample_pages(database)
    # resumed past its end (a finished run resumed as it was has nothing to read): it reads the stream again
    return Bad(argv=["run", "--role", "consumer", "--features", str(copy / "shared"), "--output",
                     str(copy / "consumer"), "--resume", "latest", *example_args(w.tiny), "--set",
                     "train.max_steps=6"], code=1, kept=(copy,),
               says=(f"the metadata database {database}: database disk image is malformed", "restore it from a backup",
                     "a new --features directory"))


def damage_sample_pages(database: Path) -> None:
    """Overwrite the inside of every page holding sample records (page 1, the schema, stays whole)."""
    with sqlite3.connect(database) as db:
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(database.read_bytes())
    hit = 0
    for start in range(page_size, len(data), page_size):
        if b'"sample_id"' in data[start:start + page_size]:
            data[start + 16:start + page_size - 16] = b"\x5a" * (page_size - 32)
            hit += 1
    assert hit, "no page holds a sample record"
    database.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- the one test
@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_is_answered_with_a_message_and_loses_nothing(name, request, tmp_path):
    w = World(request, tmp_path)
    bad = CASES[name](w)
    kept = [*SHARED, *bad.kept]
    before = {str(path): tree_digest(path) for path in kept}
    env = environment(w.site, **bad.env)
    try:
        proc = subprocess.run([*bad.prefix, SPECFORGE, *bad.argv], capture_output=True, text=True, env=env,
                              timeout=600)
    finally:
        cleanup = tmp_path / "cleanup"
        if cleanup.exists():
            shutil.rmtree(cleanup.read_text(), ignore_errors=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == bad.code, output[-4000:]
    for fragment in bad.says:
        assert fragment in output, f"{fragment!r} not in:\n{output[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    if bad.moved is not None:  # the old run left whole, under its new name
        aside = [p for p in bad.moved.parent.iterdir() if p.name.startswith(bad.moved.name + ".old-")]
        assert len(aside) == 1 and tree_digest(aside[0]) == before.pop(str(bad.moved))
        kept.remove(bad.moved)
    after = {str(path): tree_digest(path) for path in kept}
    assert after == before


def test_the_catalogue_holds_every_known_defect_and_thirty_in_all():
    defects = {"rerun_into_a_finished_run", "deleted_feature_file", "resume_with_a_changed_contract",
               "malformed_rows_are_skipped_and_reported", "damaged_stream_database", "output_this_user_cannot_write",
               "consumer_with_another_seed"}
    assert defects <= set(CASES) and len(CASES) >= 30


@pytest.fixture(scope="module")
def online(site, tiny, tmp_path_factory):
    """A finished online colocated run of the tiny toy target (whose engine suggests train options)."""
    out = tmp_path_factory.mktemp("online") / "run"
    specforge(site, "run", "--output", str(out), *example_args(tiny, "--set", "train.max_steps=2"))
    return out


@pytest.mark.parametrize("topology", ["online", "consumer"])
def test_dry_run_shows_the_train_options_the_run_used(topology, request, site, tiny):
    """The engine's suggestions (lr 1e-3, warmup 50 for a toy target) are in the plan --dry-run prints."""
    if topology == "online":
        out = request.getfixturevalue("online")
        argv = ["run", "--output", str(out), *example_args(tiny, "--set", "train.max_steps=2")]
    else:
        features, out = request.getfixturevalue("stream")
        argv = ["run", "--role", "consumer", "--features", str(features), "--output", str(out),
                *example_args(tiny)]
    summary = json.loads((out / "summary.json").read_text())
    shown = json.loads(specforge(site, *argv, "--resume", "latest", "--dry-run").stdout)
    assert summary["train_options_suggested_by_engine"] == {"lr": 1e-3, "warmup_steps": 50}
    assert shown["train_options_suggested_by_engine"] == summary["train_options_suggested_by_engine"]
    assert shown["train"] == summary["config"]["train"]
    assert shown["train"]["lr"] == 1e-3 and shown["train"]["warmup_steps"] == 50
    # an option the user sets wins over a suggestion, in the plan shown as in the run
    explicit = json.loads(specforge(site, *argv, "--resume", "latest", "--set", "train.lr=2e-4", "--dry-run").stdout)
    assert explicit["train"]["lr"] == 2e-4 and explicit["train_options_suggested_by_engine"] == {"warmup_steps": 50}
