"""The shared draft layers and helpers in specforge_core.nn and specforge_core.hfconfig."""

import math

import pytest
import torch

from specforge_core.hfconfig import config_value, rope_theta
from specforge_core.nn import RMSNorm, SwiGLU, apply_rope, rope_cos_sin


@pytest.mark.parametrize(("config", "theta"), [
    ({"rope_theta": 500000.0}, 500000.0),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}, 1000000.0),
    ({"rope_theta": 5.0, "rope_parameters": {"rope_theta": 7.0}}, 5.0),  # the flat key wins
    ({"rope_parameters": None}, 10000.0),
    ({}, 10000.0),
])
def test_rope_theta_reads_both_config_styles(config, theta):
    assert rope_theta(config) == theta


def test_config_value_treats_null_as_missing_but_keeps_falsy_values():
    config = {"head_dim": None, "num_key_value_heads": 0, "rms_norm_eps": 1e-5}
    assert config_value(config, "head_dim", 64) == 64
    assert config_value(config, "absent", 7) == 7
    assert config_value(config, "num_key_value_heads", 8) == 0
    assert config_value(config, "rms_norm_eps", 1e-6) == 1e-5


def test_rope_tables_match_the_closed_form():
    cos, sin = rope_cos_sin(torch.tensor([0, 3]), head_dim=4, theta=100.0)
    assert cos.shape == sin.shape == (2, 4) and cos.dtype == torch.float32
    assert torch.equal(cos[0], torch.ones(4)) and torch.equal(sin[0], torch.zeros(4))
    # frequencies 1 and 1/10 for head_dim 4, theta 100; the half-split layout repeats them
    angles = [3.0, 0.3, 3.0, 0.3]
    assert cos[1].tolist() == pytest.approx([math.cos(a) for a in angles], abs=1e-6)
    assert sin[1].tolist() == pytest.approx([math.sin(a) for a in angles], abs=1e-6)


def test_rope_tables_keep_leading_dimensions():
    cos, _ = rope_cos_sin(torch.arange(6).view(2, 3), head_dim=8, theta=10000.0)
    assert cos.shape == (2, 3, 8)


def test_apply_rope_rotates_each_half_pair_by_its_angle():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # pairs (x0, x2) and (x1, x3)
    cos, sin = rope_cos_sin(torch.tensor([2]), head_dim=4, theta=100.0)
    out = apply_rope(x, cos, sin)
    a, b = 2.0, 0.2
    expected = [1 * math.cos(a) - 3 * math.sin(a), 2 * math.cos(b) - 4 * math.sin(b),
                3 * math.cos(a) + 1 * math.sin(a), 4 * math.cos(b) + 2 * math.sin(b)]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert torch.linalg.vector_norm(out).item() == pytest.approx(torch.linalg.vector_norm(x).item(), rel=1e-6)


def test_apply_rope_returns_the_input_dtype_and_is_identity_at_position_zero():
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.zeros(3, dtype=torch.long), head_dim=8, theta=10000.0)
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16 and torch.equal(out, x)


def test_rmsnorm_and_swiglu_follow_their_formulas():
    x = torch.tensor([[3.0, 4.0]])
    norm = RMSNorm(2, eps=0.0)
    assert norm(x)[0].tolist() == pytest.approx([3 / math.sqrt(12.5), 4 / math.sqrt(12.5)])
    mlp = SwiGLU(2, 3)
    with torch.no_grad():
        for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            layer.weight.fill_(0.5)
    gate = up = 0.5 * 7.0  # each of the 3 hidden units sees 0.5 * (3 + 4)
    hidden = gate / (1 + math.exp(-gate)) * up
    assert mlp(x)[0].tolist() == pytest.approx([0.5 * 3 * hidden] * 2, rel=1e-6)
    assert sorted(name for name, _ in mlp.named_parameters()) == ["down_proj.weight", "gate_proj.weight",
                                                                 "up_proj.weight"]
