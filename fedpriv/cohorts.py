"""Which users a node hosts, and a per-process cache of their (regenerated) data."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from fedpriv.data.synthetic import SyntheticProblem, UserData, generate_users


def partition_users(num_users: int, partition_id: int, num_partitions: int) -> np.ndarray:
    """Users of a partition: a contiguous, near-equal slice of ``range(num_users)``."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside [0, {num_partitions})")
    start = partition_id * num_users // num_partitions
    stop = (partition_id + 1) * num_users // num_partitions
    return np.arange(start, stop, dtype=np.int64)


def auto_num_nodes(num_users: int, users_per_node: int) -> int:
    """Number of SuperNodes: ``ceil(n / users-per-node)``, or with ``users-per-node = 0`` a
    cohort layout that keeps Flower's per-node overhead small (at most 10 nodes, cohorts of at
    least 100 users)."""
    if users_per_node > 0:
        return -(-num_users // users_per_node)
    return max(1, min(10, num_users // 100))


@lru_cache(maxsize=32)  # a Ray worker may host several nodes; keep all their cohorts
def _cached(problem: SyntheticProblem, start: int, stop: int, samples: int, fresh: bool):
    return generate_users(problem, np.arange(start, stop), samples=samples, fresh=fresh)


def cohort_data(
    problem: SyntheticProblem, user_ids: np.ndarray, samples: int | None = None,
    fresh: bool = False,
) -> UserData:
    """Data of a contiguous block of users, regenerated once per process and cached."""
    ids = np.asarray(user_ids)
    if ids.size and np.array_equal(ids, np.arange(ids[0], ids[0] + ids.size)):
        m = problem.samples_per_user if samples is None else samples
        return _cached(problem, int(ids[0]), int(ids[0] + ids.size), m, fresh)
    return generate_users(problem, ids, samples=samples, fresh=fresh)
