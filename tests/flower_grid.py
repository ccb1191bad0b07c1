"""An in-memory stand-in for Flower's Grid, for unit tests of server strategies: nodes answer
train messages with ``reply_fn(node, arrays) -> {key: array}`` and evaluate messages with
``metric_fn(node) -> {name: value}``; every message in both directions is recorded. (The real
runtime is exercised by the simulation-engine tests.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity


def set_identity() -> None:
    """Messages built outside a Flower process need a run and a node identity."""
    TaskIdentity.run_id = 1
    TaskIdentity.task_id = 1
    TaskIdentity.node_id = 0


class FakeGrid:
    def __init__(self, nodes: int | list[int],
                 reply_fn: Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray] | None],
                 metric_fn: Callable[[int], dict[str, float]] | None = None,
                 weight_fn: Callable[[int], float] = lambda node: 1.0) -> None:
        set_identity()
        self.nodes = list(range(1, nodes + 1)) if isinstance(nodes, int) else list(nodes)
        self.reply_fn, self.metric_fn, self.weight_fn = reply_fn, metric_fn, weight_fn
        self.sent: list[Message] = []
        self.received: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> list[Message]:
        out = []
        for m in messages:
            self.sent.append(m)
            node = m.metadata.dst_node_id
            if m.metadata.message_type == "train":
                arrays = {k: v.numpy() for k, v in m.content["arrays"].items()}
                new = self.reply_fn(node, arrays)
                if new is None:  # the node fails: Flower answers with an error reply
                    out.append(Message(Error(code=0, reason="node failed"), reply_to=m))
                    continue
                reply = Message(RecordDict({
                    "arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in new.items()}),
                    "metrics": MetricRecord({"num-examples": self.weight_fn(node),
                                             "train-loss": 0.25})}), reply_to=m)
            else:
                metrics = dict(self.metric_fn(node)) if self.metric_fn else {}
                reply = Message(RecordDict({"metrics": MetricRecord(
                    {**metrics, "num-examples": 1})}), reply_to=m)
            self.received.append(reply)
            out.append(reply)
        return out


def run_in_simulation(module: str, path: str, nodes: int, env: dict[str, str], cwd: str,
                      timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """Run ``module.server`` and ``module.app`` (a ServerApp and a ClientApp in a file under
    ``path``) in Flower's simulation engine with ``nodes`` SuperNodes, in a fresh process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("from flwr.simulation import run_simulation\n"
            f"import {module} as a\n"
            f"run_simulation(a.server, a.app, num_supernodes={nodes}, backend_config={{\n"
            "    'client_resources': {'num_cpus': 1, 'num_gpus': 0.0},\n"
            "    'init_args': {'num_cpus': 2, 'include_dashboard': False}})\n")
    env = {**env, "PYTHONPATH": os.pathsep.join([path, root])}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
