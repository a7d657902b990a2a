"""Training components in isolation: schedule, fp32 master weights, rotation, accumulation."""

import json
import math

import pytest
import torch

from specforge_core.config import TrainOptions
from specforge_core.training.checkpoint import CheckpointError, CheckpointManager, check_contract
from specforge_core.training.distributed import DistInfo
from specforge_core.training.optim import MasterWeightAdamW, build_optimizer, fused_adamw, lr_factor


def test_warmup_then_cosine_schedule_values():
    train = TrainOptions(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(step, train, total_steps=14) for step in range(15)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[14] == pytest.approx(0.1)


def test_constant_schedule_after_warmup():
    train = TrainOptions(warmup_steps=2, schedule="constant")
    assert [lr_factor(s, train, total_steps=10) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_bf16_parameters_get_fp32_master_weights_that_keep_small_updates():
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 4, bias=False)
    low = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(torch.full((4, 4), 1.0))
        low.weight.copy_(torch.full((4, 4), 1.0))
    opt = build_optimizer(low, TrainOptions(lr=1e-4, weight_decay=0.0))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    assert isinstance(opt, MasterWeightAdamW)
    x = torch.ones(2, 4)
    for _ in range(20):
        for model, optimizer in ((low, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            model(x.to(model.weight.dtype)).float().sum().backward()
            optimizer.step()
    master = opt.param_groups[0]["params"][0]
    # 20 updates of 1e-4 are below bf16 resolution at 1.0 (2**-7): a plain bf16 AdamW would not move.
    assert torch.allclose(master, reference.weight, atol=1e-6)
    assert master.dtype == torch.float32 and low.weight.dtype == torch.bfloat16
    assert torch.equal(low.weight, master.to(torch.bfloat16))


def test_float32_parameters_take_the_fused_adamw_with_the_for_loop_updates():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference.load_state_dict(model.state_dict())
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = build_optimizer(model, TrainOptions(lr=1e-2, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["fused"] is True
    assert not ref_opt.param_groups[0]["fused"] and not ref_opt.param_groups[0]["foreach"]  # the for-loop form
    x, y = torch.randn(32, 8), torch.randn(32, 3)
    for _ in range(30):
        for net, optimizer in ((model, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    with torch.no_grad():
        for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
            assert float((mine - start[name]).abs().max()) > 0.05  # 30 steps of lr 1e-2 moved every parameter
            assert float((mine - theirs).abs().max()) < 1e-6
    assert float(opt.state[model[0].weight]["step"]) == 30.0


def test_bf16_master_weights_take_the_fused_adamw():
    low = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    opt = build_optimizer(low, TrainOptions(lr=1e-4))
    assert isinstance(opt, MasterWeightAdamW) and opt.param_groups[0]["fused"] is True


def test_fused_adamw_only_for_floating_parameters_on_one_supported_device_type():
    assert fused_adamw([torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(1, dtype=torch.bfloat16)])
    assert not fused_adamw([torch.zeros(2), torch.zeros(2, device="meta")])  # two device types
    assert not fused_adamw([torch.zeros(2, device="meta")])  # no fused kernel there
    assert not fused_adamw([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    assert not fused_adamw([])


def _save(manager, step, best=False):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    return manager.save(global_step=step, model=model, optimizer=opt, trainer_state={"state": {}}, is_best=best)


def test_rotation_keeps_the_newest_and_never_deletes_best(tmp_path):
    manager = CheckpointManager(tmp_path, "r", DistInfo(), keep_last=2)
    _save(manager, 1)
    _save(manager, 2, best=True)
    for step in (3, 4, 5):
        _save(manager, step)
    assert [p.name for p in manager.checkpoints()] == ["r-step2", "r-step4", "r-step5"]
    assert manager.resolve("best").name == "r-step2"
    assert manager.resolve("latest").name == "r-step5"
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_checkpoints_of_other_runs_and_temp_dirs_are_ignored(tmp_path):
    manager = CheckpointManager(tmp_path, "r", DistInfo(), keep_last=5)
    _save(manager, 3)
    (tmp_path / ".tmp-r-step9").mkdir()
    other = CheckpointManager(tmp_path, "other", DistInfo(), keep_last=5)
    _save(other, 7)
    assert [p.name for p in manager.checkpoints()] == ["r-step3"]


def test_contract_check_names_the_nested_field(tmp_path):
    saved = {"strategy": "x", "strategy_options": {"ttt_length": 7}, "world_size": 1}
    check_contract(saved, json.loads(json.dumps(saved)), tmp_path)
    with pytest.raises(CheckpointError, match=r"strategy_options\.ttt_length changed \(checkpoint: 7, now: 5\)"):
        check_contract(saved, {**saved, "strategy_options": {"ttt_length": 5}}, tmp_path)
    with pytest.raises(CheckpointError, match=r"strategy changed \(checkpoint: 'x', now: 'y'\)"):
        check_contract(saved, {**saved, "strategy": "y"}, tmp_path)


def test_the_seed_and_data_are_checked_where_the_checkpoint_recorded_them(tmp_path):
    now = {"strategy": "x", "seed": 0, "data": {"path": "/d/train.jsonl", "max_length": 2048}}
    check_contract({"strategy": "x"}, now, tmp_path)  # an earlier release's checkpoint: neither recorded
    with pytest.raises(CheckpointError, match=r"seed changed \(checkpoint: 1, now: 0\)"):
        check_contract({**now, "seed": 1}, now, tmp_path)
    with pytest.raises(CheckpointError, match=r"data\.max_length changed \(checkpoint: 1024, now: 2048\)"):
        check_contract({**now, "data": {**now["data"], "max_length": 1024}}, now, tmp_path)
    with pytest.raises(CheckpointError, match=r"target changed \(checkpoint: 'a', now: None\)"):
        check_contract({**now, "target": "a"}, now, tmp_path)  # any other field is checked as before


def test_the_training_samples_are_checked_where_the_checkpoint_recorded_them(tmp_path):
    from specforge_core.runtime import samples_fingerprint

    now = {"strategy": "x", "samples": samples_fingerprint(["a.jsonl:1:00aa", "a.jsonl:2:00bb"])}
    assert now["samples"]["count"] == 2 and len(now["samples"]["digest"]) == 32
    check_contract({"strategy": "x"}, now, tmp_path)  # an earlier release's checkpoint: not recorded
    edited = samples_fingerprint(["a.jsonl:1:00aa", "a.jsonl:2:00cc"])  # line 2's tokens changed
    with pytest.raises(CheckpointError, match=r"samples\.digest changed \(checkpoint: '[0-9a-f]{32}', now: "
                                              r"'[0-9a-f]{32}'\): the training samples are not those the checkpoint "
                                              r"trained on \(a data file edited in place, "):
        check_contract({**now, "samples": edited}, now, tmp_path)
    reordered = samples_fingerprint(["a.jsonl:2:00bb", "a.jsonl:1:00aa"])
    assert reordered["digest"] != now["samples"]["digest"]  # the order is the loader's: it is part of the identity
    with pytest.raises(CheckpointError, match=r"samples\.count changed \(checkpoint: 1, now: 2\)"):
        check_contract({**now, "samples": samples_fingerprint(["a.jsonl:1:00aa"])}, now, tmp_path)


def test_curves_are_smoothed_without_bias_and_eval_points_are_drawn(tmp_path):
    from specforge_core.training.plot import plot_curves, smoothed

    assert smoothed([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])  # debiased: no pull towards 0
    ema = smoothed([0.0, 10.0], 0.5)
    assert ema == pytest.approx([0.0, (0.5 * 0.0 * 0.5 + 0.5 * 10.0) / 0.75])
    records = [{"step": s, "loss": 5.0 / s, "acc": s / 40} for s in range(1, 41)]
    records += [{"step": 20, "eval/loss": 0.3, "eval/accept_len_sim": 2.0}, {"step": 40, "eval/accept_len_sim": 2.5}]
    path = plot_curves(records, tmp_path / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
