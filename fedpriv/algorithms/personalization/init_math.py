"""Private initialization: Snedeker, Zhou & Bassily (2025), Algorithm 2.

Each user sends the U-statistic ``Z_i = 1/(m(m-1)) sum_{j1 != j2} y_j1 y_j2 x_j1 x_j2^T`` of its
first half (an unbiased estimate of ``w*_i w*_i^T`` for zero-mean, identity-covariance features);
the server clips each ``Z_i`` in Frobenius norm, sums, adds symmetric Gaussian noise, divides by
``n`` and takes the top-k eigenvectors.
"""

from __future__ import annotations

import numpy as np

from fedpriv.algorithms.personalization.linear_math import top_eigenvectors
from fedpriv.privacy.mechanisms import clipped_sum, factors_from_norms, without_dropped


def u_statistics(features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``Z_i`` for each user, shape (n, d, d). Uses ``sum_{j1 != j2} a_j1 a_j2^T = s s^T -
    sum_j a_j a_j^T`` with ``a_j = y_j x_j`` and ``s = sum_j a_j``."""
    m = features.shape[1]
    if m < 2:
        raise ValueError(f"the U-statistic needs at least 2 samples per user, got {m}")
    weighted = features * labels[:, :, None]  # a_j, (n, m, d)
    total = weighted.sum(axis=1)
    outer = np.einsum("ni,nj->nij", total, total) - np.einsum("nmi,nmj->nij", weighted, weighted)
    statistic: np.ndarray = outer / (m * (m - 1))
    return statistic


def _norm_bounds(weighted: np.ndarray, total: np.ndarray) -> np.ndarray:
    """An upper bound on ``||Z_i||_F`` for each user, without forming ``Z_i``: with ``A`` the
    (m, d) matrix of rows ``a_j`` and ``s = A^T 1``, ``||s s^T - A^T A||_F^2 = ||s||^4 -
    2 ||A s||^2 + ||A A^T||_F^2`` (an m x m Gram matrix instead of a d x d one).

    The three terms can cancel (a user with one non-zero sample has ``Z = 0``), so the
    computed square may be off by a few ulps of the terms' size. A norm that came out too small
    would let the user's clipped ``Z`` exceed the clip norm, breaking the sensitivity the
    accountant assumes; so the rounding error is added: each term is a sum of at most
    ``m d + m^2`` products, whose floating-point error is below ``(m d + m^2 + 4) eps`` times
    the sum of magnitudes (Higham, Thm. 3.5), taken here with a factor 16 to spare. Using an
    upper bound only clips more: ``min(1, psi / bound) ||Z|| <= psi`` always."""
    n, m, d = weighted.shape
    s2 = np.einsum("ni,ni->n", total, total)
    a_s = np.einsum("nmd,nd->nm", weighted, total)
    gram = weighted @ weighted.transpose(0, 2, 1)
    terms = (s2 * s2, 2.0 * np.einsum("nm,nm->n", a_s, a_s),
             np.einsum("nij,nij->n", gram, gram))
    slack = 16.0 * (m * d + m * m + 4) * np.finfo(np.float64).eps * sum(terms)
    square = terms[0] - terms[1] + terms[2] + slack
    norms: np.ndarray = np.sqrt(np.maximum(square, 0.0)) / (m * (m - 1))
    return norms


def clipped_u_statistic_sum(
    features: np.ndarray, labels: np.ndarray, clip_norm: float
) -> tuple[np.ndarray, int]:
    """Sum over users of ``clip(Z_i, clip_norm)``: clip factors ``f_i`` from an upper bound on
    ``||Z_i||_F`` (``_norm_bounds``), then ``sum_i f_i Z_i = (S^T F S - sum_i f_i A_i^T A_i) /
    (m(m-1))`` as two matrix products over the block (never an (n, d, d) array)."""
    n, m, d = features.shape
    if m < 2:
        raise ValueError(f"the U-statistic needs at least 2 samples per user, got {m}")
    weighted = features * labels[:, :, None]  # a_j, (n, m, d)
    total = weighted.sum(axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        factors = factors_from_norms(_norm_bounds(weighted, total), clip_norm)
    # a user whose bound is not finite (overflow, nan) has factor 0: its rows become zeros
    weighted, total = without_dropped(weighted, factors), without_dropped(total, factors)
    flat = weighted.reshape(n * m, d)
    outer = total.T @ (total * factors[:, None]) - flat.T @ (flat * np.repeat(factors, m)[:, None])
    return outer / (m * (m - 1)), int(np.count_nonzero(factors < 1.0))


def server_init(noisy_mean: np.ndarray, rank: int) -> np.ndarray:
    """``U_init``: top-k eigenvectors of ``sum_i clip(Z_i) / n + xi`` (xi symmetric)."""
    return top_eigenvectors(noisy_mean, rank)


# ----- Jain et al. (2021), Algorithm 3 ---------------------------------------------------------
def pair_statistics(
    features: np.ndarray, labels: np.ndarray, response_clip: float
) -> np.ndarray:
    """Per-user ``M_i = sum_p sym(x_a x_b^T / (||x_a|| ||x_b||)) clip(y_a) clip(y_b)`` over the
    disjoint pairs ``(a, b) = (0, 1), (2, 3), ...`` of the given samples, shape (n, d, d).

    ``sym(A) = (A + A^T) / 2`` (the paper's "replicate the upper triangle" can grow the Frobenius
    norm by sqrt(2); this keeps every term's norm <= zeta^2 with the same expectation), so
    ``||M_i||_F <= pairs * zeta^2``: the per-user bound, by construction.
    """
    pairs = features.shape[1] // 2
    if pairs < 1:
        raise ValueError("Jain et al.'s initialization needs at least 2 samples per user")
    a, b = features[:, 0 : 2 * pairs : 2], features[:, 1 : 2 * pairs : 2]
    ya, yb = labels[:, 0 : 2 * pairs : 2], labels[:, 1 : 2 * pairs : 2]
    if np.isfinite(response_clip):
        ya, yb = np.clip(ya, -response_clip, response_clip), np.clip(yb, -response_clip,
                                                                      response_clip)
    with np.errstate(invalid="ignore", divide="ignore"):
        weight = ya * yb / (np.linalg.norm(a, axis=2) * np.linalg.norm(b, axis=2))
    weight = np.nan_to_num(weight, nan=0.0, posinf=0.0, neginf=0.0)  # a zero feature vector
    outer = np.einsum("npi,npj,np->nij", a, b, weight)
    symmetric: np.ndarray = (outer + outer.transpose(0, 2, 1)) / 2.0
    return symmetric


def pair_bound(samples: int, response_clip: float) -> float:
    """Per-user Frobenius bound of ``pair_statistics`` with ``samples`` samples."""
    return (samples // 2) * response_clip**2


def clipped_pair_sum(
    features: np.ndarray, labels: np.ndarray, response_clip: float, chunk: int = 2048
) -> tuple[np.ndarray, int]:
    """Sum over users of ``M_i``, each re-clipped to its bound (a no-op up to rounding; it makes
    the stated sensitivity hold whatever the arithmetic does)."""
    d = features.shape[2]
    bound = pair_bound(features.shape[1], response_clip)
    total = np.zeros((d, d))
    clipped = 0
    for start in range(0, features.shape[0], chunk):
        stop = start + chunk
        m = pair_statistics(features[start:stop], labels[start:stop], response_clip)
        if np.isfinite(bound):
            part, count = clipped_sum(m, bound)
        else:
            part, count = m.sum(axis=0), 0
        total += part
        clipped += count
    return total, clipped
