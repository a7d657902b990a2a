"""Each strategy's train step at this checkout against the same step at another commit, at equal shapes.

What a change to the step code is worth, measured the way ``versus_reference.py`` measures the
step against its textbook: two worker processes (one torch thread each) build the same model and
batch (``versus_reference.build`` of their own tree) and step in turn, alternating which goes
first, so load from other processes hits both alike. One worker imports this checkout, the other
a detached git worktree of ``--commit`` (made in a temporary directory and removed afterwards).
Each takes the optimizer its tree's trainer builds (torch's fused AdamW where that tree has
``specforge_core.training.optim.fused_adamw``, AdamW's defaults before it) and keeps the C heap as
its tree's trainer does (``specforge_core.heap.keep_heap`` where that tree has it, the C library's
defaults before). One JSON line per strategy and dtype:

    ms_here / ms_commit       median step milliseconds
    speedup                   median of the per-pair ratios ``commit seconds / here`` (> 1: here is faster)
    speedup_p25 / _p75        their quartiles
    shapes                    the dimensions (``--shapes``)
    cpu                       the CPU both workers ran on (``--cpu``, as ``versus_reference.py`` takes it)
    load_before / load_after  the machine's 1-minute load average

On a machine shared with other work single pairs spread by 10-20%; the default 15 pairs put
the median within a few percent.

    python bench/versus_commit.py --commit HEAD~3                       # every strategy, float32
    python bench/versus_commit.py --commit v0.1.0 --strategies dflash --dtypes float32,bfloat16 --pairs 31
    python bench/versus_commit.py --commit HEAD~1 --strategies dflash --shapes smollm2 --pairs 7
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = ("eagle3", "dflash", "domino", "dspark")


def tree_paths(tree: str) -> list[str]:
    """The import roots of a checkout: the core, the bench, and every plugin distribution's folder."""
    plugins = [os.path.dirname(package) for package in glob.glob(os.path.join(tree, "plugins", "**",
                                                                               "specforge_plugin_*"), recursive=True)
               if os.path.isfile(os.path.join(package, "__init__.py"))]
    return [tree, os.path.join(tree, "bench"), *sorted(set(plugins))]


def worker(tree: str, name: str, dtype_name: str, ttt_length: int, shapes: str) -> None:
    """Build ``tree``'s step, take one untimed step, print ``ready``, then one step per ``step`` line on stdin."""
    sys.path[:0] = tree_paths(tree)
    import torch

    torch.set_num_threads(1)
    try:
        from specforge_core.heap import keep_heap
    except ImportError:  # a tree from before the trainer kept its heap
        pass
    else:
        keep_heap()
    import specforge_core
    import versus_reference
    from specforge_core.contracts import StepContext

    for module in (specforge_core, versus_reference):
        if not os.path.abspath(module.__file__).startswith(os.path.abspath(tree) + os.sep):
            sys.exit(f"{module.__name__} came from {module.__file__}, not from {tree}")
    strategy, model, batch, _tokens = versus_reference.build(name, dtype_name,
                                                             argparse.Namespace(ttt_length=ttt_length, compile=False,
                                                                                shapes=shapes))
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        from specforge_core.training.optim import fused_adamw
    except ImportError:  # a tree from before the trainer fused its AdamW
        fused = {}
    else:
        fused = {"fused": True} if fused_adamw(params) else {}
    optimizer = torch.optim.AdamW(params, lr=1e-4, **fused)

    def step(index: int) -> float:
        start = time.perf_counter()
        strategy.forward_loss(model, batch, StepContext(global_step=index, total_steps=1000)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(0)
    print("ready", flush=True)
    for index, line in enumerate(sys.stdin, start=1):
        if line.strip() != "step":
            break
        print(step(index), flush=True)


class _Worker:
    def __init__(self, tree: str, name: str, dtype_name: str, ttt_length: int, shapes: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", tree, name, dtype_name,
                                      str(ttt_length), shapes], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.wait()
            sys.exit(f"the {name} {dtype_name} worker of {tree} did not start (exit {self.proc.returncode})")

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def compare(commit_tree: str, commit: str, name: str, dtype_name: str, args: argparse.Namespace) -> dict:
    workers = {"here": _Worker(HERE, name, dtype_name, args.ttt_length, args.shapes),
               "commit": _Worker(commit_tree, name, dtype_name, args.ttt_length, args.shapes)}
    load_before = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {side: [] for side in workers}
    try:
        for pair in range(args.pairs):
            for side in (("here", "commit") if pair % 2 == 0 else ("commit", "here")):
                seconds[side].append(workers[side].step())
    finally:
        for proc in workers.values():
            proc.close()
    ratios = sorted(c / h for h, c in zip(seconds["here"], seconds["commit"]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"bench": "versus_commit", "commit": commit, "strategy": name, "dtype": dtype_name,
            "shapes": args.shapes, "threads": 1, "pairs": args.pairs, "cpu": args.cpu,
            "ms_here": statistics.median(seconds["here"]) * 1e3,
            "ms_commit": statistics.median(seconds["commit"]) * 1e3, "speedup": statistics.median(ratios),
            "speedup_p25": quartiles[0], "speedup_p75": quartiles[2], "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        tree, name, dtype_name, ttt_length, shapes = sys.argv[2:7]
        worker(tree, name, dtype_name, int(ttt_length), shapes)
        return
    import versus_reference  # this checkout's (the workers import their own tree's): --cpu as it takes it

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True, help="the commit to compare with (anything git rev-parse takes)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma separated (default: all)")
    parser.add_argument("--dtypes", default="float32", help="comma separated (default: float32)")
    parser.add_argument("--pairs", type=int, default=15, help="timed step pairs per comparison (default 15)")
    parser.add_argument("--ttt-length", type=int, default=7, help="EAGLE3 unroll steps (default 7)")
    parser.add_argument("--shapes", choices=("tiny", "smollm2"), default="tiny",
                        help="the dimensions, as versus_reference.py --shapes takes them (default tiny; a commit "
                             "whose versus_reference.py lacks them cannot be compared at them)")
    parser.add_argument("--cpu", type=int, default=None, help=versus_reference.CPU_HELP)
    args = parser.parse_args()
    args.cpu = versus_reference.resolve_cpu(args.cpu)
    if args.cpu is not None:  # the workers inherit it; this process only waits for them
        os.sched_setaffinity(0, {args.cpu})
    for name in args.strategies.split(","):
        if name not in STRATEGIES:
            sys.exit(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if args.pairs < 1:
        sys.exit("--pairs must be at least 1")
    found = subprocess.run(["git", "-C", HERE, "rev-parse", "--verify", f"{args.commit}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        sys.exit(f"no commit {args.commit!r} in {HERE}: {found.stderr.strip()}")
    commit = found.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="specforge-versus-commit-") as scratch:
        tree = os.path.join(scratch, "tree")
        subprocess.run(["git", "-C", HERE, "worktree", "add", "--detach", "--quiet", tree, commit], check=True)
        try:
            for name in args.strategies.split(","):
                for dtype_name in args.dtypes.split(","):
                    record = compare(tree, commit, name, dtype_name, args)
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}),
                          flush=True)
        finally:
            subprocess.run(["git", "-C", HERE, "worktree", "remove", "--force", tree], check=False)


if __name__ == "__main__":
    main()
