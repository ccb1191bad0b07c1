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
    """Data of the given users, regenerated once per process and cached by covering range.

    Users of a step are a node's contiguous partition, or a subset of it (a user group); both
    are served from the partition's cached block.
    """
    ids = np.asarray(user_ids, dtype=np.int64)
    if not ids.size:
        return generate_users(problem, ids, samples=samples, fresh=fresh)
    m = problem.samples_per_user if samples is None else samples
    start, stop = int(ids.min()), int(ids.max()) + 1
    block = _cached(problem, start, stop, m, fresh)
    if ids.size == stop - start and np.array_equal(ids, np.arange(start, stop)):
        return block
    rows = ids - start
    return UserData(ids, block.features[rows], block.labels[rows],
                    block.true_local_vectors[rows])
