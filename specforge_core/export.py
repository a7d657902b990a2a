"""Export a trained draft for serving, and load drafts back for evaluation.

``OUTPUT/run.json`` records what a run was (its resolved config, the target's info, the
features directory if offline), so a checkpoint can be exported later without the
command line that produced it.

The folder I/O every strategy's export shares lives here too, so a plugin's export module
holds only its format (tensor names, config.json fields): :func:`export_state` (the
tensors, FSDP2 shards gathered), :func:`write_export_files` (both files replaced only once
both are written), :func:`open_export` / :class:`ExportConfig` (config.json read with
errors that name the file, the field and what was expected), :func:`load_weights` and
:func:`load_checked_state` (the safetensors file, checked against the model it goes into).
Each takes the plugin's error type (a subclass of :class:`ExportError`), so callers catch
the error of the format they asked for.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import attrs

from .errors import SpecforgeError
from .fileio import fsync_dir
from .hfconfig import config_value
from .protocols import BuildContext, DataStats, TargetInfo
from .run_directory import RUN_FILE
from .serving import DEFAULT_EXPORT_DTYPE, check_export_dtype

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: The serving formats first-party strategies write, and what each is (a strategy's spec says which it can).
EXPORT_FORMATS = {
    "sglang": "the folder SGLang loads (for EAGLE3 and DFlash the same folder also serves in vLLM)",
    "vllm": "the folder vLLM loads natively; for EAGLE3 and DFlash the very folder `sglang` writes",
    "speculators": "vLLM's speculators layout (speculators_config + transformer_layer_config), what the "
                   "speculators library writes",
}
#: config.json fields every specforge export carries, so `specforge eval` rebuilds the strategy as trained.
STRATEGY_FIELD = "specforge_strategy"
OPTIONS_FIELD = "specforge_strategy_options"


class ExportError(SpecforgeError):
    """A run, checkpoint or export directory cannot be used as asked."""


def write_run_file(output: str | os.PathLike[str], plan: Any, target: TargetInfo) -> None:
    from .fileio import atomic_write_text

    record = {"config": plan.to_dict(), "target": attrs.asdict(target), "features": plan.features}
    Path(output).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(output) / RUN_FILE, json.dumps(record, indent=2, sort_keys=True, default=str))


def resolve_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """A run directory (its best, else latest, checkpoint) or a checkpoint -> (checkpoint, run dir)."""
    path = Path(path)
    if (path / "trainer_state.json").exists():
        return path, path.parent
    for pointer in ("best", "latest"):
        if (path / pointer).exists():
            return path / (path / pointer).read_text().strip(), path
    if is_export(path):
        raise ExportError(f"{path} is an export already (a draft for serving), not a checkpoint: export from the run "
                          "directory or the checkpoint it came from")
    raise ExportError(f"{path} is neither a checkpoint (no trainer_state.json) nor a run directory with a "
                      "'best' or 'latest' checkpoint")


def rebuild_model(manager: Any, checkpoint: Path, run_dir: Path) -> tuple[Any, Any, Any, TargetInfo]:
    """(strategy spec, strategy, model with the checkpoint's weights, target info) of a finished run."""
    from safetensors.torch import load_file

    from .config import plan_to_raw, resolve_plan
    from .features import FeatureSet, frozen_fingerprint
    from .components import build_component
    from .preflight import check_strategy
    from .training.checkpoint import load_model_state
    from .training.distributed import DistInfo

    run_file = run_dir / RUN_FILE
    if not run_file.exists():
        raise ExportError(f"{run_dir} has no {RUN_FILE}; export needs the run directory a checkpoint came from")
    run = json.loads(run_file.read_text())
    plan = resolve_plan(manager, plan_to_raw(run["config"]))
    context = BuildContext(run_id=plan.run_id, output_dir=str(run_dir))
    strategy = build_component(plan, "strategy", context)
    check_strategy(strategy, plan["strategy"].spec)
    target = TargetInfo(**run["target"])
    if run.get("features"):
        frozen = FeatureSet.open(run["features"]).frozen_parts()
    else:
        frozen = build_component(plan, "target_engine", context).frozen_parts()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if frozen_fingerprint(frozen) != state["contract"]["target"]:
        raise ExportError(f"the target's frozen parts differ from the ones {checkpoint} was trained against")
    # The weights do not say which target layers they were trained on: the export must repeat the recorded ones.
    trained_on, resolved = state["contract"].get("layer_ids"), list(strategy.capture_plan(target).layer_ids)
    if trained_on is None:
        raise ExportError(f"{checkpoint} does not record the target layers its draft was trained on (it predates "
                          "specforge recording them), so no export could name them safely; train the draft again")
    if trained_on != resolved:
        raise ExportError(f"{checkpoint} was trained on target layers {trained_on}, but the run's strategy options "
                          f"now resolve to {resolved} (a plugin's defaults changed?); set them explicitly, e.g. "
                          "strategy.aux_layer_ids or strategy.target_layer_ids, in the run's run.json")
    model = strategy.build_model(target, frozen, DataStats())
    load_model_state(model, load_file(str(checkpoint / "model.safetensors")), DistInfo())
    return plan["strategy"].spec, strategy, model, target


def export_format(spec: Any, fmt: str | None = None) -> str:
    """The serving format ``fmt`` (default: the first the strategy's spec declares), checked against the spec."""
    formats = tuple(getattr(spec, "export_formats", ()))
    if not formats:
        raise ExportError(f"strategy {spec.name!r} declares no serving format (its spec's export_formats is "
                          "empty), so it cannot be exported for a serving engine")
    if fmt is None:
        return formats[0]
    check_format(fmt, formats, spec.name)
    return fmt


def export_model(strategy: Any, model: Any, target: TargetInfo, out_dir: str | os.PathLike[str], *, spec: Any,
                 fmt: str | None = None, dtype: str = DEFAULT_EXPORT_DTYPE) -> Path:
    """Write ``model`` in serving format ``fmt`` (see :func:`export_format`) with its floating-point weights
    in ``dtype`` into ``out_dir``; a new folder is removed again if that fails.

    The strategy's ``export(model, out_dir, target, *, fmt, dtype)`` writes the folder; an
    implementation that accepts fewer keyword arguments is called with those it accepts.
    """
    fmt = export_format(spec, fmt)
    check_export_dtype(dtype, error=ExportError)
    if not hasattr(strategy, "export"):
        raise ExportError(f"strategy {spec.name!r} declares export formats {list(spec.export_formats)} but has no "
                          "export method")
    out = Path(out_dir)
    check_export_folder(out)
    created = not out.exists()  # the strategy's writer makes the folder (and says what it left)
    from .preflight import accepted_kwargs

    try:
        strategy.export(model, str(out), target, **accepted_kwargs(strategy.export, fmt=fmt, dtype=dtype))
    except BaseException:
        _remove_if_empty(out, created)
        raise
    return out


def check_export_folder(out: Path) -> None:
    """Raise unless ``out`` can take an export: a new or empty folder, or one holding an earlier specforge export
    (which the new one replaces). A checkpoint, a run's directory or a folder of other files is refused, before
    anything is written: an export there would replace or mix with files it did not write."""
    from .run_directory import CHECKPOINT_STATE, existing_run

    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"cannot export to {out}: it exists and is not a folder; choose another --output")
    if (out / CHECKPOINT_STATE).exists():
        raise ExportError(f"cannot export to {out}: it is a checkpoint ({CHECKPOINT_STATE}), whose weights the export "
                          f"would replace; choose a new folder, e.g. --output {out.parent / 'export'}")
    found = existing_run(out)
    if found:
        raise ExportError(f"cannot export to {out}: it holds a run ({', '.join(found[:4])}); choose a new folder, "
                          f"e.g. --output {out / 'export'}")
    if any(out.iterdir()) and not is_export(out):
        raise ExportError(f"cannot export to {out}: the folder is not empty and holds no specforge export "
                          f"({CONFIG_FILE} naming a strategy); choose a new or empty folder")


def is_export(folder: Path) -> bool:
    """Whether ``folder`` holds a specforge export: a ``config.json`` that names its strategy."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get(STRATEGY_FIELD))


def strategy_fields(name: str, options: Any) -> dict[str, Any]:
    """The config.json fields naming the strategy and the options it was trained with (for `specforge eval`)."""
    from .options import options_to_dict

    return {STRATEGY_FIELD: name, OPTIONS_FIELD: options_to_dict(options) if options is not None else {}}


def load_exported_draft(manager: Any, draft_dir: str | os.PathLike[str], engine: Any,
                        overrides: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """(strategy, model) from an export directory; the strategy is named in its config.json.

    The strategy is rebuilt with the options recorded at export (``specforge_strategy_options``;
    an option the installed plugin no longer knows is dropped), then ``overrides`` (``--set
    strategy.KEY=VALUE`` of `specforge eval`), validated like a run's.
    """
    import attrs as _attrs

    from .preflight import check_strategy

    config = open_export(draft_dir, what="an exported draft", weights=False)
    name = config.get(STRATEGY_FIELD)
    if not name:
        raise ExportError(f"{config.source} does not name its strategy ({STRATEGY_FIELD}); was it exported by "
                          "specforge?")
    spec = manager.get("strategy", name)
    recorded = config.value(OPTIONS_FIELD, dict, {})
    known = {field.name for field in _attrs.fields(spec.options)} if _attrs.has(spec.options) else set()
    values = {key: value for key, value in recorded.items() if key in known}
    values.update(overrides or {})
    strategy = spec.load_factory()(spec.build_options(values), BuildContext())
    check_strategy(strategy, spec)
    model = strategy.load_export(str(config.source.parent), engine.info(), engine.frozen_parts())
    return strategy, model


# ---------------------------------------------------------------- vLLM's speculators layout
#: The field naming a speculators-format config.json's algorithm (what vLLM's speculators loader keys on).
SPECULATORS_TYPE = "speculators_model_type"


def speculators_config(algorithm: str, speculative_tokens: int, target: TargetInfo | None) -> dict[str, Any]:
    """The ``speculators_config`` section vLLM's speculators loader requires: one greedy proposal method of
    ``speculative_tokens`` tokens (vLLM's default ``num_speculative_tokens``) and the verifier (target)
    it was trained for, by path or name and architecture."""
    architecture = (target.extra.get("architecture") if target is not None else None)
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": target.model_id if target is not None else None,
                     "architectures": [architecture] if architecture else []},
    }


def speculators_type(config: Mapping[str, Any]) -> str | None:
    """The ``speculators_model_type`` of a config.json, or None for the SGLang / vLLM native layout."""
    value = config.get(SPECULATORS_TYPE)
    return value if isinstance(value, str) else None


#: A hub repository id as huggingface_hub validates one: an optional namespace, a name of word characters, dots
#: and dashes (96 at most); no "--" or "..", no ".git" ending (checked apart).
_HUB_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]{1,96}")


def verifier_note(config: Mapping[str, Any], folder: str | os.PathLike[str]) -> str | None:
    """What to know before serving a speculators-layout export whose verifier is no hub repository id (a local
    folder, or the toy target's name), or None.

    vLLM reads ``speculators_config.verifier.name_or_path`` only when the folder itself is served as the
    model, and then (0.33.0) refuses a local path or anything else that is not a hub repository id; served
    as the draft of a named target, as docs/serving.md shows, the field is not read."""
    if speculators_type(config) is None:
        return None
    section = config.get("speculators_config")
    verifier = section.get("verifier") if isinstance(section, Mapping) else None
    name = verifier.get("name_or_path") if isinstance(verifier, Mapping) else None
    if not isinstance(name, str):
        return None
    hub_id = (_HUB_ID.fullmatch(name) is not None and "--" not in name and ".." not in name
              and not name.endswith(".git") and not os.path.exists(name))
    if hub_id:
        return None
    return (f"note: {folder} names its verifier {name!r}, which is no hub repository id. Serve it as the draft "
            f"of its target: vllm serve TARGET --speculative-config '{{\"method\": ..., \"model\": \"{folder}\", "
            f"\"num_speculative_tokens\": ...}}' (docs/serving.md). vLLM refuses to serve the folder by itself "
            "unless speculators_config.verifier.name_or_path is a hub repository id.")


def check_format(fmt: str, formats: Iterable[str], strategy: str, *, error: type[ExportError] = ExportError) -> None:
    """Refuse ``fmt`` unless the strategy's writer handles it (``formats``), naming those it does."""
    formats = tuple(formats)
    if fmt not in formats:
        raise error(f"strategy {strategy!r} exports as {', '.join(formats)}, not {fmt!r}; pass --format {formats[0]}")


# ---------------------------------------------------------------- writing an export folder
def export_state(model: torch.nn.Module, dtype: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors an export holds: ``model.state_dict()`` without frozen parameters, whole and on the CPU,
    with floating-point tensors cast to ``dtype`` when given (integer and bool buffers keep theirs).

    Frozen parameters are the target's (embedding, lm_head), which the server takes from the
    target itself. An FSDP2 shard is gathered with ``full_tensor()``, a collective: every
    rank must call this, even those that will not write.
    """
    from .dtypes import torch_dtype

    cast = torch_dtype(dtype) if dtype is not None else None
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    state = {}
    for name, tensor in model.state_dict().items():
        if name in frozen:
            continue
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.detach().cpu()
        if cast is not None and tensor.is_floating_point():
            tensor = tensor.to(cast)
        state[name] = tensor.contiguous()
    return state


def write_export_files(out_dir: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
                       config: Mapping[str, Any], *, error: type[ExportError] = ExportError) -> Path:
    """Write ``model.safetensors`` and ``config.json`` into ``out_dir`` (created if needed); returns the folder.

    Both files are written in full (and fsynced) under hidden temporary names before either
    replaces anything, so a failure while writing (a tensor safetensors refuses, a config
    value JSON cannot hold, a full disk) removes the temporaries and leaves an export already
    in the folder as it was. config.json is renamed last: a folder with a config.json reads
    as a complete export.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    try:
        text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise error(f"the export's {CONFIG_FILE} cannot be written as JSON ({exc}); nothing was written to "
                    f"{out}") from None
    created = _make_export_folder(out, error)
    staged: list[Path] = []
    try:
        _stage(out / WEIGHTS_FILE, lambda tmp: save_file(dict(tensors), tmp, metadata={"format": "pt"}), staged)
        _stage(out / CONFIG_FILE, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), staged)
    except Exception as exc:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        _remove_if_empty(out, created)
        kept = "nothing was written" if created else "the folder was left as it was"
        reason = " ".join(str(exc).split())  # safetensors' messages span several indented lines
        raise error(f"could not write the export to {out} ({type(exc).__name__}: {reason}); {kept}") from exc
    for tmp, name in zip(staged, (WEIGHTS_FILE, CONFIG_FILE)):
        os.replace(tmp, out / name)
    fsync_dir(out)
    return out


def _stage(path: Path, write: Callable[[str], None], staged: list[Path]) -> None:
    """Write ``path``'s content to a hidden sibling (recorded in ``staged`` first, so a failed write is cleaned up)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staged.append(tmp)
    write(str(tmp))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())


def _make_export_folder(out: Path, error: type[ExportError]) -> bool:
    """Create ``out`` if needed (True when it was created); a clear error when a file is in the way."""
    if out.exists() and not out.is_dir():
        raise error(f"cannot export to {out}: it exists and is not a folder; choose another --output")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    return created


def _remove_if_empty(out: Path, created: bool) -> None:
    """Undo :func:`_make_export_folder` after a failed export, so no empty folder poses as an export."""
    if created and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


# ---------------------------------------------------------------- reading an export folder
_REQUIRED: Any = object()

#: the JSON kinds a field can be asked for, and how an error message names them
_KINDS: dict[type, str] = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                           list: "a list", dict: "an object"}


def _is_kind(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


@attrs.frozen
class ExportConfig:
    """An export's parsed config.json, read field by field with errors that say which file, field and form.

    ``what`` names the draft the reader expects ("an EAGLE3 draft"), ``error`` is the
    plugin's error type, ``prefix`` the dotted path of a nested section
    (``dflash_config.``). A missing field raises unless a default is given; JSON null counts
    as missing, since transformers writes unknown fields as null.
    """

    data: Mapping[str, Any]
    source: Path
    what: str
    error: type[ExportError] = ExportError
    prefix: str = ""

    def get(self, name: str, default: Any = None) -> Any:
        """The raw value of ``name`` (no checks), for fields whose absence is meaningful."""
        return config_value(self.data, name, default)

    def fail(self, message: str) -> ExportError:
        """The plugin's error for ``message`` about this file (raise it)."""
        return self.error(f"{self.source} {message}")

    def value(self, name: str, kind: type, default: Any = _REQUIRED) -> Any:
        """``name`` checked to be of JSON ``kind`` (int, float, bool, str, list, dict); ``default`` if absent."""
        value = self._read(name, default, lambda v: _is_kind(v, kind), _KINDS[kind])
        return float(value) if kind is float and value is not default else value

    def ints(self, name: str, default: Any = _REQUIRED) -> list[int] | Any:
        """``name`` checked to be a list of integers (layer ids); ``default`` if absent."""
        return self._read(name, default, lambda v: isinstance(v, list) and all(_is_kind(i, int) for i in v),
                          "a list of integers")

    def _read(self, name: str, default: Any, fits: Callable[[Any], bool], expected: str) -> Any:
        value = self.data.get(name)
        if value is None:
            if default is _REQUIRED:
                raise self.fail(f"has no {self.prefix + name!r} field; {self.what} needs it as {expected}")
            return default
        if not fits(value):
            raise self.fail(f"has {self.prefix + name!r} = {value!r}; {self.what} needs it as {expected}")
        return value

    def section(self, name: str) -> ExportConfig:
        """The nested object ``name`` (empty when absent), read with the same file, draft and error."""
        return attrs.evolve(self, data=self.value(name, dict, {}), prefix=f"{self.prefix}{name}.")

    def expect_identity(self, architecture: str, strategy: str, *, strategy_required: bool = True) -> None:
        """Refuse a config.json written for another strategy or architecture, naming what it is and what to do.

        ``strategy_required=False`` accepts a config without ``specforge_strategy`` (a draft
        trained by another tool); one that names a different strategy is always refused.
        """
        written_by = self.value("specforge_strategy", str, _REQUIRED if strategy_required else strategy)
        if written_by != strategy:
            raise self.fail(f"holds an export of strategy {written_by!r} (specforge_strategy), not {strategy!r}; "
                            f"load it with --strategy {written_by}")
        names = self.data.get("architectures")
        if not isinstance(names, list) or architecture not in names:
            raise self.fail(f"names architectures {names}, not [{architecture!r}]: it is not {self.what}")


def open_export(path: str | os.PathLike[str], *, what: str, error: type[ExportError] = ExportError,
                weights: bool = True) -> ExportConfig:
    """The config.json of the export folder ``path``, parsed; ``weights`` also requires model.safetensors."""
    root = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE) if weights else (CONFIG_FILE,):
        if not (root / name).is_file():
            hint = (f"; did you mean {root / 'export'}, the run's export?" if (root / "export" / CONFIG_FILE).is_file()
                    else "")
            raise error(f"{root} is not {what} (no {name}); point at a folder written by `specforge export` "
                        f"({CONFIG_FILE} + {WEIGHTS_FILE}){hint}")
    source = root / CONFIG_FILE
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{source} is not valid JSON ({exc}); re-export the draft") from None
    if not isinstance(data, dict):
        raise error(f"{source} holds a JSON {type(data).__name__}, not an object; it is not {what}'s config")
    return ExportConfig(data, source, what, error)


def load_weights(path: str | os.PathLike[str], *, error: type[ExportError] = ExportError) -> dict[str, torch.Tensor]:
    """Every tensor of the export folder ``path``'s model.safetensors."""
    from safetensors.torch import load_file

    source = Path(path) / WEIGHTS_FILE
    try:
        return load_file(str(source))
    except Exception as exc:
        raise error(f"{source} is not a readable safetensors file: {exc}") from exc


def check_keys(found: Iterable[str], expected: Iterable[str], what: str, against: str, *,
               error: type[ExportError] = ExportError) -> None:
    """Refuse tensors whose names are not exactly ``expected``, listing (the first few) missing and unexpected."""
    found, expected = set(found), set(expected)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise error(f"{what} does not match {against}: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_checked_state(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], source: str, *,
                       error: type[ExportError] = ExportError, dtypes: bool = True) -> torch.nn.Module:
    """Load an export's ``tensors`` into ``model``, which must expect exactly these names and shapes.

    ``dtypes`` also requires each tensor's dtype (off: cast on load, for drafts written by
    other tools). Checking first turns torch's size-mismatch RuntimeError into an error that
    names the file and both shapes.
    """
    expected = export_state(model)
    check_keys(tensors, expected, source, "the draft its config.json describes", error=error)
    for key, want in expected.items():
        got = tensors[key]
        if got.shape != want.shape or (dtypes and got.dtype != want.dtype):
            raise error(f"{source}: {key} is {got.dtype} {tuple(got.shape)}, the draft its config.json describes "
                        f"expects {want.dtype} {tuple(want.shape)}")
    model.load_state_dict(dict(tensors), strict=False)
    return model
