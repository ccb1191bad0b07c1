"""The secure-aggregation scaling figure of docs/results.md: seconds per round and bytes a node
sends and receives per round against the node count, for fedpriv's secure, distributed and
central modes (``bench_secure_aggregation.py``'s JSON) and Flower's own SecAgg+
(``bench_flower_secaggplus.py``'s JSON; a node count that timed out is drawn as an open marker
at its time limit).

    python benchmarks/plot_secure_scaling.py results/bench_secure/bench.json \\
        results/flower_secaggplus.json --out docs/figures/secure_scaling.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

STYLE = {"secure": "-o", "distributed": "--s", "central": ":^"}


def fedpriv_points(record: dict[str, Any], engine: str) -> dict[str, list[tuple[int, float,
                                                                               float]]]:
    """{mode: [(nodes, seconds per round, KiB a node per round)]} of one engine's runs; bytes
    the engine did not count are the in-process run's (the same messages), else NaN."""
    payload = {(r["mode"], r["nodes"]): r for r in record["runs"]
               if "error" not in r and r.get("to_per_round") is not None}
    out: dict[str, list[tuple[int, float, float]]] = {}
    for run in record["runs"]:
        if "error" in run or run["engine"] != engine:
            continue
        sized = payload.get((run["mode"], run["nodes"]))
        kib = ((sized["to_per_round"] + sized["from_per_round"]) / run["nodes"] / 1024
               if sized else float("nan"))
        out.setdefault(run["mode"], []).append((run["nodes"], run["s_per_round"], kib))
    return {mode: sorted(points) for mode, points in out.items()}


def flower_points(record: dict[str, Any]) -> tuple[list[tuple[int, float, float]],
                                                   list[tuple[int, float, float]]]:
    """Flower's SecAgg+ runs (nodes, s/round, KiB a node): the completed ones, and the ones
    that timed out (the rounds they finished, else the time limit)."""
    done, late = [], []
    for run in record["runs"]:
        kib = ((run.get("to_per_node_round") or 0) + (run.get("from_per_node_round") or 0)
               ) / 1024 or float("nan")
        if run.get("status") == "ok" and run.get("s_per_round"):
            done.append((run["nodes"], run["s_per_round"], kib))
        elif run.get("status") == "timeout":
            late.append((run["nodes"], float(run.get("s_per_round") or run.get("proc_s")
                                             or record["timeout_s"]), kib))
    return sorted(done), sorted(late)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fedpriv_json", help="bench_secure_aggregation.py's bench.json")
    parser.add_argument("flower_json", nargs="*", help="bench_flower_secaggplus.py's JSON "
                        "files (their runs together)")
    parser.add_argument("--engine", default="flower", choices=("flower", "inprocess"))
    parser.add_argument("--out", default="results/secure_scaling.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    for mode, points in fedpriv_points(json.loads(Path(args.fedpriv_json).read_text()),
                                       args.engine).items():
        x = [p[0] for p in points]
        a.plot(x, [p[1] for p in points], STYLE[mode], label=f"fedpriv {mode}")
        b.plot(x, [p[2] for p in points], STYLE[mode], label=f"fedpriv {mode}")
    if args.flower_json:
        records = [json.loads(Path(f).read_text()) for f in args.flower_json]
        done, late = flower_points({"timeout_s": records[0].get("timeout_s"),
                                    "runs": [r for rec in records for r in rec["runs"]]})
        if done:
            a.plot([p[0] for p in done], [p[1] for p in done], "-D", color="tab:red",
                   label="Flower SecAgg+")
            b.plot([p[0] for p in done], [p[2] for p in done], "-D", color="tab:red",
                   label="Flower SecAgg+")
        if late:
            for axis, i in ((a, 1), (b, 2)):
                axis.plot([p[0] for p in late], [p[i] for p in late], "D", mfc="none",
                          color="tab:red", label="Flower SecAgg+: one round, then timed out")
    a.set(xlabel="nodes", ylabel="seconds per round", xscale="log", yscale="log",
          title=f"time per round ({args.engine})")
    b.set(xlabel="nodes", ylabel="KiB a node sends + receives per round", xscale="log",
          yscale="log", title="bytes per node per round")
    for axis in (a, b):
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3, which="both")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
