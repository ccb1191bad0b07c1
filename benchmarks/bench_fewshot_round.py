"""Seconds per round of few-shot Meta-NSGD with every task in every round (issue 50's speed
target: 10,000 tasks a round in-process on the MLP), through the real in-process engine (the
nodes' meta-gradients, the server's clipping bound, noise and accounting). Prints one row per
path: ghost clipping (the default) and per-task gradients (``torch.func``; what a body with
other layers takes).

    python benchmarks/bench_fewshot_round.py                       # Fashion-MNIST, 10,000 tasks
    python benchmarks/bench_fewshot_round.py --tasks 2000 --source digits --hidden 16
    python benchmarks/bench_fewshot_round.py --paths ghost --malloc system   # glibc's defaults
"""

from __future__ import annotations

import argparse

import torch

from fedpriv import allocator
from fedpriv.algorithms.fewshot import fewshot_math as fm
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=10_000)
    p.add_argument("--source", default="fashion-mnist")
    p.add_argument("--hidden", default="256")
    p.add_argument("--model", default="mlp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--paths", default="ghost,per-task")
    p.add_argument("--chunk-mb", type=int, default=0, help="0: the default")
    p.add_argument("--malloc", choices=["fedpriv", "system"], default="fedpriv",
                   help="fedpriv: the malloc settings of fedpriv's own processes (the fedpriv "
                        "command calls fedpriv.allocator.tune()); system: glibc's defaults")
    a = p.parse_args()
    tuned = a.malloc == "fedpriv" and allocator.tune()
    config = parse_config({
        "algorithm": "fewshot-meta-nsgd", "task-source": a.source, "num-users": a.tasks,
        "tasks-per-round": a.tasks, "rounds": a.rounds, "hidden-sizes": a.hidden,
        "model": a.model, "epsilon": 1.0, "delta": 1e-5, "clip-norm": 1.0,
        **({"chunk-mb": a.chunk_mb} if a.chunk_mb else {})})
    print(f"{a.tasks} tasks a round, 5-way 5-shot, 15 queries ({a.tasks * 100:,} images), "
          f"{a.model} {a.hidden}, {a.nodes} node(s), torch threads {torch.get_num_threads()}, "
          f"allocator {'tuned' if tuned else 'system'}")
    print(f"{'path':10s} {'s/round (each)':>28s} {'tasks/s':>9s}")
    ghost = fm.ghost_gradient_sum
    for path in a.paths.split(","):
        if path == "per-task":
            fm.ghost_gradient_sum = lambda *args, **kw: None  # type: ignore[assignment]
        out = run_in_process(config, num_partitions=a.nodes, log=lambda _: None)
        fm.ghost_gradient_sum = ghost
        rounds = [r["seconds"] for r in out["rounds"] if r["step"].startswith("round")]
        each = ", ".join(f"{r:.1f}" for r in rounds)
        print(f"{path:10s} {each:>28s} {a.tasks / min(rounds):9.0f}", flush=True)


if __name__ == "__main__":
    main()
