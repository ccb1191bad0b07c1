"""JL + exponential mechanism for margin classification (Snedeker, Zhou & Bassily 2025,
Alg. 3) and its non-private best-score version."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.algorithms.exp_mech.exp_mech_math import (
    best_margin_vectors,
    cover_size,
    frobenius_cover,
    jl_matrix,
    jl_scores,
)
from fedpriv.algorithms.exp_mech.mechanism import ExponentialMechanism
from fedpriv.algorithms.exp_mech.params import JLExpConfig
from fedpriv.algorithms.meta import meta_math as ml
from fedpriv.data.margin import MarginProblem, MarginTasks, margin_tasks
from fedpriv.data.synthetic import ground_truth_embedding
from fedpriv.params import ConfigError
from fedpriv.privacy.mechanisms import score_sum


class JLExp(ExponentialMechanism[JLExpConfig]):
    name = "jl-exp"
    summary = ("JL + exponential mechanism for margin classification (Snedeker et al. 2025, "
               "Alg. 3)")
    size_advice = "raise cover-radius, lower jl-dim"
    feature_families = ("unit-ball",)
    config_type = JLExpConfig

    @classmethod
    def num_candidates(cls, config: JLExpConfig) -> int:
        return cover_size(config.jl_dim, config.rank, config.cover_radius)

    @classmethod
    def score_bound(cls, config: JLExpConfig) -> float:
        return 1.0

    @classmethod
    def problem_size(cls, config: JLExpConfig) -> tuple[int, int]:
        return config.rank, config.samples_per_user

    @classmethod
    def validate(cls, config: JLExpConfig) -> None:
        if config.rank > 2:
            raise ConfigError(f"rank: {cls.name} supports rank 1 or 2, not {config.rank}")
        if config.jl_dim * config.rank > 8:
            raise ConfigError(f"jl-dim: the cover of a {config.jl_dim} x {config.rank} ball "
                              "grows like (1/gamma)^(jl-dim * rank); keep jl-dim * rank <= 8")
        super().validate(config)

    def cover(self) -> np.ndarray:
        c = self.config
        return frobenius_cover(c.jl_dim, c.rank, c.cover_radius)

    def embedding(self) -> np.ndarray:
        c = self.config
        u_priv: np.ndarray = jl_matrix(c.seed, c.jl_dim, c.dim).T @ self.cover()[self.choice]
        return u_priv

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {"embedding": self.embedding()} if step.is_final else {}

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return {k.removesuffix("_sum"): v / num_users for k, v in metric_sums.items()}

    @classmethod
    def user_step(cls, config: JLExpConfig, step: Step, arrays: Mapping[str, np.ndarray],
                  user_ids: np.ndarray) -> UserContribution:
        problem = MarginProblem.of(config)
        tasks = margin_tasks(problem, user_ids)
        half = config.samples_per_user // 2
        if step.is_final:
            return UserContribution({}, len(user_ids), 0,
                                    evaluate_margin(config, problem, user_ids, tasks,
                                                    np.asarray(arrays["embedding"])))
        scores = jl_scores(config, tasks.features[:, :half], tasks.labels[:, :half])
        total, dropped = score_sum(scores, step.parts[0].clip_norm)
        return UserContribution({"scores": total}, len(user_ids), dropped)


def evaluate_margin(config: JLExpConfig, problem: MarginProblem, user_ids: np.ndarray,
                    train: MarginTasks, embedding: np.ndarray) -> dict[str, float]:
    """Metric sums: each user's v on its held-back half S1 with the released embedding, scored
    on fresh test points (accuracy and margin loss), against each user alone (L2-regularized
    logistic regression on all its m points, lambda = 1e-2) and the true embedding."""
    half = config.samples_per_user // 2
    x1, y1 = train.features[:, half:], train.labels[:, half:]
    test = margin_tasks(problem, user_ids, test_samples=config.test_samples_per_user)

    def fitted(u: np.ndarray) -> np.ndarray:  # each user's w = U v, v fitted on S1
        v, _ = best_margin_vectors(np.einsum("nmd,dk->nmk", x1, u), y1, 0.0)
        models: np.ndarray = v @ u.T
        return models

    def test_margins(w: np.ndarray) -> np.ndarray:
        margins: np.ndarray = test.labels * np.einsum("nmd,nd->nm", test.features, w)
        return margins

    margins = test_margins(fitted(embedding))
    true_margins = test_margins(fitted(ground_truth_embedding(problem.embedding_problem())))
    local = ml.fit(train.features, train.labels, np.zeros(config.dim), 1e-2, "logistic", 1e-6)
    local_margins = test_margins(local.models)
    return {
        "test_accuracy_sum": float((margins > 0).mean(axis=1).sum()),
        "test_margin_loss_sum": float((margins <= config.margin).mean(axis=1).sum()),
        "local_only_accuracy_sum": float((local_margins > 0).mean(axis=1).sum()),
        "known_embedding_accuracy_sum": float((true_margins > 0).mean(axis=1).sum()),
    }


class JLExpBest(JLExp):
    name = "jl-exp-nonprivate"
    private = False
    summary = "the JL construction's best-scoring cover point, without privacy (baseline)"
