"""Never worse than training alone: each user's final choice, measured.

Runs each (setting, method, seed) once with ``final-choice = "best"`` (the default) in-process
and prints, per setting and method, the mean over seeds of: the method without the choice
(``accuracy_shared``: the same run's shared model, which is what ``final-choice = "off"``
reports, and the release is the same; a test checks both), with the choice (``accuracy``), the
users' local models (``accuracy_local``), the share of users keeping the shared model, a mix
and the local model, and the share more than 5 points below their own local model without and
with the choice. The linear family prints population MSE instead (lower is better).

    python benchmarks/bench_final_choice.py                     # the deep table (~40 min, 2 cores)
    python benchmarks/bench_final_choice.py --family linear     # the linear table (~1 min)
    python benchmarks/bench_final_choice.py --seeds 0 --settings n2000 --set rounds=2
    python benchmarks/bench_final_choice.py --methods deep-local-only     # the baseline

Default: Fashion-MNIST label skew, epsilon 1, every other key at its default, seeds 0, 1, 2
(docs: results, "Each user's final choice"; the settings of docs/defaults.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedpriv.config_files import parse_overrides
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process

DEEP_BASE = {"dataset": "fashion-mnist", "epsilon": 1.0}
DEEP_SETTINGS: dict[str, dict[str, Any]] = {
    "n2000": {"num-users": 2000},
    "n6000": {"num-users": 6000},
    "n1000": {"num-users": 1000},
    "S2": {"num-users": 2000, "classes-per-user": 2},
    "iid": {"num-users": 2000, "partition": "iid"},
}
DEEP_METHODS = ("deep-private-fedrep", "deep-dp-fedavg-ft")
DEEP_COLUMNS = ("accuracy_shared", "accuracy", "accuracy_local", "chose_shared", "chose_mix",
                "chose_local", "below_local_without_choice", "below_local", "accuracy_linear",
                "accuracy_model")  # the last two: deep-local-only's learners (--methods)

LINEAR_BASE: dict[str, Any] = {"num-users": 2000}
LINEAR_SETTINGS: dict[str, dict[str, Any]] = {
    f"eps{e}": {"epsilon": e} for e in (0.25, 1.0, 4.0)}
LINEAR_METHODS = ("private-fedrep", "priv-altmin")
LINEAR_COLUMNS = ("population_mse_shared", "population_mse", "local_only_mse", "chose_shared",
                  "chose_mix", "chose_local")


def measure(values: dict[str, Any], out: Path) -> dict[str, float]:
    config = parse_config({**values, "checkpoint": False, "results-path": str(out)})
    metrics: dict[str, float] = run_in_process(config, log=lambda _: None)["metrics"]
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("deep", "linear"), default="deep")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated")
    parser.add_argument("--settings", default="", help="comma-separated names (default: all)")
    parser.add_argument("--methods", default="", help="comma-separated (default: both)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a key for every run (e.g. dataset=digits)")
    args = parser.parse_args()
    deep = args.family == "deep"
    base = dict(DEEP_BASE if deep else LINEAR_BASE)
    overrides = parse_overrides(args.set)  # win over the settings' keys too
    settings = DEEP_SETTINGS if deep else LINEAR_SETTINGS
    names = [s for s in args.settings.split(",") if s] or list(settings)
    methods = [m for m in args.methods.split(",") if m] or list(
        DEEP_METHODS if deep else LINEAR_METHODS)
    seeds = [int(s) for s in args.seeds.split(",")]
    columns = DEEP_COLUMNS if deep else LINEAR_COLUMNS
    print("| setting | method | " + " | ".join(columns) + " | accuracy per seed | s/run |")
    print("|---|---|" + "---|" * (len(columns) + 2))
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for method in methods:
                rows, start = [], time.perf_counter()
                for seed in seeds:
                    values = {**base, **settings[name], **overrides, "algorithm": method,
                              "seed": seed}
                    rows.append(measure(values, Path(tmp) / "r.json"))
                per_run = (time.perf_counter() - start) / len(seeds)
                means = [float(np.mean([r.get(c, np.nan) for r in rows])) for c in columns]
                cells = " | ".join("—" if np.isnan(v) else f"{v:.4f}" for v in means)
                key = "accuracy" if deep else "population_mse"
                seeds_cell = " / ".join(f"{r[key]:.4f}" for r in rows)
                print(f"| {name} | {method} | {cells} | {seeds_cell} | {per_run:.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
