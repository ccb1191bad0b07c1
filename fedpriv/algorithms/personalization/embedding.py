"""The base class of the registered shared-embedding algorithms: initializations, rounds and
the final local fit.

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
from typing import Any, ClassVar, TypeVar

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.algorithms.personalization import init_math
from fedpriv.algorithms.personalization.choice import (
    choice_metrics,
    choice_sums,
    chosen_models,
)
from fedpriv.algorithms.personalization.linear_math import orthonormalize, subspace_distance
from fedpriv.algorithms.personalization.params import EmbeddingConfig
from fedpriv.algorithms.personalization.problem import (
    clip_or_inf,
    embedding_models,
    evaluate_models,
    evaluation_bounds,
    evaluation_mse,
    final_metrics,
    problem_of,
)
from fedpriv.data.cache import cohort_data
from fedpriv.data.synthetic import ground_truth_embedding, true_user_models
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease

_RANDOM_INIT_STREAM = 0xA11
EC = TypeVar("EC", bound=EmbeddingConfig)


class EmbeddingAlgorithm(Algorithm[EC]):
    """Base of the algorithms that release a shared embedding ``U`` (d x k)."""

    default_init: ClassVar[str] = "u-statistic"
    config_type = EmbeddingConfig

    @classmethod
    def init_method(cls, config: EC) -> str:
        return cls.default_init if config.init == "auto" else config.init

    @classmethod
    def validate(cls, config: EC) -> None:
        super().validate(config)
        if cls.init_method(config) in ("u-statistic", "pairs") and config.samples_per_user // 2 < 2:
            raise ConfigError("samples-per-user: the initialization needs >= 2 samples in S0")

    def __init__(self, config: EC) -> None:
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
    def round_contribution(cls, config: EC, step: Step, embedding: np.ndarray,
                           data: Any) -> UserContribution:
        """The users' answer to a round; ``data`` holds their ``S0`` (the first half of their
        training points: rounds never read the held-back half)."""
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
            bound = clip_or_inf(c.clipping, c.init_clip_norm)
        else:
            bound = init_math.pair_bound(c.samples_per_user // 2,
                                         clip_or_inf(c.clipping, c.response_clip))
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
            self.embedding = init_math.server_init(noisy_means["total"], self.config.rank)
        else:
            self.embedding = self.round_update(step, noisy_means)
        return {"subspace_distance": subspace_distance(self.embedding, self._truth)}

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        metrics = {**final_metrics(self.config, metric_sums, num_users),
                   **choice_metrics(self.config.label_noise, metric_sums, num_users)}
        if self.embedding is None:
            raise RuntimeError("finalize before the embedding was released")
        metrics["subspace_distance"] = subspace_distance(self.embedding, self._truth)
        return metrics

    def state(self) -> dict[str, Any]:
        return {"init": self.init,
                "embedding": None if self.embedding is None else self.embedding.tolist()}

    evaluation_bounds = staticmethod(evaluation_bounds)

    @classmethod
    def evaluation_values(cls, config: EC, arrays: Mapping[str, np.ndarray],
                          user_ids: np.ndarray) -> dict[str, np.ndarray]:
        problem = problem_of(config)
        if config.final_choice == "best":
            data = cohort_data(problem, user_ids)
            models = chosen_models(arrays["embedding"], data, config.choice_folds)[0]
        else:
            models = embedding_models(problem, arrays["embedding"], user_ids)
        return evaluation_mse(config, user_ids, models)

    @classmethod
    def user_step(
        cls, config: EC, step: Step, arrays: Mapping[str, np.ndarray], user_ids: np.ndarray
    ) -> UserContribution:
        problem = problem_of(config)
        if step.is_final:  # the users' data is fetched once for the fit and the metrics
            data = cohort_data(problem, user_ids)
            if config.final_choice == "best":  # each user's choice (``choice.py``)
                models, shared, weight = chosen_models(arrays["embedding"], data,
                                                       config.choice_folds)
            else:
                models = embedding_models(problem, arrays["embedding"], user_ids, data)
            metrics = evaluate_models(problem, user_ids, models, config.test_samples_per_user,
                                      data)
            if config.final_choice == "best":
                w_star = true_user_models(problem, data.true_local_vectors)
                metrics.update(choice_sums(w_star, shared, weight))
            return UserContribution({}, len(user_ids), 0, metrics)
        data = cohort_data(problem, user_ids, part="s0")  # init and rounds read S0 only
        if step.kind == "init":
            x0, y0 = data.features, data.labels
            if cls.init_method(config) == "u-statistic":
                total, clipped = init_math.clipped_u_statistic_sum(x0, y0,
                                                                   step.parts[0].clip_norm)
            else:
                total, clipped = init_math.clipped_pair_sum(
                    x0, y0, clip_or_inf(config.clipping, config.response_clip))
            return UserContribution({"total": total}, len(user_ids), clipped)
        return cls.round_contribution(config, step, arrays["embedding"], data)
