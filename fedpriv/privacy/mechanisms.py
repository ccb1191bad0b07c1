"""Privacy mechanisms: per-user clipping and Gaussian noise.

Pure functions with explicit arguments. Noise always comes from a caller-supplied
``numpy.random.Generator``; nothing here touches global random state.
"""

from __future__ import annotations

import math

import numpy as np

# Sums of squares outside [_SAFE_LOW, _SAFE_HIGH] may have overflowed or lost their entries to
# underflow (a norm of 1e-200 squared is 0: a huge update times a tiny one would then look
# unclipped): such entries are measured again, scaled by their largest magnitude.
_SAFE_LOW, _SAFE_HIGH = 1e-200, 1e200


def norms(values: np.ndarray) -> np.ndarray:
    """L2 (Frobenius) norm of each entry along the leading axis, free of overflow and
    underflow: an entry whose sum of squares is not safely inside float64's range is measured
    again scaled by its largest magnitude, so a huge or tiny but finite entry gets its true
    norm; an entry holding nan or inf gets a non-finite norm."""
    flat = values.reshape(values.shape[0], int(np.prod(values.shape[1:])))
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        squares = np.einsum("ij,ij->i", flat, flat)
        out: np.ndarray = np.sqrt(squares)
        redo = ~((squares >= _SAFE_LOW) & (squares <= _SAFE_HIGH))
        if redo.any():
            rows = flat[redo]
            peak = np.max(np.abs(rows), axis=1, initial=0.0)
            safe = np.where(peak > 0, peak, 1.0)[:, None]
            out[redo] = peak * np.sqrt(np.einsum("ij,ij->i", rows / safe, rows / safe))
    return out


def clip_factors(values: np.ndarray, clip_norm: float) -> np.ndarray:
    """``min(1, clip_norm / ||values[i]||)`` per entry; exactly 1 for an all-zero entry and 0
    for an entry whose norm is not finite (``factors_from_norms``)."""
    return factors_from_norms(norms(values), clip_norm)


def factors_from_norms(n: np.ndarray, clip_norm: float) -> np.ndarray:
    """``min(1, clip_norm / n_i)`` for entries of norms ``n``; exactly 1 for a zero norm.

    Per-user isolation: a norm that is nan or infinite (a user's data overflowed, or held a
    non-finite value) gives the factor 0, so that user's contribution is zero (and counts as
    clipped: its factor is below 1). ``n > clip_norm`` alone is False for nan, which would
    have let such an entry through unclipped."""
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be positive, got {clip_norm}")
    n = np.asarray(n, dtype=np.float64)
    factors = np.ones_like(n)
    np.divide(clip_norm, n, out=factors, where=n > clip_norm)
    factors[~np.isfinite(n)] = 0.0
    return factors


def without_dropped(values: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """``values`` with the entries whose factor is 0 set to exactly zero (a copy where there
    are any): ``0 * nan`` is nan, and a dropped user must not poison a sum."""
    dropped = factors == 0
    if not dropped.any():
        return values
    values = values.copy()
    values[dropped] = 0.0
    return values


def clip_by_norm(values: np.ndarray, clip_norm: float) -> np.ndarray:
    """Scale each entry along the leading axis so its L2 norm is at most ``clip_norm``.

    Returns a new array; a norm is never increased, and directions are kept. An entry whose
    norm is not finite becomes zero."""
    factors = clip_factors(values, clip_norm)
    clipped: np.ndarray = without_dropped(values, factors) * factors.reshape(
        (-1,) + (1,) * (values.ndim - 1))
    return clipped


def clipped_sum(values: np.ndarray, clip_norm: float) -> tuple[np.ndarray, int]:
    """Sum of per-entry clipped values, and how many entries were actually scaled down (an
    entry with a non-finite norm counts as scaled down, to zero)."""
    factors = clip_factors(values, clip_norm)
    total = np.tensordot(factors, without_dropped(values, factors), axes=(0, 0))
    return total, int(np.count_nonzero(factors < 1.0))


def clipped_outer_sum(left: np.ndarray, right: np.ndarray,
                      clip_norm: float) -> tuple[np.ndarray, int]:
    """``clipped_sum`` of rank-one entries ``left[i] right[i]^T`` without forming them:
    ``||l r^T||_F = ||l|| ||r||``, and the clipped sum is ``(F l)^T r``, one (a x n) by (n x b)
    product instead of an (n, a, b) array. ``left`` is (n, a), ``right`` (n, b)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        ll, rr = np.einsum("ni,ni->n", left, left), np.einsum("nj,nj->n", right, right)
        entry_norms = np.sqrt(ll * rr)
        redo = ~((ll >= _SAFE_LOW) & (ll <= _SAFE_HIGH) & (rr >= _SAFE_LOW)
                 & (rr <= _SAFE_HIGH))  # overflow, underflow or non-finite: measure apart
        if redo.any():
            entry_norms[redo] = norms(left[redo]) * norms(right[redo])
    factors = factors_from_norms(entry_norms, clip_norm)
    left, right = without_dropped(left, factors), without_dropped(right, factors)
    return (left * factors[:, None]).T @ right, int(np.count_nonzero(factors < 1.0))


def score_sum(scores: np.ndarray, bound: float) -> tuple[np.ndarray, int]:
    """Sum over users of exponential-mechanism scores (candidates, users), each clamped to
    ``[0, bound]``; a user with any non-finite score contributes zero to every candidate (as a
    removed user would), and is counted."""
    bad = ~np.isfinite(scores).all(axis=0)
    safe = np.clip(np.where(bad[None, :], 0.0, scores), 0.0, bound)
    return safe.sum(axis=1), int(bad.sum())


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
    weights: np.ndarray = logits - (top + np.log(np.exp(logits - top).sum()))
    return weights


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


def adapted_clip(clip: float, unclipped_fraction: float, quantile: float, rate: float) -> float:
    """Andrew et al. (2021), Alg. 1: the geometric step of the clip norm towards the
    ``quantile`` of the users' update norms, from the (noisy) fraction of unclipped users."""
    return clip * math.exp(-rate * (unclipped_fraction - quantile))
