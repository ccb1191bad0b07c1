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

from fedpriv.config import RunConfig
from fedpriv.faults import corrupted, failing_partitions
from fedpriv.nodes import auto_num_nodes, node_step
from fedpriv.secagg.local import LocalNodes
from fedpriv.server import NodeReply, PrivateServer
from fedpriv.server.secagg import SecureRound


def run_in_process(config: RunConfig, num_partitions: int | None = None,
                   log: Callable[[str], None] = print,
                   checkpoint_path: Path | None = None) -> dict[str, Any]:
    """Run every (remaining) step; nodes answer in turn. ``checkpoint_path``: save the server
    state there after every step (and resume from it when ``config.resume``)."""
    started = time.perf_counter()
    parts = num_partitions or auto_num_nodes(config.num_users, config.users_per_node)
    server = PrivateServer(config, parts, log=log, checkpoint_path=checkpoint_path)
    try:
        algorithm_cls = type(server.algorithm)
        local = LocalNodes(config, algorithm_cls, parts)
        while (step := server.next_step()) is not None:
            t0 = time.perf_counter()
            arrays = server.payload(step)
            if server.secure:
                server.aggregate_secure(step, SecureRound(
                    local.send, step, arrays, range(parts), server.threshold, server.history(),
                    log).run(), t0)
                continue
            failing = failing_partitions(config.seed, step.label, parts, config.node_fault_rate)
            replies = []
            for p in range(parts):
                if p in failing and config.node_fault_kind in ("crash", "timeout"):
                    replies.append(simulated_failure(p, config.node_fault_kind))
                    continue
                contrib = node_step(algorithm_cls, config, step, arrays,
                                    algorithm_cls.hosted_users(config, p, parts))
                replies.append(NodeReply(p, corrupted(contrib) if p in failing else contrib))
            server.aggregate(step, replies, t0)
    finally:
        server.close()
    return server.results(time.perf_counter() - started, runtime="in-process")


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
