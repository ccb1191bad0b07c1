"""Private FedRep with private initialization (Snedeker, Zhou & Bassily 2025, Algs. 1 and 2).

Steps: ``init`` (Alg. 2: clipped U-statistics, symmetric noise, top-k eigenvectors), ``round-t``
for t = 1..T (Alg. 1: disjoint-batch local solve and embedding gradient, clip, noisy mean, QR),
and ``final`` (each user fits ``v_i`` on its held-back half; metrics).

Privacy (user level): each user's contribution is clipped before anything is summed, so the mean
over the fixed population ``n`` has L2 sensitivity ``psi / n`` (add/remove) or ``2 psi / n``
(replace-one). The init release and the T rounds are one plan calibrated by dp-accounting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpriv.algorithms import fedrep, private_init
from fedpriv.algorithms.base import Algorithm, Step, UserContribution
from fedpriv.algorithms.linear import local_vectors, subspace_distance
from fedpriv.cohorts import cohort_data
from fedpriv.data.synthetic import SyntheticProblem, ground_truth_embedding, true_user_models
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import clipped_sum, symmetric_gaussian_noise
from fedpriv.registry import register


def problem_of(config: Any) -> SyntheticProblem:
    return SyntheticProblem(
        num_users=config.num_users,
        dim=config.dim,
        rank=config.rank,
        samples_per_user=config.samples_per_user,
        label_noise=config.label_noise,
        feature_dist=config.feature_dist,
        seed=config.seed,
    )


def batch_size_of(config: Any) -> int:
    policy = config.batch_size if config.batch_size in ("max", "paper") else int(config.batch_size)
    return fedrep.resolve_batch_size(policy, config.samples_per_user, config.rounds, config.rank)


def final_user_metrics(
    problem: SyntheticProblem, embedding: np.ndarray, user_ids: np.ndarray, test_samples: int
) -> dict[str, float]:
    """Per-user final fit on the held-back half ``S1`` and the metric sums over these users.

    With zero-mean, identity-covariance features the population MSE of ``w`` for user i is
    exactly ``R^2 + ||w - w*_i||^2``; ``test`` is the empirical MSE on fresh samples; ``local``
    is the user alone (minimum-norm least squares on all its m samples).
    """
    data = cohort_data(problem, user_ids)
    _, (x1, y1) = data.split_halves()
    w = local_vectors(embedding, x1, y1) @ embedding.T
    w_star = true_user_models(problem, data.true_local_vectors)
    test = cohort_data(problem, user_ids, samples=test_samples, fresh=True)
    test_err = test.labels - np.einsum("nmd,nd->nm", test.features, w)
    w_local = np.einsum("ndm,nm->nd", np.linalg.pinv(data.features), data.labels)
    return {
        "excess": float(((w - w_star) ** 2).sum()),
        "test_se": float((test_err**2).mean(axis=1).sum()),
        "local_excess": float(((w_local - w_star) ** 2).sum()),
    }


@register
class PrivateFedRep(Algorithm):
    """Private FedRep (Alg. 1) initialized by the private U-statistic method (Alg. 2)."""

    name = "private-fedrep"

    @classmethod
    def validate(cls, config: Any) -> None:
        from fedpriv.config import ConfigError

        try:
            batch_size_of(config)
        except ValueError as err:
            raise ConfigError(f"batch-size: {err}") from None
        if config.samples_per_user // 2 < 2:
            raise ConfigError("samples-per-user: the U-statistic needs >= 2 samples in S0")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.problem = problem_of(config)
        self.batch_size = batch_size_of(config)
        self.embedding: np.ndarray | None = None
        self._truth = ground_truth_embedding(self.problem)  # evaluation only

    def privacy_plan(self) -> list[PlannedRelease]:
        c = self.config
        share = (1.0 - c.init_budget_fraction) / c.rounds
        return [
            PlannedRelease("init", c.init_budget_fraction),
            PlannedRelease("round", share, c.rounds),
        ]

    def steps(self) -> list[Step]:
        c = self.config
        init = Step("init", 0, "init", c.init_clip_norm, (c.dim, c.dim))
        rounds = [
            Step("round", t, "round", c.clip_norm, (c.dim, c.rank)) for t in range(1, c.rounds + 1)
        ]
        return [init, *rounds, Step("final")]

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        if step.kind == "init":
            return {}
        assert self.embedding is not None, "the init step must run first"
        return {"embedding": self.embedding}

    def noise(self, step: Step, std: float, rng: np.random.Generator) -> np.ndarray:
        if step.kind == "init":
            return symmetric_gaussian_noise(self.config.dim, std, rng)
        return super().noise(step, std, rng)

    def apply(self, step: Step, noisy_mean: np.ndarray) -> dict[str, float]:
        if step.kind == "init":
            self.embedding = private_init.server_init(noisy_mean, self.config.rank)
        else:
            assert self.embedding is not None
            self.embedding = fedrep.server_update(
                self.embedding, noisy_mean, self.config.learning_rate
            )
        return {"subspace_distance": subspace_distance(self.embedding, self._truth)}

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        noise_floor = self.config.label_noise**2
        excess = metric_sums["excess"] / num_users
        return {
            "population_mse": noise_floor + excess,
            "excess_risk": excess,
            "test_mse": metric_sums["test_se"] / num_users,
            "local_only_mse": noise_floor + metric_sums["local_excess"] / num_users,
            "subspace_distance": subspace_distance(self.embedding, self._truth),
            "batch_size": float(self.batch_size),
        }

    def state(self) -> dict[str, Any]:
        return {"embedding": None if self.embedding is None else self.embedding.tolist()}

    @classmethod
    def user_step(
        cls, config: Any, step: Step, arrays: Mapping[str, np.ndarray], user_ids: np.ndarray
    ) -> UserContribution:
        problem = problem_of(config)
        if step.kind == "final":
            metrics = final_user_metrics(
                problem, arrays["embedding"], user_ids, config.test_samples_per_user
            )
            return UserContribution(np.zeros(0), len(user_ids), 0, metrics)
        data = cohort_data(problem, user_ids)
        (x0, y0), _ = data.split_halves()
        if step.kind == "init":
            total, clipped = private_init.clipped_u_statistic_sum(x0, y0, step.clip_norm)
        else:
            grads = fedrep.user_gradients(
                arrays["embedding"], x0, y0, data.user_ids, config.seed, step.index,
                batch_size_of(config),
            )
            total, clipped = clipped_sum(grads, step.clip_norm)
        return UserContribution(total, len(user_ids), clipped)
