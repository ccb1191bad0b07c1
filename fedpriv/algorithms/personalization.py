"""What the shared-embedding algorithms have in common: the problem, the initializations, the
final local fit and its metrics.

``EmbeddingAlgorithm`` runs ``init`` (one of three initializations), the subclass's rounds, and
``final`` (each user fits ``v_i`` on its held-back half ``S1`` given the released ``U``). A
subclass states its rounds (``round_steps``/``round_plan``), their user side
(``round_contribution``) and the server update (``round_update``).

Initializations (``init`` in the config; ``auto`` picks the algorithm's own paper's):

* ``u-statistic``: Snedeker, Zhou & Bassily (2025), Alg. 2. Per-user clipped U-statistics of
  ``S0``, symmetric noise, top-k eigenvectors. Per-user bound ``init-clip-norm``.
* ``pairs``: Jain et al. (2021), Alg. 3. Normalized outer products of disjoint sample pairs of
  ``S0`` weighted by clipped labels, symmetric noise, top-k eigenvectors. Per-user bound
  ``floor(|S0|/2) * response-clip^2``.
* ``random``: a Haar-random orthonormal ``U`` from the seed. Touches no data; costs no budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from fedpriv.algorithms import private_init
from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.algorithms.linear import local_vectors, orthonormalize, subspace_distance
from fedpriv.cohorts import cohort_data
from fedpriv.data.synthetic import SyntheticProblem, ground_truth_embedding, true_user_models
from fedpriv.privacy.accounting import PlannedRelease

_RANDOM_INIT_STREAM = 0xA11


def problem_of(config: Any) -> SyntheticProblem:
    return SyntheticProblem(
        num_users=config.num_users,
        dim=config.dim,
        rank=config.rank,
        samples_per_user=config.samples_per_user,
        label_noise=config.label_noise,
        feature_dist="gaussian" if config.feature_dist == "auto" else config.feature_dist,
        seed=config.seed,
    )


def clip_or_inf(config: Any, value: float) -> float:
    """A clip norm, or ``inf`` when the (non-private) config turns clipping off."""
    return value if config.clipping else float("inf")


def evaluate_models(
    problem: SyntheticProblem, user_ids: np.ndarray, models: np.ndarray, test_samples: int
) -> dict[str, float]:
    """Metric sums over users of their final regression vectors ``models`` (n, d).

    With zero-mean, identity-covariance features the population MSE of ``w`` for user i is
    exactly ``R^2 + ||w - w*_i||^2``; ``test_se`` is the empirical squared error on fresh samples;
    ``local_excess`` is the user alone (minimum-norm least squares on all its m samples), reported
    with every run as the reference.
    """
    data = cohort_data(problem, user_ids)
    w_star = true_user_models(problem, data.true_local_vectors)
    test = cohort_data(problem, user_ids, samples=test_samples, fresh=True)
    test_err = test.labels - np.einsum("nmd,nd->nm", test.features, models)
    return {
        "excess": float(((models - w_star) ** 2).sum()),
        "test_se": float((test_err**2).mean(axis=1).sum()),
        "local_excess": float(((local_models(problem, user_ids) - w_star) ** 2).sum()),
    }


def local_models(problem: SyntheticProblem, user_ids: np.ndarray) -> np.ndarray:
    """Each user alone: minimum-norm least squares on all its m samples, (n, d)."""
    data = cohort_data(problem, user_ids)
    return np.einsum("ndm,nm->nd", np.linalg.pinv(data.features), data.labels)


def embedding_models(
    problem: SyntheticProblem, embedding: np.ndarray, user_ids: np.ndarray
) -> np.ndarray:
    """``U v_i`` with ``v_i`` fitted on the user's held-back half ``S1``, (n, d)."""
    _, (x1, y1) = cohort_data(problem, user_ids).split_halves()
    return local_vectors(embedding, x1, y1) @ embedding.T


def final_metrics(
    config: Any, metric_sums: Mapping[str, float], num_users: int
) -> dict[str, float]:
    noise_floor = config.label_noise**2
    excess = metric_sums["excess"] / num_users
    return {
        "population_mse": noise_floor + excess,
        "excess_risk": excess,
        "test_mse": metric_sums["test_se"] / num_users,
        "local_only_mse": noise_floor + metric_sums["local_excess"] / num_users,
    }


class EmbeddingAlgorithm(Algorithm):
    """Base of the algorithms that release a shared embedding ``U`` (d x k)."""

    default_init: ClassVar[str] = "u-statistic"

    @classmethod
    def init_method(cls, config: Any) -> str:
        return cls.default_init if config.init == "auto" else config.init

    @classmethod
    def validate(cls, config: Any) -> None:
        from fedpriv.config import ConfigError

        super().validate(config)
        if cls.init_method(config) in ("u-statistic", "pairs") and config.samples_per_user // 2 < 2:
            raise ConfigError("samples-per-user: the initialization needs >= 2 samples in S0")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.problem = problem_of(config)
        self.init = self.init_method(config)
        self._truth = ground_truth_embedding(self.problem)  # evaluation only
        self.embedding: np.ndarray | None = None
        if self.init == "random":
            rng = np.random.default_rng([config.seed, _RANDOM_INIT_STREAM])
            self.embedding = orthonormalize(rng.standard_normal((config.dim, config.rank)))

    # ----- to be provided by subclasses ------------------------------------------------------
    def round_plan(self, weight: float) -> list[PlannedRelease]:
        raise NotImplementedError

    def round_steps(self) -> list[Step]:
        raise NotImplementedError

    def round_update(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def round_contribution(cls, config: Any, step: Step, embedding: np.ndarray,
                           data: Any) -> UserContribution:
        raise NotImplementedError

    # ----- the shared skeleton ---------------------------------------------------------------
    def _init_weight(self) -> float:
        return self.config.init_budget_fraction if self.init != "random" else 0.0

    def privacy_plan(self) -> list[PlannedRelease]:
        if not self.private:
            return []
        weight = self._init_weight()
        plan = [PlannedRelease("init", weight)] if weight else []
        return plan + self.round_plan(1.0 - weight)

    def init_step(self) -> Step | None:
        c = self.config
        if self.init == "random":
            return None
        if self.init == "u-statistic":
            bound = clip_or_inf(c, c.init_clip_norm)
        else:
            bound = private_init.pair_bound(c.samples_per_user // 2,
                                            clip_or_inf(c, c.response_clip))
        release = "init" if self.private else None
        return Step("init", 0, release, (Part("total", (c.dim, c.dim), bound, symmetric=True),))

    def steps(self) -> list[Step]:
        init = self.init_step()
        return [*([init] if init else []), *self.round_steps(), Step("final")]

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        if step.kind == "init":
            return {}
        assert self.embedding is not None, "the init step must run first"
        return {"embedding": self.embedding}

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        if step.kind == "init":
            self.embedding = private_init.server_init(noisy_means["total"], self.config.rank)
        else:
            self.embedding = self.round_update(step, noisy_means)
        return {"subspace_distance": subspace_distance(self.embedding, self._truth)}

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        metrics = final_metrics(self.config, metric_sums, num_users)
        metrics["subspace_distance"] = subspace_distance(self.embedding, self._truth)
        return metrics

    def state(self) -> dict[str, Any]:
        return {"init": self.init,
                "embedding": None if self.embedding is None else self.embedding.tolist()}

    @classmethod
    def user_step(
        cls, config: Any, step: Step, arrays: Mapping[str, np.ndarray], user_ids: np.ndarray
    ) -> UserContribution:
        problem = problem_of(config)
        if step.is_final:
            models = embedding_models(problem, arrays["embedding"], user_ids)
            metrics = evaluate_models(problem, user_ids, models, config.test_samples_per_user)
            return UserContribution({}, len(user_ids), 0, metrics)
        data = cohort_data(problem, user_ids)
        if step.kind == "init":
            (x0, y0), _ = data.split_halves()
            if cls.init_method(config) == "u-statistic":
                total, clipped = private_init.clipped_u_statistic_sum(x0, y0,
                                                                      step.parts[0].clip_norm)
            else:
                total, clipped = private_init.clipped_pair_sum(x0, y0,
                                                               clip_or_inf(config,
                                                                           config.response_clip))
            return UserContribution({"total": total}, len(user_ids), clipped)
        return cls.round_contribution(config, step, arrays["embedding"], data)
