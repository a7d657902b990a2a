"""The combined DSpark loss, its metrics, the shifted labels and where gradients go."""

import math

import attrs
import pytest
import torch
import torch.nn.functional as F

from specforge_core.contracts import StepContext
from specforge_plugin_dflash.loss import acceptance_lengths

from specforge_plugin_dspark.strategy import LABEL_SHIFT, distillation, probabilistic_acceptance

SAMPLES = 3
CTX = StepContext(global_step=2, total_steps=8)


def batch_for(strategy, lengths=(14, 9, 17), seed=5):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for length in lengths:
        mask = torch.ones(length, dtype=torch.long)
        mask[: length // 3] = 0
        samples.append({"input_ids": torch.randint(3, 90, (length,), generator=gen), "loss_mask": mask,
                        "target_hidden": torch.randn(length, 96, generator=gen),
                        "last_hidden": torch.randn(length, 32, generator=gen)})
    return strategy.collate(samples, [f"s{i}" for i in range(len(samples))])


def reference(strategy, model, batch):
    """Every term from whole blocks at once, the teacher gathered by an explicit loop."""
    blocks = strategy.draw_blocks(model, batch, CTX, label_shift=1)
    hidden = strategy.block_hidden(model, batch, blocks)
    previous = blocks.tokens  # the token at anchor + k
    head = model.markov_head
    logits = model.logits(hidden) + head.markov_w2(head.markov_w1(previous)).float()
    ce = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none").view(blocks.labels.shape)
    teacher = torch.zeros_like(logits)
    for b, n, k in torch.cartesian_prod(*(torch.arange(d) for d in blocks.labels.shape)).tolist():
        position = min(int(blocks.anchors[b, n]) + k, batch["last_hidden"].shape[1] - 1)
        teacher[b, n, k] = torch.softmax(batch["last_hidden"][b, position] @ model.lm_head.T, -1)
    l1 = (torch.softmax(logits, -1) - teacher).abs().sum(-1)
    accept = (1 - l1.detach() / 2).clamp(0, 1)
    features = hidden
    if model.head_config.confidence_with_markov:
        features = torch.cat([hidden, head.markov_w1(previous)], -1)
    confidence = model.confidence_head.proj(features).squeeze(-1)
    bce = F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")
    w = blocks.weights
    return {"ce": (w * ce).sum(), "l1": (w * l1).sum(), "bce": (w * bce).sum(), "weight": w.sum(), "blocks": blocks,
            "logits": logits, "accept": accept, "confidence": torch.sigmoid(confidence),
            "terms": {"ce": ce, "l1": l1, "bce": bce}}


@pytest.mark.parametrize("gamma", [None, 3.0])
@pytest.mark.parametrize("with_markov", [True, False])
def test_loss_is_the_weighted_mix_of_ce_l1_and_confidence_bce(make_draft, gamma, with_markov):
    strategy, model = make_draft(num_anchors=4, loss_decay_gamma=gamma, logit_chunk_size=3,
                                 confidence_with_markov=with_markov)
    batch = batch_for(strategy)
    with torch.no_grad():
        out = strategy.forward_loss(model, batch, CTX)
        ref = reference(strategy, model, batch)
    weight = float(ref["weight"])
    total = 0.1 * ref["ce"] + 0.9 * ref["l1"] + 1.0 * ref["bce"]
    assert float(out.loss) == pytest.approx(float(total) / weight, rel=1e-5)
    ratios = out.ratio_metrics
    for name, key in (("ce_loss", "ce"), ("l1_loss", "l1"), ("confidence_loss", "bce")):
        assert ratios[name] == pytest.approx((float(ref[key]), weight), rel=1e-5), name
    blocks, mask = ref["blocks"], ref["blocks"].label_mask
    correct = (ref["logits"].argmax(-1) == blocks.labels) & mask
    assert ratios["acc"] == (float(correct.sum()), float(mask.sum()))
    accepted = (1 + correct.long().cumprod(-1).sum(-1))[blocks.keep]  # every one of the bs slots is a draft
    assert ratios["accept_len"] == (float(accepted.sum()), float(accepted.numel()))
    expected = (ref["accept"] * mask).cumprod(-1).sum(-1)[blocks.keep]
    assert ratios["tau_probabilistic"] == pytest.approx((float(expected.sum()), float(expected.numel())), rel=1e-5)
    error = ((ref["confidence"] - ref["accept"]).abs() * mask).sum()
    assert ratios["confidence_error"] == pytest.approx((float(error), float(mask.sum())), rel=1e-5)
    assert ratios["no_anchor_samples"] == (0.0, float(SAMPLES))


def test_slot_k_predicts_the_token_after_anchor_plus_k_and_slot_0_is_supervised(make_draft):
    strategy, model = make_draft(num_anchors=2, block_size=3, loss_decay_gamma=2.0)
    ids = torch.arange(10, 22)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    batch = strategy.collate([{"input_ids": ids, "loss_mask": mask, "target_hidden": torch.zeros(12, 96),
                               "last_hidden": torch.zeros(12, 32)}], ["only"])
    blocks = strategy.draw_blocks(model, batch, CTX, label_shift=LABEL_SHIFT)
    for anchor, labels, tokens, weights in zip(blocks.anchors[0].tolist(), blocks.labels[0], blocks.tokens[0],
                                               blocks.weights[0]):
        assert tokens.tolist() == [10 + min(anchor + k, 11) for k in range(3)]  # the Markov head's previous tokens
        inside = [anchor + k + 1 < 12 for k in range(3)]
        assert [label for label, ok in zip(labels.tolist(), inside) if ok] == [
            10 + anchor + k + 1 for k in range(3) if inside[k]]
        assert weights.tolist() == pytest.approx([math.exp(-k / 2.0) if inside[k] else 0.0 for k in range(3)])


@pytest.mark.parametrize("student, teacher, l1, accept", [
    ([0.5, 0.5, 0.0], [1.0, 0.0, 0.0], 1.0, 0.5),
    ([0.25, 0.25, 0.5], [0.25, 0.25, 0.5], 0.0, 1.0),
    ([0.0, 1.0, 0.0], [1.0, 0.0, 0.0], 2.0, 0.0),
    ([0.6, 0.3, 0.1], [0.2, 0.3, 0.5], 0.8, 0.6),
])
def test_l1_distance_and_acceptance_probability_on_hand_computed_distributions(student, teacher, l1, accept):
    logits = torch.log(torch.tensor(student, dtype=torch.float64).clamp(min=1e-300))
    got_l1, got_accept = distillation(logits, torch.tensor(teacher, dtype=torch.float64))
    assert float(got_l1) == pytest.approx(l1, abs=1e-9)
    assert float(got_accept) == pytest.approx(accept, abs=1e-9)
    assert not got_accept.requires_grad


def test_probabilistic_acceptance_multiplies_along_the_block_and_stops_at_unsupervised_slots():
    accept = torch.tensor([[[0.5, 0.5, 1.0], [0.9, 0.8, 0.5], [1.0, 1.0, 1.0]]])
    mask = torch.tensor([[[True, True, True], [True, True, False], [True, True, True]]])
    keep = torch.tensor([[True, True, False]])
    # block 0: 0.5 + 0.25 + 0.25 = 1.0; block 1: 0.9 + 0.72 + 0 = 1.62; block 2 is not kept
    assert probabilistic_acceptance(accept, mask, keep) == pytest.approx((2.62, 2.0))


def test_acceptance_length_counts_all_slots_as_drafts():
    correct = torch.tensor([[[True, True, True, True], [True, False, True, True], [False, True, True, True]]])
    assert acceptance_lengths(correct, label_shift=1, drafted=4).tolist() == [[5, 2, 1]]
    assert acceptance_lengths(correct, label_shift=1).tolist() == [[4, 2, 1]]  # Domino's: bs-1 drafted slots


def test_the_replayed_decode_drafts_all_bs_slots_a_round(make_draft, monkeypatch):
    """A draft right at every slot: a 20-token reply (positions 10..29, the first from the prompt's forward) takes
    rounds of bs = 4 drafts plus the bonus, as DSpark decodes, not DFlash's bs - 1 (which would take 5 rounds)."""
    strategy, model = make_draft()
    assert model.config.block_size == 4
    batch = batch_for(strategy, lengths=(30,))
    monkeypatch.setattr(strategy, "block_predictions", lambda model, batch, blocks: blocks.labels)
    with torch.no_grad():
        ratios = strategy.forward_loss(model, batch, StepContext(global_step=2, total_steps=8, training=False)).ratio_metrics
    assert ratios["accept_len_sim"] == (19.0, 4.0)  # 5 + 5 + 5 + 4: the last round ends on the turn's end token
    assert ratios["accept_rate_4"] == (4.0, 4.0) and "accept_rate_5" not in ratios


def test_the_replay_cuts_a_block_where_decoding_does_at_the_confidence_threshold(make_draft, monkeypatch):
    """confidence_threshold 0.5 and a confidence head sure of slots 0, 1 and 3 but not 2: the replay's drafts
    are the uncut ones at slots 0 and 1 and none from slot 2 on, as draft_dspark_block stops there."""
    strategy, model = make_draft()
    batch = batch_for(strategy)
    blocks = strategy.draw_blocks(model, batch, StepContext(training=False), label_shift=LABEL_SHIFT)
    uncut = strategy.block_predictions(model, batch, blocks)
    sure = torch.tensor([10.0, 10.0, -10.0, 10.0])
    monkeypatch.setattr(model, "confidence", lambda hidden, previous, embedding=None: sure.expand(previous.shape))
    strategy.options = attrs.evolve(strategy.options, confidence_threshold=0.5)
    cut = strategy.block_predictions(model, batch, blocks)
    assert torch.equal(cut[..., :2], uncut[..., :2]) and bool((cut[..., 2:] == -1).all())
    strategy.options = attrs.evolve(strategy.options, confidence_threshold=0.0)
    assert torch.equal(strategy.block_predictions(model, batch, blocks), uncut)  # 0 never cuts


def test_the_confidence_target_is_detached_so_its_loss_does_not_train_the_logits(make_draft):
    strategy, model = make_draft(num_anchors=4, ce_loss_alpha=0.0, l1_loss_alpha=0.0)
    strategy.forward_loss(model, batch_for(strategy), CTX).loss.backward()
    assert torch.count_nonzero(model.markov_head.markov_w2.weight.grad) == 0  # reaches the loss only through accept
    assert torch.count_nonzero(model.confidence_head.proj.weight.grad) > 0
    assert torch.count_nonzero(model.markov_head.markov_w1.weight.grad) > 0  # the confidence head reads w1(prev)


def test_each_term_trains_what_it_should(make_draft):
    strategy, model = make_draft(num_anchors=4, l1_loss_alpha=0.0, confidence_loss_alpha=0.0)
    strategy.forward_loss(model, batch_for(strategy), CTX).loss.backward()
    assert torch.count_nonzero(model.confidence_head.proj.weight.grad) == 0  # CE alone leaves the confidence head
    assert torch.count_nonzero(model.markov_head.markov_w2.weight.grad) > 0
    assert torch.count_nonzero(model.fc.weight.grad) > 0


def test_the_loss_does_not_depend_on_the_logit_chunk_size(make_draft):
    outputs = []
    for chunk in (1, 2, 16):
        strategy, model = make_draft(num_anchors=5, logit_chunk_size=chunk)
        with torch.no_grad():
            outputs.append(strategy.forward_loss(model, batch_for(strategy), CTX))
    for out in outputs[1:]:
        assert float(out.loss) == pytest.approx(float(outputs[0].loss), rel=1e-6)
        assert out.ratio_metrics["acc"] == outputs[0].ratio_metrics["acc"]


def test_dpace_weights_the_positions_by_the_drafts_own_confidence_over_the_batch_size(make_draft):
    strategy, model = make_draft(num_anchors=4, loss_type="dpace", dpace_alpha=0.5)
    batch = batch_for(strategy)
    with torch.no_grad():
        out = strategy.forward_loss(model, batch, CTX)
        ref = reference(strategy, model, batch)
    terms, valid = ref["terms"], ref["blocks"].label_mask
    prefix = torch.cumprod(torch.where(valid, 0.5 * torch.exp(-terms["ce"]) + 0.5, torch.ones_like(terms["ce"])), -1)
    w = valid * (prefix * valid).flip(-1).cumsum(-1).flip(-1)  # W_k = Σ_{j≥k} P_j m_j, on supervised slots
    sums = {name: float((w * term).sum()) for name, term in terms.items()}
    for name, key in (("ce_loss", "ce"), ("l1_loss", "l1"), ("confidence_loss", "bce")):
        assert out.ratio_metrics[name] == pytest.approx((sums[key], float(SAMPLES)), rel=1e-5), name
    total = 0.1 * sums["ce"] + 0.9 * sums["l1"] + sums["bce"]
    assert float(out.loss) == pytest.approx(total / SAMPLES, rel=1e-5)


@pytest.mark.parametrize("chunk", [2, 16])  # several chunks (each recomputed in backward), one chunk
def test_the_losss_gradients_are_the_reference_losss(make_draft, chunk):
    """The fused CE and L1 terms (head_loss.py) give every parameter the gradient autograd gives the loss
    written out over whole blocks."""
    strategy, model = make_draft(num_anchors=4, logit_chunk_size=chunk)
    batch = batch_for(strategy)
    strategy.forward_loss(model, batch, CTX).loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    ref = reference(strategy, model, batch)
    ((0.1 * ref["ce"] + 0.9 * ref["l1"] + ref["bce"]) / ref["weight"]).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            scale = float(p.grad.abs().max())
            assert scale > 0 and (got[name] - p.grad).abs().max() <= 1e-4 * scale, name


@pytest.mark.parametrize("tile_blocks", [None, 1, 2])  # one tile; a block per tile; two blocks' rows per tile
@pytest.mark.parametrize("loss_type", ["dflash", "dpace"])
def test_fused_distillation_terms_equal_the_written_out_ones_in_float64(loss_type, tile_blocks, monkeypatch):
    from specforge_plugin_dflash import loss
    from specforge_plugin_dflash.dpace import LossWeighting
    from specforge_plugin_dspark.head_loss import DistillationTerms, distillation_terms

    gen = torch.Generator().manual_seed(7)
    b, c, bs, h, r, v = 2, 3, 4, 8, 5, 30
    if tile_blocks is not None:
        monkeypatch.setattr(loss, "TILE_ELEMENTS", 0)
        monkeypatch.setattr(loss, "MIN_TILE_ROWS", tile_blocks * bs)
    hidden = torch.randn(b, c, bs, h, generator=gen, dtype=torch.float64, requires_grad=True)
    embedding = torch.randn(b, c, bs, r, generator=gen, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(v, r, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.randn(v, h, generator=gen, dtype=torch.float64)
    teacher_hidden = torch.randn(b, c, bs, h, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (b, c, bs), generator=gen)
    valid = torch.rand(b, c, bs, generator=gen) > 0.2
    weighting = LossWeighting(loss_type)
    weights = weighting.position_weights(torch.rand(b, c, bs, generator=gen, dtype=torch.float64) * valid, valid)
    fused = distillation_terms(embedding, w2, DistillationTerms(
        hidden=hidden, head=head, teacher_hidden=teacher_hidden, labels=labels, weights=weights, weighting=weighting,
        ce_alpha=0.3, l1_alpha=0.7))
    got = torch.autograd.grad(2.0 * fused.loss, (hidden, embedding, w2))
    logits = hidden @ head.T + embedding @ w2.T
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    l1, accept = distillation(logits, torch.softmax(teacher_hidden @ head.T, -1))
    w = weighting.reweight(ce, weights)
    want = 0.3 * (w * ce).sum() + 0.7 * (w * l1).sum()
    assert fused.loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(fused.sums, torch.stack([(w * ce).sum(), (w * l1).sum()]).detach(), rtol=1e-12)
    assert torch.allclose(fused.weights, w.detach(), rtol=1e-12) and torch.allclose(fused.accept, accept, rtol=1e-12)
    assert torch.equal(fused.predictions, logits.argmax(-1))
    for g, wg in zip(got, torch.autograd.grad(2.0 * want, (hidden, embedding, w2))):
        assert torch.allclose(g, wg, rtol=1e-9, atol=1e-12)
