"""Simulated node faults: which nodes fail in a step, chosen from public values only.

``node-fault-rate = r`` makes ``floor(r * N)`` of the N nodes fail in every step (a seeded
choice per step, so runs are reproducible). The choice never depends on data, so it cannot leak
anything; the server still averages over the population fixed in advance, so the noise stays
calibrated to the sensitivity the accountant assumes.
"""

from __future__ import annotations

import zlib

import numpy as np

from fedpriv.algorithms.base import UserContribution
from fedpriv.config import FAULT_KINDS

__all__ = ["FAULT_KINDS", "corrupted", "failing_partitions"]
_FAULT_STREAM = 0xFA17


def failing_partitions(seed: int, step_label: str, num_partitions: int,
                       rate: float) -> frozenset[int]:
    """The partitions that fail in the step labelled ``step_label``."""
    count = int(np.floor(rate * num_partitions + 1e-12))
    if count <= 0:
        return frozenset()
    rng = np.random.default_rng([seed, _FAULT_STREAM, zlib.crc32(step_label.encode())])
    return frozenset(int(p) for p in rng.choice(num_partitions, size=count, replace=False))


def corrupted(contribution: UserContribution) -> UserContribution:
    """A 'corrupt' fault: the node's sums (or final metrics) become NaN."""
    totals = {name: np.full(np.shape(value), np.nan) for name, value in
              contribution.totals.items()}
    metrics = None if contribution.metrics is None else {
        key: float("nan") for key in contribution.metrics}
    return UserContribution(totals, contribution.num_users, contribution.num_clipped, metrics)
