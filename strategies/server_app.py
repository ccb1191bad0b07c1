"""The fedpriv ServerApp: parse and validate the run-config, check its size, plan the privacy
budget, run."""

from __future__ import annotations

import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedpriv import allocator
from fedpriv.checkpoint import checkpoint_path
from fedpriv.configure import parse_config
from fedpriv.cost import check_size
from fedpriv.outputs import output_lines, write_outputs
from fedpriv.server import check_plan, plan_lines, summary_lines
from fedpriv.stopping import server_done_line
from strategies.private import PrivateStrategy, discover_partitions
from strategies.sim_dispatch import index_dispatch

app = ServerApp()
allocator.tune()  # the server's steps reuse their pages (fedpriv.allocator)


@app.main()
def main(grid: Grid, context: Context) -> None:
    started, started_unix = time.perf_counter(), time.time()
    config = parse_config(context.run_config)  # fails here on a bad config
    check_size(config)  # and on a run too large for this machine, before anything is made
    print(f"fedpriv: {config.algorithm}, {config.num_users} users, target "
          f"(epsilon={config.epsilon}, delta={config.delta:g})", flush=True)
    # the privacy plan first: calibrated while a simulation starts its workers (the accountant
    # keeps what it computed for the strategy below), and an infeasible plan fails before any
    # node is asked anything
    check_plan(config)
    indexed = index_dispatch(grid)  # Flower's simulation engine: O(K) dispatch, not O(K^2)
    # nodes register asynchronously (a simulation starts its workers first): wait at least
    # two minutes for them, whatever the per-step node-timeout
    partitions = discover_partitions(grid, timeout=max(config.node_timeout, 120.0))
    discovered_unix = time.time()
    checkpoint = checkpoint_path(config) if config.checkpoint else None
    strategy = PrivateStrategy(config, partitions, checkpoint_path=checkpoint)
    for line in plan_lines(strategy.server.multipliers, strategy.server.pure_epsilons):
        print(line, flush=True)  # none for a run without noise
    results = strategy.run(grid)
    results["wall_time_s"] = time.perf_counter() - started
    results["profile"] = {"serverapp_started_unix": started_unix,
                          "nodes_discovered_unix": discovered_unix,
                          "steps_done_unix": time.time(), "steps": strategy.profile,
                          "indexed_dispatch": indexed}
    path, release = write_outputs(results, config.results_path)
    strategy.server.discard_checkpoint()  # the results file is now the record of the run
    for line in summary_lines(results):
        print(line, flush=True)
    for line in output_lines(path, release, results):
        print(line, flush=True)
    done = server_done_line()
    if done:  # the fedpriv command that started this run stops the rest of it now
        print(done, flush=True)
