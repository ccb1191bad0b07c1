"""A Flower app ported from Flower's DP wrapper to fedpriv's, stage by stage (issue 47's table):
the app as it was (``DifferentialPrivacyServerSideFixedClipping`` + Flower's ``RdpAccountant``),
the accountant only (the same wrapper and noise with ``PldAccountant``), ``PrivateStrategy``
with the ``finetune`` schedule, the same with ``fedrep``, and the no-federation control (each
node's head fitted on the untrained model). The apps are in ``flower_port_app.py`` (the example
app's task: Fashion-MNIST label skew, S = 5, the MLP 784-256-128-10, its local training).

Each run is a fresh process running the apps through Flower's simulation engine
(``flwr.simulation.run_simulation``, one SuperNode per user, Ray on this machine's cores), or
with ``--engine inprocess`` through an in-memory grid (the same app code, no Flower runtime).
Seed s draws the partition, the initial model and the noise.

    python benchmarks/flower_port_compare.py                     # N = 300, T = 5, 3 seeds
    python benchmarks/flower_port_compare.py --num-nodes 20 --rounds 2 --seeds 1   # a smoke run

Prints the table; writes it with every run to ``--out`` (default
results/flower_port_compare.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flower-app"
VARIANTS = ("flower-rdp", "flower-pld", "fedpriv-finetune", "fedpriv-fedrep", "local")
EXTRA = ("fedpriv-finetune-best", "fedpriv-fedrep-best")  # run when named in --variants
LABELS = {"flower-rdp": "the app as it was (Flower's wrapper, RDP)",
          "flower-pld": "Flower's wrapper + PldAccountant",
          "fedpriv-finetune": "PrivateStrategy, finetune",
          "fedpriv-fedrep": "PrivateStrategy, fedrep",
          "local": "no federation (head on the untrained model)",
          "fedpriv-finetune-best": "PrivateStrategy, finetune, keep_best",
          "fedpriv-fedrep-best": "PrivateStrategy, fedrep, keep_best"}


def example_config() -> dict[str, Any]:
    data = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    return dict(data["tool"]["flwr"]["app"]["config"])


def child_env(tmp: Path) -> dict[str, str]:
    ray_tmp = Path(tempfile.mkdtemp(prefix="fpport", dir="/tmp"))  # Ray's socket paths: short
    path = os.pathsep.join([str(ROOT / "benchmarks"), str(EXAMPLE), str(ROOT)])
    return {**os.environ, "PYTHONPATH": path, "FLWR_HOME": str(tmp / "flwr"),
            "RAY_TMPDIR": str(ray_tmp), "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def run_one(variant: str, settings: dict[str, Any], engine: str) -> None:
    """In the child process: one run of ``variant``."""
    import flower_port_app as port

    nodes = settings["num_nodes"]
    client = port.client_app(variant, settings)
    if engine == "inprocess":
        port.serve(variant, settings, port.InProcessGrid(client, nodes))
        return
    from flwr.simulation import run_simulation
    run_simulation(port.server_app(variant, settings), client, num_supernodes=nodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": os.cpu_count() or 1,
                                                 "include_dashboard": False}})


def launch(variant: str, settings: dict[str, Any], engine: str, tmp: Path,
           timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--engine", engine,
           "--settings", json.dumps(settings)]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=child_env(tmp), cwd=tmp, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    out = Path(settings["out"])
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{variant} (seed {settings['seed']}) failed, exit "
                           f"{done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return {**json.loads(out.read_text()), "wall_s": wall}


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """flower_app_compare's summary of the runs, with the noise multiplier they shared."""
    from flower_app_compare import summary as accuracy_summary

    return {**accuracy_summary(runs), "noise_multiplier": runs[0]["noise_multiplier"]}


def main(argv: list[str] | None = None) -> int:
    app = example_config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=300, help="N: users = SuperNodes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. k-1")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--clip-norm", type=float, default=0.15, help="a fixed clip, all variants")
    parser.add_argument("--head-steps", type=int, default=app["head-steps"])
    parser.add_argument("--local-steps", type=int, default=app["local-steps"])
    parser.add_argument("--lr", type=float, default=app["learning-rate"])
    parser.add_argument("--batch-size", type=int, default=app["batch-size"])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--engine", choices=("simulation", "inprocess"), default="simulation")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--out", default=str(ROOT / "results" / "flower_port_compare.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_one(args.child, json.loads(args.settings), args.engine)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS) - set(EXTRA))
    if unknown or not variants:
        parser.error(f"--variants: {', '.join(unknown) or 'none given'}; choose among "
                     f"{', '.join(VARIANTS + EXTRA)}")
    if args.num_nodes < 1 or args.rounds < 1 or args.seeds < 1:
        parser.error("--num-nodes, --rounds and --seeds must be at least 1")

    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="flower-port-") as name:
        tmp = Path(name)
        for seed in range(args.seeds):
            for variant in variants:
                settings = {"num_nodes": args.num_nodes, "rounds": args.rounds, "seed": seed,
                            "epsilon": args.epsilon, "delta": args.delta,
                            "clip_norm": args.clip_norm, "head_steps": args.head_steps,
                            "local_steps": args.local_steps, "lr": args.lr,
                            "batch_size": args.batch_size,
                            "out": str(tmp / f"{variant}-seed{seed}.json")}
                run = launch(variant, settings, args.engine, tmp, args.timeout)
                runs[variant].append(run)
                print(f"seed {seed}  {variant:17s} accuracy {run['accuracy']:.4f}  "
                      f"epsilon {run['epsilon']:.4f}  z {run['noise_multiplier']:.3f}  "
                      f"{run['wall_s']:.0f} s", flush=True)
    table = {v: summary(r) for v, r in runs.items()}
    print(f"\nN = {args.num_nodes}, T = {args.rounds}, epsilon = {args.epsilon}, delta = "
          f"{args.delta:g}, C = {args.clip_norm}, {args.seeds} seed(s), {args.engine}")
    print(f"{'variant':46s} {'accuracy (mean ± sd)':>21s} {'min..max':>15s} {'eps printed':>11s}"
          f" {'wall s':>7s}")
    for v, s in table.items():
        print(f"{LABELS[v]:46s} {s['accuracy_mean']:>12.4f} ± {s['accuracy_sd']:.4f} "
              f"{s['accuracy_min']:>7.4f}..{s['accuracy_max']:.4f} {s['epsilon_max']:>11.4f} "
              f"{s['wall_s_mean']:>7.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "summary": table, "runs": runs},
                              indent=2))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
