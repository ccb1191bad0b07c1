"""The base class of the registered meta-learning algorithms: the meta-model(s), the user-side
meta-gradient (Zhou & Bassily 2022, Proposition 2: ``-lambda (w^_h(Z) - h)``, the gradient of the
Moreau envelope), and the final evaluation on fresh tasks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, TypeVar

import numpy as np

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.algorithms.meta import meta_math as ml
from fedpriv.algorithms.meta.params import MetaConfig
from fedpriv.algorithms.meta.problem import (
    evaluate_fresh,
    evaluation_bounds,
    final_meta_metrics,
    fresh_task_values,
    meta_problem_of,
)
from fedpriv.algorithms.meta.schedule import MetaModels
from fedpriv.data.meta import generate_tasks
from fedpriv.privacy.mechanisms import clipped_sum

MC = TypeVar("MC", bound=MetaConfig)


class MetaAlgorithm(MetaModels[MC]):
    """The linear family: its meta-model(s) start at the origin, its tasks' meta-gradients,
    their final evaluation on fresh tasks."""

    feature_families: ClassVar[tuple[str, ...]] = ("unit-ball",)
    config_type = MetaConfig

    @classmethod
    def model_size(cls, config: MC) -> int:
        return config.dim

    @classmethod
    def starting_models(cls, config: MC) -> np.ndarray:
        """The meta-model(s) before the first round, (q, d): one model at the origin."""
        return np.zeros((1, config.dim))

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return final_meta_metrics(self.config, metric_sums, num_users, len(self.models))

    evaluation_bounds = staticmethod(evaluation_bounds)

    @classmethod
    def evaluation_values(cls, config: MC, arrays: Mapping[str, np.ndarray],
                          user_ids: np.ndarray) -> dict[str, np.ndarray]:
        models = np.atleast_2d(np.asarray(arrays["models"], dtype=np.float64))
        return fresh_task_values(config, models, user_ids)

    @classmethod
    def user_step(cls, config: MC, step: Step, arrays: Mapping[str, np.ndarray],
                  user_ids: np.ndarray) -> UserContribution:
        models = np.atleast_2d(np.asarray(arrays["models"], dtype=np.float64))
        if step.is_final:
            return UserContribution({}, len(user_ids), 0,
                                    evaluate_fresh(config, models, user_ids))
        tasks = generate_tasks(meta_problem_of(config), user_ids)
        choice, fitted = ml.select_and_fit(tasks.features, tasks.labels, models,
                                           config.meta_lambda, config.task_loss,
                                           config.base_accuracy)
        grads = np.zeros((len(user_ids),) + models.shape)
        rows = np.arange(len(user_ids))
        grads[rows, choice] = ml.meta_gradients(fitted, models[choice], config.meta_lambda)
        total, clipped = clipped_sum(grads, step.parts[0].clip_norm)
        return UserContribution({"grads": total}, len(user_ids), clipped)

