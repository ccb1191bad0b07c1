"""Where the time of a Flower run goes: start-up, node discovery, node compute, messaging,
server work, results.

Each size is one ``fedpriv run CONFIG --engine flower --set num-users=N`` in a fresh process
(``measured_run``). The ServerApp writes a ``profile`` into the operator report: when it
started, when every SuperNode had answered the discovery query, when the last step ended, and
for each step its wall time, the nodes' own ``node_step`` seconds (each ClientApp times itself
and reports it with its answer) and the server's aggregation seconds. From those:

* start-up: from the command to the ServerApp running (``flwr run``, the local SuperLink, the
  SuperExec, the simulation process and Ray);
* node discovery: the ServerApp's query until every node answered (Ray starts the ClientApp
  actors here, and each imports the app);
* node compute: the nodes' ``node_step`` seconds, divided by the ClientApp actors that run
  them in parallel (one per core);
* messaging and scheduling: the rest of the steps' wall time (serializing arrays, the
  SuperLink's message store, Ray scheduling nodes on actors, waiting for the slowest actor);
* server: the server's aggregation, noise and accounting after the replies arrived;
* results and shutdown: writing the results to the command's exit (stopping the SuperLink).

    python benchmarks/profile_flower.py --sizes 20000 1000000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_private_fedrep import ROOT, measured_run  # noqa: E402

from fedpriv.nodes import auto_num_nodes  # noqa: E402


def profile_rows(results: dict, started_unix: float, wall: float, actors: int) -> dict:
    """The table's seconds from one run's operator report."""
    prof = results["profile"]
    steps = prof["steps"]
    step_wall = sum(s["wall_s"] for s in steps)
    compute = sum(s["nodes_compute_s"] for s in steps) / actors
    server = sum(s["server_s"] for s in steps)
    return {
        "start-up (flwr run, SuperLink, SuperExec, simulation process, Ray)":
            prof["serverapp_started_unix"] - started_unix,
        "node discovery (Ray starts the ClientApp actors)":
            prof["nodes_discovered_unix"] - prof["serverapp_started_unix"],
        "planning (noise calibration) and the steps' set-up":
            prof["steps_done_unix"] - prof["nodes_discovered_unix"] - step_wall,
        f"node compute (node_step, over {actors} actors)": compute,
        "messaging and scheduling (the rest of the steps)": step_wall - compute - server,
        "server (aggregation, noise, accounting)": server,
        "results and shutdown": started_unix + wall - prof["steps_done_unix"],
        "total wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20000, 1000000])
    ap.add_argument("--config", default=str(ROOT / "configs" / "private_fedrep.toml"))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(ROOT / "results" / "profile_flower"))
    args = ap.parse_args()
    out = Path(args.out)
    columns = {}
    for n in args.sizes:
        started = time.time()
        m = measured_run([f"num-users={n}", "checkpoint=false", *args.sets],
                         out / f"flower-{n}.json", args.config, "flower")
        if m.status != "ok" or m.results is None or "profile" not in m.results:
            print(f"n = {n}: {m.status}; see {m.log}")
            continue
        actors = max(1, min(auto_num_nodes(n, 0), os.cpu_count() or 1))  # one per core
        columns[n] = profile_rows(m.results, started, m.wall, actors)
        print(f"n = {n:,}: {m.wall:.1f} s, peak RSS summed {m.peak_total:.0f} MB", flush=True)
    if not columns:
        return
    sizes = list(columns)
    print("\n| seconds | " + " | ".join(f"n = {n:,}" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for row in next(iter(columns.values())):
        print(f"| {row} | " + " | ".join(f"{columns[n][row]:.1f}" for n in sizes) + " |")


if __name__ == "__main__":
    main()
