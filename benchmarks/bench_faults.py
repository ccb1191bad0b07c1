"""Benchmark: every private algorithm with a fraction of its nodes failing in every step.

For each shipped config it runs the same seeds fault-free and with ``--rate`` of the nodes
failing (``node-fault-kind``), in-process, and prints the utility of both, their ratio, and the
epsilon the accountant reports for each (they must be equal: the mean is over the population
fixed in advance, so the noise and the accounting do not change when nodes fail).

    python benchmarks/bench_faults.py                      # 20% crash, 3 seeds, every algorithm
    python benchmarks/bench_faults.py --rate 0.5 --kind timeout --seeds 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from fedpriv.config_files import load_run_config  # noqa: E402
from fedpriv.configure import parse_config  # noqa: E402
from fedpriv.engine import run_in_process  # noqa: E402

# (label, config file, overrides, metric, lower is better)
CASES = [
    ("private-fedrep", "private_fedrep.toml", {}, "population_mse", True),
    ("priv-altmin", "priv_altmin.toml", {}, "population_mse", True),
    ("dp-global-model", "private_fedrep.toml", {"algorithm": "dp-global-model"},
     "population_mse", True),
    ("meta-nsgd", "meta_nsgd.toml", {}, "transfer_risk", True),
    ("dp-ftmrl", "meta_nsgd.toml", {"algorithm": "dp-ftmrl"}, "transfer_risk", True),
    ("private-meta-cluster", "meta_cluster.toml", {}, "transfer_risk", True),
    ("a-exp", "a_exp.toml", {}, "population_mse", True),
    ("jl-exp", "jl_exp.toml", {}, "test_accuracy", False),
]


def run(values: dict, seed: int, rate: float, kind: str) -> dict:
    config = parse_config({**values, "seed": seed, "node-fault-rate": rate,
                                     "node-fault-kind": kind, "users-per-node": 0})
    return run_in_process(config, log=lambda _: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=0.2)
    parser.add_argument("--kind", default="crash", choices=("crash", "timeout", "corrupt"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="algorithm labels to run")
    args = parser.parse_args()
    print(f"| algorithm | metric | fault-free (mean over {args.seeds} seeds) | "
          f"{args.rate:.0%} of nodes failing ({args.kind}) | worst ratio over seeds | "
          "epsilon fault-free / faulty | wall s |")
    print("|---|---|---|---|---|---|---|")
    for label, file, overrides, metric, lower_better in CASES:
        if args.only and label not in args.only:
            continue
        values = {**load_run_config(str(ROOT / "configs" / file), []), **overrides}
        started = time.perf_counter()
        clean, faulty, ratios, eps = [], [], [], set()
        for seed in range(args.seeds):
            a, b = run(values, seed, 0.0, args.kind), run(values, seed, args.rate, args.kind)
            clean.append(a["metrics"][metric])
            faulty.append(b["metrics"][metric])
            ratio = b["metrics"][metric] / a["metrics"][metric]
            ratios.append(ratio if lower_better else 1.0 / ratio)
            eps.add((a["privacy"]["epsilon"], b["privacy"]["epsilon"]))
            assert all(r["nodes_failed"] >= 1 for r in b["rounds"]), "no node failed"
        eps_text = "; ".join(f"{x:.4f} / {y:.4f}" for x, y in sorted(eps))
        print(f"| {label} | {metric} | {statistics.mean(clean):.4g} | "
              f"{statistics.mean(faulty):.4g} | {max(ratios):.3f} | {eps_text} | "
              f"{time.perf_counter() - started:.0f} |", flush=True)


if __name__ == "__main__":
    main()
