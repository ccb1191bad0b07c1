"""A bounded per-process cache of regenerated synthetic users' data, in blocks.

A user's data is regenerated from (seed, user id) when it is needed; regenerated blocks of
``block_users()`` ids (``FEDPRIV_BLOCK_USERS``, default 20,000) are kept in a per-process cache
bounded by ``FEDPRIV_CACHE_MB`` (default 2048 MB; blocks that do not fit are regenerated when
needed), so a node's memory is bounded by the cache plus one block's working set, whatever its
cohort size. Neither setting changes what a run computes.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np

from fedpriv.data.synthetic import SyntheticProblem, UserData, generate_users

BLOCK_USERS_ENV = "FEDPRIV_BLOCK_USERS"
CACHE_MB_ENV = "FEDPRIV_CACHE_MB"


def block_users() -> int:
    """Users per block of a node's computation and of the data cache."""
    value = int(os.environ.get(BLOCK_USERS_ENV, "20000"))
    if value < 1:
        raise ValueError(f"{BLOCK_USERS_ENV} must be >= 1, got {value}")
    return value


class BlockCache:
    """Cache of regenerated user blocks, bounded in bytes (keys start with the problem)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.nbytes = 0
        self.peak = 0  # the most it ever held (tests)
        self._blocks: OrderedDict[tuple[Hashable, ...], UserData] = OrderedDict()

    def get(self, key: tuple[Hashable, ...], make: Callable[[], UserData]) -> UserData:
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

_CACHE: list[BlockCache] = []


def block_cache() -> BlockCache:
    """The process's cache, made on first use with ``FEDPRIV_CACHE_MB`` megabytes (so setting
    the variable before the first run counts, whenever this module was imported)."""
    if not _CACHE:
        megabytes = float(os.environ.get(CACHE_MB_ENV, str(DEFAULT_CACHE_MB)))
        if not megabytes >= 0:
            raise ValueError(f"{CACHE_MB_ENV} must be a number >= 0, got {megabytes}")
        _CACHE.append(BlockCache(int(megabytes * 2**20)))
    return _CACHE[0]


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

        pieces.append(block_cache().get((problem, first, last, m, purpose, part), make))
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
