"""The dual loss L = (1-λ)·final + λ·base, its metrics, and the head's shapes and gradients."""

import pytest
import torch
import torch.nn.functional as F

from specforge_core.contracts import StepContext
from specforge_plugin_dflash.loss import acceptance_lengths

SAMPLES = 3


def batch_for(strategy, lengths=(14, 9, 17)):
    gen = torch.Generator().manual_seed(5)
    samples = []
    for length in lengths:
        mask = torch.ones(length, dtype=torch.long)
        mask[: length // 3] = 0
        samples.append({"input_ids": torch.randint(3, 90, (length,), generator=gen), "loss_mask": mask,
                        "target_hidden": torch.randn(length, 96, generator=gen)})
    return strategy.collate(samples, [f"s{i}" for i in range(len(samples))])


def reference(strategy, model, batch, ctx):
    """Σw·CE of both heads, accuracies and acceptance, from full (unchunked) logits."""
    head = model.head_config
    blocks = strategy.draw_blocks(model, batch, ctx, label_shift=head.label_shift)
    hidden = strategy.block_hidden(model, batch, blocks)
    base = model.logits(hidden)
    final = model.final_logits(base, hidden, model.block_states(blocks.tokens))
    out = {"weight": float(blocks.weights.sum())}
    for name, logits in (("base", base), ("final", final)):
        ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none")
        out[f"{name}_ce"] = (ce * blocks.weights.flatten()).sum()
        correct = (logits.argmax(-1) == blocks.labels) & blocks.label_mask
        out[f"{name}_acc"] = float(correct.sum()) / float(blocks.label_mask.sum())
        accepted = acceptance_lengths(correct, label_shift=head.label_shift)[blocks.keep]
        out[f"{name}_accept"] = float(accepted.float().mean())
    return out


@pytest.mark.parametrize("shift_label", [True, False])
@pytest.mark.parametrize("step", [0, 2, 4, 7])
def test_loss_is_one_minus_lambda_final_plus_lambda_base(make_draft, shift_label, step):
    strategy, model = make_draft(shift_label=shift_label, num_anchors=4, loss_decay_gamma=3.0, logit_chunk_size=3)
    batch = batch_for(strategy)
    ctx = StepContext(global_step=step, total_steps=8)  # window floor(8 * 0.5) = 4
    lam = max(0.0, 1.0 - step / 4)
    with torch.no_grad():
        out = strategy.forward_loss(model, batch, ctx)
        ref = reference(strategy, model, batch, ctx)
    weight = ref["weight"]
    assert out.metrics == {"lambda": pytest.approx(lam)}
    expected = ((1 - lam) * ref["final_ce"] + lam * ref["base_ce"]) / weight
    assert float(out.loss) == pytest.approx(float(expected), rel=1e-5)
    ratios = out.ratio_metrics
    assert ratios["final_loss"][1] == ratios["base_loss"][1] == pytest.approx(weight)
    assert ratios["final_loss"][0] == pytest.approx(float(ref["final_ce"]), rel=1e-5)
    assert ratios["base_loss"][0] == pytest.approx(float(ref["base_ce"]), rel=1e-5)
    assert ratios["final_loss"][0] != ratios["base_loss"][0]  # the correction is not zero
    for name, key in (("acc", "final_acc"), ("base_acc", "base_acc"), ("accept_len", "final_accept"),
                      ("base_accept_len", "base_accept")):
        assert ratios[name][0] / ratios[name][1] == pytest.approx(ref[key]), name
    assert ratios["no_anchor_samples"] == (0.0, float(SAMPLES))


@pytest.mark.parametrize("loss_type", ["dpace", "dpace-continuation-value-only"])
@pytest.mark.parametrize("shift_label", [True, False])
def test_dpace_weights_each_head_by_its_own_confidence_over_the_batch_size(make_draft, loss_type, shift_label):
    strategy, model = make_draft(shift_label=shift_label, num_anchors=4, logit_chunk_size=3, loss_type=loss_type,
                                 dpace_alpha=0.4)
    batch = batch_for(strategy)
    ctx = StepContext(global_step=1, total_steps=8)  # λ = 0.75
    with torch.no_grad():
        out = strategy.forward_loss(model, batch, ctx)
        head = model.head_config
        blocks = strategy.draw_blocks(model, batch, ctx, label_shift=head.label_shift)
        hidden = strategy.block_hidden(model, batch, blocks)
        base = model.logits(hidden)
        final = model.final_logits(base, hidden, model.block_states(blocks.tokens))
        sums = {}
        for name, logits in (("base", base), ("final", final)):
            ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none").view(
                blocks.labels.shape)
            valid = blocks.label_mask
            prefix = torch.cumprod(torch.where(valid, 0.6 * torch.exp(-ce) + 0.4, torch.ones_like(ce)), -1)
            value = (prefix * valid).flip(-1).cumsum(-1).flip(-1)
            weights = value if loss_type == "dpace" else value / prefix
            sums[name] = float((ce * valid * weights).sum())
    assert float(out.loss) == pytest.approx((0.25 * sums["final"] + 0.75 * sums["base"]) / SAMPLES, rel=1e-5)
    assert out.ratio_metrics["final_loss"] == pytest.approx((sums["final"], SAMPLES), rel=1e-5)
    assert out.ratio_metrics["base_loss"] == pytest.approx((sums["base"], SAMPLES), rel=1e-5)


def test_the_loss_does_not_depend_on_the_logit_chunk_size(make_draft):
    outputs = []
    for chunk in (1, 2, 16):
        strategy, model = make_draft(num_anchors=5, logit_chunk_size=chunk)
        with torch.no_grad():
            outputs.append(strategy.forward_loss(model, batch_for(strategy), StepContext(global_step=1, total_steps=8)))
    for out in outputs[1:]:
        assert float(out.loss) == pytest.approx(float(outputs[0].loss), rel=1e-6)
        assert out.ratio_metrics["acc"] == outputs[0].ratio_metrics["acc"]


def head_grads(strategy, model, ctx):
    model.zero_grad(set_to_none=True)
    strategy.forward_loss(model, batch_for(strategy), ctx).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def test_while_lambda_is_one_only_the_base_trains_and_without_a_horizon_the_head_trains(make_draft):
    strategy, model = make_draft(num_anchors=4)
    grads = head_grads(strategy, model, StepContext(global_step=0, total_steps=10))  # λ = 1
    head = {n: g for n, g in grads.items() if n.startswith(("prefix_gru.", "embed_proj."))}
    assert set(head) == {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight",
                         "embed_proj.2.weight"}
    assert all(g is not None and not g.any() for g in head.values())
    assert grads["fc.weight"].abs().sum() > 0
    grads = head_grads(strategy, model, StepContext(global_step=0, total_steps=None))  # λ = 0
    assert all(grads[n].abs().sum() > 0 for n in head)


def test_head_shapes_follow_h_g_e_and_v(make_draft):
    _strategy, model = make_draft(gru_hidden_dim=24, emb_dim=16)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {n: s for n, s in shapes.items() if n.startswith(("prefix_gru.", "embed_proj."))} == {
        "prefix_gru.weight_ih_l0": (3 * 24, 32), "prefix_gru.weight_hh_l0": (3 * 24, 24),
        "embed_proj.0.weight": (16, 32 + 24), "embed_proj.2.weight": (97, 16)}
    tokens = torch.randint(0, 97, (2, 5, 4))  # [B, N, bs]
    hidden = torch.randn(2, 5, 4, 32)
    with torch.no_grad():
        states = model.block_states(tokens)
        final = model.final_logits(model.logits(hidden), hidden, states)
    assert states.shape == (2, 5, 4, 24) and final.shape == (2, 5, 4, 97) and final.dtype == torch.float32


def test_acceptance_counts_the_drafted_positions_of_each_alignment():
    correct = torch.tensor([[[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 0]]], dtype=torch.bool)  # [1, 3, bs=4]
    assert acceptance_lengths(correct, label_shift=0).tolist() == [[2, 4, 3]]  # positions 1..3
    assert acceptance_lengths(correct, label_shift=1).tolist() == [[3, 1, 4]]  # positions 0..2


def test_grouped_weights_give_each_loss_its_weighted_sum_in_one_pass():
    from specforge_plugin_dflash.loss import chunked_cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 3, 11, generator=gen, requires_grad=True)  # [B, N, bs, V]
    labels = torch.randint(0, 11, (2, 5, 3), generator=gen)
    weights = torch.rand(2, 2, 5, 3, generator=gen)  # [G, B, N, bs]
    sums, predictions = chunked_cross_entropy(lambda a, b: logits[:, a:b], labels, weights, 2)
    singles = [chunked_cross_entropy(lambda a, b: logits[:, a:b], labels, w, 2)[0] for w in weights]
    assert sums.shape == (2,) and torch.allclose(sums, torch.stack(singles))
    assert torch.equal(predictions, logits.argmax(-1))
    sums.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_collate_refuses_a_sample_without_a_feature_naming_it_and_the_features_it_has(make_draft):
    from specforge_core.data.collate import CollateError

    strategy, _model = make_draft()
    sample = {"input_ids": torch.arange(5), "target_hidden": torch.zeros(5, 96)}
    with pytest.raises(CollateError, match=r"^sample 's0' lacks feature\(s\) \['loss_mask'\] \(it has \['input_ids', "
                                           r"'target_hidden'\]\); it was not captured with the domino capture plan: "
                                           r"capture it again with --strategy domino$"):
        strategy.collate([sample], ["s0"])


@pytest.mark.parametrize("step", [2, 5])  # λ = 0.75, then 0.375 (total 8 steps)
@pytest.mark.parametrize("chunk", [2, 16])  # several chunks, one chunk
def test_the_losss_gradients_are_the_written_out_losss(make_draft, chunk, step):
    """The fused heads (head_loss.py) give every parameter the gradient autograd gives the loss written out
    over whole blocks."""
    ctx = StepContext(global_step=step, total_steps=8)
    strategy, model = make_draft(num_anchors=4, logit_chunk_size=chunk)
    batch = batch_for(strategy)
    strategy.forward_loss(model, batch, ctx).loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    ref = reference(strategy, model, batch, ctx)
    lam = strategy.base_loss_weight(ctx)
    (((1 - lam) * ref["final_ce"] + lam * ref["base_ce"]) / ref["weight"]).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            scale = float(p.grad.abs().max())
            assert scale > 0 and (got[name] - p.grad).abs().max() <= 1e-4 * scale, name


@pytest.mark.parametrize("tile_blocks", [None, 1, 2])  # one tile; a block per tile; two blocks' rows per tile
@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("loss_type", ["dflash", "dpace"])
def test_fused_heads_equal_the_written_out_ones_in_float64(loss_type, lam, tile_blocks, monkeypatch):
    from specforge_plugin_dflash import loss
    from specforge_plugin_dflash.dpace import LossWeighting
    from specforge_plugin_domino.head_loss import DualHeadSums, DualHeadTerms, dual_head_terms

    gen = torch.Generator().manual_seed(7)
    b, c, bs, h, e, v, start = 2, 3, 5, 8, 6, 30, 2
    if tile_blocks is not None:
        monkeypatch.setattr(loss, "TILE_ELEMENTS", 0)
        monkeypatch.setattr(loss, "MIN_TILE_ROWS", tile_blocks * bs)
    hidden = torch.randn(b, c, bs, h, generator=gen, dtype=torch.float64, requires_grad=True)
    activation = torch.randn(b, c, bs - start, e, generator=gen, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(v, e, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.randn(v, h, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (b, c, bs), generator=gen)
    valid = torch.rand(b, c, bs, generator=gen) > 0.2
    weighting = LossWeighting(loss_type)
    weights = weighting.position_weights(torch.rand(b, c, bs, generator=gen, dtype=torch.float64) * valid, valid)
    fused = DualHeadSums(*dual_head_terms(activation, w2, DualHeadTerms(
        hidden=hidden, head=head, labels=labels, weights=weights, weighting=weighting, suffix_start=start,
        base_weight=lam)))
    got = torch.autograd.grad(2.0 * fused.loss, (hidden, activation, w2), allow_unused=True)
    base = hidden @ head.T
    final = torch.cat([base[..., :start, :], base[..., start:, :] + activation @ w2.T], dim=-2)

    def ce(logits):
        return F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)

    base_ce, final_ce = ce(base), ce(final)
    sums = torch.stack([(weighting.reweight(base_ce, weights) * base_ce).sum(),
                        (weighting.reweight(final_ce, weights) * final_ce).sum()])
    want = lam * sums[0] + (1 - lam) * sums[1]
    assert fused.loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(fused.sums, sums.detach(), rtol=1e-12)
    assert torch.equal(fused.base_predictions, base.argmax(-1)) and torch.equal(fused.predictions, final.argmax(-1))
    for g, wg in zip(got, torch.autograd.grad(2.0 * want, (hidden, activation, w2), allow_unused=True)):
        wg = torch.zeros_like(g) if wg is None else wg  # λ = 1: the correction gets no gradient
        assert torch.allclose(g, wg, rtol=1e-9, atol=1e-12)
    if lam == 1.0:
        assert not got[1].any() and not got[2].any()
