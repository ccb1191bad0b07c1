"""Synthetic binary classification with a shared embedding and a margin (the setting of
Snedeker, Zhou & Bassily 2025, Sec. 4 / Alg. 3).

User i has ``w_i = U* v_i`` with ``U*`` the d x k ground-truth embedding (Haar, from the seed,
as in ``fedpriv.data.synthetic``) and ``v_i`` uniform on the unit sphere of R^k, so
``||w_i|| = 1``. Points are uniform in the unit ball conditioned on ``|<x, w_i>| >= margin``
(rejection: the first m of 8m draws outside the band; in the rare case fewer than m qualify,
the rest are pushed along ``w_i`` out of the band, ``x <- x + y (margin - |<x, w_i>|) w_i``),
labelled ``y = sign(<x, w_i>)``: every point has margin at least ``margin`` and
``||x|| <= 1 + margin``. Training points, held-back points and fresh test points are pure functions
of (seed, user id) from counter-based streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedpriv.data.meta import counter_normals, unit_ball_points
from fedpriv.data.synthetic import SyntheticProblem, ground_truth_embedding

_P_V, _P_X, _P_TEST = 0x3A0, 0x3A1, 0x3A2
_DRAWS = 8  # candidate draws per point for the rejection step


class MarginKeys(Protocol):
    """The run-config keys a margin problem is made of (``jl-exp``'s config has them; the data
    layer reads them without importing the algorithms)."""

    @property
    def num_users(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def samples_per_user(self) -> int: ...
    @property
    def margin(self) -> float: ...
    @property
    def seed(self) -> int: ...


@dataclass(frozen=True)
class MarginProblem:
    num_users: int
    dim: int
    rank: int
    samples_per_user: int
    margin: float
    seed: int = 0

    @classmethod
    def of(cls, config: MarginKeys) -> MarginProblem:
        return cls(config.num_users, config.dim, config.rank, config.samples_per_user,
                   config.margin, config.seed)

    def embedding_problem(self) -> SyntheticProblem:
        """The personalization problem whose ground-truth embedding ``U*`` this one shares."""
        return SyntheticProblem(self.num_users, self.dim, self.rank, self.samples_per_user,
                                0.0, seed=self.seed)


@dataclass(frozen=True)
class MarginTasks:
    features: np.ndarray  # (n, m, d)
    labels: np.ndarray  # (n, m) in {-1, +1}
    models: np.ndarray  # (n, d) the true w_i


def margin_tasks(problem: MarginProblem, user_ids: np.ndarray,
                 test_samples: int | None = None) -> MarginTasks:
    """The users' ``samples_per_user`` points, or ``test_samples`` fresh test points."""
    ids = np.asarray(user_ids, dtype=np.int64)
    v = counter_normals(problem.seed, _P_V, 0, ids, problem.rank)
    v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)
    w = v @ ground_truth_embedding(problem.embedding_problem()).T
    purpose = _P_X if test_samples is None else _P_TEST
    m = problem.samples_per_user if test_samples is None else int(test_samples)
    draws = unit_ball_points(problem.seed, purpose, 0, ids, _DRAWS * m, problem.dim)
    t = np.einsum("nmd,nd->nm", draws, w)
    # the qualifying draws first (stable order), then the others
    order = np.argsort(np.abs(t) < problem.margin, axis=1, kind="stable")[:, :m]
    x = np.take_along_axis(draws, order[..., None], axis=1)
    t = np.take_along_axis(t, order, axis=1)
    y = np.where(t >= 0, 1.0, -1.0)
    push = y * np.maximum(problem.margin - np.abs(t), 0.0)
    x = x + push[..., None] * w[:, None, :]
    return MarginTasks(x, y, w)
