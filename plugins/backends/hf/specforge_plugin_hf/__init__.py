"""specforge-plugin-hf: the ``hf`` target engine (transformers causal LMs) and the toy target.

This module is what the ``specforge`` entry point loads, so it stays cheap: no torch or
transformers import here. The engine lives in :mod:`specforge_plugin_hf.engine` and the
toy target in :mod:`specforge_plugin_hf.toy`, both imported only when used.
"""

import attrs

from specforge_core import hookimpl
from specforge_core.options import option, positive
from specforge_core.specs import TargetEngineSpec

__version__ = "0.1.0"


@attrs.frozen
class HFEngineOptions:
    """Options of the ``hf`` target engine."""

    model: str | None = option(None, "Local folder (or hub id, with network) of a causal LM. None uses the "
                                     "toy target, built once and cached.")
    dtype: str = option("auto", "Target weights dtype. auto: float32 on CPU; on CUDA the checkpoint's "
                                "float16/bfloat16, else bfloat16.",
                        choices=("auto", "float32", "bfloat16", "float16"))
    device: str = option("auto", "Where the target runs (auto: CUDA when available).", choices=("auto", "cpu", "cuda"))
    capture_batch_size: int = option(8, "Sequences per capture forward.", check=positive)
    attn_implementation: str = option(
        "auto", "Attention kernel. auto: batch_invariant on CPU (a padded batch captures exactly what each "
                "sample alone would), sdpa on CUDA; eager instead where the model's attention needs it (logit "
                "softcapping, attention sinks). A kernel that cannot run the model is refused when it loads.",
        choices=("auto", "batch_invariant", "eager", "sdpa", "flash_attention_2"))
    toy_variant: str = option("default", "Which toy target serves when model is None (tiny: for tests).",
                              choices=("default", "tiny"))


@hookimpl
def specforge_target_engines():
    return [
        TargetEngineSpec(
            name="hf",
            factory="specforge_plugin_hf.engine:HFTargetEngine",
            options=HFEngineOptions,
            capabilities={"aux_hidden_states", "last_hidden", "frozen_parts", "verify", "generate"},
            train_suggestions="specforge_plugin_hf.suggestions:suggested_train_options",
            description="Runs a transformers causal LM in-process and captures its hidden states.",
        )
    ]


@hookimpl
def specforge_add_commands(cli):
    import click

    @cli.command(name="toy-target")
    @click.option("--output", "output", required=True, type=click.Path(file_okay=False),
                  help="New or empty folder to write the toy target into (a folder already holding this very "
                       "toy target is left as it is).")
    @click.option("--variant", type=click.Choice(["default", "tiny"]), default="default", show_default=True,
                  help="default: the embedded target (about two minutes on CPU); tiny: a second, for tests.")
    def toy_target(output, variant):
        """Build the toy target: a small Llama trained on CPU on generated conversations.

        The folder holds a transformers model and tokenizer (with its chat template) plus
        the train.jsonl / eval.jsonl conversations it learned. Use it to try the pipeline
        (--set target_engine.model=DIR); it is not a useful language model.
        """
        from specforge_core.errors import SpecforgeError

        from .toy import build_toy_target, read_manifest

        try:
            folder = build_toy_target(output, variant)
        except SpecforgeError as exc:  # as every specforge command reports a refusal
            click.echo(f"error: {exc}", err=True)
            raise SystemExit(1) from None
        metrics = read_manifest(folder)["metrics"]
        click.echo(f"toy target ({variant}) in {folder}: eval loss {metrics['eval_loss']:.3f} nats/token "
                   f"(uniform would be {metrics['log_vocab']:.3f})")
