"""The Flower app of examples/flower-app (a plain Flower PyTorch app plus the fedpriv lines of
docs/tutorials/flower-app.md) against fedpriv's own ``deep-dp-fedavg-ft``, with the same users,
the same hyperparameters and the same seeds.

The app runs through the real ``flwr run`` (Flower's simulation engine, one SuperNode per user,
on a local SuperLink of its own: private FLWR_HOME, free ports, stopped after each run);
``deep-dp-fedavg-ft`` runs in-process (``fedpriv run --engine inprocess``). fedpriv's keys are
derived from the app's own run config (``[tool.flwr.app.config]`` of its pyproject.toml, with
the overrides below), so the two cannot drift apart:

=====================  ==========================================================
app (run config)       fedpriv ``deep-dp-fedavg-ft``
=====================  ==========================================================
num-users              num-users (and num-supernodes: one node = one user)
num-server-rounds      rounds
learning-rate          local-lr (one SGD step of each user's whole model)
local-steps            body-steps
batch-size = 2b        local-batch-size = b (two disjoint batches of b: 2b rows)
clip-norm              clip-norm
clip-quantile          clip-quantile (adaptive clipping; clip-lr 0.2, count share 0.05)
head-steps, head-lr    final-head-steps, head-lr (each user's head fine-tuned at the end)
FedAvg                 learning-rate = 1, server-momentum = 0
=====================  ==========================================================

Both use fedpriv's label-skew partition of Fashion-MNIST (S = 5 classes per user) for the given
seed, the MLP 784-256-128-10 initialized from the seed, and the PLD accountant. The accuracy is
the mean over users of each user's test accuracy after its fine-tuning (the app's: the exact
``eval_acc`` of the operator report, averaged over nodes; fedpriv's: ``accuracy``).

    python benchmarks/flower_app_compare.py                       # N = 2000, 3 seeds (long)
    python benchmarks/flower_app_compare.py --num-nodes 50 --rounds 2 --seeds 1   # a smoke run

Writes the table and every run's figures to ``--out`` (default results/flower_app_compare.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower-app"
EPSILON_LINE = re.compile(r"fedpriv: epsilon spent = ([0-9.]+) at delta")


def app_config() -> dict[str, Any]:
    """The app's run config as its pyproject.toml declares it."""
    data = tomllib.loads((APP / "pyproject.toml").read_text())
    return dict(data["tool"]["flwr"]["app"]["config"])


def fedpriv_keys(app: dict[str, Any]) -> dict[str, Any]:
    """fedpriv's ``deep-dp-fedavg-ft`` keys for the app's run config (the module's table)."""
    if app["batch-size"] % 2:
        raise SystemExit("batch-size: fedpriv's round steps on two batches of b rows: use an "
                         "even batch-size (2b)")
    return {
        "algorithm": "deep-dp-fedavg-ft", "dataset": "fashion-mnist", "partition": "label-skew",
        "classes-per-user": 5, "model": "mlp", "hidden-sizes": "256,128",
        "num-users": app["num-users"], "rounds": app["num-server-rounds"],
        "seed": app["seed"], "epsilon": app["epsilon"], "delta": app["delta"],
        "local-lr": app["learning-rate"], "body-steps": app["local-steps"],
        "local-batch-size": str(app["batch-size"] // 2), "clip-norm": app["clip-norm"],
        "clip-quantile": app["clip-quantile"], "final-head-steps": app["head-steps"],
        "head-lr": app["head-lr"], "learning-rate": 1.0, "server-momentum": 0.0,
        "users-per-round": 0, "max-rows-per-user": 1000,
        "final-choice": "off",  # the app fine-tunes every user's head: compare like with like
    }


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def run_app(config: dict[str, Any], nodes: int, workdir: Path, timeout: float,
            verbose: bool) -> dict[str, Any]:
    """One ``flwr run`` of the example on a local SuperLink of its own; the accuracy and the
    epsilon it printed, and the wall time."""
    from fedpriv.launcher import LocalSuperLink

    short = Path(tempfile.mkdtemp(prefix="fpapp", dir="/tmp"))  # Ray's socket paths: short
    link = LocalSuperLink.choose(str(short))
    (short / "ray").mkdir()
    env = link.env({**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "FLWR_TELEMETRY_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    "RAY_TMPDIR": str(short / "ray")})
    report = workdir / f"app-seed{config['seed']}.json"
    overrides = {**config, "results-path": str(report)}
    run_config = workdir / f"app-seed{config['seed']}.toml"
    run_config.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in overrides.items()))
    cmd = ["flwr", "run", str(APP), "--stream", "--run-config", str(run_config),
           "--federation-config", f"num-supernodes={nodes} client-resources-num-cpus=1"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=timeout)
        wall = time.perf_counter() - start  # flwr run's, start-up included
    finally:
        link.stop()
        shutil.rmtree(short, ignore_errors=True)
    log = done.stdout + done.stderr
    if verbose:
        print(log[-4000:], file=sys.stderr)
    printed = EPSILON_LINE.findall(log)
    if done.returncode != 0 or not report.is_file() or not printed:
        raise RuntimeError(f"flwr run failed (exit {done.returncode}):\n{log[-3000:]}")
    rows = json.loads(report.read_text())["rounds"]
    metrics = next(r["exact_metrics"] for r in reversed(rows) if "exact_metrics" in r)
    return {"accuracy": metrics["eval_acc"], "epsilon": float(printed[-1]),
            "wall_s": wall, "report": str(report)}


def run_fedpriv(keys: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """One in-process ``fedpriv run`` of deep-dp-fedavg-ft."""
    out = workdir / f"fedpriv-seed{keys['seed']}.json"
    cmd = [sys.executable, "-m", "fedpriv.cli", "run", "--engine", "inprocess", "--out",
           str(out)]
    for key, value in keys.items():
        cmd += ["--set", f"{key}={value}"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"fedpriv run failed (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    report = json.loads(out.read_text())
    return {"accuracy": report["metrics"]["accuracy"],
            "epsilon": report["privacy"]["epsilon"], "wall_s": wall, "report": str(out)}


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    acc = [r["accuracy"] for r in runs]
    return {"accuracy_mean": statistics.fmean(acc),
            "accuracy_sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "accuracy_min": min(acc), "accuracy_max": max(acc),
            "epsilon_max": max(r["epsilon"] for r in runs),
            "wall_s_mean": statistics.fmean(r["wall_s"] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=2000, help="N: users = SuperNodes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. k-1")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per run")
    parser.add_argument("--out", default=str(ROOT / "results" / "flower_app_compare.json"))
    parser.add_argument("--verbose", action="store_true", help="print the end of each log")
    args = parser.parse_args(argv)

    base = {**app_config(), "num-users": args.num_nodes, "num-server-rounds": args.rounds,
            "epsilon": args.epsilon, "delta": args.delta}
    runs: dict[str, list[dict[str, Any]]] = {"flower-app": [], "deep-dp-fedavg-ft": []}
    with tempfile.TemporaryDirectory(prefix="flower-app-compare-") as tmp:
        workdir = Path(tmp)
        for seed in range(args.seeds):
            config = {**base, "seed": seed}
            app = run_app(config, args.num_nodes, workdir, args.timeout, args.verbose)
            own = run_fedpriv(fedpriv_keys(config), workdir, args.timeout)
            for name, run in (("flower-app", app), ("deep-dp-fedavg-ft", own)):
                run.pop("report")
                runs[name].append({"seed": seed, **run})
                print(f"seed {seed}  {name:18s} accuracy {run['accuracy']:.4f}  "
                      f"epsilon {run['epsilon']:.4f}  {run['wall_s']:.0f} s", flush=True)
    table = {name: summary(r) for name, r in runs.items()}
    print(f"\nN = {args.num_nodes}, T = {args.rounds}, epsilon = {args.epsilon}, "
          f"delta = {args.delta:g}, {args.seeds} seed(s)")
    print(f"{'method':20s} {'accuracy (mean ± sd)':>22s} {'min..max':>15s} {'epsilon':>8s} "
          f"{'wall s':>8s}")
    for name, s in table.items():
        print(f"{name:20s} {s['accuracy_mean']:>13.4f} ± {s['accuracy_sd']:.4f} "
              f"{s['accuracy_min']:>7.4f}..{s['accuracy_max']:.4f} {s['epsilon_max']:>8.4f} "
              f"{s['wall_s_mean']:>8.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": {**vars(args), "app_config": base},
                               "fedpriv_keys": fedpriv_keys({**base, "seed": 0}),
                               "summary": table, "runs": runs}, indent=2))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
