"""Secure aggregation in one process: the nodes' stages called directly (the in-process engine,
tests). Same messages, same node code as over Flower; only the transport differs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.faults import corrupted, failing_partitions
from fedpriv.nodes import node_step
from fedpriv.secagg import node as N


class LocalNodes:
    """The run's nodes, each with its own state; ``send`` answers a stage for each addressee.
    Simulated faults (``node-fault-rate``): a crash or timeout happens in the collect stage,
    after the node shared its keys (its masks must then be reconstructed); a corrupt node
    sends garbage sums, which its own bound zeroes."""

    def __init__(self, config: RunConfig, algorithm: type[Algorithm[Any]], nodes: int) -> None:
        self.config, self.algorithm, self.nodes = config, algorithm, nodes
        self.states: dict[int, dict[str, Any]] = {p: {} for p in range(nodes)}
        self.step: Step | None = None

    def _failing(self) -> frozenset[int]:
        assert self.step is not None
        return failing_partitions(self.config.seed, self.step.label, self.nodes,
                                  self.config.node_fault_rate)

    def send(self, stage: str, messages: Mapping[int, Mapping[str, Any]]
             ) -> dict[int, Mapping[str, Any] | N.Failure]:
        out: dict[int, Mapping[str, Any] | N.Failure] = {}
        for pid, msg in messages.items():
            if stage == "setup":
                self.step = Step.from_json(str(msg["step"]))
            if (stage == "collect" and pid in self._failing()
                    and self.config.node_fault_kind in ("crash", "timeout")):
                kind = self.config.node_fault_kind
                out[pid] = N.Failure("timeout" if kind == "timeout" else "node-error",
                                     f"simulated {kind} (node-fault-rate)")
                continue
            try:
                out[pid] = self._answer(stage, pid, msg)
            except Exception as err:  # noqa: BLE001 -- a node's error is its reply
                out[pid] = N.Failure("node-error", f"{type(err).__name__}: {err}"[:300])
        return out

    def _answer(self, stage: str, pid: int, msg: Mapping[str, Any]) -> Mapping[str, Any]:
        state = self.states[pid]
        if stage == "setup":
            arrays = {k: v for k, v in msg.items() if isinstance(v, np.ndarray)}
            return N.setup(self.config, pid, self.nodes, state, msg, arrays,
                           lambda step, arr: self._compute(pid, step, arr))
        if stage == "share-keys":
            return N.share_keys(pid, self.nodes, state, msg)
        if stage == "collect":
            return N.collect(pid, state, msg)
        if stage == "unmask":
            return N.unmask(self.config, pid, self.nodes, state, msg)
        raise ValueError(f"unknown stage {stage!r}")

    def _compute(self, pid: int, step: Step, arrays: Mapping[str, np.ndarray]
                 ) -> UserContribution:
        contrib = node_step(self.algorithm, self.config, step, arrays,
                            self.algorithm.hosted_users(self.config, pid, self.nodes))
        faulty = pid in self._failing() and self.config.node_fault_kind == "corrupt"
        return corrupted(contrib) if faulty else contrib
