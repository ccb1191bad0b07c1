"""Private FedRep: Snedeker, Zhou & Bassily (2025), Algorithm 1.

User side (lines 5-7): from its first half ``S0`` each user draws two disjoint batches ``B`` and
``B'`` of size ``b``; solves ``v`` by least squares on ``B`` and computes the embedding gradient on
``B'``. Server side (line 10): clip each user's gradient to Frobenius norm ``psi``, average over the
population ``n``, add Gaussian noise, take a gradient step and re-orthonormalize with QR.
"""

from __future__ import annotations

import numpy as np

from fedpriv.algorithms.personalization.linear_math import least_squares, orthonormalize
from fedpriv.randomness import user_permutations

BATCH_PURPOSE = 1  # tag of the batch-sampling stream in fedpriv.randomness


def paper_batch_size(samples_per_user: int, rounds: int) -> int:
    """The paper's ``b = floor(m / (2T))`` (may be 0 or below k)."""
    return samples_per_user // (2 * rounds)


def resolve_batch_size(
    policy: str | int, samples_per_user: int, rounds: int, rank: int
) -> int:
    """Batch size ``b`` of each of the two disjoint batches drawn per round from ``S0``.

    * ``"max"`` (default): ``b = floor(|S0| / 2)``, the largest two disjoint batches ``S0`` holds.
      Batches are redrawn each round, so a sample may serve in several rounds (the paper's
      analysis wants fresh samples; with m = 10 that would leave b = 1 < k).
    * ``"paper"``: ``b = max(1, floor(m / (2T)))``; when ``b < k`` the local solve is the
      minimum-norm least-squares solution.
    * an integer: that size, which must satisfy ``1 <= 2b <= |S0|``.
    """
    half = samples_per_user // 2
    if policy == "max":
        b = half // 2
    elif policy == "paper":
        b = max(1, paper_batch_size(samples_per_user, rounds))
    else:
        b = int(policy)
    if b < 1 or 2 * b > half:
        raise ValueError(
            f"batch size {b} does not fit: two disjoint batches of size b must come from the "
            f"first half of each user's data ({half} samples), so 1 <= b <= {half // 2}"
        )
    return b


def disjoint_batches(
    seed: int, round_index: int, user_ids: np.ndarray, pool_size: int, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (n, b) of the two disjoint batches each user draws without replacement."""
    perm = user_permutations(seed, BATCH_PURPOSE, round_index, user_ids, pool_size)
    return perm[:, :batch_size], perm[:, batch_size : 2 * batch_size]


def embedding_gradients(
    embedding: np.ndarray,
    solve_features: np.ndarray,
    solve_labels: np.ndarray,
    grad_features: np.ndarray,
    grad_labels: np.ndarray,
) -> np.ndarray:
    """Per-user gradient of the batch loss at ``(U, v_i)``, with ``v_i`` solved on the other batch.

    ``v_i = argmin_v L(U, v; B)``, then ``grad_i = d/dU (1/b') sum_{B'} (y - <x, U v_i>)^2
    = -(2/b') X'^T r v_i^T``. Shapes: features (n, b, d), labels (n, b); returns (n, d, k).
    """
    v = least_squares(solve_features @ embedding, solve_labels)
    residual = grad_labels - np.einsum("nbd,dk,nk->nb", grad_features, embedding, v)
    scale = -2.0 / grad_features.shape[1]
    gradients: np.ndarray = scale * np.einsum("nbd,nb,nk->ndk", grad_features, residual, v)
    return gradients


def gradient_factors(
    embedding: np.ndarray,
    features: np.ndarray,
    labels: np.ndarray,
    user_ids: np.ndarray,
    seed: int,
    round_index: int,
    batch_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1, lines 5-7, for a cohort, in factored form: each user's gradient is the
    rank-one ``g_i v_i^T`` with ``g_i = -(2/b) X'^T r`` (d,) and ``v_i`` (k,) solved on the other
    batch; returns ``(g, v)``, (n, d) and (n, k). ``features``/``labels`` are the users' ``S0``.
    The server's clipped sum of these is ``fedpriv.privacy.mechanisms.clipped_outer_sum``.

    Works on ``X U`` of all of ``S0`` (n, |S0|, k) and gathers the two batches from it, and
    writes the second batch's residuals into an (n, |S0|) weight matrix, so no batch of
    d-dimensional features is copied: the same numbers as ``embedding_gradients`` on the
    gathered batches, several times faster."""
    first, second = disjoint_batches(seed, round_index, user_ids, features.shape[1], batch_size)
    rows = np.arange(features.shape[0])[:, None]
    projected = features @ embedding  # (n, |S0|, k)
    v = least_squares(projected[rows, first], labels[rows, first])
    residual = labels[rows, second] - np.einsum("nbk,nk->nb", projected[rows, second], v)
    weights = np.zeros(labels.shape)
    weights[rows, second] = residual * (-2.0 / batch_size)
    return np.einsum("nmd,nm->nd", features, weights), v


def server_update(
    embedding: np.ndarray, noisy_mean: np.ndarray, learning_rate: float
) -> np.ndarray:
    """Algorithm 1, line 10: ``U_{t+1} = QR(U_t - eta (sum_i clip(grad_i) / n + xi))``.

    ``noisy_mean`` is the clipped sum divided by the population size fixed in advance (not the
    number of users that answered), plus the Gaussian noise, so the sensitivity stays what the
    accountant assumes.
    """
    return orthonormalize(embedding - learning_rate * noisy_mean)
