"""The DFlash loss and metrics against independent, explicit per-block computations."""

import math
import platform

import attrs
import pytest
import torch
import torch.nn.functional as F

from specforge_core.contracts import StepContext
from specforge_core.protocols import BuildContext, DataStats, TargetInfo

from specforge_plugin_dflash import LOSS_TYPES, DFlashOptions
from specforge_plugin_dflash.blocks import build_blocks
from specforge_plugin_dflash.loss import acceptance_lengths, block_metrics, chunked_cross_entropy
from specforge_plugin_dflash.strategy import DFlashStrategy

HIDDEN, VOCAB, LAYERS = 16, 50, 4


def tiny_target():
    gen = torch.Generator().manual_seed(0)
    info = TargetInfo(num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB,
                      extra={"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
                             "head_dim": 4, "mask_token_id": VOCAB - 1})
    frozen = {"embed_tokens": torch.randn(VOCAB, HIDDEN, generator=gen),
              "lm_head": torch.randn(VOCAB, HIDDEN, generator=gen) / 4}
    return info, frozen


def samples(strategy, info, lengths=(13, 9), seed=1):
    gen = torch.Generator().manual_seed(seed)
    width = strategy.capture_plan(info).features["target_hidden"].shape[1]
    out = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.long)
        mask[:3] = 0
        out.append({"input_ids": torch.randint(0, VOCAB - 1, (n,), generator=gen), "loss_mask": mask,
                    "target_hidden": torch.randn(n, width, generator=gen)})
    return out


def explicit_reference(model, sample, anchors, block_size, gamma):
    """Each block run alone on its own context, weights by explicit loops: (Σw·CE, Σw, correct, count, accepts)."""
    ids, mask, feats = sample["input_ids"], sample["loss_mask"], sample["target_hidden"]
    seq_len = ids.shape[0]
    sums = [0.0, 0.0, 0, 0, []]
    for anchor in anchors:
        block = torch.tensor([[int(ids[anchor])] + [model.config.mask_token_id] * (block_size - 1)])
        ctx = model.context(feats[None, :anchor])  # only the positions strictly before the anchor
        positions = torch.arange(anchor, anchor + block_size)[None]
        hidden = model.run_layers(ctx, model.embed(block), positions,
                                  torch.ones(1, block_size, anchor + block_size, dtype=torch.bool),
                                  context_positions=torch.arange(anchor)[None])
        logits = model.logits(hidden)[0]
        prefix_alive, accept = True, 1
        for k in range(1, block_size):
            j = anchor + k
            supervised = j < seq_len and int(mask[j]) == 1
            correct = supervised and int(logits[k].argmax()) == int(ids[j])
            if supervised:
                w = 1.0 if gamma is None else math.exp(-(k - 1) / gamma)
                sums[0] += w * float(F.cross_entropy(logits[k][None], ids[j][None]))
                sums[1] += w
                sums[2] += int(correct)
                sums[3] += 1
            prefix_alive = prefix_alive and correct
            accept += int(prefix_alive)
        sums[4].append(accept)
    return sums


@pytest.mark.parametrize("gamma", [None, 3.0])
def test_loss_accuracy_and_acceptance_match_an_explicit_per_block_computation(gamma):
    info, frozen = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(block_size=4, num_anchors=3, loss_decay_gamma=gamma, attention="eager",
                                            logit_chunk_size=2), BuildContext())
    torch.manual_seed(0)
    model = strategy.build_model(info, frozen, DataStats()).double()
    model.embed_tokens.data, model.lm_head.data = frozen["embed_tokens"].double(), frozen["lm_head"].double()
    data = [{k: (v.double() if v.is_floating_point() else v) for k, v in s.items()} for s in samples(strategy, info)]
    batch = strategy.collate(data, ["x", "y"])
    ctx = StepContext(global_step=4, total_steps=10)
    with torch.no_grad():
        out = strategy.forward_loss(model, batch, ctx)
        blocks = strategy.draw_blocks(model, batch, ctx)
        totals = [0.0, 0.0, 0, 0, []]
        for row, sample in enumerate(data):
            anchors = blocks.anchors[row][blocks.keep[row]].tolist()
            assert anchors, "the fixture gives every sample anchors"
            ref = explicit_reference(model, sample, anchors, 4, gamma)
            totals = [a + b for a, b in zip(totals, ref)]
    # (the decay weights are float32, so the loss agrees to float32 precision)
    assert float(out.loss) == pytest.approx(totals[0] / totals[1], rel=1e-6)
    assert out.ratio_metrics["loss"] == pytest.approx((totals[0], totals[1]), rel=1e-6)
    assert out.ratio_metrics["acc"] == (totals[2], totals[3])
    assert out.ratio_metrics["accept_len"] == (sum(totals[4]), len(totals[4]))
    assert out.ratio_metrics["no_anchor_samples"] == (0.0, 2.0)


def test_the_anchor_position_of_each_block_never_reaches_the_head():
    """Block position 0 holds the anchor and is never supervised: the step's logits GEMMs take the other
    bs - 1 rows of every block, and nothing else (the loss and metrics stay those of the explicit
    per-block computation above, which computes every position)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    info, frozen = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(block_size=4, num_anchors=3, attention="eager", logit_chunk_size=2),
                              BuildContext())
    torch.manual_seed(0)
    model = strategy.build_model(info, frozen, DataStats())
    model.lm_head.data = frozen["lm_head"]
    batch = strategy.collate(samples(strategy, info), ["x", "y"])
    head = model.lm_head.data_ptr()
    rows = []

    class HeadRows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out) and args[1].data_ptr() == head \
                    and args[1].shape == (HIDDEN, VOCAB):  # x @ head^T: the logits
                rows.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    with HeadRows():
        strategy.forward_loss(model, batch, StepContext(global_step=4, total_steps=10)).loss.backward()
    assert sum(rows) == 2 * 3 * (4 - 1)  # B x N x (bs - 1)


def test_chunked_cross_entropy_equals_the_unchunked_loss_and_gradients():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)  # [B, N, bs, H]
    head = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 30, (2, 5, 3), generator=gen)
    weights = torch.rand(2, 5, 3, generator=gen, dtype=torch.float64)
    full = hidden @ head.T
    reference = (F.cross_entropy(full.flatten(0, 2), labels.flatten(), reduction="none") * weights.flatten()).sum()
    (ref_grad,) = torch.autograd.grad(reference, hidden)
    for chunk in (1, 2, 5, 100):
        total, predictions = chunked_cross_entropy(lambda s, e: hidden[:, s:e] @ head.T, labels, weights, chunk)
        (grad,) = torch.autograd.grad(total, hidden)
        assert total.item() == pytest.approx(reference.item(), rel=1e-12)
        assert torch.allclose(grad, ref_grad, rtol=1e-12, atol=1e-14)
        assert torch.equal(predictions, full.argmax(-1))


@pytest.mark.parametrize("tile_blocks", [None, 1, 3])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_fused_frozen_head_loss_equals_the_chunked_one_in_sum_gradient_and_argmax(loss_type, tile_blocks,
                                                                                     monkeypatch):
    """frozen_head_cross_entropy against chunked_cross_entropy over the same head (autograd, checkpointed
    chunks), under DFlash's weights and every D-PACE type, in chunks of 1, 2 and all blocks, and in tiles
    of one tile per chunk, one block per tile, and three blocks' rows per tile (both samples of a
    one-block chunk in one tile)."""
    from specforge_plugin_dflash import loss
    from specforge_plugin_dflash.dpace import LossWeighting
    from specforge_plugin_dflash.loss import frozen_head_cross_entropy

    if tile_blocks is not None:
        monkeypatch.setattr(loss, "TILE_ELEMENTS", 0)
        monkeypatch.setattr(loss, "MIN_TILE_ROWS", tile_blocks * 4)  # blocks of 4 positions

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 30, (2, 5, 4), generator=gen)
    valid = torch.rand(2, 5, 4, generator=gen) > 0.2
    weighting = LossWeighting(loss_type)
    weights = weighting.position_weights(torch.rand(2, 5, 4, generator=gen, dtype=torch.float64) * valid, valid)
    want, want_predictions = chunked_cross_entropy(lambda s, e: hidden[:, s:e] @ head.T, labels, weights, 2,
                                                   weighting=weighting)
    (want_grad,) = torch.autograd.grad(want, hidden)
    for chunk in (1, 2, 5):
        total, predictions = frozen_head_cross_entropy(hidden, head, labels, weights, chunk, weighting=weighting)
        (grad,) = torch.autograd.grad(2.5 * total, hidden)
        assert total.item() == pytest.approx(want.item(), rel=1e-12)
        assert torch.allclose(grad, 2.5 * want_grad, rtol=1e-10, atol=1e-14)
        assert torch.equal(predictions, want_predictions)
    with torch.no_grad():  # eval: the same sum and argmax, no gradient computed
        total, predictions = frozen_head_cross_entropy(hidden, head, labels, weights, 2, weighting=weighting)
    assert total.item() == pytest.approx(want.item(), rel=1e-12) and torch.equal(predictions, want_predictions)


def test_block_tiles_cover_every_block_once_within_the_chunk_and_the_logit_budget():
    from specforge_plugin_dflash.loss import block_tiles

    def spans(tiles):
        return [((t[0].start, t[0].stop), (t[1].start, t[1].stop)) for t in tiles]

    # a small vocabulary: the chunk of blocks is the limit (2 blocks of 4 positions, both samples)
    assert spans(block_tiles(2, 5, 4, 30, 2)) == [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((0, 2), (4, 5))]
    # the step bench's shapes (V 1024): 256 rows a tile, one sample's 16 blocks
    assert spans(block_tiles(4, 16, 16, 1024, 16)) == [((b, b + 1), (0, 16)) for b in range(4)]
    # a 49152-token vocabulary: never fewer than MIN_TILE_ROWS = 128 rows, so 8 blocks of 16
    assert spans(block_tiles(2, 16, 16, 49152, 16)) == [((0, 1), (0, 8)), ((1, 2), (0, 8)),
                                                        ((0, 1), (8, 16)), ((1, 2), (8, 16))]
    # a block wider than a tile's rows is a tile of its own
    assert spans(block_tiles(2, 2, 300, 49152, 16)) == [((0, 1), (0, 1)), ((1, 2), (0, 1)),
                                                        ((0, 1), (1, 2)), ((1, 2), (1, 2))]
    # CUDA: every sample's chunk of blocks, however large the vocabulary
    assert spans(block_tiles(2, 5, 4, 49152, 2, cache_sized=False)) == [((0, 2), (0, 2)), ((0, 2), (2, 4)),
                                                                        ((0, 2), (4, 5))]
    for batch, blocks, bs, vocab, chunk in [(3, 7, 5, 100000, 3), (5, 9, 2, 7, 4), (1, 1, 1, 1, 1)]:
        tiles = block_tiles(batch, blocks, bs, vocab, chunk)
        seen = torch.zeros(batch, blocks, dtype=torch.long)
        for samples, part in tiles:
            seen[samples, part] += 1
            assert part.stop - part.start <= chunk
        assert seen.eq(1).all()


def test_the_fused_frozen_head_loss_in_bfloat16_is_within_bfloat16_rounding_of_float32(half_gemm):
    from specforge_plugin_dflash.loss import frozen_head_cross_entropy

    gen = torch.Generator().manual_seed(4)
    hidden32 = torch.randn(2, 3, 4, 16, generator=gen).to(torch.bfloat16).float().requires_grad_()
    head32 = (torch.randn(64, 16, generator=gen) / 4).to(torch.bfloat16).float()
    labels = torch.randint(0, 64, (2, 3, 4), generator=gen)
    weights = torch.rand(2, 3, 4, generator=gen)
    want, _ = frozen_head_cross_entropy(hidden32, head32, labels, weights, 2)
    (want_grad,) = torch.autograd.grad(want, hidden32)
    for route in ("native", "fp32"):
        half_gemm(route)
        hidden = hidden32.detach().to(torch.bfloat16).requires_grad_()
        total, _ = frozen_head_cross_entropy(hidden, head32.to(torch.bfloat16), labels, weights, 2)
        total.backward()
        assert total.dtype == torch.float32 and total.item() == pytest.approx(want.item(), rel=1e-2)
        assert hidden.grad.dtype == torch.bfloat16
        assert (hidden.grad.float() - want_grad).abs().max() <= 2 ** -7 * want_grad.abs().max()


def test_acceptance_length_is_one_plus_the_correct_prefix_after_the_anchor():
    correct = torch.tensor([[[False, True, True, False, True],
                             [True, False, True, True, True],
                             [False, True, True, True, True]]])
    assert acceptance_lengths(correct).tolist() == [[3, 1, 5]]


def test_accuracy_counts_supervised_positions_unweighted_and_acceptance_stops_at_unsupervised_ones():
    labels = torch.tensor([[[5, 6, 7, 8], [5, 6, 7, 8]]])
    predictions = torch.tensor([[[0, 6, 7, 0], [0, 6, 7, 8]]])
    label_mask = torch.tensor([[[False, True, True, True], [False, True, False, True]]])
    metrics = block_metrics(predictions, labels, label_mask, torch.tensor([[True, True]]))
    assert metrics["acc"] == (4.0, 5.0)
    assert metrics["accept_len"] == (3.0 + 2.0, 2.0)  # block 1: position 2 is unsupervised, so its prefix stops


def test_a_sample_without_valid_anchor_is_reported_and_the_batch_still_trains():
    info, frozen = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(block_size=3, num_anchors=2), BuildContext())
    model = strategy.build_model(info, frozen, DataStats())
    data = samples(strategy, info, lengths=(10, 6))
    data[1]["loss_mask"] = torch.tensor([1, 0, 1, 0, 0, 1])  # no two supervised tokens in a row
    out = strategy.forward_loss(model, strategy.collate(data, ["ok", "empty"]), StepContext())
    assert out.ratio_metrics["no_anchor_samples"] == (1.0, 2.0)
    assert torch.isfinite(out.loss) and out.ratio_metrics["loss"][1] > 0
    out.loss.backward()

    nothing = strategy.forward_loss(model, strategy.collate(data[1:], ["empty"]), StepContext())
    assert nothing.loss.item() == 0.0 and nothing.loss.requires_grad
    assert nothing.ratio_metrics["no_anchor_samples"] == (1.0, 1.0)
    assert nothing.ratio_metrics["accept_len"] == (0.0, 0.0)
    nothing.loss.backward()


def test_eval_anchors_are_the_same_at_every_step_and_training_anchors_change_with_the_step():
    info, frozen = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(block_size=3, num_anchors=2), BuildContext())
    model = strategy.build_model(info, frozen, DataStats())
    batch = strategy.collate(samples(strategy, info, lengths=(40,)), ["s"])
    anchors = {(step, training): strategy.draw_blocks(model, batch, StepContext(global_step=step, training=training))
               .anchors.tolist() for step in (1, 2) for training in (True, False)}
    assert anchors[(1, False)] == anchors[(2, False)]
    assert anchors[(1, True)] != anchors[(2, True)]


def test_a_block_sees_nothing_at_or_after_its_anchor_except_the_anchor_token():
    info, frozen = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(block_size=4, num_anchors=4, attention="eager"), BuildContext())
    model = strategy.build_model(info, frozen, DataStats())
    data = samples(strategy, info, lengths=(30,))
    batch = strategy.collate(data, ["s"])
    with torch.no_grad():
        blocks = strategy.draw_blocks(model, batch, StepContext())
        hidden = strategy.block_hidden(model, batch, blocks)
        for b, anchor in enumerate(blocks.anchors[0].tolist()):
            future = {k: v.clone() for k, v in batch.tensors.items()}
            future["target_hidden"][0, anchor:] = torch.randn_like(future["target_hidden"][0, anchor:])
            future["input_ids"][0, anchor + 1:] = (future["input_ids"][0, anchor + 1:] + 1) % (VOCAB - 1)
            changed = attrs.evolve(batch, tensors=future)
            same_anchors = build_blocks(future["input_ids"], future["loss_mask"], blocks.anchors, blocks.keep,
                                        blocks.num_valid, block_size=4, mask_token_id=VOCAB - 1)
            assert torch.allclose(strategy.block_hidden(model, changed, same_anchors)[0, b], hidden[0, b], atol=1e-6)
            # ... while the context before the anchor does matter
            past = {k: v.clone() for k, v in batch.tensors.items()}
            past["target_hidden"][0, :anchor] += 1.0
            if anchor > 0:
                moved = strategy.block_hidden(model, attrs.evolve(batch, tensors=past), blocks)[0, b]
                assert not torch.allclose(moved, hidden[0, b], atol=1e-3)


def test_the_draft_can_memorise_a_small_batch():
    info, frozen = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(block_size=4, num_anchors=8, num_layers=2), BuildContext())
    torch.manual_seed(0)
    model = strategy.build_model(info, frozen, DataStats())
    batch = strategy.collate(samples(strategy, info, lengths=(24, 20)), ["a", "b"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(200):
        strategy.forward_loss(model, batch, StepContext(global_step=step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        metrics = strategy.forward_loss(model, batch, StepContext(training=False)).ratio_metrics
    assert metrics["acc"][0] / metrics["acc"][1] > 0.95
    assert metrics["accept_len"][0] / metrics["accept_len"][1] > 3.0  # of at most 4


def test_tau_sim_is_the_pooled_acceptance_length_without_the_bonus_token():
    strategy = DFlashStrategy(DFlashOptions(), BuildContext())
    assert strategy.derived_metrics({"accept_len": 3.25, "acc": 0.5}) == {"tau_sim": 2.25}
    assert strategy.derived_metrics({"acc": 0.5}) == {}


def test_collate_pads_to_the_longest_sample_and_keeps_the_lengths():
    info, _ = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(block_size=4), BuildContext())
    data = samples(strategy, info, lengths=(5, 2))
    data[1]["input_ids"] = data[1]["input_ids"].int()  # cast to int64 like every batch's ids
    batch = strategy.collate(data, ["x", "y"])
    assert batch["lengths"].tolist() == [5, 2] and batch.num_tokens == 7 and batch.sample_ids == ("x", "y")
    assert batch["input_ids"].dtype == torch.long
    assert batch["input_ids"][1].tolist() == data[1]["input_ids"].tolist() + [0, 0, 0]
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]
    assert torch.equal(batch["target_hidden"][1, :2], data[1]["target_hidden"])
    assert torch.equal(batch["target_hidden"][1, 2:], torch.zeros(3, data[1]["target_hidden"].shape[1]))


def test_collate_refuses_a_sample_without_a_feature_naming_it_and_the_features_it_has():
    from specforge_core.data.collate import CollateError

    info, _ = tiny_target()
    strategy = DFlashStrategy(DFlashOptions(block_size=4), BuildContext())
    data = samples(strategy, info)
    del data[1]["target_hidden"]
    with pytest.raises(CollateError, match=r"^sample 'y' lacks feature\(s\) \['target_hidden'\] \(it has \['input_ids', "
                                           r"'loss_mask'\]\); it was not captured with the dflash capture plan: "
                                           r"capture it again with --strategy dflash$"):
        strategy.collate(data, ["x", "y"])
    data = samples(strategy, info)
    data[0]["loss_mask"] = data[0]["loss_mask"][:-1]
    with pytest.raises(CollateError, match=r"sample 'x' has features of different lengths: \{'input_ids': 13, "
                                           r"'loss_mask': 12, 'target_hidden': 13\}"):
        strategy.collate(data, ["x", "y"])


PACKS_HERE = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()


@pytest.mark.skipif(not PACKS_HERE, reason="oneDNN's packed heads run on x86-64 CPUs with oneDNN only")
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, on toggling oneDNN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_loss_over_a_packed_vocabulary_wide_head_equals_it_over_the_plain_one(half_gemm, dtype):
    """A head of 8195 rows, float32 or (on the native bf16 route) bf16, is packed for oneDNN
    (specforge_core.nn.frozen_head); the sum, the gradient and the argmax are those of the same loss with
    oneDNN turned off (torch's GEMMs over the head as it is), within float32 summation order."""
    from specforge_core.nn import frozen_head
    from specforge_plugin_dflash.loss import frozen_head_cross_entropy

    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU's oneDNN has no bf16 GEMMs")
    half_gemm("native")
    gen = torch.Generator().manual_seed(5)
    head = torch.nn.Parameter(torch.randn(8195, 16, generator=gen).to(dtype), requires_grad=False)
    hidden = torch.randn(2, 3, 4, 16, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, 8195, (2, 3, 4), generator=gen)
    weights = torch.rand(2, 3, 4, generator=gen)
    results = []
    for enabled in (True, False):
        with torch.backends.mkldnn.flags(enabled=enabled):
            assert frozen_head(head, dtype).packed is enabled
            total, predictions = frozen_head_cross_entropy(hidden, head, labels, weights, 2)
            (grad,) = torch.autograd.grad(total, hidden)
        results.append((total, predictions, grad))
    (packed, packed_ids, packed_grad), (plain, plain_ids, plain_grad) = results
    assert packed.dtype == torch.float32 and packed_grad.dtype == dtype
    assert packed.item() == pytest.approx(plain.item(), rel=1e-6 if dtype == torch.float32 else 1e-5)
    assert torch.equal(packed_ids, plain_ids)
    if dtype == torch.float32:
        torch.testing.assert_close(packed_grad, plain_grad, rtol=1e-5, atol=1e-5)  # sums of 8195 terms
    else:  # rounded once to bf16 from float32 sums
        torch.testing.assert_close(packed_grad.float(), plain_grad.float(), rtol=2 ** -7, atol=1e-2)
