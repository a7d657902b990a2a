"""Every hook a specforge plugin can implement, in one file.

A plugin is a module of ``@hookimpl`` functions named after these specs, reached through an
entry point in the ``specforge`` group. All hooks collect from every plugin (none is
"first result"). An implementation may accept fewer arguments than the spec declares: hooks
evolve by adding arguments, so write only the ones you use.

Collection hooks return an iterable of typed specs (see :mod:`specforge_core.specs`). They
must stay cheap: name the implementation lazily in ``factory`` and import nothing heavy at
module level, because ``specforge plugins`` and ``specforge --help`` call them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import pluggy

if TYPE_CHECKING:
    import click

    from .specs import ControlPlaneSpec, FeatureStoreSpec, StrategySpec, TargetEngineSpec

hookspec = pluggy.HookspecMarker("specforge")


@hookspec
def specforge_strategies() -> Iterable[StrategySpec]:
    """Return the draft algorithms this plugin provides.

    Called once per process when the plugin set is resolved. Each name must be unique
    across all installed plugins; a clash is an error naming both distributions.

    Example::

        @hookimpl
        def specforge_strategies():
            return [StrategySpec(
                name="example",
                factory="specforge_plugin_example.strategy:ExampleStrategy",
                options=ExampleOptions,
                description="A one-layer draft for trying the plugin path.",
                requires={"last_hidden"},
            )]
    """


@hookspec
def specforge_target_engines() -> Iterable[TargetEngineSpec]:
    """Return the target engines (what runs the target model) this plugin provides.

    ``capabilities`` tells strategies what the engine can produce: e.g.
    ``"aux_hidden_states"``, ``"last_hidden"``, ``"verify"``. A strategy whose
    ``requires`` is not covered is refused before any model is loaded.

    Example::

        @hookimpl
        def specforge_target_engines():
            return [TargetEngineSpec(
                name="hf", factory="specforge_plugin_hf.engine:HFTargetEngine",
                options=HFOptions, capabilities={"aux_hidden_states", "last_hidden", "verify"},
            )]
    """


@hookspec
def specforge_feature_stores() -> Iterable[FeatureStoreSpec]:
    """Return the feature stores (where captured feature tensors live) this plugin provides.

    The factory is called with the validated options and returns an object with
    ``put``, ``get``, ``release``, ``abort``, ``stats`` and ``close``; subclass
    ``specforge_core.testing.FeatureStoreConformance`` to test it.

    Example::

        @hookimpl
        def specforge_feature_stores():
            return [FeatureStoreSpec(
                name="mooncake", factory="specforge_plugin_mooncake.store:MooncakeStore",
                options=MooncakeOptions, capabilities={"cross_process", "consume_once"},
            )]
    """


@hookspec
def specforge_control_planes() -> Iterable[ControlPlaneSpec]:
    """Return the control planes (sample metadata, acks, ref channels) this plugin provides.

    The factory is called with the validated options and returns a control plane with a
    ``metadata`` store and a ``channel``; subclass
    ``specforge_core.testing.ControlPlaneConformance`` to test it.

    Example::

        @hookimpl
        def specforge_control_planes():
            return [ControlPlaneSpec(
                name="redis", factory="specforge_plugin_redis.plane:RedisControlPlane",
                options=RedisOptions, capabilities={"durable", "cross_process"},
            )]
    """


@hookspec
def specforge_run_started(run_id: str, output_dir: str, config: dict[str, Any]) -> None:
    """Called once, on every rank, after components are resolved and before training starts.

    ``config`` is the resolved run configuration (plain JSON data).

    Example::

        @hookimpl
        def specforge_run_started(run_id, config):
            tracker.start(run_id, params=config)
    """


@hookspec
def specforge_step_end(run_id: str, global_step: int, metrics: dict[str, float]) -> None:
    """Called on rank 0 after every optimizer update with that step's reduced metrics.

    ``global_step`` counts optimizer updates; ``metrics`` holds loss, lr, grad_norm,
    tokens_per_s, data_wait_fraction and the strategy's own metrics.

    Example::

        @hookimpl
        def specforge_step_end(global_step, metrics):
            tracker.log(metrics, step=global_step)
    """


@hookspec
def specforge_eval_end(run_id: str, global_step: int, metrics: dict[str, float]) -> None:
    """Called on rank 0 after each evaluation on the eval split, with its pooled metrics.

    ``metrics`` holds the strategy's eval metrics without a prefix: ``loss``,
    ``accept_len_sim`` (the simulated acceptance length, bonus token included),
    ``accept_rate_k``, and the strategy's own.

    Example::

        @hookimpl
        def specforge_eval_end(global_step, metrics):
            tracker.log({f"eval/{k}": v for k, v in metrics.items()}, step=global_step)
    """


@hookspec
def specforge_checkpoint_saved(run_id: str, global_step: int, path: str) -> None:
    """Called on rank 0 after a checkpoint directory has been atomically put in place.

    Example::

        @hookimpl
        def specforge_checkpoint_saved(path):
            uploader.copy_tree(path)
    """


@hookspec
def specforge_run_finished(run_id: str, output_dir: str, summary: dict[str, Any]) -> None:
    """Called once on rank 0 when a run ends normally, with the contents of ``summary.json``.

    Example::

        @hookimpl
        def specforge_run_finished(summary):
            notify(f"run done, loss {summary['final']['loss']:.3f}")
    """


@hookspec
def specforge_add_commands(cli: click.Group) -> None:
    """Add sub-commands to the ``specforge`` command line.

    Called while the CLI is assembled; keep the command's imports inside its body so
    ``specforge --help`` stays fast.

    Example::

        @hookimpl
        def specforge_add_commands(cli):
            @cli.command(name="example-hello")
            def hello():
                "Say hello from the example plugin."
                click.echo("hello")
    """
