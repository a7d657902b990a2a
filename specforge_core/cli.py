"""The ``specforge`` command line.

``specforge --help``, ``--version`` and ``plugins`` must stay light: nothing here imports
torch, and plugins are asked only for their specs.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from . import __version__
from .errors import CapabilityError, OptionError, PluginError, SpecforgeError, UnknownComponentError
from .plugins import get_plugin_manager
from .serving import DEFAULT_EXPORT_DTYPE, EXPORT_DTYPES
from .specs import SPEC_KINDS

#: What `specforge options` describes: the core's own sections, then one per component kind.
OPTION_SECTIONS = ("train", "data", "regenerate", *sorted(SPEC_KINDS))

_USAGE_ERRORS = (OptionError, UnknownComponentError, CapabilityError, PluginError)


def _fail(exc: SpecforgeError) -> None:
    click.echo(f"error: {exc}", err=True)
    status = 2 if isinstance(exc, _USAGE_ERRORS) else 1
    if _launched_rank():
        _end_rank(status)
    sys.exit(status)


def _version_text() -> str:
    lines = [f"specforge-core {__version__}"]
    for record in get_plugin_manager().plugin_list():
        if record["name"] == "builtin":
            continue
        status = "" if record["status"] == "active" else f" ({record['status']})"
        lines.append(f"  {record['name']}: {record['distribution']} {record['version']}{status}")
    return "\n".join(lines)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(_version_text())
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the core version and every plugin's name and version.")
def cli() -> None:
    """Train draft models for speculative decoding (EAGLE3, DFlash, Domino, ...).

    Every algorithm and backend is a plugin. `specforge plugins` lists what is installed;
    `specforge run --strategy NAME` trains a draft.
    """


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: a JSON list, one entry per plugin.")
@click.option("--check", is_flag=True,
              help="Also import every component's implementation (the factory its spec names), which listing "
                   "alone does not, and exit 1 if one fails.")
def plugins(as_json: bool, check: bool) -> None:
    """List installed plugins, their versions, status and what they provide.

    Listing imports only the plugins' hook modules, so it stays fast; `--check` imports each
    implementation too (torch and all), the way a run would.
    """
    manager = get_plugin_manager()
    records = manager.plugin_list()
    broken = _check_factories(manager, records) if check else {}
    if as_json:
        click.echo(json.dumps(records, indent=2))
    else:
        for record in records:
            provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in record["provides"].items() if names)
            click.echo(f"{record['name']:<12} {record['distribution']} {record['version']}  [{record['status']}]"
                       + (f"  {provides}" if provides else ""))
            if record["error"]:
                click.echo(f"{'':<12} error: {record['error']}")
            for message in record.get("factory_errors", []):
                click.echo(f"{'':<12} error: {message}")
    for message in manager.conflicts():
        click.echo(f"conflict: {message}", err=True)
    if broken:
        sys.exit(1)


def _check_factories(manager: Any, records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Import the factory of every spec of every active plugin; record failures as ``factory_errors``."""
    import inspect

    from .preflight import check_strategy, load_factory

    broken: dict[str, list[str]] = {}
    for record in records:
        if record["status"] != "active":
            continue
        for kind, names in record["provides"].items():
            for name in names:
                try:
                    spec = manager.get(kind, name)
                    factory = load_factory(spec)
                    if kind == "strategy" and inspect.isclass(factory):  # its methods, without building it
                        check_strategy(factory, spec)
                except SpecforgeError as exc:
                    broken.setdefault(record["name"], []).append(str(exc))
        record["factory_errors"] = broken.get(record["name"], [])
    return broken


@cli.command()
@click.argument("section", required=False, type=click.Choice(OPTION_SECTIONS))
@click.argument("name", required=False)
def options(section: str | None, name: str | None) -> None:
    """Describe the options of a section, with defaults and docs.

    \b
      specforge options                    the sections and the components of each
      specforge options train              the training loop (train.*)
      specforge options train lr           one of its options
      specforge options data               the data (data.*)
      specforge options strategy           the installed strategies
      specforge options strategy eagle3    one component's options (strategy.*)

    Set them in a config file section or with `--set SECTION.OPTION=VALUE` on `specforge run`
    or `specforge capture`.
    """
    from .config import PLAIN_SECTIONS
    from .options import describe_options

    manager = get_plugin_manager()
    if section is None:
        for plain, cls in PLAIN_SECTIONS.items():
            click.echo(f"{plain:<14} {_first_line(cls)}  (specforge options {plain})")
        for kind in sorted(SPEC_KINDS):
            names = ", ".join(sorted(manager.specs(kind))) or "(none installed)"
            click.echo(f"{kind:<14} {names}  (specforge options {kind} NAME)")
        return
    if section in PLAIN_SECTIONS:
        cls = PLAIN_SECTIONS[section]
        rows = describe_options(cls)
        if name is not None:  # one option, as `train.lr` or `lr`
            wanted = name.removeprefix(f"{section}.")
            names = [row["name"] for row in rows]
            rows = [row for row in rows if row["name"] == wanted]
            if not rows:
                close = difflib.get_close_matches(wanted, names, n=1)
                _fail(OptionError(f"section '{section}' has no option '{wanted}'"
                                  + (f" (did you mean '{close[0]}'?)" if close else "")
                                  + f"; `specforge options {section}` lists its {len(names)} options"))
        click.echo(f"{section}: {_first_line(cls)}")
        _echo_option_rows(section, rows)
        return
    if name is None:
        try:
            specs = manager.specs(section)
        except SpecforgeError as exc:
            _fail(exc)
        for spec_name, spec in sorted(specs.items()):
            click.echo(f"{spec_name:<12} {spec.description}")
        click.echo(f"(`specforge options {section} NAME` describes one)")
        return
    try:
        spec = manager.get(section, name)
    except SpecforgeError as exc:
        _fail(exc)
    from .specs import ENGINE_CAPABILITIES

    click.echo(f"{spec.origin()}: {spec.description}")
    if section == "strategy":
        formats = ", ".join(spec.export_formats) or "none (it cannot be exported for serving)"
        click.echo(f"  export formats: {formats}")
    for label, names in (("requires", getattr(spec, "requires", None)),
                         ("capabilities", getattr(spec, "capabilities", None))):
        if names:
            click.echo(f"  {label}: {', '.join(sorted(names))}")
            for capability in sorted(names):
                if capability in ENGINE_CAPABILITIES:
                    click.echo(f"      {capability}: {ENGINE_CAPABILITIES[capability]}")
    _echo_option_rows(section, describe_options(spec.options))


def _first_line(cls: type) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0].replace("``", "`")


def _echo_option_rows(section: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        click.echo("  (no options)")
    for row in rows:
        click.echo(f"  {section}.{row['name']} ({row['type']}, default {row['default']!r})")
        if row["doc"]:
            click.echo(f"      {row['doc']}")


def _component_option(kind: str) -> Any:
    flag = "--" + kind.replace("_", "-")
    return click.option(flag, kind, default=None, metavar="NAME",
                        help=f"The {kind.replace('_', ' ')} plugin to use (see `specforge plugins`).")


def _data_flags(command: Any) -> Any:
    """``--target-model``, ``--data`` and ``--eval-data``: one spelling on every command that takes them."""
    command = click.option("--eval-data", default=None, type=click.Path(dir_okay=False, exists=True),
                           help="Held-out conversations (JSONL) for evaluation (data.eval_path). Default: a "
                                "share of --data held out (data.eval_holdout).")(command)
    command = click.option("--data", default=None, type=click.Path(dir_okay=False, exists=True),
                           help="Training conversations, JSONL (data.path). Default: the toy target's data.")(command)
    return click.option("--target-model", default=None, metavar="PATH",
                        help="Target model folder (target_engine.model). Default: the toy target.")(command)


def _config_options(command: Any) -> Any:
    command = click.option("--set", "assignments", multiple=True, metavar="SECTION.KEY=VALUE",
                           help="Override one option, e.g. --set train.lr=1e-4 --set strategy.ttt_length=5 "
                                "(repeatable; `specforge options` lists them).")(command)
    return click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                        help="YAML configuration; flags and --set override it.")(command)


def _raw_config(config_path: str | None, assignments: tuple[str, ...],
                flags: dict[tuple[str, str], Any], top: dict[str, Any] | None = None) -> dict[str, Any]:
    """The raw configuration of a command: the config file, then its flags, then ``--set`` (last wins)."""
    from .config import apply_sets, load_config_file, set_option

    raw: dict[str, Any] = load_config_file(config_path) if config_path else {}
    for (section, key), value in flags.items():
        if value is not None:
            set_option(raw, section, key, value)
    raw.update({key: value for key, value in (top or {}).items() if value is not None})
    return apply_sets(raw, assignments)


def _data_values(target_model: str | None, data: str | None, eval_data: str | None) -> dict[tuple[str, str], Any]:
    return {("target_engine", "model"): target_model, ("data", "path"): data, ("data", "eval_path"): eval_data}


@cli.command()
@_component_option("strategy")
@_component_option("target_engine")
@_component_option("feature_store")
@_component_option("control_plane")
@_data_flags
@_config_options
@click.option("--output", default=None, type=click.Path(file_okay=False),
              help="Run output directory. Default: runs/RUN_ID (runs/run).")
@click.option("--run-id", default=None, help="Name of the run (used in checkpoint names). Default: run.")
@click.option("--features", default=None, type=click.Path(file_okay=False),
              help="Train offline from a features directory written by `specforge capture`; with --role, "
                   "the directory a producer streams into.")
@click.option("--role", type=click.Choice(["producer", "consumer"]), default=None,
              help="Disaggregated run: `producer` captures target features into --features DIR while a "
                   "`consumer` (another process sharing DIR) trains from them, each sample exactly once. "
                   "Across hosts, no directory: --control-plane postgres --feature-store mooncake, any "
                   "number of producers.")
@click.option("--resume", default=None, metavar="latest|best|PATH",
              help="Continue from a checkpoint of this run (weights, optimizer, schedule, RNG, data position).")
@click.option("--overwrite", is_flag=True,
              help="Start over in an --output directory that holds a run: the old run is first moved aside, "
                   "whole, to OUTPUT.old-<time> (without this, such a directory is refused).")
@click.option("--dry-run", is_flag=True, help="Resolve and validate everything, print the plan, build nothing.")
def run(strategy: str | None, target_engine: str | None, feature_store: str | None, control_plane: str | None,
        target_model: str | None, data: str | None, eval_data: str | None,
        config_path: str | None, assignments: tuple[str, ...], output: str | None, run_id: str | None,
        features: str | None, role: str | None, resume: str | None, overwrite: bool, dry_run: bool) -> None:
    """Train a draft model.

    Components are resolved from installed plugins; every option is validated before
    anything heavy is built. Examples:

    \b
        specforge run --strategy eagle3 --set train.max_steps=200 --output out/
        specforge run --strategy dflash --target-model models/my-llm --data chats.jsonl --output out/

    An --output directory that already holds a run is refused: continue it with
    --resume latest, or start over with --overwrite (the old run is moved aside).

    Disaggregated: one process captures while another trains, sharing a directory
    (SQLite metadata and a ref channel in DIR/control, features in DIR/store; every sample
    is trained exactly once across crashes and restarts of either side):

    \b
        specforge run --role producer --strategy eagle3 --features DIR --output prod/
        specforge run --role consumer --strategy eagle3 --features DIR --output out/

    Across hosts that share no directory: a pool of producers and a torchrun consumer
    group meet in PostgreSQL and Mooncake (see "Across hosts" in the README):

    \b
        specforge run --role producer --strategy eagle3 --control-plane postgres \\
            --set control_plane.dsn=postgresql://USER:PASSWORD@HOST/DB --feature-store mooncake \\
            --set feature_store.master_address=HOST:50051 --output prod/
    """
    from .config import check_data_files, resolve_plan
    from .preflight import check_plan

    try:
        flags = {(kind, "name"): name for kind, name in (("strategy", strategy), ("target_engine", target_engine),
                                                         ("feature_store", feature_store),
                                                         ("control_plane", control_plane))}
        raw = _raw_config(config_path, assignments, {**flags, **_data_values(target_model, data, eval_data)},
                          {"output": output, "run_id": run_id, "features": features, "role": role})
        plan = resolve_plan(get_plugin_manager(), raw)
        built = check_plan(plan)  # every factory imports, the strategy has its methods: before any model loads
        check_data_files(plan)
        if plan.role == "producer":
            for flag, given in (("--resume", resume), ("--overwrite", overwrite)):
                if given:
                    raise OptionError(f"a producer resumes by itself from its features directory; drop {flag}")
    except SpecforgeError as exc:
        _fail(exc)
    if dry_run:
        _dry_run(plan, built, resume=resume, overwrite=overwrite)
        return
    if plan.role == "producer":
        from .run_directory import check_writable
        from .topologies.stream.producer import run_producer

        try:
            check_writable(plan.output)
            result = run_producer(plan, get_plugin_manager())
        except SpecforgeError as exc:
            _fail(exc)
        click.echo(result["data"])
        click.echo(f"done: published {result['published']} samples ({result['reused']} already committed before "
                   f"this start); stream closed in {result.get('features') or result['stream']}")
        return
    from .runtime import execute

    try:
        summary = execute(plan, get_plugin_manager(), resume=resume, overwrite=overwrite)
    except SpecforgeError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        _interrupted(plan.output)
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(_run_result_line(summary, os.path.join(plan.output, "summary.json")))
    if _launched_rank():
        _end_rank(0)


def _interrupted(output: str) -> None:
    """Ctrl-C during a run: say where it can continue from, and leave with the shell's status for SIGINT."""
    pointer = Path(output) / "latest"
    name = pointer.read_text().strip() if pointer.is_file() else ""
    if name:
        click.echo(f"interrupted; the run's latest checkpoint is {Path(output) / name}: continue it with the same "
                   "command and --resume latest", err=True)
    else:
        click.echo(f"interrupted before the run's first checkpoint; nothing to resume in {output}", err=True)
    if _launched_rank():
        _end_rank(130)
    sys.exit(130)


def _launched_rank() -> bool:
    """Whether this process is one rank of several that a launcher (torchrun) started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _end_rank(status: int) -> None:
    """Exit a launched rank with ``status`` now that its run is over, without interpreter teardown.

    torch keeps a run's process groups alive after ``destroy_process_group`` (DTensor's caches
    hold the device meshes that hold them), so gloo's threads are still running while Python and
    the C++ runtime tear down, and a complete run has been seen to abort there ("terminate called
    without an active exception") and so fail its launcher. Everything the run writes is on disk
    by now; the rank's output is flushed and it leaves at once.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _figure(value: Any) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _run_result_line(summary: dict[str, Any], summary_path: str) -> str:
    """The last line of a run: steps, supervised tokens/s, acceptance sim vs real, the best checkpoint."""
    parts = [f"done: {summary['steps']} steps, {summary['tokens_per_s']:.0f} supervised tokens/s"]
    if summary.get("final_eval"):
        parts.append(f"accept_len_sim {_figure(summary.get('accept_len_sim'))}, accept_len_real "
                     f"{_figure(summary.get('accept_len_real'))} (bonus token included)")
    else:
        parts.append(f"nothing evaluated ({summary.get('eval_split') or 'no eval split'})")
    best = summary["best"]
    if best.get("checkpoint"):
        parts.append(f"best checkpoint {best['checkpoint']} ({best['metric']} {_figure(best['value'])} at step "
                     f"{best['step']})")
    return "; ".join(parts) + f"; summary in {summary_path}"


def _dry_run(plan: Any, strategy: Any, *, resume: str | None, overwrite: bool) -> None:
    """Print the plan as the run would use it: the output checked, the engine's suggestions applied."""
    from .features import FeatureSet
    from .run_directory import check_output, check_writable
    from .runtime import check_resume, plan_as_run

    try:
        if plan.role == "producer":
            check_writable(plan.output)
        else:
            check_output(plan.output, resume=resume, overwrite=overwrite)
            if resume:
                check_resume(plan, resume, int(os.environ.get("WORLD_SIZE", "1")))
            if plan.features and plan.role is None:  # an offline run reads a finished capture of its features
                features = FeatureSet.open(plan.features)
                features.check_complete()
                features.check_plan(strategy.capture_plan(features.target), plan["strategy"].spec.name)
        shown, applied = plan_as_run(plan)
    except SpecforgeError as exc:
        _fail(exc)
    if applied is None:
        click.echo(f"note: the train defaults the producer's target engine suggests are known once it streams into "
                   f"{plan.features or 'the stream'}; the plan below has none applied", err=True)
    click.echo(json.dumps({**shown.to_dict(), "train_options_suggested_by_engine": applied}, indent=2, default=str))


@cli.command()
@_component_option("strategy")
@_component_option("target_engine")
@_data_flags
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Features directory to write.")
@click.option("--batch-size", default=8, show_default=True, help="Sequences per target forward.")
@click.option("--pack/--no-pack", default=True, show_default=True,
              help="At the end, move the sample files into packs of about 1 GiB, which training reads faster "
                   "(their maps are kept from one epoch to the next). --no-pack leaves one file per sample.")
@_config_options
def capture(strategy: str | None, target_engine: str | None, target_model: str | None, data: str | None,
            eval_data: str | None, output: str, batch_size: int, pack: bool, config_path: str | None,
            assignments: tuple[str, ...]) -> None:
    """Capture target features for offline training (`specforge run --features DIR`).

    The strategy's capture plan decides which layers and features are stored. Resumable:
    samples already in DIR are skipped, and samples captured later go into a new pack. Prints
    bytes per token and the ratio to the unpadded minimum.
    """
    from .config import check_data_files, resolve_plan
    from .preflight import check_plan
    from .topologies.offline import run_capture

    try:
        raw = _raw_config(config_path, assignments, {("strategy", "name"): strategy,
                                                     ("target_engine", "name"): target_engine,
                                                     **_data_values(target_model, data, eval_data)},
                          {"output": output})
        plan = resolve_plan(get_plugin_manager(), raw, default_feature_store="disk")
        check_plan(plan)
        check_data_files(plan)
        result = run_capture(plan, get_plugin_manager(), batch_size=batch_size, pack=pack)
    except SpecforgeError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: the samples captured so far stay in {output}; run the same command again to "
                   "finish (it skips them)", err=True)
        sys.exit(130)
    click.echo(result["eval_split"])
    if result["packed"] and result["packed"]["samples"]:
        packed = result["packed"]
        click.echo(f"packed {packed['samples']} sample files ({packed['bytes'] / 2**20:.1f} MiB) into "
                   f"{packed['packs']} pack{'s' if packed['packs'] != 1 else ''}")
    for split, report in result["data"].items():
        click.echo(f"{split}: {result['samples'][split]} samples ({report['new']} new, {report['reused']} reused); "
                   f"{report['summary']}")
    click.echo(f"{result['tokens']} tokens, {result['bytes_per_token']:.1f} bytes/token, "
               f"{result['ratio_to_unpadded_minimum']:.3f}x the unpadded minimum; features in {result['output']}")


@cli.command()
@_component_option("target_engine")
@click.option("--target-model", default=None, metavar="PATH",
              help="Target model folder (target_engine.model). Default: the toy target.")
@click.option("--data", required=True, type=click.Path(dir_okay=False, exists=True),
              help="Conversations to regenerate (JSONL: messages, ShareGPT conversations, or prompt/response).")
@click.option("--output", required=True, type=click.Path(dir_okay=False),
              help="JSONL file to write (must not exist; OUTPUT.partial holds a run in progress).")
@click.option("--max-new-tokens", default=None, type=int, help="Most tokens per reply (regenerate.max_new_tokens).")
@click.option("--temperature", default=None, type=float,
              help="0 (default): greedy, the target's own most likely reply; above 0: sampled.")
@click.option("--batch-size", default=None, type=int, help="Conversations generated together (regenerate.batch_size).")
@_config_options
def regenerate(target_engine: str | None, target_model: str | None, data: str, output: str,
               max_new_tokens: int | None, temperature: float | None, batch_size: int | None,
               config_path: str | None, assignments: tuple[str, ...]) -> None:
    """Rewrite the assistant turns of a conversation file with the target's own replies.

    Drafts are judged by how well they predict the target; trained on replies the target
    would not give, they accept less than published figures. Each assistant turn is
    replaced by the target's reply to the conversation so far, and a conversation ending on
    a user turn gets one. Batched and KV-cached; resumable (run the same command again
    after an interruption); written in the input's format. Example:

    \b
        specforge regenerate --target-model models/my-llm --data chats.jsonl --output chats.regen.jsonl
        specforge run --strategy eagle3 --target-model models/my-llm --data chats.regen.jsonl --output out/
    """
    from .config import RegenerateOptions, TrainOptions
    from .options import build_options
    from .protocols import BuildContext
    from .regenerate import check_paths, run_regenerate
    from .threads import apply_threads

    try:
        check_paths(data, output)  # before the target is loaded
        raw = _raw_config(config_path, assignments, {
            ("target_engine", "name"): target_engine, ("target_engine", "model"): target_model,
            ("regenerate", "max_new_tokens"): max_new_tokens, ("regenerate", "temperature"): temperature,
            ("regenerate", "batch_size"): batch_size})
        unknown = sorted(set(raw) - {"target_engine", "regenerate", "train"})
        if unknown:
            raise OptionError(f"regenerate reads the sections target_engine, regenerate and train (threads); "
                              f"got '{unknown[0]}'")
        engine_raw = dict(raw.get("target_engine") or {})
        spec = get_plugin_manager().get("target_engine", str(engine_raw.pop("name", None) or "hf"))
        options = build_options(RegenerateOptions, raw.get("regenerate"), section="regenerate")
        apply_threads(build_options(TrainOptions, raw.get("train"), section="train").threads)
        engine = spec.load_factory()(spec.build_options(engine_raw), BuildContext(role="regenerate"))
        if not hasattr(engine, "generate"):
            raise OptionError(f"{spec.origin()} cannot generate text; regenerate with --target-engine hf")
        report = run_regenerate(engine, data, output, options)
    except SpecforgeError as exc:
        _fail(exc)
    click.echo(report.summary())
    click.echo(f"regenerated conversations in {output}")


@cli.command(name="export")
@click.argument("source", type=click.Path(exists=True, file_okay=False), metavar="RUN_OR_CHECKPOINT")
@click.option("--format", "fmt", default=None, metavar="FORMAT",
              help="Serving format to write: one the strategy's plugin declares (eagle3 and dflash: sglang, vllm, "
                   "speculators; domino: sglang; dspark: sglang, vllm; `specforge options strategy NAME` lists them). "
                   "Default: the strategy's first. `sglang` and `vllm` write the same folder for eagle3, dflash and "
                   "dspark: it serves in both engines.")
@click.option("--dtype", default=DEFAULT_EXPORT_DTYPE, show_default=True, type=click.Choice(EXPORT_DTYPES),
              help="dtype of the exported weights: the dtype the draft will be served in (SGLang and vLLM serve a "
                   "float32 export as float16 under --dtype auto).")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Directory to write the draft to.")
def export_command(source: str, fmt: str | None, dtype: str, output: str) -> None:
    """Export a trained draft for serving.

    RUN_OR_CHECKPOINT is a run's output directory (its best checkpoint, else the latest)
    or one checkpoint directory. Writes model.safetensors and config.json in the chosen
    format; see docs/serving.md for the engine command lines.
    """
    from .export import (CONFIG_FILE, check_export_folder, export_format, export_model, is_export, rebuild_model,
                         resolve_checkpoint, verifier_note)

    try:
        check_export_folder(Path(output))  # before the checkpoint is read
        replacing = is_export(Path(output))
        checkpoint, run_dir = resolve_checkpoint(source)
        spec, strategy, model, target = rebuild_model(get_plugin_manager(), checkpoint, run_dir)
        fmt = export_format(spec, fmt)
        out = export_model(strategy, model, target, output, spec=spec, fmt=fmt, dtype=dtype)
    except SpecforgeError as exc:
        _fail(exc)
    click.echo(f"exported {checkpoint.name} of strategy {spec.name} as {fmt} ({dtype}) to {out}"
               + (" (replacing the export that was there)" if replacing else ""))
    note = verifier_note(json.loads((out / CONFIG_FILE).read_text()), out)
    if note:
        click.echo(note)


@cli.command(name="eval")
@click.option("--draft", required=True, type=click.Path(exists=True, file_okay=False),
              help="An exported draft directory (`specforge export` or OUTPUT/export of a run), in any format "
                   "specforge writes.")
@click.option("--target-model", default=None, metavar="PATH", help="Target model folder. Default: the toy target.")
@click.option("--target-engine", default="hf", show_default=True, metavar="NAME", help="Target engine plugin.")
@click.option("--data", "--prompts", "prompts", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSONL conversations; each is cut at its last user turn. Default: the toy target's eval split.")
@click.option("--num-prompts", default=32, show_default=True, type=click.IntRange(min=1),
              help="How many prompts to decode.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Tokens generated per prompt.")
@click.option("--set", "assignments", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a strategy or target engine option, e.g. --set strategy.spec_depth=4 or --set "
                   "target_engine.dtype=bfloat16 (repeatable), or the CPU threads, --set train.threads=N. The "
                   "strategy starts from the options it was trained with, recorded in the export.")
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON.")
def eval_command(draft: str, target_model: str | None, target_engine: str, prompts: str | None, num_prompts: int,
                 max_new_tokens: int, assignments: tuple[str, ...], as_json: bool) -> None:
    """Measure a draft's real acceptance length and speedup with speculative decoding.

    Every prompt is decoded twice on the same engine: by the target alone (greedy) and
    speculatively with the draft. The outputs must be identical token for token (exit
    status 1 otherwise). accept_len_real is tokens per target verification forward, bonus
    token included; the speedup is the wall-clock ratio of new tokens per second of the
    two decodes (batch 1, prefill included) on this machine, not a prediction of a GPU
    serving engine's (docs/serving.md says what it does and does not tell).
    """
    from .config import TrainOptions, apply_sets
    from .export import load_exported_draft
    from .options import build_options
    from .protocols import BuildContext
    from .speculative import measure_acceptance, prompts_from_jsonl

    from .threads import apply_threads

    try:
        sets = apply_sets({}, assignments)
        unknown = sorted(set(sets) - {"strategy", "target_engine", "train"})
        if unknown:
            raise OptionError(f"`specforge eval --set` takes strategy.KEY=VALUE, target_engine.KEY=VALUE and "
                              f"train.threads=N, not {unknown[0]}.*")
        other = sorted(set(sets.get("train") or {}) - {"threads"})
        if other:
            raise OptionError(f"`specforge eval --set` takes train.threads only of the train options, not "
                              f"train.{other[0]}")
        apply_threads(build_options(TrainOptions, sets.get("train"), section="train").threads)
        manager = get_plugin_manager()
        spec = manager.get("target_engine", target_engine)
        values = {k: v for k, v in sets.get("target_engine", {}).items() if k != "name"}
        if target_model:
            values["model"] = target_model
        engine = spec.load_factory()(build_options(spec.options, values, section="target_engine"), BuildContext())
        overrides = {k: v for k, v in sets.get("strategy", {}).items() if k != "name"}
        strategy, model = load_exported_draft(manager, draft, engine, overrides)
        if prompts is None:
            default = getattr(engine, "default_data", lambda: None)()
            if default is None:
                raise OptionError("no prompts: pass --data FILE (only the toy target ships held-out prompts)")
            # the eval split a run on the toy measures: its held-out prompts with the target's own replies
            prompts = str(getattr(engine, "default_eval_data", lambda: None)() or default[1])
        prompt_ids = prompts_from_jsonl(prompts, engine.tokenizer, limit=num_prompts)
        if not prompt_ids:
            raise OptionError(f"{prompts} holds no usable prompt (a conversation with a user turn)")
        result = measure_acceptance(strategy, model, engine, prompt_ids, max_new_tokens=max_new_tokens)
    except SpecforgeError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"accept_len_real {result['accept_len_real']:.3f} ({result['convention']}) over "
                   f"{result['prompts']} prompts, {result['tokens']} tokens in {result['target_forwards']} target "
                   "forwards; output identical to the target's greedy decode")
        click.echo(f"speed: greedy {result['greedy_tokens_per_s']:.1f} tokens/s, speculative "
                   f"{result['speculative_tokens_per_s']:.1f} tokens/s, speedup {result['speedup']:.2f}x "
                   "(wall clock on this machine, batch 1)")


@cli.group()
def plugin() -> None:
    """Write new plugins (`specforge plugin new`); list installed ones with `specforge plugins`."""


@plugin.command(name="new")
@click.argument("name")
@click.option("--kind", required=True,
              type=click.Choice(["strategy", "target-engine", "feature-store", "control-plane", "tracker"]),
              help="What the plugin provides.")
@click.option("--output", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Folder to create specforge-plugin-NAME in.")
def plugin_new(name: str, kind: str, output: str) -> None:
    """Write a working skeleton distribution for plugin NAME.

    The folder specforge-plugin-NAME holds pyproject.toml (with the `specforge` entry point), a
    hook module, an implementation that works as generated and passes its conformance suite, a
    README with the next steps, and tests. Example:

        specforge plugin new medusa --kind strategy && pip install -e "specforge-plugin-medusa[test]"
    """
    from .scaffold import KINDS, new_plugin

    try:
        target = new_plugin(name, kind, output)
    except SpecforgeError as exc:
        _fail(exc)
    component = KINDS[kind].component
    if component is not None and name in get_plugin_manager().specs(component):
        existing = get_plugin_manager().get(component, name)
        click.echo(f"note: {existing.origin()} is already installed; installing this plugin too makes the name "
                   "ambiguous (an error) until one of them is uninstalled or renamed", err=True)
    click.echo(f"wrote {target}")
    click.echo(f"next: pip install -e \"{target}[test]\" && SPECFORGE_STRICT_PLUGINS=1 python -m pytest -q "
               f"{target / 'tests'}  (then see {target / 'README.md'})")


def build_cli() -> click.Group:
    """The CLI with every plugin's sub-commands added."""
    manager = get_plugin_manager()
    manager.hook.specforge_add_commands(cli=cli)
    return cli


def main(argv: list[str] | None = None) -> None:
    try:
        command = build_cli()
    except SpecforgeError as exc:
        _fail(exc)
    command.main(args=argv, prog_name="specforge")


if __name__ == "__main__":  # pragma: no cover
    main()
