"""``strategy.compile``: the decoder layer under torch.compile gives the eager step's loss and gradients,
keeps its parameter names and does not recompile for new lengths."""

import torch

from specforge_core.contracts import StepContext
from specforge_core.options import build_options
from specforge_core.protocols import DataStats
from specforge_core.testing.compiled import check_compiled_step
from specforge_plugin_eagle3 import Eagle3Options
from specforge_plugin_eagle3.strategy import Eagle3Strategy

from specforge_plugin_eagle3.testing import tiny_batch, tiny_target


def build(**options):
    info, frozen = tiny_target(vocab=23, hidden=32)
    strategy = Eagle3Strategy(Eagle3Options(ttt_length=3, **options))
    torch.manual_seed(0)
    return info, strategy, strategy.build_model(info, frozen, DataStats())


def test_compiled_layer_gives_the_eager_loss_and_gradients_without_recompiling_for_new_lengths():
    info, strategy, eager = build()
    _, _, compiled = build(compile=True)
    batches = [tiny_batch(strategy, info, lengths=lengths, seed=seed)[1]
               for seed, lengths in enumerate([(12, 9), (20, 15), (17, 16)])]
    losses = check_compiled_step(lambda model, batch: strategy.forward_loss(model, batch, StepContext(global_step=0)).loss,
                                 eager, compiled, batches)
    assert min(losses) > 1.0


def test_compile_option_defaults_to_off():
    assert build_options(Eagle3Options, {}, section="strategy").compile is False
