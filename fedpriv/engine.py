"""Run an algorithm in one process, without Flower: the same core math, the same server.

Used by tests and by the benchmark to measure what Flower adds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fedpriv.cohorts import auto_num_nodes, partition_users
from fedpriv.config import RunConfig
from fedpriv.server import NodeReply, PrivateServer


def run_in_process(config: RunConfig, num_partitions: int | None = None, log=print) -> dict:
    started = time.perf_counter()
    parts = num_partitions or auto_num_nodes(config.num_users, config.users_per_node)
    server = PrivateServer(config, parts, log=log)
    algorithm_cls = type(server.algorithm)
    for step in server.steps():
        t0 = time.perf_counter()
        arrays = server.payload(step)
        replies = []
        for p in range(parts):
            users = algorithm_cls.participants(config, step,
                                               partition_users(config.num_users, p, parts))
            contrib = algorithm_cls.user_step(config, step, arrays, users)
            replies.append(NodeReply(p, contrib))
        server.aggregate(step, replies, t0)
    return server.results(time.perf_counter() - started, runtime="in-process")


def write_results(results: dict, path: str | os.PathLike) -> Path:
    """Write the results JSON atomically; returns the absolute path."""
    target = Path(path).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=float))
    os.replace(tmp, target)
    return target
