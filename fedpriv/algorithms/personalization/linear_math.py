"""Batched least squares and subspace utilities shared by the personalization algorithms."""

from __future__ import annotations

import numpy as np


def least_squares(design: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Minimum-norm least squares per user: ``argmin_v ||targets - design v||``.

    ``design`` is (n, b, k), ``targets`` (n, b); returns (n, k). When b < k the problem is
    underdetermined and the minimum-norm solution is returned (the pseudo-inverse).
    """
    return np.einsum("nkb,nb->nk", np.linalg.pinv(design), targets)


def local_vectors(embedding: np.ndarray, features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``v_i = argmin_v sum_j (y_ij - <x_ij, U v>)^2`` for each user (minimum norm)."""
    return least_squares(features @ embedding, labels)


def orthonormalize(matrix: np.ndarray) -> np.ndarray:
    """The Q factor of the QR decomposition, with the sign convention diag(R) >= 0."""
    q, r = np.linalg.qr(matrix)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return q * signs


def top_eigenvectors(symmetric: np.ndarray, rank: int) -> np.ndarray:
    """Orthonormal eigenvectors of the ``rank`` algebraically largest eigenvalues."""
    _, vectors = np.linalg.eigh((symmetric + symmetric.T) / 2.0)
    return vectors[:, ::-1][:, :rank].copy()


def subspace_distance(estimate: np.ndarray, truth: np.ndarray) -> float:
    """Principal-angle distance ``||U_perp^T U*||_2`` (Definition 2 of Snedeker et al. 2025):
    the sine of the largest principal angle between the column spaces, in [0, 1]."""
    q_est = orthonormalize(estimate)
    q_true = orthonormalize(truth)
    residual = q_true - q_est @ (q_est.T @ q_true)
    return float(np.linalg.norm(residual, ord=2))
