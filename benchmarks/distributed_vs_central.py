"""Benchmark: distributed (Skellam shares, secure aggregation mod 2^b) vs central Gaussian noise.

Issue 36's judged comparisons, RDP accounting on both sides (``accountant = "rdp"``), paired
seeds (each mode runs the same seeds, so data, partitions and batches agree), in-process with
``num_partitions`` K = 10 nodes:

1. Snedeker setting (configs/private_fedrep.toml, n = 20,000): central, distributed,
   distributed with 10% of the nodes crashing in every step, and central with the same crashes
   (reference). Metric: population MSE (lower is better). Judged: the ratio of seed means
   distributed / central is at most 1.05.
2. Fashion-MNIST, label skew, N = 2,000, epsilon = 1 (configs/figure_fmnist_label_skew.toml:
   [base] plus the series of deep-private-fedrep and deep-dp-fedavg-ft, each with its own
   keys), users-per-round = 0 (no server sampling, which distributed mode refuses): central,
   distributed, distributed with 10% crashing. Metric: mean per-user test accuracy. Judged:
   distributed within 1 accuracy point of central (seed means).

    python benchmarks/distributed_vs_central.py --quick   # smoke: n = 2000, N = 300, 1 seed
    python benchmarks/distributed_vs_central.py           # the judged setting, seeds 0-2
    python benchmarks/distributed_vs_central.py --only snedeker --seeds 0 1

    python benchmarks/distributed_vs_central.py --only snedeker --seeds 0 1 2 3 4 5 6 7 8 9 \
        --repeats 5 --out results/distributed_vs_central_snedeker_10x5.json
    python benchmarks/distributed_vs_central.py --only fmnist --fmnist-reference \
        --modes central:0.1 --out results/distributed_vs_central_fmnist_ref.json
    python benchmarks/distributed_vs_central.py --table results/a.json results/b.json

Pairing: a seed fixes the data, the partition, the batches, which nodes crash and central's
noise; distributed noise comes from each node's OS-seeded CSPRNG by design, so it differs on
every run, even at the same seed and noise-seed. ``--repeats R`` averages R noise draws per
seed and mode (central: noise-seed 1000 seed + r for r > 0) to take that spread out.

Every finished run is appended to the JSON at ``--out`` at once (metric, epsilon, wall time,
the noise multipliers and the privacy ledger), so a partial run keeps what it measured;
``--table`` prints the table of saved files together (give a setting's modes once: runs of
the same setting, mode and seed in two files are pooled as extra draws).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
import tomllib
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedpriv.configure import parse_config  # noqa: E402
from fedpriv.engine import run_in_process  # noqa: E402
from fedpriv.server.report import measured_metrics  # noqa: E402

NODES = 10
DROPOUT = 0.1
FMNIST_ALGORITHMS = ("deep-private-fedrep", "deep-dp-fedavg-ft")

# (mode label, overrides on top of the setting's keys)
CENTRAL = ("central", {"aggregation": "central", "node-fault-rate": 0.0})
DISTRIBUTED = ("distributed", {"aggregation": "distributed", "node-fault-rate": 0.0})
DIST_DROP = ("distributed", {"aggregation": "distributed", "node-fault-rate": DROPOUT,
                             "node-fault-kind": "crash"})
CENTRAL_DROP = ("central", {"aggregation": "central", "node-fault-rate": DROPOUT,
                            "node-fault-kind": "crash"})


def snedeker_values(quick: bool) -> dict[str, Any]:
    """The keys of configs/private_fedrep.toml (without results-path), accountant = rdp."""
    with open(ROOT / "configs" / "private_fedrep.toml", "rb") as f:
        values = tomllib.load(f)
    values.pop("results-path", None)
    values["accountant"] = "rdp"
    if quick:
        values["num-users"] = 2000
    return values


def fmnist_values(algorithm: str, quick: bool) -> dict[str, Any]:
    """[base] of configs/figure_fmnist_label_skew.toml plus the series of ``algorithm`` (its
    ``set`` keys applied), epsilon = 1, accountant = rdp, users-per-round = 0."""
    with open(ROOT / "configs" / "figure_fmnist_label_skew.toml", "rb") as f:
        sweep = tomllib.load(f)
    series = [s for s in sweep["series"] if s["algorithm"] == algorithm]
    if len(series) != 1:
        raise SystemExit(f"{algorithm}: expected one series in the figure config, "
                         f"found {len(series)}")
    values = {**sweep["base"], "algorithm": algorithm, **series[0].get("set", {}),
              "epsilon": 1.0, "accountant": "rdp", "users-per-round": 0}
    if quick:
        values["num-users"] = 300
    return values


def settings(quick: bool, only: Sequence[str] | None,
             fmnist_reference: bool = False) -> list[dict[str, Any]]:
    """Each setting: name, keys, metric, whether lower is better, modes (label, overrides).
    ``fmnist_reference``: Fashion-MNIST also runs central with the same crashes."""
    out = [{"name": "snedeker private-fedrep", "group": "snedeker",
            "values": snedeker_values(quick), "metric": ("population_mse",),
            "lower_better": True, "modes": [CENTRAL, DISTRIBUTED, DIST_DROP, CENTRAL_DROP]}]
    for algorithm in FMNIST_ALGORITHMS:
        out.append({"name": f"fmnist {algorithm}", "group": "fmnist",
                    "values": fmnist_values(algorithm, quick),
                    "metric": ("test_accuracy", "accuracy"), "lower_better": False,
                    "modes": [CENTRAL, DISTRIBUTED, DIST_DROP]
                    + ([CENTRAL_DROP] if fmnist_reference else [])})
    return [s for s in out if not only or s["group"] in only]


def jsonable(x: Any) -> Any:
    """numpy scalars/arrays and tuples to plain JSON values."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def one_run(values: dict[str, Any], overrides: dict[str, Any], seed: int,
            metric_keys: Sequence[str]) -> dict[str, Any]:
    """Run one (mode, seed) in-process; the record keeps the metric, epsilon and ledger."""
    config = parse_config({**values, **overrides, "seed": seed})
    started = time.perf_counter()
    r = run_in_process(config, num_partitions=NODES, log=lambda _: None)
    metrics = measured_metrics(r)  # a distributed server receives none: the simulator's
    key = next((k for k in metric_keys if k in metrics), None)
    if key is None:
        raise KeyError(f"none of {list(metric_keys)} in metrics {sorted(metrics)}")
    failed = [row.get("nodes_failed", 0) for row in r.get("rounds", [])]
    return {"metric_key": key, "metric": float(metrics[key]), "metrics": jsonable(metrics),
            "epsilon": float(r["privacy"]["epsilon"]),
            "target_epsilon": jsonable(r["privacy"].get("target_epsilon")),
            "noise_multipliers": jsonable(r["privacy"].get("noise_multipliers")),
            "ledger": jsonable(r["privacy"].get("ledger")),
            "nodes_failed_per_step": failed, "wall_time_s": float(r["wall_time_s"]),
            "elapsed_s": time.perf_counter() - started}


def seed_means(runs: dict[int, list[dict[str, Any]]]) -> dict[int, float]:
    """Each seed's metric, averaged over its repeats."""
    return {seed: statistics.mean(r["metric"] for r in rs) for seed, rs in runs.items() if rs}


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def gap_text(central: dict[int, float], other: dict[int, float], lower_better: bool) -> str:
    """Paired gap to central: ratio of seed means and per seed (MSE), or the difference in
    accuracy points (accuracy)."""
    seeds = sorted(set(central) & set(other))
    if not seeds:
        return "-"
    c = statistics.mean(central[s] for s in seeds)
    o = statistics.mean(other[s] for s in seeds)
    if lower_better:
        per = ", ".join(f"{other[s] / central[s]:.3f}" for s in seeds)
        return f"ratio {o / c:.3f} (per seed {per})"
    per = ", ".join(f"{100 * (other[s] - central[s]):+.2f}" for s in seeds)
    return f"{100 * (o - c):+.2f} pt (per seed {per})"


def judged(central: dict[int, float], dist: dict[int, float], lower_better: bool) -> str:
    seeds = sorted(set(central) & set(dist))
    if not seeds:
        return "n/a"
    c = statistics.mean(central[s] for s in seeds)
    d = statistics.mean(dist[s] for s in seeds)
    ok = d <= 1.05 * c if lower_better else d >= c - 0.01
    return "PASS" if ok else "FAIL"


MODE_ORDER = [("central", 0.0), ("distributed", 0.0), ("distributed", DROPOUT),
              ("central", DROPOUT)]


def table(runs: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The table's rows and the judged verdicts, from run records (``record["runs"]``, or
    several files' runs together): per setting, mode and dropout, the seed means (each seed's
    metric averaged over its noise draws) and the paired gap to central without faults."""
    rows: list[str] = []
    verdicts: dict[str, dict[str, str]] = {}
    for name in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == name]
        lower_better = mine[0]["metric_key"] not in ("accuracy", "test_accuracy")
        by_mode: dict[tuple[str, float], dict[int, list[dict[str, Any]]]] = {}
        for r in mine:
            by_mode.setdefault((r["mode"], float(r["dropout"])), {}).setdefault(
                int(r["seed"]), []).append(r)
        central = seed_means(by_mode.get(("central", 0.0), {}))
        for mode in sorted(by_mode, key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER
                           else len(MODE_ORDER)):
            label, rate = mode
            vals = seed_means(by_mode[mode])
            m, sd = mean_std(list(vals.values()))
            flat = [v for rs in by_mode[mode].values() for v in rs]
            eps = sorted({round(v["epsilon"], 4) for v in flat})
            wall = statistics.mean(v["wall_time_s"] for v in flat)
            draws = len(flat) // max(len(vals), 1)
            gap = "-" if mode == ("central", 0.0) else gap_text(central, vals, lower_better)
            rows.append(f"| {name} | {label} | {rate:.0%} | {len(vals)} x {draws} | "
                        f"{flat[0]['metric_key']} {m:.4g} ± {sd:.2g} | "
                        f"{', '.join(f'{e:.4f}' for e in eps)} | {wall:.1f} | {gap} |")
        dist = seed_means(by_mode.get(("distributed", 0.0), {}))
        verdict = judged(central, dist, lower_better)
        bar = "ratio of seed means <= 1.05" if lower_better else "within 1 point"
        verdicts[name] = {"verdict": verdict, "criterion": bar}
        rows.append(f"| {name} | judged: distributed vs central ({bar}) | | | {verdict} "
                    "| | | |")
    return rows, verdicts


def print_table(rows: Sequence[str]) -> None:
    print("| setting | mode | dropout | seeds x draws | seed-mean metric ± std (over seeds) | "
          "epsilon reported | wall s (mean) | gap to central (paired seeds) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke setting: Snedeker n = 2000, FMNIST N = 300, seed 0 only")
    parser.add_argument("--seeds", type=int, nargs="*", default=None,
                        help="seeds (default 0 1 2; --quick: 0)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="noise draws per seed and mode (the per-seed metric is their "
                        "mean); repeat r > 0 sets central's noise-seed to 1000 seed + r")
    parser.add_argument("--fmnist-reference", action="store_true",
                        help="Fashion-MNIST: also central with 10%% of the nodes crashing")
    parser.add_argument("--modes", nargs="*", help="run only these modes, as label:dropout "
                        "(e.g. central:0.1 distributed:0.0)")
    parser.add_argument("--only", nargs="*", choices=("snedeker", "fmnist"),
                        help="run only these settings")
    parser.add_argument("--out", default=str(ROOT / "results" / "distributed_vs_central.json"))
    parser.add_argument("--table", nargs="*", metavar="JSON",
                        help="run nothing: print the table of these results files together")
    args = parser.parse_args()
    if args.table:
        runs = [r for f in args.table for r in json.loads(Path(f).read_text())["runs"]]
        print_table(table(runs)[0])
        return
    seeds = args.seeds if args.seeds else ([0] if args.quick else [0, 1, 2])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"quick": args.quick, "seeds": seeds, "repeats": args.repeats,
                              "nodes": NODES, "dropout": DROPOUT, "runs": [], "errors": []}
    started = time.perf_counter()
    for s in settings(args.quick, args.only, args.fmnist_reference):
        if args.modes:
            s["modes"] = [(lab, o) for lab, o in s["modes"] if
                          f"{lab}:{float(o.get('node-fault-rate', 0.0))}" in args.modes]
        for seed, rep in itertools.product(seeds, range(args.repeats)):  # seed-major
            # repeat r > 0: a fresh noise draw (central: noise-seed; distributed: its nodes'
            # CSPRNGs are OS-seeded, so every run draws fresh noise anyway)
            extra = {"noise-seed": 1000 * seed + rep} if rep else {}
            for label, overrides in s["modes"]:
                rate = float(overrides.get("node-fault-rate", 0.0))
                try:
                    run = one_run(s["values"], {**overrides, **extra}, seed, s["metric"])
                except Exception as exc:  # the integration is new: report, keep going
                    err = {"setting": s["name"], "mode": label, "dropout": rate, "seed": seed,
                           "repeat": rep, "error": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc()}
                    record["errors"].append(err)
                    print(f"  ERROR {s['name']} {label} dropout={rate} seed={seed}: "
                          f"{err['error']}", flush=True)
                    continue
                record["runs"].append({"setting": s["name"], "mode": label, "dropout": rate,
                                       "seed": seed, "repeat": rep, **run})
                out.write_text(json.dumps(record, indent=1))
                print(f"  {s['name']:<32} {label:<11} dropout={rate:.1f} seed={seed} r={rep} "
                      f"{run['metric_key']}={run['metric']:.5g} eps={run['epsilon']:.4f} "
                      f"wall={run['wall_time_s']:.1f}s", flush=True)
    rows, record["judged"] = table(record["runs"])
    record["total_s"] = time.perf_counter() - started
    out.write_text(json.dumps(record, indent=1))
    print(f"\nseeds {seeds} x {args.repeats} noise draw(s), K = {NODES} nodes, accountant rdp, "
          f"dropout = crash of {DROPOUT:.0%} of the nodes in every step; "
          f"total {record['total_s']:.0f} s; results: {out}\n")
    print_table(rows)
    if record["errors"]:
        print(f"\n{len(record['errors'])} run(s) raised; see 'errors' in {out}")


if __name__ == "__main__":
    main()
