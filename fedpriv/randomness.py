"""Explicit, reproducible randomness.

Two kinds of draws exist in a run:

* Server draws (privacy noise) come from a ``numpy.random.Generator`` derived from the run seed
  and the release index, so a release's noise does not depend on anything else that happened.
* User draws (which samples go in which batch) must not depend on how users are spread across
  nodes. They come from a counter-based hash of (seed, purpose, round, user id, index), computed
  vectorized for a whole cohort.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TypeVar

import numpy as np

from fedpriv.config import RunConfig

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)

_GROUP_STREAM = 0x6A17

# what the hash mixes: one uint64 key, or an array of them
_Bits = TypeVar("_Bits", np.ndarray, np.uint64)


def _splitmix64(x: _Bits) -> _Bits:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
    return x ^ (x >> np.uint64(31))


def user_uniforms(
    seed: int, purpose: int, round_index: int, user_ids: np.ndarray, count: int
) -> np.ndarray:
    """Uniform [0, 1) numbers, shape (len(user_ids), count), a pure function of the arguments:
    entry (i, j) depends on (seed, purpose, round, user_ids[i], j) alone."""
    return uniforms_at(seed, purpose, round_index, np.asarray(user_ids)[:, None],
                       np.arange(count)[None, :])


def uniforms_at(seed: int, purpose: int, round_index: int, user_ids: np.ndarray,
                counters: np.ndarray) -> np.ndarray:
    """``user_uniforms``' number of each (user id, counter) pair, the two arrays broadcast
    against each other (e.g. one entry per row of a table: its user and its place among that
    user's rows)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.uint64(seed & 0xFFFFFFFF) << np.uint64(32) | np.uint64(purpose))
        key = _splitmix64(key ^ np.uint64(round_index & 0xFFFFFFFFFFFF))
        ids = _splitmix64(np.asarray(user_ids).astype(np.uint64) ^ key)
        bits = _splitmix64(ids * np.uint64(0x100000001B3)
                           ^ np.asarray(counters).astype(np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def user_permutations(
    seed: int, purpose: int, round_index: int, user_ids: np.ndarray, size: int
) -> np.ndarray:
    """A uniformly random permutation of ``range(size)`` per user, shape (n, size)."""
    return np.argsort(user_uniforms(seed, purpose, round_index, user_ids, size), axis=1)


def server_generator(seed: int, release_index: int) -> np.random.Generator:
    """The generator for the server's noise in one release."""
    return np.random.default_rng([seed, 0x5E7, release_index])


def noise_generator(config: RunConfig, release_index: int) -> np.random.Generator:
    """The generator of one release's privacy noise.

    ``secure-noise``: seeded from OS entropy (``SeedSequence()`` reads ``secrets``), so nobody
    who knows the config can reproduce the noise. Otherwise a pure function of ``noise-seed``
    (or the run seed) and the release index: reproducible, for research.
    """
    if config.secure_noise:
        return np.random.default_rng(np.random.SeedSequence())
    seed = config.noise_seed if config.noise_seed >= 0 else config.seed
    return server_generator(seed, release_index)


@lru_cache(maxsize=8)
def user_groups(seed: int, num_users: int, groups: int) -> np.ndarray:
    """Group of every user id (Priv-AltMin's user groups, Jain et al. Alg. 1 lines 2 and 4;
    DP-FTMRL's one-pass batches): a seeded permutation cut in ``groups``
    contiguous, near-equal pieces. Public: a function of (seed, n, G) only."""
    order = np.random.default_rng([seed, _GROUP_STREAM]).permutation(num_users)
    group_of = np.empty(num_users, dtype=np.int64)
    for g, chunk in enumerate(np.array_split(order, groups)):
        group_of[chunk] = g
    group_of.setflags(write=False)
    return group_of
