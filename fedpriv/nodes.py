"""How many nodes a run has and how a node computes its users: in blocks.

Memory: a node never computes its whole cohort at once. ``node_step`` cuts its users into
blocks of ``FEDPRIV_BLOCK_USERS`` (environment; default 20,000), runs the algorithm's user step
on each block and adds the blocks' sums (every contribution and final metric is a sum over
users, so the result is the same up to float rounding). The users' data comes from the
process's cache (``fedpriv.data.cache``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.data.cache import block_users
from fedpriv.shares import encode_shares, split_parameters


def auto_num_nodes(num_users: int, users_per_node: int) -> int:
    """Number of SuperNodes: ``ceil(n / users-per-node)``, or with ``users-per-node = 0`` a
    cohort layout that keeps Flower's per-node overhead small (at most 10 nodes, cohorts of at
    least 100 users)."""
    if users_per_node > 0:
        return -(-num_users // users_per_node)
    return max(1, min(10, num_users // 100))


def node_step(algorithm: type[Algorithm[Any]], config: RunConfig, step: Step,
              arrays: Mapping[str, np.ndarray], hosted: np.ndarray) -> UserContribution:
    """The node's answer to ``step`` for the users it hosts: the algorithm's user step over
    blocks of at most ``block_users()`` hosted users (those of each block that take part in
    the step), summed."""
    arrays, shares = split_parameters(arrays)
    if shares is None and config.noise_shares and step.release is not None:
        raise ValueError(f"{step.label}: the run is distributed but the server's broadcast "
                         "carries no noise-share parameters; this node sends no exact sums")
    total = _users_step(algorithm, config, step, arrays, hosted)
    if shares is not None:  # aggregation = "distributed": this node's noisy share
        return encode_shares(config.seed, step, total, shares)
    return total


def _users_step(algorithm: type[Algorithm[Any]], config: RunConfig, step: Step,
                arrays: Mapping[str, np.ndarray], hosted: np.ndarray) -> UserContribution:
    size = block_users()
    total: UserContribution | None = None
    for start in range(0, len(hosted), size):
        users = algorithm.participants(config, step, hosted[start:start + size])
        if len(users):
            part = algorithm.user_step(config, step, arrays, users)
            total = part if total is None else add_contributions(total, part)
    if total is None:  # nobody takes part: the algorithm's own empty answer
        total = algorithm.user_step(config, step, arrays, hosted[:0])
    return total


def add_contributions(a: UserContribution, b: UserContribution) -> UserContribution:
    """The contribution of two disjoint sets of users (sums add)."""
    if set(a.totals) != set(b.totals) or (a.metrics is None) != (b.metrics is None):
        raise ValueError("blocks of one step returned different parts")
    metrics = None
    if a.metrics is not None and b.metrics is not None:
        metrics = {k: a.metrics[k] + b.metrics[k] for k in a.metrics}
    return UserContribution({k: a.totals[k] + b.totals[k] for k in a.totals},
                            a.num_users + b.num_users, a.num_clipped + b.num_clipped, metrics)
