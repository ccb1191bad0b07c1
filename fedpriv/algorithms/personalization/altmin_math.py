"""Private alternating minimization: Jain, Rush, Smith, Song & Thakurta (2021), Algs. 1 and 2.

User side (Alg. 1 line 5, Alg. 2 line 1): from the first part of its training half a user solves
``v`` by least squares given ``U``; on the second part it forms, per sample, ``W = clip(vec(x v^T),
eta)`` and ``y~ = clip(y, zeta)``, and contributes ``sum W W^T`` and ``sum y~ W``.
Server side (Alg. 2 lines 2-4): add symmetric Gaussian noise to the first sum and Gaussian noise
to the second, solve ``(sum W W^T + N_sym) u = (sum y~ W + N)`` for ``u = vec(U)`` and return the Q
factor of ``U``.

Sensitivity: every ``W W^T`` has Frobenius norm ``||W||^2 <= eta^2`` and every ``y~ W`` has norm
``<= zeta eta``, so with ``s`` statistic samples one user moves the two sums by at most
``s eta^2`` and ``s zeta eta`` (add/remove; twice that for replace-one).

``vec`` here is the row-major flattening of a d x k matrix; any fixed flattening works because
``<x, U v> = <vec(U), vec(x v^T)>`` holds for all of them.
"""

from __future__ import annotations

import numpy as np

from fedpriv.algorithms.personalization.linear_math import local_vectors, orthonormalize
from fedpriv.privacy.mechanisms import clip_factors, without_dropped


def sample_split(train_samples: int) -> int:
    """How many of a user's training samples solve ``v``; the rest form the statistics.

    The paper uses quarters of m (``[1, m/4]`` for ``v``, ``(m/4, m/2]`` for the statistics,
    ``(m/2, m]`` for the final fit). With an odd training half the extra sample solves ``v``:
    at m = 10, k = 2 an exactly determined 2 x 2 solve is heavy-tailed enough to make
    unclipped AltMin diverge (docs/measurements.md).
    """
    if train_samples < 2:
        raise ValueError(f"Priv-AltMin needs at least 2 training samples per user, got "
                         f"{train_samples}")
    return train_samples - train_samples // 2


def statistic_bounds(stat_samples: int, feature_clip: float,
                     response_clip: float) -> tuple[float, float]:
    """Per-user L2 bounds of ``sum W W^T`` and ``sum y~ W`` (add/remove sensitivities)."""
    return stat_samples * feature_clip**2, stat_samples * response_clip * feature_clip


def sufficient_statistics(
    embedding: np.ndarray,
    features: np.ndarray,
    labels: np.ndarray,
    feature_clip: float,
    response_clip: float,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Alg. 1 line 5 and Alg. 2 line 1 for a cohort, summed over its users.

    ``features`` (n, m0, d) and ``labels`` (n, m0) are the users' training samples. Returns
    ``(sum W W^T (dk, dk), sum y~ W (dk,), users with a clipped sample)``; ``inf`` clips disable
    clipping (the non-private baseline).
    """
    n, m0, d = features.shape
    k = embedding.shape[1]
    a = sample_split(m0)
    v = local_vectors(embedding, features[:, :a], labels[:, :a])  # (n, k)
    x, y = features[:, a:], labels[:, a:]
    rows = (x[:, :, :, None] * v[:, None, None, :]).reshape(n * (m0 - a), d * k)
    clipped_users = np.zeros(n, dtype=bool)
    if np.isfinite(feature_clip):
        f = clip_factors(rows, feature_clip)  # 0 for a row that is not finite
        rows = without_dropped(rows, f) * f[:, None]
        clipped_users |= (f < 1.0).reshape(n, -1).any(axis=1)
    y = y.reshape(-1)
    if np.isfinite(response_clip):
        with np.errstate(invalid="ignore"):
            clipped_users |= ~(np.abs(y) <= response_clip).reshape(n, -1).all(axis=1)
        # a response that is not a number contributes nothing (its W is kept: |y~ W| = 0)
        y = np.where(np.isnan(y), 0.0, np.clip(y, -response_clip, response_clip))
    return rows.T @ rows, rows.T @ y, int(clipped_users.sum())


def solve_embedding(cov: np.ndarray, corr: np.ndarray, dim: int, rank: int) -> np.ndarray:
    """Alg. 2 lines 3-4: ``u = argmin u^T C u - 2 u^T b`` (i.e. ``C u = b``), then QR of ``U``.

    A singular ``C`` (few users, or noise cancelling signal) falls back to the minimum-norm
    least-squares solution.
    """
    sym = (cov + cov.T) / 2.0
    try:
        u = np.linalg.solve(sym, corr)
    except np.linalg.LinAlgError:
        u = np.linalg.lstsq(sym, corr, rcond=None)[0]
    return orthonormalize(u.reshape(dim, rank))
