"""Private tuning at one total epsilon: random stopping, the composed baseline, and the
hyperparameters nobody accounted for.

    python benchmarks/bench_tuning.py [--config configs/tune_private_fedrep.toml] [--users N]

Runs, at the tuning file's setting and its total (epsilon, delta):

1. ``fedpriv tune`` as configured (random stopping, Papernot & Steinke 2022);
2. the composed baseline over the same space: round(E[K]) random candidates, every one run once
   and all their releases composed (each candidate gets less);
3. the project's defaults (``configs/private_fedrep.toml``) and 4. the paper's hyperparameters
   (``configs/snedeker2025_paper_hparams.toml``), each one run at the total epsilon, with the
   choice of its hyperparameters not accounted (the defaults were picked on a grid scored on U*).

Prints one Markdown table: population MSE (exact, operator), the per-candidate epsilon and the
number of candidates run. Outputs go under results/bench_tuning/ (ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from fedpriv.config_files import load_run_config  # noqa: E402
from fedpriv.configure import parse_config  # noqa: E402
from fedpriv.engine import run_in_process  # noqa: E402
from fedpriv.tuning.run import run_tuning, select  # noqa: E402
from fedpriv.tuning.spec import load_tune  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tune_private_fedrep.toml"))
    ap.add_argument("--users", type=int, help="override num-users")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_tuning"))
    args = ap.parse_args()
    sets = [f"num-users={args.users}"] if args.users else []
    spec = load_tune(args.config, sets)
    out = Path(args.out)
    rows = []

    def tuned(label: str, which) -> None:
        t0 = time.perf_counter()
        report = run_tuning(which, out / label.split()[0], log=lambda line: print("  " + line,
                                                                                  flush=True))
        if not report["candidates"]:
            print(f"  {label}: no candidate ran (K = 0)")
            return
        best = select(report["candidates"], which.maximize)
        rows.append((label, best["population_mse"], report["tuning"]["epsilon"],
                     report["tuning"]["candidate_target_epsilon"], report["candidates_run"],
                     time.perf_counter() - t0))

    tuned("random-stopping (Papernot & Steinke)", spec)
    composed = dataclasses.replace(spec, method="compose-all", repetitions=None,
                                   candidates=round(spec.repetitions.mean))
    tuned("compose-all (every candidate composed)", composed)
    for label, path in (("defaults, selection not accounted", "private_fedrep.toml"),
                        ("paper's hyperparameters", "snedeker2025_paper_hparams.toml")):
        values = load_run_config(str(ROOT / "configs" / path), sets)
        values.update({"epsilon": spec.epsilon, "delta": spec.delta,
                       "seed": spec.base.get("seed", 0), "checkpoint": False})
        t0 = time.perf_counter()
        res = run_in_process(parse_config(values, strict=True), log=lambda _: None)
        rows.append((label, res["metrics"]["population_mse"], res["privacy"]["epsilon"],
                     res["privacy"]["epsilon"], 1, time.perf_counter() - t0))
    print(f"\nn = {spec.base['num-users']}, total (epsilon {spec.epsilon:g}, delta "
          f"{spec.delta:g}), data seed {spec.base.get('seed', 0)}")
    print("| hyperparameters | population MSE | total epsilon | epsilon per run | runs | "
          "wall s |")
    print("|---|---|---|---|---|---|")
    for label, mse, total, each, runs, wall in rows:
        print(f"| {label} | {mse:.3g} | {total:.3g} | {each:.3g} | {runs} | {wall:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
