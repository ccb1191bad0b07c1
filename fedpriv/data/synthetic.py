"""Synthetic shared-representation regression problems.

Follows Assumptions 4-6 of Snedeker, Zhou & Bassily (2025): a ground-truth embedding ``U*``
(d x k, orthonormal columns), a local vector ``v*_i ~ N(0, I_k)`` per user, features with zero
mean and identity covariance from a sub-Gaussian family, and labels ``y = <x, U* v*_i> + zeta``
with Gaussian label noise of standard deviation ``R``.

A user's data is a pure function of ``(seed, user_id)``: any node regenerates exactly the users it
hosts, whatever the cohort layout, and the same seed always gives the same problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fedpriv.data.streams import StreamWriter, pcg64_states

FEATURE_FAMILIES = ("gaussian", "rademacher", "uniform", "mixed")
"""Sub-Gaussian feature families with identity covariance. ``mixed`` gives each user one of the
other three, chosen from its own seed, so users have different feature distributions."""

_PURE_FAMILIES = ("gaussian", "rademacher", "uniform")

# Stream tags keep the draws for different purposes independent of each other.
_STREAM_TRUTH = 0
_STREAM_TRAIN = 1
_STREAM_TEST = 2
_STREAM_VALIDATION = 3

PURPOSES = ("train", "test", "validation")
"""What a user's points are for: its training set, fresh test points (the reported metrics), or
its held-back validation points (what private tuning scores candidates on; never trained on and
never the reported test data)."""
_STREAMS = {"train": _STREAM_TRAIN, "test": _STREAM_TEST, "validation": _STREAM_VALIDATION}


@dataclass(frozen=True)
class SyntheticProblem:
    """The parameters that define a synthetic personalization problem."""

    num_users: int
    dim: int
    rank: int
    samples_per_user: int
    label_noise: float
    feature_dist: str = "gaussian"
    seed: int = 0
    dtype: str = "float64"
    """``float32``: points are drawn in float64 and stored rounded to float32."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"dtype must be float64 or float32, got {self.dtype!r}")
        if self.feature_dist not in FEATURE_FAMILIES:
            raise ValueError(
                f"feature_dist must be one of {FEATURE_FAMILIES}, got {self.feature_dist!r}"
            )
        if not 1 <= self.rank <= self.dim:
            raise ValueError(f"rank must be in [1, dim={self.dim}], got {self.rank}")


@dataclass(frozen=True)
class UserData:
    """Data of a batch of users; arrays carry a leading user axis."""

    user_ids: np.ndarray  # (n,)
    features: np.ndarray  # (n, m, d)
    labels: np.ndarray  # (n, m)
    true_local_vectors: np.ndarray  # (n, k)

    @property
    def num_users(self) -> int:
        return int(self.user_ids.shape[0])

    def split_halves(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """``S0`` (first floor(m/2) samples, used for training the embedding) and ``S1`` (the
        held-back rest, used only for each user's final local fit)."""
        half = self.features.shape[1] // 2
        return (
            (self.features[:, :half], self.labels[:, :half]),
            (self.features[:, half:], self.labels[:, half:]),
        )


def ground_truth_embedding(problem: SyntheticProblem) -> np.ndarray:
    """``U*``: QR of a d x k standard Gaussian matrix (orthonormal columns)."""
    rng = np.random.default_rng([problem.seed, _STREAM_TRUTH])
    q, r = np.linalg.qr(rng.standard_normal((problem.dim, problem.rank)))
    return q * np.sign(np.diag(r))  # a unique, Haar-distributed choice of basis


def _draw_features(rng: np.random.Generator, family: str, shape: tuple[int, int]) -> np.ndarray:
    if family == "gaussian":
        return rng.standard_normal(shape)
    if family == "rademacher":
        return rng.integers(0, 2, size=shape).astype(np.float64) * 2.0 - 1.0
    if family == "uniform":  # uniform on [-sqrt(3), sqrt(3)] has unit variance
        return rng.uniform(-np.sqrt(3.0), np.sqrt(3.0), size=shape)
    raise ValueError(f"unknown feature family {family!r}")


def _user_families(problem: SyntheticProblem, user_ids: np.ndarray,
                   writer: StreamWriter) -> list[str]:
    """Each user's feature family: ``feature_dist``, or for ``mixed`` one of the pure families
    drawn from the user's own stream ``(seed, truth, 2, user)``."""
    if problem.feature_dist != "mixed":
        return [problem.feature_dist] * len(user_ids)
    states = pcg64_states((problem.seed, _STREAM_TRUTH, 2), user_ids)
    return [_PURE_FAMILIES[int(writer.start(state).integers(0, len(_PURE_FAMILIES)))]
            for state in states]


_V_BLOCK = 4096  # users per block of cached v*


@lru_cache(maxsize=1024)
def _local_vector_block(problem: SyntheticProblem, first: int) -> np.ndarray:
    """``v*_i ~ N(0, I_k)`` of the users ``first .. first + _V_BLOCK - 1``, each from its own
    stream ``(seed, truth, 1, user)``, drawn once per process."""
    ids = np.arange(first, min(first + _V_BLOCK, problem.num_users))
    vectors = np.empty((len(ids), problem.rank))
    writer = StreamWriter()
    for row, state in enumerate(pcg64_states((problem.seed, _STREAM_TRUTH, 1), ids)):
        writer.start(state).standard_normal(out=vectors[row])
    vectors.setflags(write=False)
    return vectors


def _true_local_vectors(problem: SyntheticProblem, user_ids: np.ndarray) -> np.ndarray:
    """``v*_i`` of the given users, (n, k), from the per-process block cache (each user's v* is
    drawn once, not at every generation of its training or test data)."""
    out = np.empty((len(user_ids), problem.rank))
    blocks = user_ids // _V_BLOCK
    for b in np.unique(blocks):
        rows = blocks == b
        out[rows] = _local_vector_block(problem, int(b) * _V_BLOCK)[user_ids[rows]
                                                                   - int(b) * _V_BLOCK]
    return out


def generate_users(
    problem: SyntheticProblem,
    user_ids: np.ndarray,
    samples: int | None = None,
    fresh: bool = False,
    purpose: str | None = None,
) -> UserData:
    """Generate the data of the given users.

    ``fresh=False`` gives each user's training set (``samples_per_user`` points); ``fresh=True``
    draws new test points from the same user distributions (``samples`` of them).
    ``purpose`` (one of ``PURPOSES``) names the stream instead: ``"validation"`` gives the user's
    held-back validation points, a stream of its own (seeded by ``(seed, user)``, independent of
    its training and test points).

    User ``u``'s points are its features, then its label noise, drawn from
    ``np.random.default_rng([seed, stream, u])``; ``fedpriv.data.streams`` starts those streams
    for a whole block at once (the same draws, without a generator object per user).
    """
    user_ids = np.asarray(user_ids, dtype=np.int64)
    if user_ids.size and (user_ids.min() < 0 or user_ids.max() >= problem.num_users):
        raise ValueError(f"user ids must lie in [0, {problem.num_users}), got {user_ids}")
    m = problem.samples_per_user if samples is None else int(samples)
    n, d = user_ids.shape[0], problem.dim
    u_star = ground_truth_embedding(problem)
    features = np.empty((n, m, d))
    noise = np.empty((n, m))
    if purpose is None:
        purpose = "test" if fresh else "train"
    if purpose not in _STREAMS:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    writer = StreamWriter()
    families = _user_families(problem, user_ids, writer)
    states = pcg64_states((problem.seed, _STREAMS[purpose]), user_ids)
    for row, family in enumerate(families):
        rng = writer.start(states[row])
        if family == "gaussian":
            rng.standard_normal(out=features[row])
        else:
            features[row] = _draw_features(rng, family, (m, d))
        rng.standard_normal(out=noise[row])
    noise *= problem.label_noise
    local_vectors = _true_local_vectors(problem, user_ids)
    w_star = local_vectors @ u_star.T  # (n, d)
    labels = np.einsum("nmd,nd->nm", features, w_star) + noise
    if problem.dtype == "float32":
        features, labels = features.astype(np.float32), labels.astype(np.float32)
    return UserData(user_ids, features, labels, local_vectors)


def true_user_models(problem: SyntheticProblem, local_vectors: np.ndarray) -> np.ndarray:
    """``w*_i = U* v*_i`` for a batch of users, shape (n, d)."""
    models: np.ndarray = local_vectors @ ground_truth_embedding(problem).T
    return models
