"""``strategy.compile``: the decoder layers under torch.compile give the eager step's loss and gradients,
keep their parameter names, do not recompile for new lengths, and a CPU without a C++ compiler is refused
before a run starts."""

import os
import subprocess
import sys

import pytest
import torch

from specforge_core.contracts import StepContext
from specforge_core.errors import OptionError
from specforge_core.options import build_options
from specforge_core.testing.compiled import check_compiled_step
from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.strategy import DFlashStrategy
from specforge_plugin_dflash.testing import HIDDEN, SMALL, VOCAB, small_draft


def make_batch(strategy, lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    width = SMALL["num_target_layers"] * HIDDEN
    samples = []
    for length in lengths:
        loss_mask = torch.ones(length, dtype=torch.long)
        loss_mask[:4] = 0  # a prompt
        samples.append({"input_ids": torch.randint(0, VOCAB - 1, (length,), generator=gen), "loss_mask": loss_mask,
                        "target_hidden": torch.randn(length, width, generator=gen)})
    return strategy.collate(samples, [f"s{seed}-{i}" for i in range(len(lengths))])


def test_compiled_layers_give_the_eager_loss_and_gradients_without_recompiling_for_new_lengths():
    strategy, eager = small_draft(DFlashStrategy, DFlashOptions, num_anchors=3, num_layers=1)
    _, compiled = small_draft(DFlashStrategy, DFlashOptions, num_anchors=3, num_layers=1, compile=True)
    assert all(torch.equal(compiled.state_dict()[k], v) for k, v in eager.state_dict().items())
    batches = [make_batch(strategy, lengths, seed) for seed, lengths in enumerate([(24, 17), (40, 33), (31, 29)])]
    losses = check_compiled_step(lambda model, batch: strategy.forward_loss(model, batch, StepContext(global_step=0)).loss,
                                 eager, compiled, batches)
    assert min(losses) > 1.0  # real losses over real blocks


def test_compile_option_is_refused_on_a_cpu_without_a_cpp_compiler(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("CXX", None)
    code = ("from specforge_core.options import build_options\n"
            "from specforge_plugin_dflash import DFlashOptions\n"
            "build_options(DFlashOptions, {'compile': True}, section='strategy')\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("OptionError: option 'strategy.compile' needs a C++ compiler on CPU (torch.compile builds C++ kernels "
            "there) and none was found (InvalidCxxCompiler): install g++ (or point CXX at one) or set it to false; "
            "got True") in done.stderr


def test_compile_option_off_or_with_a_compiler_is_accepted():
    assert build_options(DFlashOptions, {}, section="strategy").compile is False
    assert build_options(DFlashOptions, {"compile": True}, section="strategy").compile is True
    with pytest.raises(OptionError, match="option 'strategy.compile'"):
        build_options(DFlashOptions, {"compile": "sometimes"}, section="strategy")
