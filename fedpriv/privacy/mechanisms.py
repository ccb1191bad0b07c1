"""Privacy mechanisms: per-user clipping and Gaussian noise.

Pure functions with explicit arguments. Noise always comes from a caller-supplied
``numpy.random.Generator``; nothing here touches global random state.
"""

from __future__ import annotations

import numpy as np


def norms(values: np.ndarray) -> np.ndarray:
    """L2 (Frobenius) norm of each entry along the leading axis."""
    flat = values.reshape(values.shape[0], int(np.prod(values.shape[1:])))
    return np.sqrt(np.einsum("ij,ij->i", flat, flat))


def clip_factors(values: np.ndarray, clip_norm: float) -> np.ndarray:
    """``min(1, clip_norm / ||values[i]||)`` per entry; exactly 1 for an all-zero entry."""
    return factors_from_norms(norms(values), clip_norm)


def factors_from_norms(n: np.ndarray, clip_norm: float) -> np.ndarray:
    """``min(1, clip_norm / n_i)`` for entries of norms ``n``; exactly 1 for a zero norm."""
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be positive, got {clip_norm}")
    factors = np.ones_like(n)
    np.divide(clip_norm, n, out=factors, where=n > clip_norm)
    return factors


def clip_by_norm(values: np.ndarray, clip_norm: float) -> np.ndarray:
    """Scale each entry along the leading axis so its L2 norm is at most ``clip_norm``.

    Returns a new array; a norm is never increased, and directions are kept.
    """
    factors = clip_factors(values, clip_norm)
    return values * factors.reshape((-1,) + (1,) * (values.ndim - 1))


def clipped_sum(values: np.ndarray, clip_norm: float) -> tuple[np.ndarray, int]:
    """Sum of per-entry clipped values, and how many entries were actually scaled down."""
    factors = clip_factors(values, clip_norm)
    total = np.tensordot(factors, values, axes=(0, 0))
    return total, int(np.count_nonzero(factors < 1.0))


def clipped_outer_sum(left: np.ndarray, right: np.ndarray,
                      clip_norm: float) -> tuple[np.ndarray, int]:
    """``clipped_sum`` of rank-one entries ``left[i] right[i]^T`` without forming them:
    ``||l r^T||_F = ||l|| ||r||``, and the clipped sum is ``(F l)^T r``, one (a x n) by (n x b)
    product instead of an (n, a, b) array. ``left`` is (n, a), ``right`` (n, b)."""
    entry_norms = np.sqrt(np.einsum("ni,ni->n", left, left)
                          * np.einsum("nj,nj->n", right, right))
    factors = factors_from_norms(entry_norms, clip_norm)
    return (left * factors[:, None]).T @ right, int(np.count_nonzero(factors < 1.0))


def gaussian_noise(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """I.i.d. N(0, std^2) noise of the given shape."""
    if std < 0:
        raise ValueError(f"noise std must be non-negative, got {std}")
    return rng.standard_normal(shape) * std


def symmetric_gaussian_noise(dim: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """A symmetric d x d matrix whose upper triangle (diagonal included) is i.i.d. N(0, std^2).

    Releasing the upper triangle of a symmetric statistic has L2 sensitivity at most the
    Frobenius sensitivity of the statistic, so this noise gives the same guarantee as noising the
    full matrix, with the output kept symmetric.
    """
    upper = np.triu(rng.standard_normal((dim, dim)) * std)
    return upper + np.triu(upper, 1).T


def exponential_log_weights(scores: np.ndarray, epsilon: float,
                            sensitivity: float) -> np.ndarray:
    """Log-probabilities (normalized, by log-sum-exp) of the exponential mechanism that prefers
    *low* scores: ``P(c) ~ exp(-epsilon * score_c / (2 * sensitivity))``. Epsilon-DP when one
    user moves every score by at most ``sensitivity``."""
    if not epsilon > 0 or not sensitivity > 0:
        raise ValueError(f"epsilon and sensitivity must be > 0, got {epsilon}, {sensitivity}")
    logits = -epsilon * np.asarray(scores, dtype=np.float64) / (2.0 * sensitivity)
    top = logits.max()
    return logits - (top + np.log(np.exp(logits - top).sum()))


def exponential_mechanism(scores: np.ndarray, epsilon: float, sensitivity: float,
                          rng: np.random.Generator) -> int:
    """One draw of the exponential mechanism (low scores preferred) by the Gumbel-max trick:
    ``argmax_c (logit_c + G_c)`` with i.i.d. standard Gumbel ``G_c`` has exactly the softmax
    distribution, and never exponentiates a logit (no overflow however large the scores)."""
    if not epsilon > 0 or not sensitivity > 0:
        raise ValueError(f"epsilon and sensitivity must be > 0, got {epsilon}, {sensitivity}")
    logits = -epsilon * np.asarray(scores, dtype=np.float64) / (2.0 * sensitivity)
    if not np.all(np.isfinite(logits)):
        raise ValueError("exponential mechanism: non-finite scores")
    return int(np.argmax(logits + rng.gumbel(size=logits.shape)))
