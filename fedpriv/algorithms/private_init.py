"""Private initialization: Snedeker, Zhou & Bassily (2025), Algorithm 2.

Each user sends the U-statistic ``Z_i = 1/(m(m-1)) sum_{j1 != j2} y_j1 y_j2 x_j1 x_j2^T`` of its
first half (an unbiased estimate of ``w*_i w*_i^T`` for zero-mean, identity-covariance features);
the server clips each ``Z_i`` in Frobenius norm, sums, adds symmetric Gaussian noise, divides by
``n`` and takes the top-k eigenvectors.
"""

from __future__ import annotations

import numpy as np

from fedpriv.algorithms.linear import top_eigenvectors
from fedpriv.privacy.mechanisms import clipped_sum


def u_statistics(features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``Z_i`` for each user, shape (n, d, d). Uses ``sum_{j1 != j2} a_j1 a_j2^T = s s^T -
    sum_j a_j a_j^T`` with ``a_j = y_j x_j`` and ``s = sum_j a_j``."""
    m = features.shape[1]
    if m < 2:
        raise ValueError(f"the U-statistic needs at least 2 samples per user, got {m}")
    weighted = features * labels[:, :, None]  # a_j, (n, m, d)
    total = weighted.sum(axis=1)
    outer = np.einsum("ni,nj->nij", total, total) - np.einsum("nmi,nmj->nij", weighted, weighted)
    return outer / (m * (m - 1))


def clipped_u_statistic_sum(
    features: np.ndarray, labels: np.ndarray, clip_norm: float, chunk: int = 2048
) -> tuple[np.ndarray, int]:
    """Sum over users of ``clip(Z_i, clip_norm)``, computed in chunks to bound memory."""
    d = features.shape[2]
    total = np.zeros((d, d))
    clipped = 0
    for start in range(0, features.shape[0], chunk):
        z = u_statistics(features[start : start + chunk], labels[start : start + chunk])
        part, count = clipped_sum(z, clip_norm)
        total += part
        clipped += count
    return total, clipped


def server_init(noisy_mean: np.ndarray, rank: int) -> np.ndarray:
    """``U_init``: top-k eigenvectors of ``sum_i clip(Z_i) / n + xi`` (xi symmetric)."""
    return top_eigenvectors(noisy_mean, rank)
