"""The synthetic linear personalization problem of both papers: how a run's config makes it, the
final models' metrics, and the local-only reference.

User i's labels are ``y = <x, U* v*_i> + noise`` (``fedpriv.data.synthetic``). With zero-mean,
identity-covariance features the population MSE of a model ``w`` is exactly
``R^2 + ||w - w*_i||^2``, which is what ``population_mse`` reports.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedpriv.algorithms.personalization.linear_math import least_squares, local_vectors
from fedpriv.algorithms.personalization.params import ProblemKeys
from fedpriv.data.cache import cohort_data
from fedpriv.data.synthetic import SyntheticProblem, UserData, true_user_models


def problem_of(config: ProblemKeys) -> SyntheticProblem:
    return SyntheticProblem(
        num_users=config.num_users,
        dim=config.dim,
        rank=config.rank,
        samples_per_user=config.samples_per_user,
        label_noise=config.label_noise,
        feature_dist="gaussian" if config.feature_dist == "auto" else config.feature_dist,
        seed=config.seed,
        dtype=config.data_dtype,
    )


def clip_or_inf(clipping: bool, value: float) -> float:
    """A clip norm, or ``inf`` when the (non-private) config turns clipping off."""
    return value if clipping else float("inf")


def evaluate_models(
    problem: SyntheticProblem, user_ids: np.ndarray, models: np.ndarray, test_samples: int,
    data: UserData | None = None,
) -> dict[str, float]:
    """Metric sums over users of their final regression vectors ``models`` (n, d).

    With zero-mean, identity-covariance features the population MSE of ``w`` for user i is
    exactly ``R^2 + ||w - w*_i||^2``; ``test_se`` is the empirical squared error on fresh samples;
    ``local_excess`` is the user alone (minimum-norm least squares on all its m samples), reported
    with every run as the reference. ``data``: the users' training data, if the caller has it.
    """
    data = cohort_data(problem, user_ids) if data is None else data
    w_star = true_user_models(problem, data.true_local_vectors)
    return {
        "excess": float(((models - w_star) ** 2).sum()),
        "test_se": float(user_test_mse(problem, user_ids, models, test_samples).sum()),
        "local_excess": float(((local_models(problem, user_ids, data) - w_star) ** 2).sum()),
    }


def user_test_mse(problem: SyntheticProblem, user_ids: np.ndarray, models: np.ndarray,
                  test_samples: int, purpose: str = "test") -> np.ndarray:
    """Each user's mean squared error of its model on fresh test samples (``purpose =
    "validation"``: on its held-back validation samples), (n,)."""
    test = cohort_data(problem, user_ids, samples=test_samples, purpose=purpose)
    test_err = test.labels - np.einsum("nmd,nd->nm", test.features, models)
    mse: np.ndarray = (test_err**2).mean(axis=1)
    return mse


def evaluation_bounds(config: ProblemKeys) -> dict[str, float]:
    """Private metrics of the personalization family: each user's test MSE (``metrics-split =
    "validation"``: its validation MSE), clipped to ``[0, metric-clip]`` (see
    ``fedpriv.evaluation``). ``metric-clip = 0``: twice the test MSE of the zero model,
    ``2 (R^2 + k)`` (``E ||w*_i||^2 = k``), from public parameters only."""
    name = _evaluation_split(config)[0]
    return {name: config.metric_clip or 2.0 * (config.label_noise**2 + config.rank)}


def _evaluation_split(config: ProblemKeys) -> tuple[str, str, int]:
    """(metric name, data purpose, points per user) of the private evaluation."""
    if config.metrics_split == "validation":
        return "validation_mse", "validation", config.validation_samples_per_user
    return "test_mse", "test", config.test_samples_per_user


def evaluation_mse(config: ProblemKeys, user_ids: np.ndarray,
                   models: np.ndarray) -> dict[str, np.ndarray]:
    """The per-user values of the private evaluation: each user's MSE of its final model on its
    test points, or on its held-back validation points (``metrics-split``)."""
    name, purpose, samples = _evaluation_split(config)
    return {name: user_test_mse(problem_of(config), user_ids, models, samples, purpose)}


def local_models(problem: SyntheticProblem, user_ids: np.ndarray,
                 data: UserData | None = None) -> np.ndarray:
    """Each user alone: minimum-norm least squares on all its m samples, (n, d)."""
    data = cohort_data(problem, user_ids) if data is None else data
    return least_squares(data.features, data.labels)


def embedding_models(
    problem: SyntheticProblem, embedding: np.ndarray, user_ids: np.ndarray,
    data: UserData | None = None,
) -> np.ndarray:
    """``U v_i`` with ``v_i`` fitted on the user's held-back half ``S1``, (n, d)."""
    data = cohort_data(problem, user_ids) if data is None else data
    _, (x1, y1) = data.split_halves()
    models: np.ndarray = local_vectors(embedding, x1, y1) @ embedding.T
    return models


def final_metrics(
    config: ProblemKeys, metric_sums: Mapping[str, float], num_users: int
) -> dict[str, float]:
    noise_floor = config.label_noise**2
    excess = metric_sums["excess"] / num_users
    return {
        "population_mse": noise_floor + excess,
        "excess_risk": excess,
        "test_mse": metric_sums["test_se"] / num_users,
        "local_only_mse": noise_floor + metric_sums["local_excess"] / num_users,
    }
