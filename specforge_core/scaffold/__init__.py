"""``specforge plugin new``: write a working skeleton distribution for a new plugin.

A skeleton is a complete distribution: ``pyproject.toml`` with the ``specforge`` entry point, a
cheap hook module with the spec and its options, an implementation that works as generated and
passes its kind's conformance suite, a README, and tests (the suite, plus "the installed plugin
provides the component"). Templates live in ``templates/<kind>/`` next to this file; they are
plain text with ``{{placeholders}}``, rendered by :func:`render`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Mapping

import attrs

from .. import __version__
from ..errors import OptionError

_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


class ScaffoldError(OptionError):
    """A plugin skeleton cannot be written as asked (a bad name, a folder in the way)."""


@attrs.frozen
class Kind:
    """What a skeleton of one kind holds: its implementation module and the words of its README."""

    component: str | None  # the component kind its spec registers (None: hooks only)
    module: str
    label: str
    intro: str
    try_command: str
    suite_note: str
    next_steps: str


KINDS: dict[str, Kind] = {
    "strategy": Kind(
        "strategy", "strategy", "strategy (draft algorithm)",
        "It trains a linear head over the target's last hidden state: a starting point to replace with your "
        "algorithm.",
        "specforge run --strategy {name} --dry-run   # resolves and checks it; drop --dry-run to train on the toy "
        "target",
        "StrategyConformance: collate, the loss, gradients, frozen parts, exact metric pooling",
        "1. Replace the model and the loss in `strategy.py` (keep `capture_plan`, `build_model`, `collate`,\n"
        "   `forward_loss`); `specforge run --strategy {name}` trains it on the embedded toy target.\n"
        "2. Give the draft a served format and a real acceptance length: add `export`, `load_export` and\n"
        "   `speculate` (all three), the formats `export` writes to the spec's `export_formats` and `\"verify\"`\n"
        "   to its `requires`; the conformance suite then checks the export round trip and that decoding is\n"
        "   lossless, and runs report `tau_real`.\n"
        "3. Add `derived_metrics` for metrics computed from pooled ones, and point `best_metric` at one."),
    "target-engine": Kind(
        "target_engine", "engine", "target engine",
        "It runs specforge's ReferenceTarget (a small random model) so it passes the engine contract as generated: "
        "replace it with your model runner.",
        "specforge run --strategy dflash --target-engine {name} --dry-run",
        "TargetEngineConformance: info vs frozen parts, unpadded capture, batch invariance, sessions",
        "1. Replace `engine.py`'s ReferenceTarget with your model runner: `info`, `tokenizer`, `capture`,\n"
        "   `frozen_parts`, `session` (docstring there; specforge_core.protocols.TargetEngine).\n"
        "2. Declare only the capabilities it really offers (`aux_hidden_states`, `last_hidden`,\n"
        "   `frozen_parts`, `verify`): strategies that need more are refused before anything loads."),
    "feature-store": Kind(
        "feature_store", "store", "feature store",
        "It keeps tensors in a dict, under the core's BaseFeatureStore (which does the checks and bookkeeping).",
        "specforge run --strategy dflash --feature-store {name} --dry-run",
        "FeatureStoreConformance (consume-once and retaining): refs, generations, stale refs, bad input",
        "1. Replace the six hooks in `store.py` (`_store`, `_load`, `_release`, `_drop`, `_resident`, `_close`)\n"
        "   with your backend.\n"
        "2. Add `cross_process` to the spec's capabilities once other processes can read what one put (the\n"
        "   disaggregated topology needs it) and set the suite's `persistent = True` if it survives a restart."),
    "control-plane": Kind(
        "control_plane", "plane", "control plane",
        "It pairs the core's in-memory metadata store with an in-process queue channel.",
        "specforge run --strategy dflash --control-plane {name} --dry-run",
        "ControlPlaneConformance: commit/dedup, acks and the durable step, markers, the channel",
        "1. Replace `metadata` and `channel` in `plane.py` with your backend (a database, a queue service).\n"
        "2. Add `durable` / `cross_process` to the spec's capabilities, and set the suite's flags, once it\n"
        "   keeps those promises: the suite then tests reopening and separate handles."),
    "tracker": Kind(
        None, "tracker", "tracker (run observer)",
        "It writes one JSON line per run event into OUTPUT/{name}.jsonl through the lifecycle hooks.",
        "specforge run --strategy dflash --set train.max_steps=5   # then read runs/run/{name}.jsonl",
        "a run's events recorded in order; a failure to record never breaks the run",
        "1. Send the records to your tracking service in `tracker.py`.\n"
        "2. Other hooks: `specforge_checkpoint_saved(run_id, global_step, path)` and\n"
        "   `specforge_add_commands(cli)` (specforge_core/hookspecs.py lists each with an example)."),
}

#: template file -> path in the distribution (placeholders allowed)
_LAYOUT = {
    "common/pyproject.toml.tmpl": "pyproject.toml",
    "common/README.md.tmpl": "README.md",
    "{kind}/__init__.py.tmpl": "src/{{package}}/__init__.py",
    "{kind}/{module}.py.tmpl": "src/{{package}}/{{module}}.py",
    "{kind}/test.py.tmpl": "tests/test_{{package_suffix}}.py",
}


def names_for(name: str, kind: str) -> dict[str, str]:
    """The placeholders of plugin ``name`` of ``kind``: distribution, package, class prefix, ..."""
    if not _NAME.match(name):
        raise ScaffoldError(f"plugin name {name!r} is not usable: use lowercase letters, digits, '-' or '_', starting "
                            "with a letter (it becomes the component name, specforge-plugin-NAME and the package)")
    if kind not in KINDS:
        raise ScaffoldError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
    spec = KINDS[kind]
    suffix = name.replace("-", "_")
    return {
        "name": name, "kind": kind, "kind_label": spec.label, "module": spec.module,
        "package": f"specforge_plugin_{suffix}", "package_suffix": suffix,
        "Class": "".join(part.capitalize() for part in re.split(r"[-_]", name) if part),
        "core_version": __version__, "extra_dependencies": "",
        "kind_intro": spec.intro.replace("{name}", name), "try_command": spec.try_command.replace("{name}", name),
        "suite_note": spec.suite_note, "next_steps": spec.next_steps.replace("{name}", name),
    }


def render(text: str, values: Mapping[str, str]) -> str:
    """``text`` with every ``{{key}}`` replaced; an unknown placeholder is an error, not silent text."""
    def replace(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in values:
            raise ScaffoldError(f"template placeholder {{{{{key}}}}} has no value")
        return values[key]

    return re.sub(r"\{\{(\w+)\}\}", replace, text)


def new_plugin(name: str, kind: str, output_dir: str | os.PathLike[str] = ".") -> Path:
    """Write the skeleton of plugin ``name`` of ``kind`` into ``output_dir/specforge-plugin-NAME``; returns it.

    The folder must not exist or be empty; it appears complete or not at all (written beside it,
    then renamed into place).
    """
    values = names_for(name, kind)
    target = Path(output_dir) / f"specforge-plugin-{name}"
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ScaffoldError(f"{target} already exists and is not an empty folder; choose another --output or "
                            "remove it")
    templates = resources.files(__name__).joinpath("templates")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the plugin's folder is an ordinary one
    try:
        for source, destination in _LAYOUT.items():
            text = templates.joinpath(source.format(kind=kind, module=values["module"])).read_text(encoding="utf-8")
            path = staging / render(destination, values)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render(text, values), encoding="utf-8")
        if target.exists():
            target.rmdir()  # empty, checked above
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
