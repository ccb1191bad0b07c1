"""Run an algorithm in one process, without Flower: the same core math, the same server.

Used by tests and by the benchmark to measure what Flower adds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.faults import corrupted, failing_partitions
from fedpriv.nodes import add_contributions, auto_num_nodes, node_step, simulated_metrics
from fedpriv.progress import StepProgress
from fedpriv.secagg.local import LocalNodes
from fedpriv.server import NodeReply, PrivateServer
from fedpriv.server.secagg import KeysAhead, SecureRound


def run_in_process(config: RunConfig, num_partitions: int | None = None,
                   log: Callable[[str], None] = print,
                   checkpoint_path: Path | None = None) -> dict[str, Any]:
    """Run every (remaining) step; nodes answer in turn. ``checkpoint_path``: save the server
    state there after every step (and resume from it when ``config.resume``)."""
    started = time.perf_counter()
    simulated: dict[str, float] | None = None
    parts = num_partitions or auto_num_nodes(config.num_users, config.users_per_node)
    server = PrivateServer(config, parts, log=log, checkpoint_path=checkpoint_path)
    try:
        algorithm_cls = type(server.algorithm)
        local = LocalNodes(config, algorithm_cls, parts)
        ahead: KeysAhead | None = None  # after a resume: none, a full setup first
        while (step := server.next_step()) is not None:
            t0 = time.perf_counter()
            arrays = server.payload(step)
            if not server.sends(step):  # a distributed run's metrics step: nodes send none
                if step.kind == "final":
                    simulated = simulate_metrics(server, step, arrays, parts)
                server.record_unsent(step, t0)
                continue
            if server.secure:
                outcome = SecureRound(local.send, step, arrays, range(parts), server.graph,
                                      server.history(), log, count=parts, ahead=ahead).run()
                ahead = outcome.ahead  # the next secure round: three exchanges
                server.aggregate_secure(step, outcome, t0)
                continue
            failing = failing_partitions(config.seed, step.label, parts, config.node_fault_rate)
            replies = []
            progress = StepProgress(step.label, parts, log)
            for p in range(parts):
                progress.done(p)
                if p in failing and config.node_fault_kind in ("crash", "timeout"):
                    replies.append(simulated_failure(p, config.node_fault_kind))
                    continue
                contrib = node_step(algorithm_cls, config, step, arrays,
                                    algorithm_cls.hosted_users(config, p, parts))
                replies.append(NodeReply(p, corrupted(contrib) if p in failing else contrib))
            server.aggregate(step, replies, t0)
    finally:
        server.close()
    results = server.results(time.perf_counter() - started, runtime="in-process")
    if simulated is not None:
        results["simulation_metrics"] = simulated
    return results


def simulate_metrics(server: PrivateServer, step: Step, arrays: Mapping[str, Any],
                     parts: int) -> dict[str, float] | None:
    """A distributed run's final metrics as the in-process simulator measures them on its
    nodes, for its operator (the server receives none; ``results["simulation_metrics"]``)."""
    cls = type(server.algorithm)
    total: UserContribution | None = None
    for p in range(parts):
        try:
            part = simulated_metrics(cls, server.config, step, arrays,
                                     cls.hosted_users(server.config, p, parts))
        except Exception:  # noqa: BLE001 - a node failing here fails no release
            continue
        total = part if total is None else add_contributions(total, part)
    if total is None or total.num_users == 0 or total.metrics is None:
        return None
    return server.algorithm.finalize(total.metrics, total.num_users)


def simulated_failure(partition: int, kind: str) -> NodeReply:
    """What the transport reports for a node that crashed or did not answer in time."""
    if kind == "timeout":
        return NodeReply(partition, error="no reply before the timeout (simulated fault)",
                         failure="timeout")
    return NodeReply(partition, error="simulated crash (node-fault-rate)", failure="node-error")


def write_results(results: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the results JSON atomically; returns the absolute path."""
    target = Path(path).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=float))
    os.replace(tmp, target)
    return target
