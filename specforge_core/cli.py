"""The ``specforge`` command line.

``specforge --help``, ``--version`` and ``plugins`` must stay light: nothing here imports
torch, and plugins are asked only for their specs.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from . import __version__
from .errors import CapabilityError, OptionError, PluginError, SpecforgeError, UnknownComponentError
from .plugins import get_plugin_manager
from .specs import SPEC_KINDS

_USAGE_ERRORS = (OptionError, UnknownComponentError, CapabilityError, PluginError)


def _fail(exc: SpecforgeError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, _USAGE_ERRORS) else 1)


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
def plugins(as_json: bool) -> None:
    """List installed plugins, their versions, status and what they provide."""
    manager = get_plugin_manager()
    records = manager.plugin_list()
    if as_json:
        click.echo(json.dumps(records, indent=2))
    else:
        for record in records:
            provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in record["provides"].items() if names)
            click.echo(f"{record['name']:<12} {record['distribution']} {record['version']}  [{record['status']}]"
                       + (f"  {provides}" if provides else ""))
            if record["error"]:
                click.echo(f"{'':<12} error: {record['error']}")
    for message in manager.conflicts():
        click.echo(f"conflict: {message}", err=True)


@cli.command()
@click.argument("kind", type=click.Choice(sorted(SPEC_KINDS)))
@click.argument("name")
def options(kind: str, name: str) -> None:
    """Describe the options of one component (`specforge options strategy eagle3`).

    Set them in a config file section or with `--set KIND.OPTION=VALUE` on `specforge run`.
    """
    from .options import describe_options

    try:
        spec = get_plugin_manager().get(kind, name)
    except SpecforgeError as exc:
        _fail(exc)
    click.echo(f"{spec.origin()}: {spec.description}")
    rows = describe_options(spec.options)
    if not rows:
        click.echo("  (no options)")
    for row in rows:
        click.echo(f"  {kind}.{row['name']} ({row['type']}, default {row['default']!r})")
        if row["doc"]:
            click.echo(f"      {row['doc']}")


def _component_option(kind: str) -> Any:
    flag = "--" + kind.replace("_", "-")
    return click.option(flag, kind, default=None, metavar="NAME",
                        help=f"The {kind.replace('_', ' ')} plugin to use (see `specforge plugins`).")


@cli.command()
@_component_option("strategy")
@_component_option("target_engine")
@_component_option("feature_store")
@_component_option("control_plane")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="YAML run configuration; flags and --set override it.")
@click.option("--set", "assignments", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one option, e.g. --set train.lr=1e-4 --set strategy.ttt_length=5 (repeatable).")
@click.option("--output", default=None, type=click.Path(file_okay=False), help="Run output directory.")
@click.option("--run-id", default=None, help="Name of the run (used in checkpoint names).")
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
@click.option("--dry-run", is_flag=True, help="Resolve and validate everything, print the plan, build nothing.")
def run(strategy: str | None, target_engine: str | None, feature_store: str | None, control_plane: str | None,
        config_path: str | None, assignments: tuple[str, ...], output: str | None, run_id: str | None,
        features: str | None, role: str | None, resume: str | None, dry_run: bool) -> None:
    """Train a draft model.

    Components are resolved from installed plugins; every option is validated before
    anything heavy is built. Example:

        specforge run --strategy eagle3 --set train.max_steps=200 --output out/

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
    from .config import apply_sets, load_config_file, resolve_plan, set_option

    try:
        raw: dict[str, Any] = load_config_file(config_path) if config_path else {}
        flags = {"strategy": strategy, "target_engine": target_engine, "feature_store": feature_store,
                 "control_plane": control_plane}
        for kind, name in flags.items():
            if name:
                set_option(raw, kind, "name", name)
        if output:
            raw["output"] = output
        if run_id:
            raw["run_id"] = run_id
        if features:
            raw["features"] = features
        if role:
            raw["role"] = role
        raw = apply_sets(raw, assignments)
        plan = resolve_plan(get_plugin_manager(), raw)
    except SpecforgeError as exc:
        _fail(exc)
    if dry_run:
        click.echo(json.dumps(plan.to_dict(), indent=2, default=str))
        return
    if plan.role == "producer":
        from .topologies.stream.producer import run_producer

        if resume:
            _fail(OptionError("a producer resumes by itself from its features directory; drop --resume"))
        try:
            result = run_producer(plan, get_plugin_manager())
        except SpecforgeError as exc:
            _fail(exc)
        click.echo(f"done: published {result['published']} samples ({result['reused']} already committed before "
                   f"this start); stream closed in {result.get('features') or result['stream']}")
        return
    from .runtime import execute

    try:
        summary = execute(plan, get_plugin_manager(), resume=resume)
    except SpecforgeError as exc:
        _fail(exc)
    if int(os.environ.get("RANK", "0")) == 0:
        best = summary["best"]
        click.echo(f"done: {summary['steps']} steps, {summary['tokens_per_s']:.0f} tokens/s; "
                   f"best {best['metric']}={best['value']} at step {best['step']}; summary in "
                   f"{os.path.join(plan.output, 'summary.json')}")


@cli.command()
@_component_option("strategy")
@_component_option("target_engine")
@click.option("--target-model", default=None, metavar="PATH",
              help="Target model folder (or hub id with network). Default: the toy target.")
@click.option("--data", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Training conversations (JSONL). Default: the toy target's bundled data.")
@click.option("--eval-data", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Held-out conversations (JSONL), stored as the eval split.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Features directory to write.")
@click.option("--batch-size", default=8, show_default=True, help="Sequences per target forward.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="YAML configuration.")
@click.option("--set", "assignments", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override an option, e.g. --set data.max_length=1024 --set strategy.ttt_length=5.")
def capture(strategy: str | None, target_engine: str | None, target_model: str | None, data: str | None,
            eval_data: str | None, output: str, batch_size: int, config_path: str | None,
            assignments: tuple[str, ...]) -> None:
    """Capture target features for offline training (`specforge run --features DIR`).

    The strategy's capture plan decides which layers and features are stored. Resumable:
    samples already in DIR are skipped. Prints bytes per token and the ratio to the
    unpadded minimum.
    """
    from .topologies.offline import run_capture
    from .config import apply_sets, load_config_file, resolve_plan, set_option

    try:
        raw: dict[str, Any] = load_config_file(config_path) if config_path else {}
        raw["output"] = output
        raw = apply_sets(raw, assignments)
        for section, key, value in (("strategy", "name", strategy), ("target_engine", "name", target_engine),
                                    ("target_engine", "model", target_model), ("data", "path", data),
                                    ("data", "eval_path", eval_data)):
            if value:
                set_option(raw, section, key, value)
        plan = resolve_plan(get_plugin_manager(), raw, default_feature_store="disk")
        result = run_capture(plan, get_plugin_manager(), batch_size=batch_size)
    except SpecforgeError as exc:
        _fail(exc)
    for split, report in result["data"].items():
        click.echo(f"{split}: {result['samples'][split]} samples ({report['new']} new, {report['reused']} reused); "
                   f"{report['summary']}")
    click.echo(f"{result['tokens']} tokens, {result['bytes_per_token']:.1f} bytes/token, "
               f"{result['ratio_to_unpadded_minimum']:.3f}x the unpadded minimum; features in {result['output']}")


@cli.command(name="export")
@click.argument("source", type=click.Path(exists=True, file_okay=False), metavar="RUN_OR_CHECKPOINT")
@click.option("--format", "fmt", default="sglang", show_default=True, type=click.Choice(["sglang"]),
              help="Serving format to write.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Directory to write the draft to.")
def export_command(source: str, fmt: str, output: str) -> None:
    """Export a trained draft for serving.

    RUN_OR_CHECKPOINT is a run's output directory (its best checkpoint, else the latest)
    or one checkpoint directory. Writes safetensors and a config.json SGLang loads.
    """
    from .export import export_model, rebuild_model, resolve_checkpoint

    try:
        checkpoint, run_dir = resolve_checkpoint(source)
        strategy, model, target, _frozen = rebuild_model(get_plugin_manager(), checkpoint, run_dir)
        out = export_model(strategy, model, target, output, fmt)
    except SpecforgeError as exc:
        _fail(exc)
    click.echo(f"exported {checkpoint.name} as {fmt} to {out}")


@cli.command(name="eval")
@click.option("--draft", required=True, type=click.Path(exists=True, file_okay=False),
              help="An exported draft directory (`specforge export` or OUTPUT/export of a run).")
@click.option("--target-model", default=None, metavar="PATH", help="Target model folder. Default: the toy target.")
@click.option("--target-engine", default="hf", show_default=True, metavar="NAME", help="Target engine plugin.")
@click.option("--prompts", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSONL conversations; each is cut at its last user turn. Default: the toy target's eval split.")
@click.option("--num-prompts", default=32, show_default=True, help="How many prompts to decode.")
@click.option("--max-new-tokens", default=64, show_default=True, help="Tokens generated per prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON.")
def eval_command(draft: str, target_model: str | None, target_engine: str, prompts: str | None, num_prompts: int,
                 max_new_tokens: int, as_json: bool) -> None:
    """Measure a draft's real acceptance length with speculative decoding.

    Every prompt is decoded twice: by the target alone (greedy) and speculatively with
    the draft. The outputs must be identical token for token (exit status 1 otherwise);
    tau_real is tokens per target verification forward, bonus token included.
    """
    from .export import load_exported_draft
    from .options import build_options
    from .protocols import BuildContext
    from .speculative import measure_acceptance, prompts_from_jsonl

    try:
        manager = get_plugin_manager()
        spec = manager.get("target_engine", target_engine)
        values = {"model": target_model} if target_model else {}
        engine = spec.load_factory()(build_options(spec.options, values, section="target_engine"), BuildContext())
        strategy, model = load_exported_draft(manager, draft, engine)
        if prompts is None:
            default = getattr(engine, "default_data", lambda: None)()
            if default is None:
                raise OptionError("no prompts: pass --prompts FILE (only the toy target ships held-out prompts)")
            prompts = str(default[1])
        prompt_ids = prompts_from_jsonl(prompts, engine.tokenizer, limit=num_prompts)
        if not prompt_ids:
            raise OptionError(f"{prompts} holds no usable prompt (a conversation with a user turn)")
        result = measure_acceptance(strategy, model, engine, prompt_ids, max_new_tokens=max_new_tokens)
    except SpecforgeError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"tau_real {result['tau_real']:.3f} ({result['convention']}) over {result['prompts']} prompts, "
                   f"{result['tokens']} tokens in {result['target_forwards']} target forwards; output identical to "
                   "the target's greedy decode")


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
