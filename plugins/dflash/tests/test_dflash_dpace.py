"""D-PACE loss weighting (``loss_type``) of the dflash strategy: weights, loss, gradients, options."""

import math

import pytest
import torch
import torch.nn.functional as F

from specforge_core.contracts import StepContext
from specforge_core.errors import OptionError
from specforge_core.options import build_options
from specforge_core.protocols import BuildContext, DataStats, TargetInfo

from specforge_plugin_dflash import DFlashOptions
from specforge_plugin_dflash.dpace import LossWeighting, dpace_weights
from specforge_plugin_dflash.strategy import DFlashStrategy

HIDDEN, VOCAB = 16, 50
CUMULATIVE, CONTINUATION = "dpace-cumulative-confidence-only", "dpace-continuation-value-only"


def ce_of(probabilities):
    """Cross-entropies whose label probabilities exp(-CE) are ``probabilities``."""
    return -torch.log(torch.tensor(probabilities, dtype=torch.float64))


# Hand-computed (see each case): p = exp(-CE), s = (1-α)p + α (1 where invalid), P = cumprod(s),
# dpace W_k = Σ_{j≥k} P_j m_j, cumulative W_k = P_k, continuation W_k = Σ_{j≥k} P_j m_j / P_k.
CASES = [
    # α = 0.5, p = [0.8, 0.5, 0.25]: s = [0.9, 0.75, 0.625], P = [0.9, 0.675, 0.421875]
    (0.5, [0.8, 0.5, 0.25], [1, 1, 1],
     {"dpace": [1.996875, 1.096875, 0.421875], CUMULATIVE: [0.9, 0.675, 0.421875], CONTINUATION: [2.21875, 1.625, 1.0]}),
    # the middle label is not supervised: s = [0.9, 1, 0.625], P = [0.9, 0.9, 0.5625]
    (0.5, [0.8, 0.5, 0.25], [1, 0, 1],
     {"dpace": [1.4625, 0.5625, 0.5625], CUMULATIVE: [0.9, 0.9, 0.5625], CONTINUATION: [1.625, 0.625, 1.0]}),
    # α = 0: the raw probabilities, P = [0.8, 0.4, 0.1]
    (0.0, [0.8, 0.5, 0.25], [1, 1, 1],
     {"dpace": [1.3, 0.5, 0.1], CUMULATIVE: [0.8, 0.4, 0.1], CONTINUATION: [1.625, 1.25, 1.0]}),
    # α = 1: every position counts fully, W = the number of supervised positions from k on
    (1.0, [0.8, 0.5, 0.25], [1, 1, 1],
     {"dpace": [3.0, 2.0, 1.0], CUMULATIVE: [1.0, 1.0, 1.0], CONTINUATION: [3.0, 2.0, 1.0]}),
]


@pytest.mark.parametrize("alpha, probabilities, valid, expected", CASES)
@pytest.mark.parametrize("loss_type", ["dpace", CUMULATIVE, CONTINUATION])
def test_weights_match_the_closed_forms_on_hand_computed_blocks(alpha, probabilities, valid, expected, loss_type):
    weights = dpace_weights(ce_of(probabilities), torch.tensor(valid, dtype=torch.bool), alpha=alpha,
                            loss_type=loss_type)
    assert weights.tolist() == pytest.approx(expected[loss_type], rel=1e-6)


def test_blocks_are_weighted_independently_along_every_leading_dimension():
    ce = torch.stack([ce_of([0.8, 0.5, 0.25]), ce_of([0.8, 0.5, 0.25]).flip(0)])[None]  # [1, 2, 3]
    valid = torch.tensor([[[True, True, True], [True, False, True]]])
    weights = dpace_weights(ce, valid, alpha=0.5)
    assert weights[0, 0].tolist() == pytest.approx([1.996875, 1.096875, 0.421875])
    # second block: p = [0.25, 0.5, 0.8] -> s = [0.625, 1, 0.9], P = [0.625, 0.625, 0.5625]
    assert weights[0, 1].tolist() == pytest.approx([1.1875, 0.5625, 0.5625])


def test_continuation_value_stays_finite_where_the_confidence_underflows():
    ce = torch.tensor([200.0, 200.0, 0.0])  # exp(-200) is 0 in float32: P_k = 0 from position 0 on
    weights = dpace_weights(ce, torch.ones(3, dtype=torch.bool), alpha=0.0, loss_type=CONTINUATION)
    assert torch.isfinite(weights).all() and weights.tolist() == pytest.approx([1.0, 2.0, 1.0])


def test_weights_carry_no_gradient():
    ce = ce_of([0.8, 0.5, 0.25]).requires_grad_(True)
    weights = dpace_weights(ce, torch.ones(3, dtype=torch.bool), alpha=0.5)
    assert not weights.requires_grad and weights.grad_fn is None


def test_dflash_is_not_a_dpace_loss_type():
    with pytest.raises(ValueError, match="not a D-PACE loss type"):
        dpace_weights(ce_of([0.5]), torch.ones(1, dtype=torch.bool), alpha=0.5, loss_type="dflash")


# ----------------------------------------------------------------------------- the strategy's loss
def tiny_target():
    gen = torch.Generator().manual_seed(0)
    info = TargetInfo(num_layers=4, hidden_size=HIDDEN, vocab_size=VOCAB,
                      extra={"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
                             "head_dim": 4, "mask_token_id": VOCAB - 1})
    frozen = {"embed_tokens": torch.randn(VOCAB, HIDDEN, generator=gen),
              "lm_head": torch.randn(VOCAB, HIDDEN, generator=gen) / 4}
    return info, frozen


def draft(**options):
    info, frozen = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(**{"block_size": 4, "num_anchors": 3, "num_layers": 1, **options}),
                              BuildContext())
    torch.manual_seed(0)
    model = strategy.build_model(info, frozen, DataStats())
    gen = torch.Generator().manual_seed(3)
    width = strategy.capture_plan(info).features["target_hidden"].shape[1]
    samples = []
    for n in (14, 9, 11):
        mask = torch.ones(n, dtype=torch.long)
        mask[:3] = 0
        samples.append({"input_ids": torch.randint(0, VOCAB - 1, (n,), generator=gen), "loss_mask": mask,
                        "target_hidden": torch.randn(n, width, generator=gen)})
    return strategy, model, strategy.collate(samples, ["a", "b", "c"])


CTX = StepContext(global_step=2, total_steps=10)


def closed_form_weights(ce, valid, alpha, loss_type):
    """The definitions written out with cumprod / cumsum / a division (independent of dpace_weights)."""
    smoothed = torch.where(valid, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
    prefix = torch.cumprod(smoothed, -1)
    value = (prefix * valid).flip(-1).cumsum(-1).flip(-1)
    return {"dpace": value, CUMULATIVE: prefix, CONTINUATION: value / prefix}[loss_type]


@pytest.mark.parametrize("loss_type", ["dpace", CUMULATIVE, CONTINUATION])
def test_loss_is_the_dpace_weighted_cross_entropy_over_the_batch_size(loss_type):
    strategy, model, batch = draft(loss_type=loss_type, dpace_alpha=0.3, logit_chunk_size=2)
    out = strategy.forward_loss(model, batch, CTX)
    with torch.no_grad():
        blocks = strategy.draw_blocks(model, batch, CTX)
        logits = model.logits(strategy.block_hidden(model, batch, blocks))  # [B, N, bs, V], every block at once
        ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none").view(blocks.labels.shape)
        weights = closed_form_weights(ce, blocks.label_mask, 0.3, loss_type)
        expected = (ce * blocks.label_mask * weights).sum() / 3
    assert float(out.loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert out.ratio_metrics["loss"] == pytest.approx((float(expected) * 3, 3.0), rel=1e-5)


def test_the_loss_does_not_depend_on_the_logit_chunk_size():
    losses = []
    for size in (1, 2, 16):
        strategy, model, batch = draft(loss_type="dpace", logit_chunk_size=size)
        losses.append(float(strategy.forward_loss(model, batch, CTX).loss.detach()))
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-6)


def reference_gradient(strategy, model, batch, *, detach):
    """``fc``'s gradient of Σ CE·m·W / B computed over whole blocks, W held constant or trained through."""
    model.zero_grad()
    blocks = strategy.draw_blocks(model, batch, CTX)
    logits = model.logits(strategy.block_hidden(model, batch, blocks))
    ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none").view(blocks.labels.shape)
    weights = closed_form_weights(ce.detach() if detach else ce, blocks.label_mask, 0.5, "dpace")
    ((ce * blocks.label_mask * weights).sum() / 3).backward()
    return model.fc.weight.grad.clone()


def test_no_gradient_flows_through_the_weights():
    strategy, model, batch = draft(loss_type="dpace")
    strategy.forward_loss(model, batch, CTX).loss.backward()
    got = model.fc.weight.grad.clone()
    assert torch.allclose(got, reference_gradient(strategy, model, batch, detach=True), rtol=1e-4, atol=1e-7)
    # (the check can fail: training through the weights gives another gradient)
    assert not torch.allclose(got, reference_gradient(strategy, model, batch, detach=False), rtol=1e-3)


def dflash_loss_before_loss_type(strategy, model, batch):
    """The dflash loss as the strategy computed it before ``loss_type`` existed: autograd through the chunks'
    logits and ``F.cross_entropy``."""
    blocks = strategy.draw_blocks(model, batch, CTX)
    hidden = strategy.block_hidden(model, batch, blocks)
    total = blocks.weights.new_zeros(())
    size = strategy.options.logit_chunk_size
    for start in range(0, blocks.labels.shape[1], size):
        end = min(start + size, blocks.labels.shape[1])
        logits = model.logits(hidden[:, start:end]).float()
        ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels[:, start:end].flatten(), reduction="none")
        total = total + (ce * blocks.weights[..., start:end, :].flatten(-3)).sum(-1)
    weight = blocks.weights.sum()
    return total / torch.where(weight > 0, weight, torch.ones_like(weight))


@pytest.mark.parametrize("gamma", [None, 7.0])
def test_loss_type_dflash_is_the_loss_before_the_option(gamma):
    """The same loss and gradients to float32 rounding (the fused head sums in another order; the dflash
    weighting itself passes everything through untouched, see the next test)."""
    strategy, model, batch = draft(loss_decay_gamma=gamma, logit_chunk_size=2)
    assert strategy.options.loss_type == "dflash"
    loss = strategy.forward_loss(model, batch, CTX).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    reference = dflash_loss_before_loss_type(strategy, model, batch)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    for got, param in zip(grads, [p for p in model.parameters() if p.requires_grad]):
        assert torch.allclose(got, param.grad, rtol=1e-4, atol=1e-6 * float(param.grad.abs().max()))


def test_dflash_weighting_passes_weights_and_normalisation_through_unchanged():
    weighting = LossWeighting()
    weights = torch.tensor([[0.0, 1.0, 0.5]])
    assert weighting.reweight(torch.ones(1, 3), weights) is weights
    assert weighting.position_weights(weights, weights > 0) is weights
    loss, denominator = weighting.normalize(torch.tensor(3.0), weights, batch_size=7)
    assert float(loss) == 2.0 and denominator == 1.5


# ----------------------------------------------------------------------------- options
def test_loss_type_and_alpha_are_validated_naming_the_option():
    with pytest.raises(OptionError, match="strategy.loss_type.*dflash, dpace, dpace-cumulative-confidence-only"):
        build_options(DFlashOptions, {"loss_type": "dpace_p"}, section="strategy")
    with pytest.raises(OptionError, match="strategy.dpace_alpha' must be between 0 and 1; got 1.5"):
        build_options(DFlashOptions, {"loss_type": "dpace", "dpace_alpha": 1.5}, section="strategy")
    options = build_options(DFlashOptions, {"loss_type": CONTINUATION, "dpace_alpha": "0.25"}, section="strategy")
    assert (options.loss_type, options.dpace_alpha) == (CONTINUATION, 0.25)


def test_a_decay_with_a_dpace_loss_is_refused_saying_what_to_change():
    with pytest.raises(OptionError, match=r"loss_decay_gamma' \(7.0\) weights positions for loss_type=dflash only.*"
                                          r"unset strategy.loss_decay_gamma or set strategy.loss_type=dflash"):
        build_options(DFlashOptions, {"loss_type": "dpace", "loss_decay_gamma": 7}, section="strategy")


def test_alpha_one_dpace_weights_each_position_by_the_supervised_positions_left_in_its_block():
    strategy, model, batch = draft(loss_type="dpace", dpace_alpha=1.0)
    with torch.no_grad():
        out = strategy.forward_loss(model, batch, CTX)
        blocks = strategy.draw_blocks(model, batch, CTX)
        logits = model.logits(strategy.block_hidden(model, batch, blocks))
        ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none").view(blocks.labels.shape)
        mask = blocks.label_mask.double()
        left = mask.flip(-1).cumsum(-1).flip(-1)
    assert float(out.loss) == pytest.approx(float((ce * mask * left).sum() / 3), rel=1e-5)
    assert not math.isnan(float(out.loss))
