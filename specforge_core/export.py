"""Export a trained draft for serving, and load drafts back for evaluation.

``OUTPUT/run.json`` records what a run was (its resolved config, the target's info, the
features directory if offline), so a checkpoint can be exported later without the
command line that produced it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs

from .errors import SpecforgeError
from .protocols import BuildContext, DataStats, TargetInfo

RUN_FILE = "run.json"
EXPORT_FORMATS = ("sglang",)


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
    raise ExportError(f"{path} is neither a checkpoint (no trainer_state.json) nor a run directory with a "
                      "'best' or 'latest' checkpoint")


def rebuild_model(manager: Any, checkpoint: Path, run_dir: Path) -> tuple[Any, Any, TargetInfo, dict[str, Any]]:
    """(strategy, model with the checkpoint's weights, target info, frozen parts) of a finished run."""
    from safetensors.torch import load_file

    from .config import plan_to_raw, resolve_plan
    from .features import FeatureSet, frozen_fingerprint
    from .runtime import build_component
    from .training.checkpoint import load_model_state
    from .training.distributed import DistInfo

    run_file = run_dir / RUN_FILE
    if not run_file.exists():
        raise ExportError(f"{run_dir} has no {RUN_FILE}; export needs the run directory a checkpoint came from")
    run = json.loads(run_file.read_text())
    plan = resolve_plan(manager, plan_to_raw(run["config"]))
    context = BuildContext(run_id=plan.run_id, output_dir=str(run_dir))
    strategy = build_component(plan, "strategy", context)
    target = TargetInfo(**run["target"])
    if run.get("features"):
        frozen = FeatureSet.open(run["features"]).frozen_parts()
    else:
        frozen = build_component(plan, "target_engine", context).frozen_parts()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if frozen_fingerprint(frozen) != state["contract"]["target"]:
        raise ExportError(f"the target's frozen parts differ from the ones {checkpoint} was trained against")
    model = strategy.build_model(target, frozen, DataStats())
    load_model_state(model, load_file(str(checkpoint / "model.safetensors")), DistInfo())
    return strategy, model, target, frozen


def export_model(strategy: Any, model: Any, target: TargetInfo, out_dir: str | os.PathLike[str],
                 fmt: str = "sglang") -> Path:
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; formats: {', '.join(EXPORT_FORMATS)}")
    if not hasattr(strategy, "export"):
        raise ExportError(f"strategy {type(strategy).__name__} cannot export for serving")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    strategy.export(model, str(out), target)
    return out


def load_exported_draft(manager: Any, draft_dir: str | os.PathLike[str], engine: Any) -> tuple[Any, Any]:
    """(strategy, model) from an export directory; the strategy is named in its config.json."""
    from .options import build_options

    draft_dir = Path(draft_dir)
    config_file = draft_dir / "config.json"
    if not config_file.exists():
        raise ExportError(f"{draft_dir} is not an exported draft (no config.json)")
    config = json.loads(config_file.read_text())
    name = config.get("specforge_strategy")
    if not name:
        raise ExportError(f"{config_file} does not name its strategy (specforge_strategy); was it exported by "
                          "specforge?")
    spec = manager.get("strategy", name)
    strategy = spec.load_factory()(build_options(spec.options, {}, section="strategy"), BuildContext())
    model = strategy.load_export(str(draft_dir), engine.info(), engine.frozen_parts())
    return strategy, model
