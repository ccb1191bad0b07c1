"""A_Exp (Jain et al. 2021, Alg. 4) and its non-private best-score version: the exponential
mechanism over Haar-random embeddings, scored by ball-constrained least squares."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.algorithms.exp_mech.exp_mech_math import (
    a_exp_scores,
    ball_least_squares,
    haar_candidates,
)
from fedpriv.algorithms.exp_mech.mechanism import ExponentialMechanism
from fedpriv.algorithms.exp_mech.params import AExpConfig
from fedpriv.algorithms.personalization.linear_math import subspace_distance
from fedpriv.algorithms.personalization.problem import evaluate_models, final_metrics, problem_of
from fedpriv.data.cache import cohort_data
from fedpriv.data.synthetic import ground_truth_embedding
from fedpriv.privacy.mechanisms import score_sum


class AExp(ExponentialMechanism[AExpConfig]):
    name = "a-exp"
    summary = "A_Exp (Jain et al. 2021, Alg. 4): exponential mechanism over embeddings"
    config_type = AExpConfig

    @classmethod
    def num_candidates(cls, config: AExpConfig) -> int:
        return config.candidates

    @classmethod
    def score_bound(cls, config: AExpConfig) -> float:
        return config.response_clip**2

    @classmethod
    def problem_size(cls, config: AExpConfig) -> tuple[int, int]:
        return config.rank, config.samples_per_user

    def __init__(self, config: AExpConfig) -> None:
        super().__init__(config)
        self.problem = problem_of(config)
        self._truth = ground_truth_embedding(self.problem)  # evaluation only

    @cached_property
    def candidate_set(self) -> np.ndarray:
        c = self.config
        return haar_candidates(c.seed, c.candidates, c.dim, c.rank)

    def embedding(self) -> np.ndarray:
        return self.candidate_set[self.choice]

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {"embedding": self.embedding()} if step.is_final else {}

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        report = super().apply(step, noisy_means)
        report["subspace_distance"] = subspace_distance(self.embedding(), self._truth)
        return report

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        c = self.config
        metrics = final_metrics(c, metric_sums, num_users)
        metrics["subspace_distance"] = subspace_distance(self.embedding(), self._truth)
        # the candidate set's own limit (evaluation only): its closest member to U*
        # candidates are orthonormal: the sine of the largest principal angle, all at once
        cands = self.candidate_set
        residual = self._truth[None] - cands @ np.einsum("cdk,dl->ckl", cands, self._truth)
        metrics["best_candidate_distance"] = float(
            np.linalg.norm(residual, ord=2, axis=(1, 2)).min())
        return metrics

    def state(self) -> dict[str, Any]:
        return {**super().state(), "embedding": self.embedding().tolist()}

    @classmethod
    def user_step(cls, config: AExpConfig, step: Step, arrays: Mapping[str, np.ndarray],
                  user_ids: np.ndarray) -> UserContribution:
        problem = problem_of(config)
        data = cohort_data(problem, user_ids)
        (x0, y0), (x1, y1) = data.split_halves()
        if step.is_final:
            u = np.asarray(arrays["embedding"])
            v, _ = ball_least_squares(np.einsum("nmd,dk->nmk", x1, u), y1, config.local_norm)
            metrics = evaluate_models(problem, user_ids, v @ u.T, config.test_samples_per_user)
            return UserContribution({}, len(user_ids), 0, metrics)
        cands = haar_candidates(config.seed, config.candidates, config.dim, config.rank)
        total, dropped = score_sum(a_exp_scores(config, x0, y0, cands), step.parts[0].clip_norm)
        return UserContribution({"scores": total}, len(user_ids), dropped)


class AExpBest(AExp):
    name = "a-exp-nonprivate"
    private = False
    summary = "A_Exp's candidate with the best score, without privacy (baseline)"
