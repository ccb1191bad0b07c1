"""Baselines both personalization papers compare against.

* ``local-only``: each user fits minimum-norm least squares on all its own m samples. Nothing
  leaves a user, so nothing is released (epsilon 0).
* ``known-embedding``: the reference with the true ``U*`` given: each user fits ``v_i`` on its
  held-back half ``S1`` exactly as the other algorithms' final step does. It isolates the error
  of the final local fit; no algorithm that learns ``U`` can beat it in expectation.
* ``dp-global-model``: one regression vector ``w`` shared by all users, trained by DP-FedAvg
  (McMahan et al. 2018) with one local gradient step per round: every user sends the gradient of
  its mean squared error on ``S0`` at ``w``, clipped to ``clip-norm``; the server averages over
  the population, adds Gaussian noise and steps ``w <- w - learning-rate * mean``. T rounds, one
  plan calibrated by the same accountant.

The non-private FedRep and AltMin baselines are ``fedrep`` and ``altmin`` (same steps as the
private algorithms, no noise; ``clipping = false`` removes clipping too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.algorithms.personalization.params import GlobalModelConfig, ProblemKeys
from fedpriv.algorithms.personalization.problem import (
    clip_or_inf,
    embedding_models,
    evaluate_models,
    evaluation_bounds,
    evaluation_mse,
    final_metrics,
    local_models,
    problem_of,
)
from fedpriv.data.cache import cohort_data
from fedpriv.data.synthetic import ground_truth_embedding
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import clipped_sum


class _FinalOnly(Algorithm[ProblemKeys]):
    """An algorithm whose only step is each user's final fit: nothing is released."""

    config_type = ProblemKeys

    def privacy_plan(self) -> list[PlannedRelease]:
        return []

    def steps(self) -> list[Step]:
        return [Step("final")]

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {}

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return final_metrics(self.config, metric_sums, num_users)

    @classmethod
    def models(cls, config: ProblemKeys, user_ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    evaluation_bounds = staticmethod(evaluation_bounds)

    @classmethod
    def evaluation_values(cls, config: ProblemKeys, arrays: Mapping[str, np.ndarray],
                          user_ids: np.ndarray) -> dict[str, np.ndarray]:
        return evaluation_mse(config, user_ids, cls.models(config, user_ids))

    @classmethod
    def user_step(cls, config: ProblemKeys, step: Step, arrays: Mapping[str, np.ndarray],
                  user_ids: np.ndarray) -> UserContribution:
        problem = problem_of(config)
        metrics = evaluate_models(problem, user_ids, cls.models(config, user_ids),
                                  config.test_samples_per_user)
        return UserContribution({}, len(user_ids), 0, metrics)


class LocalOnly(_FinalOnly):
    name = "local-only"
    summary = "each user alone: least squares on its own m samples (baseline)"

    @classmethod
    def models(cls, config: ProblemKeys, user_ids: np.ndarray) -> np.ndarray:
        return local_models(problem_of(config), user_ids)


class KnownEmbedding(_FinalOnly):
    name = "known-embedding"
    summary = "reference: the true U* given, v_i fitted on S1 (oracle)"

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return {**super().finalize(metric_sums, num_users), "subspace_distance": 0.0}

    @classmethod
    def models(cls, config: ProblemKeys, user_ids: np.ndarray) -> np.ndarray:
        problem = problem_of(config)
        return embedding_models(problem, ground_truth_embedding(problem), user_ids)


class DPGlobalModel(Algorithm[GlobalModelConfig]):
    """A single user-level DP regression vector for everybody (DP-FedAvg, one local step)."""

    name = "dp-global-model"
    summary = "one shared regression vector by DP-FedAvg (baseline)"
    config_type = GlobalModelConfig

    def __init__(self, config: GlobalModelConfig) -> None:
        super().__init__(config)
        self.model = np.zeros(config.dim)

    def privacy_plan(self) -> list[PlannedRelease]:
        return [PlannedRelease("round", 1.0 / self.config.rounds, self.config.rounds)]

    def steps(self) -> list[Step]:
        c = self.config
        part = Part("total", (c.dim,), clip_or_inf(c.clipping, c.clip_norm))
        return [*(Step("round", t, "round", (part,)) for t in range(1, c.rounds + 1)),
                Step("final")]

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {"model": self.model}

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        self.model = self.model - self.config.learning_rate * noisy_means["total"]
        return {"model_norm": float(np.linalg.norm(self.model))}

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return final_metrics(self.config, metric_sums, num_users)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.tolist()}

    evaluation_bounds = staticmethod(evaluation_bounds)

    @classmethod
    def evaluation_values(cls, config: GlobalModelConfig, arrays: Mapping[str, np.ndarray],
                          user_ids: np.ndarray) -> dict[str, np.ndarray]:
        model = np.asarray(arrays["model"], dtype=np.float64)
        models = np.broadcast_to(model, (len(user_ids), config.dim))
        return evaluation_mse(config, user_ids, models)

    @classmethod
    def user_step(cls, config: GlobalModelConfig, step: Step, arrays: Mapping[str, np.ndarray],
                  user_ids: np.ndarray) -> UserContribution:
        problem = problem_of(config)
        model = np.asarray(arrays["model"], dtype=np.float64)
        if step.is_final:
            models = np.broadcast_to(model, (len(user_ids), config.dim))
            metrics = evaluate_models(problem, user_ids, models, config.test_samples_per_user)
            return UserContribution({}, len(user_ids), 0, metrics)
        s0 = cohort_data(problem, user_ids, part="s0")
        x0, y0 = s0.features, s0.labels
        residual = np.einsum("nmd,d->nm", x0, model) - y0
        grads = (2.0 / x0.shape[1]) * np.einsum("nmd,nm->nd", x0, residual)
        total, clipped = clipped_sum(grads, step.parts[0].clip_norm)
        return UserContribution({"total": total}, len(user_ids), clipped)
