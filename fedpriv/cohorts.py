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

from fedpriv.algorithms.base import Step, UserContribution, partition_users
from fedpriv.data.synthetic import SyntheticProblem, UserData, generate_users

__all__ = ["partition_users"]  # re-exported: where the node layout is looked up

BLOCK_USERS_ENV = "FEDPRIV_BLOCK_USERS"
CACHE_MB_ENV = "FEDPRIV_CACHE_MB"


def block_users() -> int:
    """Users per block of a node's computation and of the data cache."""
    value = int(os.environ.get(BLOCK_USERS_ENV, "20000"))
    if value < 1:
        raise ValueError(f"{BLOCK_USERS_ENV} must be >= 1, got {value}")
    return value


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


DEFAULT_CACHE_MB = 2048
"""The cache of one process; a Flower simulation gives each ClientApp actor its share."""

CACHE = BlockCache(int(float(os.environ.get(CACHE_MB_ENV, str(DEFAULT_CACHE_MB))) * 2**20))


PARTS = ("all", "s0")
"""What of each user's points ``cohort_data`` returns: all of them, or ``S0`` (the first
half, all that the initializations and rounds of the embedding algorithms read: cached alone,
half the memory)."""


def _first_half(data: UserData) -> UserData:
    (x0, y0), _ = data.split_halves()
    return UserData(data.user_ids, x0.copy(), y0.copy(), data.true_local_vectors)


def cohort_data(
    problem: SyntheticProblem, user_ids: np.ndarray, samples: int | None = None,
    fresh: bool = False,
    purpose: str | None = None,
    part: str = "all",
) -> UserData:
    """Data of the given users, regenerated once per process per block and cached.

    Blocks are aligned to a grid of ``block_users()`` ids, so a node's partition and any
    subset of it (a user group, a Poisson sample) are served from the same cached blocks.
    ``part = "s0"``: only each user's first half ``S0`` (see ``PARTS``).
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    ids = np.asarray(user_ids, dtype=np.int64)
    purpose = purpose or ("test" if fresh else "train")
    if not ids.size:
        empty = generate_users(problem, ids, samples=samples, purpose=purpose)
        return _first_half(empty) if part == "s0" else empty
    m = problem.samples_per_user if samples is None else samples
    size = block_users()
    pieces = []
    for first in range(int(ids.min()) // size * size, int(ids.max()) + 1, size):
        last = min(first + size, problem.num_users)

        def make(f: int = first, la: int = last) -> UserData:
            data = generate_users(problem, np.arange(f, la), samples=m, purpose=purpose)
            return _first_half(data) if part == "s0" else data

        pieces.append(CACHE.get((problem, first, last, m, purpose, part), make))
    if len(pieces) == 1:
        block = pieces[0]
    else:
        block = UserData(*(np.concatenate([getattr(p, f) for p in pieces]) for f in
                           ("user_ids", "features", "labels", "true_local_vectors")))
    start = int(block.user_ids[0])
    rows = ids - start
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if hi - lo == ids.size and np.array_equal(rows, np.arange(lo, hi)):  # a range: views
        if lo == 0 and hi == len(block.user_ids):
            return _float64(block)
        return _float64(UserData(block.user_ids[lo:hi], block.features[lo:hi],
                                 block.labels[lo:hi], block.true_local_vectors[lo:hi]))
    return _float64(UserData(ids, block.features[rows], block.labels[rows],
                             block.true_local_vectors[rows]))


def _float64(data: UserData) -> UserData:
    """Points kept in float32 (``data-dtype``) are computed on in float64 (a copy of the
    block being computed, not of the cache)."""
    if data.features.dtype == np.float64:
        return data
    return UserData(data.user_ids, data.features.astype(np.float64),
                    data.labels.astype(np.float64), data.true_local_vectors)
