"""EAGLE3 under FSDP2 on two real gloo ranks: its gradients are the single process's.

The unroll computes the token half of q/k/v and the stacked q/k/v weights once, in the
first of the layer's seven calls, and every later call reads them: their gradients reach
the weights during the first call's backward, which FSDP2 must still count before it
reduces the gradients.
"""

import json
import os
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent('''
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from specforge_core.contracts import StepContext
    from specforge_core.protocols import DataStats
    from specforge_core.training.distributed import init_distributed, shard_model, shutdown
    from specforge_plugin_eagle3 import Eagle3Options
    from specforge_plugin_eagle3.strategy import Eagle3Strategy
    from specforge_plugin_eagle3.testing import tiny_batch, tiny_target

    def gradients(info_dist=None):
        info, frozen = tiny_target()
        strategy = Eagle3Strategy(Eagle3Options(ttt_length=4))
        torch.manual_seed(0)
        model = strategy.build_model(info, frozen, DataStats())
        _samples, batch = tiny_batch(strategy, info, lengths=(7, 5))
        if info_dist is not None:
            model = shard_model(model, info_dist)
        for _ in range(2):  # a second backward: gradients of both steps add up on every rank
            strategy.forward_loss(model, batch, StepContext()).loss.backward()
        return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                for name, p in model.named_parameters() if p.grad is not None}

    single = gradients()
    info = init_distributed("cpu")
    sharded = gradients(info)
    if info.rank == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump({name: [float((sharded[name] - g).abs().max()), float(g.abs().max())]
                       for name, g in single.items()}, fh)
    shutdown()
    # leave without interpreter teardown, as specforge's launched ranks do (specforge_core.cli._end_rank):
    # gloo's threads outlive destroy_process_group and can abort the teardown ("terminate called
    # without an active exception"), failing the launcher after the result was written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
''')


def test_two_fsdp2_ranks_on_one_batch_give_the_single_process_gradients(tmp_path):
    script, result = tmp_path / "worker.py", tmp_path / "result.json"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(result)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(result.read_text())
    assert {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.self_attn.v_proj.weight", "lm_head.weight"} <= set(diffs)
    for name, (diff, scale) in diffs.items():
        assert scale > 0, name
        assert diff <= 1e-5 * scale, (name, diff, scale)
