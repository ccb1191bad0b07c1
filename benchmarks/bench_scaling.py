"""Benchmark: wall time and peak memory against the number of users n, in-process vs Flower.

For each engine and n, one ``fedpriv run CONFIG --engine ENGINE --set num-users=N`` in a fresh
process (``measured_run`` of ``bench_private_fedrep.py``): wall time (start-up included), the
peak of the RSS summed over every process of the run (in-process: the one process; Flower: the
CLI, ``flwr``, the SuperLink, the simulation and every Ray daemon and worker, told apart from
other processes by a marker in their environment), the largest single process, and the
population MSE. A point past ``--timeout`` is killed (its whole process group and every process
of the run) and recorded as timed out; the benchmark goes on. Checkpoints are off (as in
sweeps); ``FEDPRIV_BLOCK_USERS`` and ``FEDPRIV_CACHE_MB`` pass through to the runs.

    python benchmarks/bench_scaling.py                                # 10^4 .. 10^6, both engines
    python benchmarks/bench_scaling.py --sizes 10000 30000 --engines inprocess flower \\
        --timeout 900 --plot docs/figures/scaling.png

Prints a Markdown table as the points finish, the fitted log-log slope of wall time per engine
and, for Flower, which processes hold the memory at its peak. Outputs: results/bench_scaling/
(``scaling.csv``, ``scaling.json``, ``runs/ENGINE-N.json`` and ``.log``; ignored); ``--plot``: a
two-panel log-log PNG (wall time and peak summed RSS vs n, one line per engine, dashed slope-1
references through each engine's first point).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

from bench_private_fedrep import ROOT, Measured, measured_run

ENGINES = ("inprocess", "flower")
COLUMNS = ("n", "engine", "wall_s", "peak_rss_sum_mb", "largest_process_mb",
           "population_mse", "status", "peak_pss_sum_mb", "num_nodes", "leftovers")
STYLE = {"inprocess": ("tab:blue", "o"), "flower": ("tab:orange", "s")}


def row_of(n: int, engine: str, m: Measured) -> dict:
    res = m.results or {}
    mse = res.get("metrics", {}).get("population_mse")
    return {"n": n, "engine": engine, "wall_s": round(m.wall, 2),
            "peak_rss_sum_mb": round(m.peak_total), "largest_process_mb": round(m.peak_single),
            "population_mse": mse, "status": m.status, "peak_pss_sum_mb": round(m.peak_pss),
            "num_nodes": res.get("num_nodes"), "leftovers": " ".join(m.leftovers),
            "memory_at_peak_mb": {k: round(v) for k, v in m.at_peak.items()}}


def markdown_row(r: dict) -> str:
    mse = "n/a" if r["population_mse"] is None else f"{r['population_mse']:.4g}"
    wall = f"{r['wall_s']:.1f}" if r["status"] != "timeout" else f"> {r['wall_s']:.0f}"
    return (f"| {r['n']:,} | {r['engine']} | {wall} | {r['peak_rss_sum_mb']} | "
            f"{r['largest_process_mb']} | {mse} | {r['status']} |")


def slope(rows: list[dict], engine: str, key: str = "wall_s") -> tuple[float | None, int]:
    """Least-squares slope of log(key) against log(n) over the engine's finished points."""
    pts = [(math.log(r["n"]), math.log(r[key])) for r in rows
           if r["engine"] == engine and r["status"] == "ok" and r[key] > 0]
    if len({x for x, _ in pts}) < 2:
        return None, len(pts)
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    return sxy / sum((x - mx) ** 2 for x, _ in pts), len(pts)


def write_tables(rows: list[dict], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "scaling.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "scaling.json").write_text(json.dumps(rows, indent=2))
    return out / "scaling.csv", out / "scaling.json"


def plot(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("wall_s", "wall time (s)"), ("peak_rss_sum_mb", "peak RSS, summed (MB)"))
    for ax, (key, ylabel) in zip(axes, panels, strict=True):
        for engine in dict.fromkeys(r["engine"] for r in rows):
            color, marker = STYLE.get(engine, ("tab:gray", "^"))
            ok = sorted((r["n"], r[key]) for r in rows
                        if r["engine"] == engine and r["status"] == "ok" and r[key] > 0)
            lost = [(r["n"], r[key]) for r in rows if r["engine"] == engine
                    and r["status"] != "ok" and r[key] > 0]
            if ok:
                fit, _ = slope(rows, engine, key)
                label = engine + (f" (slope {fit:.2f})" if fit is not None else "")
                ax.plot(*zip(*ok, strict=True), marker=marker, color=color, label=label)
                (n0, y0), n1 = ok[0], max(r["n"] for r in rows)
                ax.plot([n0, n1], [y0, y0 * n1 / n0], "--", color=color, alpha=0.5, lw=1,
                        label=f"slope 1 through {engine}'s first point")
            if lost:
                ax.scatter(*zip(*lost, strict=True), marker="x", color=color, s=60,
                           label=f"{engine}: timed out / failed (value when stopped)")
        ax.set(xscale="log", yscale="log", xlabel="number of users n", ylabel=ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10000, 100000, 1000000],
                    help="numbers of users n (each one run per engine)")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--config", default=str(ROOT / "configs" / "private_fedrep.toml"),
                    help="run config (default: the paper setting, configs/private_fedrep.toml)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds per point before it is killed and recorded as timed out")
    ap.add_argument("--plot", metavar="PNG", help="also draw the log-log figure here")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-config override for every run (e.g. data-dtype=float32)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_scaling"),
                    help="output folder (default: results/bench_scaling)")
    ap.add_argument("--include", nargs="+", default=[], metavar="JSON",
                    help="scaling.json files of earlier invocations whose points join the "
                         "table, the slopes and the figure (a 10^7 point measured alone)")
    args = ap.parse_args()
    config = Path(args.config).expanduser().resolve()
    if not config.is_file():
        ap.error(f"no config at {config}")
    out = Path(args.out).expanduser().resolve()
    print(f"config {config.name}, timeout {args.timeout:g} s per point; outputs in {out}")
    print("| n | engine | wall s | peak RSS summed MB | largest process MB | population MSE | "
          "status |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for earlier in args.include:
        for r in json.loads(Path(earlier).read_text()):
            rows.append(r)
            print(markdown_row(r) + f" (from {earlier})", flush=True)
    for n in sorted(set(args.sizes)):
        for engine in args.engines:
            m = measured_run([f"num-users={n}", "checkpoint=false", *args.sets],
                             out / "runs" / f"{engine}-{n}.json", config, engine, args.timeout)
            rows.append(row_of(n, engine, m))
            print(markdown_row(rows[-1]), flush=True)
            write_tables(rows, out)  # a partial table survives an interrupted benchmark
    for engine in args.engines:
        fit, points = slope(rows, engine)
        text = "n/a (fewer than two finished sizes)" if fit is None else f"{fit:.2f}"
        print(f"wall-time log-log slope, {engine}: {text} ({points} finished points)")
    for r in rows:
        if r["engine"] == "flower" and r["memory_at_peak_mb"]:
            parts = ", ".join(f"{k} {v}" for k, v in r["memory_at_peak_mb"].items())
            print(f"flower n={r['n']:,}, RSS (MB) at the peak sum: {parts}; summed PSS "
                  f"(shared pages once) {r['peak_pss_sum_mb']} MB")
        if r["leftovers"]:
            print(f"{r['engine']} n={r['n']:,}: killed processes left after the run: "
                  f"{r['leftovers']}")
    csv_path, json_path = write_tables(rows, out)
    print(f"tables: {csv_path} and {json_path}")
    if args.plot:
        figure = plot(rows, Path(args.plot).expanduser().resolve(),
                      f"{config.name}: wall time and peak memory vs number of users")
        print(f"figure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
