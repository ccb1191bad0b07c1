"""Batched least squares and subspace utilities shared by the personalization algorithms."""

from __future__ import annotations

import numpy as np

_COND_LIMIT = 1e6
"""Users whose matrix (``D`` when square, else its Gram matrix) has an estimated condition
number above this are solved by ``pinv``: squaring the condition number would cost digits."""


def least_squares(design: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Minimum-norm least squares per user: ``argmin_v ||targets - design v||``.

    ``design`` is (n, b, k), ``targets`` (n, b); returns (n, k). When b < k the problem is
    underdetermined and the minimum-norm solution is returned (the pseudo-inverse).

    For a full-rank ``D`` the pseudo-inverse solution is ``D^{-1} y`` (b = k),
    ``D^T (D D^T)^{-1} y`` (b < k) or ``(D^T D)^{-1} D^T y`` (b > k): a batched small inverse
    instead of a batched SVD (several times faster at the paper setting). Users whose inverted
    matrix is singular or ill-conditioned (estimated condition number ``||M||_F ||M^-1||_F``
    above 1e6) are solved with ``np.linalg.pinv`` as before, so the answers agree with it to
    about 1e-10 relative.
    """
    n, b, k = design.shape
    if n == 0:
        return np.zeros((0, k))
    finite = np.isfinite(design).all(axis=(1, 2)) & np.isfinite(targets).all(axis=1)
    if not finite.all():  # a user's non-finite data: its own v is nan (its update is dropped)
        out = np.full((n, k), np.nan)
        out[finite] = least_squares(design[finite], targets[finite])
        return out
    if b == k:
        matrix = design
    elif b < k:
        matrix = design @ design.transpose(0, 2, 1)
    else:
        matrix = design.transpose(0, 2, 1) @ design
    try:
        inverse = np.linalg.inv(matrix)
        cond = (np.sqrt(np.einsum("nij,nij->n", matrix, matrix))
                * np.sqrt(np.einsum("nij,nij->n", inverse, inverse)))
        bad = ~(cond <= _COND_LIMIT)  # NaN and inf included
    except np.linalg.LinAlgError:  # a singular matrix in the batch
        inverse, bad = None, np.ones(n, dtype=bool)
    out = np.empty((n, k))
    good = ~bad
    if inverse is not None and good.any():
        d, y, inv = design[good], targets[good], inverse[good]
        if b == k:
            out[good] = np.einsum("nij,nj->ni", inv, y)
        elif b < k:
            out[good] = np.einsum("nbk,nb->nk", d, np.einsum("nij,nj->ni", inv, y))
        else:
            out[good] = np.einsum("nij,nj->ni", inv, np.einsum("nbk,nb->nk", d, y))
    if bad.any():
        out[bad] = np.einsum("nkb,nb->nk", np.linalg.pinv(design[bad]), targets[bad])
    return out


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
