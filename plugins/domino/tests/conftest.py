"""Fixtures of the domino plugin's tests: one thread per test, the tiny toy target, small drafts."""

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specforge_core.protocols import BuildContext, DataStats, TargetInfo  # noqa: E402
from specforge_plugin_domino import DominoOptions  # noqa: E402
from specforge_plugin_domino.strategy import DominoStrategy  # noqa: E402

HIDDEN, VOCAB, LAYERS = 32, 97, 8


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread for these tests and their session fixtures (the toy target's build
    too): the models are tiny, and on a shared machine several threads per process spin against
    each other (building the toy target took 60 s instead of 4)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_target(vocab=VOCAB):
    """A small Llama-shaped target description and random frozen parts (no model behind them)."""
    gen = torch.Generator().manual_seed(0)
    info = TargetInfo(num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=vocab, dtype="float32", model_id="random",
                      extra={"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                             "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
                             "mask_token_id": vocab - 1})
    frozen = {"embed_tokens": torch.randn(vocab, HIDDEN, generator=gen),
              "lm_head": torch.randn(vocab, HIDDEN, generator=gen) / math.sqrt(HIDDEN)}
    return info, frozen


def _make_draft(info=None, frozen=None, *, perturb=True, **options):
    """(strategy, model) of a small Domino draft; ``perturb`` moves the weights off their initial values."""
    if info is None:
        info, frozen = _random_target()
    strategy = DominoStrategy(DominoOptions(**{"block_size": 4, "num_layers": 2, "num_target_layers": 3,
                                               "emb_dim": 16, **options}), BuildContext())
    torch.manual_seed(0)
    model = strategy.build_model(info, frozen, DataStats())
    if perturb:
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.2)
    return strategy, model


@pytest.fixture
def random_target():
    """``random_target(vocab=97) -> (TargetInfo, frozen parts)``: a random 8-layer target, H=32, no model behind it."""
    return _random_target


@pytest.fixture
def make_draft():
    """``make_draft(info=None, frozen=None, *, perturb=True, **options) -> (strategy, model)``: a small Domino draft
    (block 4, 2 layers, 3 target layers, e=16) over ``random_target()`` unless a target is given."""
    return _make_draft


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny toy target (a trained 4-layer Llama, H=32, V=384), built once per session."""
    from specforge_plugin_hf.toy import build_toy_target

    return build_toy_target(tmp_path_factory.mktemp("toy") / "tiny", "tiny", progress=False)


@pytest.fixture(scope="session")
def engine(tiny):
    """The hf target engine over the tiny toy target, on CPU in float32."""
    from specforge_plugin_hf import HFEngineOptions
    from specforge_plugin_hf.engine import HFTargetEngine

    return HFTargetEngine(HFEngineOptions(model=str(tiny), dtype="float32", device="cpu"), BuildContext())
