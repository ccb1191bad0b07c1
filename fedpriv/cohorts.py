"""Which users a node hosts, how it computes them in blocks, and a bounded cache of their data.

Memory: a node never computes its whole cohort at once. ``node_step`` cuts its users into
blocks of ``FEDPRIV_BLOCK_USERS`` (environment; default 20,000), runs the algorithm's user step
on each block and adds the blocks' sums (every contribution and final metric is a sum over
users, so the result is the same up to float rounding). A user's data is regenerated from
(seed, user id) when it is needed; regenerated blocks are kept in a per-process cache bounded by
``FEDPRIV_CACHE_MB`` (default 2048 MB; blocks that do not fit are regenerated when needed), so
a node's memory is bounded by the cache plus one block's working set, whatever its cohort size.
Neither setting changes what a run computes.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.data.synthetic import SyntheticProblem, UserData, generate_users

BLOCK_USERS_ENV = "FEDPRIV_BLOCK_USERS"
CACHE_MB_ENV = "FEDPRIV_CACHE_MB"


def block_users() -> int:
    """Users per block of a node's computation and of the data cache."""
    value = int(os.environ.get(BLOCK_USERS_ENV, "20000"))
    if value < 1:
        raise ValueError(f"{BLOCK_USERS_ENV} must be >= 1, got {value}")
    return value


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


def node_step(algorithm: Any, config: Any, step: Step, arrays: Mapping[str, np.ndarray],
              hosted: np.ndarray) -> UserContribution:
    """The node's answer to ``step`` for the users it hosts: the algorithm's user step over
    blocks of at most ``block_users()`` hosted users (those of each block that take part in
    the step), summed."""
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
    metrics = None if a.metrics is None else {k: a.metrics[k] + b.metrics[k]
                                               for k in a.metrics}  # type: ignore[index]
    return UserContribution({k: a.totals[k] + b.totals[k] for k in a.totals},
                            a.num_users + b.num_users, a.num_clipped + b.num_clipped, metrics)


class BlockCache:
    """Cache of regenerated user blocks, bounded in bytes (keys start with the problem)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.nbytes = 0
        self.peak = 0  # the most it ever held (tests)
        self._blocks: OrderedDict[tuple, UserData] = OrderedDict()

    def get(self, key: tuple, make) -> UserData:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
            return block
        block = make()
        size = _nbytes(block)
        # Scan-resistant: every step reads a node's blocks in the same order, and evicting the
        # least recently used block for the next one would miss on every read once the data
        # outgrows the cache. So only blocks of other problems (earlier runs) are evicted; a
        # block that does not fit is used and dropped, and the cached ones keep hitting.
        for old in [k for k in self._blocks if k[0] != key[0]]:
            if self.nbytes + size <= self.capacity:
                break
            self.nbytes -= _nbytes(self._blocks.pop(old))
        if self.nbytes + size <= self.capacity:
            self._blocks[key] = block
            self.nbytes += size
            self.peak = max(self.peak, self.nbytes)
        return block

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0


def _nbytes(data: UserData) -> int:
    return sum(a.nbytes for a in (data.user_ids, data.features, data.labels,
                                  data.true_local_vectors))


CACHE = BlockCache(int(float(os.environ.get(CACHE_MB_ENV, "2048")) * 2**20))


def cohort_data(
    problem: SyntheticProblem, user_ids: np.ndarray, samples: int | None = None,
    fresh: bool = False,
    purpose: str | None = None,
) -> UserData:
    """Data of the given users, regenerated once per process per block and cached.

    Blocks are aligned to a grid of ``block_users()`` ids, so a node's partition and any
    subset of it (a user group, a Poisson sample) are served from the same cached blocks.
    """
    ids = np.asarray(user_ids, dtype=np.int64)
    purpose = purpose or ("test" if fresh else "train")
    if not ids.size:
        return generate_users(problem, ids, samples=samples, purpose=purpose)
    m = problem.samples_per_user if samples is None else samples
    size = block_users()
    pieces = []
    for first in range(int(ids.min()) // size * size, int(ids.max()) + 1, size):
        last = min(first + size, problem.num_users)
        block = CACHE.get((problem, first, last, m, purpose), lambda f=first, la=last:
                          generate_users(problem, np.arange(f, la), samples=m,
                                         purpose=purpose))
        pieces.append(block)
    if len(pieces) == 1:
        block = pieces[0]
    else:
        block = UserData(*(np.concatenate([getattr(p, f) for p in pieces]) for f in
                           ("user_ids", "features", "labels", "true_local_vectors")))
    start = int(block.user_ids[0])
    if ids.size == len(block.user_ids) and ids[0] == start and np.array_equal(
            ids, block.user_ids):
        return block
    rows = ids - start
    return UserData(ids, block.features[rows], block.labels[rows],
                    block.true_local_vectors[rows])
