"""Test helpers for DFlash and the strategies built on it (Domino, DSpark): a small random target, drafts over it.

    info, frozen = random_target()                       8 layers, H = 32, V = 97, 4 heads / 2 kv, no model behind
    strategy, model = small_draft(DominoStrategy, DominoOptions, emb_dim=16)

and pytest fixtures a plugin's ``tests/conftest.py`` imports to use (``from
specforge_plugin_dflash.testing import one_torch_thread, random_target_fixture as random_target,
tiny, engine``): one torch thread per test session, the random target, and the tiny toy target
with the ``hf`` engine over it (those two need specforge-plugin-hf). Imports torch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import pytest
import torch

from specforge_core.protocols import BuildContext, DataStats, TargetInfo

HIDDEN, VOCAB, LAYERS = 32, 97, 8
#: The small draft :func:`small_draft` builds unless told otherwise: block 4, 2 layers over 3 target layers.
SMALL = {"block_size": 4, "num_layers": 2, "num_target_layers": 3}


def random_target(vocab: int = VOCAB) -> tuple[TargetInfo, dict[str, torch.Tensor]]:
    """A small Llama-shaped target description and random frozen parts (seeded; no model behind them)."""
    gen = torch.Generator().manual_seed(0)
    info = TargetInfo(num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=vocab, dtype="float32", model_id="random",
                      extra={"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                             "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
                             "mask_token_id": vocab - 1})
    frozen = {"embed_tokens": torch.randn(vocab, HIDDEN, generator=gen),
              "lm_head": torch.randn(vocab, HIDDEN, generator=gen) / math.sqrt(HIDDEN)}
    return info, frozen


def small_draft(strategy_class: type, options_class: type, info: TargetInfo | None = None,
                frozen: dict[str, torch.Tensor] | None = None, *, perturb: bool = True, **options: Any) -> tuple[Any, Any]:
    """``(strategy, model)``: a :data:`SMALL` draft of ``strategy_class`` (``options`` override) over ``info``
    and ``frozen`` (default :func:`random_target`); ``perturb`` moves the weights off their initial values,
    seeded, so heads initialised near zero still change the outputs."""
    if info is None:
        info, frozen = random_target()
    strategy = strategy_class(options_class(**{**SMALL, **options}), BuildContext())
    torch.manual_seed(0)
    model = strategy.build_model(info, frozen, DataStats())
    if perturb:
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.2)
    return strategy, model


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the session (its fixtures too, the toy target's build included): the models are
    tiny, and on a shared machine several threads per process spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def random_target_fixture() -> Callable[..., tuple[TargetInfo, dict[str, torch.Tensor]]]:
    """``random_target(vocab=97) -> (TargetInfo, frozen parts)`` (:func:`random_target`)."""
    return random_target


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny toy target (a trained 4-layer Llama, H=32, V=384), built once per session (specforge-plugin-hf)."""
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="session")
def engine(tiny: Any) -> Any:
    """The hf target engine over the tiny toy target, on CPU in float32."""
    from specforge_plugin_hf import HFEngineOptions
    from specforge_plugin_hf.engine import HFTargetEngine

    return HFTargetEngine(HFEngineOptions(model=str(tiny), dtype="float32", device="cpu"), BuildContext())


def random_batch(strategy: Any, info: TargetInfo, lengths: tuple[int, ...] = (23, 9, 30), *, seed: int = 3,
                 extra: dict[str, int] | None = None) -> Any:
    """A collated batch of random samples of ``lengths`` for ``strategy`` over ``info`` (the first third of each
    sample is an unsupervised prompt); ``extra`` names further floating features and their widths (DSpark's
    ``last_hidden``)."""
    gen = torch.Generator().manual_seed(seed)
    width = strategy.capture_plan(info).features["target_hidden"].shape[1]
    samples = []
    for length in lengths:
        mask = torch.ones(length, dtype=torch.long)
        mask[: length // 3] = 0
        sample = {"input_ids": torch.randint(0, info.vocab_size - 1, (length,), generator=gen), "loss_mask": mask,
                  "target_hidden": torch.randn(length, width, generator=gen)}
        sample.update({name: torch.randn(length, size, generator=gen) for name, size in (extra or {}).items()})
        samples.append(sample)
    return strategy.collate(samples, [f"s{i}" for i in range(len(samples))])


#: (dtype, relative loss tolerance, gradient tolerance relative to the largest gradient) for
#: :func:`grouped_vs_dense`: float32 to its rounding; bfloat16 to two of its ulps (2^-6) of the largest
#: gradient, since the two paths round differently (on CPU the grouped one computes its attention in
#: float32 and rounds once) and each is about one ulp from the exact step.
GROUPED_TOLERANCES = [("float32", 1e-6, 1e-5), ("bfloat16", 1e-3, 2.0 ** -6)]


def grouped_vs_dense(strategy_class: type, options_class: type, dtype: str, *, group_blocks: int,
                     extra: dict[str, int] | None = None, **options: Any) -> dict[str, float]:
    """One training step's loss and gradients with the block attention in groups of ``group_blocks`` blocks
    against the dense mask (``attention_group_blocks=0``), same weights and batch: ``{"loss", "loss_diff",
    "grad_max", "grad_diff"}`` (the dense path's values, and the largest absolute differences)."""
    import attrs

    from specforge_core.contracts import StepContext

    strategy, model = small_draft(strategy_class, options_class, dtype=dtype, num_anchors=5, **options)
    batch = random_batch(strategy, random_target()[0], extra=extra)
    results = []
    for group in (0, group_blocks):
        strategy.options = attrs.evolve(strategy.options, attention_group_blocks=group)
        model.zero_grad(set_to_none=True)
        loss = strategy.forward_loss(model, batch, StepContext(global_step=4, total_steps=10)).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        results.append((float(loss.detach()), grads))
    (dense_loss, dense_grads), (loss, grads) = results
    return {"loss": dense_loss, "loss_diff": abs(loss - dense_loss), "grad_max": float(dense_grads.abs().max()),
            "grad_diff": float((grads - dense_grads).abs().max())}
