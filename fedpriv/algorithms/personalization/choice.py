"""Each user's final choice in linear personalization (``final-choice = "best"``, the default of
the shared-embedding algorithms: Private FedRep, Priv-AltMin and their non-private versions):
never worse than training alone, as the deep family's (``fedpriv.algorithms.deep.choice``).

User i has two regression vectors at the end: the **shared** one, ``U v_i`` with ``v_i`` fitted
on its held-back half ``S1`` given the released ``U`` (the vector without the choice), and its
**local** one (minimum-norm least squares on its own samples, alone). It keeps ``w U v_i + (1
- w) w_local`` for the weight ``w`` in ``MIX_WEIGHTS`` of least cross-validated squared error:
the first half ``S0`` in k folds (sample j in fold j mod k), the local vector fitted on all m
samples but the fold and scored on it, beside the shared vector (``v_i`` never sees ``S0``); a
tie goes to the larger weight. The local vector kept is the mean of the k fold fits (why: at
the end of ``chosen_models``). Nothing but the user's own samples and the released ``U``
enters: post-processing on the node, no privacy cost.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedpriv.algorithms.personalization.linear_math import least_squares, local_vectors
from fedpriv.algorithms.shared_params import MIX_WEIGHTS
from fedpriv.data.synthetic import UserData

CHOICE_KEYS = ("shared_excess", "chose_shared", "chose_mix", "chose_local")


def chosen_models(embedding: np.ndarray, data: UserData, folds: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each user's kept vector, its shared vector (the run without the choice) and the chosen
    weight of the shared one: (n, d), (n, d), (n,)."""
    x, y = data.features, data.labels
    n, m, _ = x.shape
    half = m // 2
    fold = np.where(np.arange(m) < half, np.arange(m) % folds, -1)  # S1 is never held back
    held_shared, held_local = np.zeros((n, half)), np.zeros((n, half))
    shared = local_vectors(embedding, x[:, half:], y[:, half:]) @ embedding.T  # on all of S1
    fitted = []
    for j in range(min(folds, half)):
        local = least_squares(x[:, fold != j], y[:, fold != j])
        fitted.append(local)
        rows = fold[:half] == j
        held_shared[:, rows] = np.einsum("nmd,nd->nm", x[:, :half][:, rows], shared)
        held_local[:, rows] = np.einsum("nmd,nd->nm", x[:, :half][:, rows], local)
    errors = np.stack([((y[:, :half] - (w * held_shared + (1 - w) * held_local)) ** 2).sum(1)
                       for w in MIX_WEIGHTS], 1)  # (n, weights)
    errors = np.where(np.isfinite(errors), errors, np.inf)
    weight = np.asarray(MIX_WEIGHTS)[errors.argmin(1)]  # argmin: the first of equal errors
    # the local vector kept is the mean of the fold fits the choice scored, not a refit on all
    # m samples: minimum-norm least squares is unstable where m is near d (a refit can be far
    # worse than every fold fit), and by convexity the mean's squared error is at most the
    # mean of theirs, which is what the cross-validation estimated
    local = np.mean(fitted, axis=0)
    w = weight[:, None]
    with np.errstate(invalid="ignore"):  # the model a user does not keep may be non-finite
        kept = np.where(w == 1, shared, np.where(w == 0, local, w * shared + (1 - w) * local))
    return kept, shared, weight


def choice_sums(w_star: np.ndarray, shared: np.ndarray, weight: np.ndarray) -> dict[str, float]:
    """The operator's sums beside the kept vectors' (``evaluate_models``): the shared vectors'
    excess risk (the run without the choice) and how many users chose each kind."""
    return {"shared_excess": float(((shared - w_star) ** 2).sum()),
            "chose_shared": float((weight == 1.0).sum()),
            "chose_mix": float(((weight > 0.0) & (weight < 1.0)).sum()),
            "chose_local": float((weight == 0.0).sum())}


def choice_metrics(label_noise: float, sums: Mapping[str, float],
                   num_users: int) -> dict[str, float]:
    """``population_mse_shared`` (the method without the choice) and the share of users
    choosing each kind; nothing for a run without the choice."""
    if "chose_shared" not in sums:
        return {}
    return {"population_mse_shared": label_noise**2 + sums["shared_excess"] / num_users,
            **{k: sums[k] / num_users for k in CHOICE_KEYS[1:]}}
