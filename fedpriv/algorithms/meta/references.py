"""Meta-learning references that release nothing: each fresh task alone (``meta-local``) and the
base learner biased towards the true task mean(s) (``meta-oracle``, not an algorithm)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedpriv.algorithms.base import Step
from fedpriv.algorithms.meta.meta_algorithm import MetaAlgorithm
from fedpriv.algorithms.meta.params import MetaConfig
from fedpriv.algorithms.meta.problem import meta_problem_of
from fedpriv.data.meta import cluster_centers
from fedpriv.privacy.accounting import PlannedRelease


class MetaLocal(MetaAlgorithm[MetaConfig]):
    """Each fresh task alone: the base learner with h = 0. Nothing is released."""

    name = "meta-local"
    summary = "local training of each task alone (meta-learning baseline)"

    def privacy_plan(self) -> list[PlannedRelease]:
        return []

    def steps(self) -> list[Step]:
        return [Step("final")]

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        metrics = super().finalize(metric_sums, num_users)
        metrics.pop("cluster_purity", None)
        metrics["transfer_risk"] = metrics["local_risk"]
        for key in ("population_transfer_risk", "transfer_error"):
            if key in metrics:
                metrics[key] = metrics[key.replace("transfer", "local")]
        return metrics


class MetaOracle(MetaAlgorithm[MetaConfig]):
    """Reference: the base learner biased towards the true task mean(s) -- the cluster centers
    of the task distribution, which no algorithm knows. A floor for what a learned meta-model
    can reach (not a bound: a learned h may differ from the centers and still do as well)."""

    name = "meta-oracle"
    summary = "reference: base learner biased to the true task mean(s) (not an algorithm)"

    @classmethod
    def starting_models(cls, config: MetaConfig) -> np.ndarray:
        return cluster_centers(meta_problem_of(config))

    @classmethod
    def num_models(cls, config: MetaConfig) -> int:
        return config.task_clusters

    def privacy_plan(self) -> list[PlannedRelease]:
        return []

    def steps(self) -> list[Step]:
        return [Step("final")]
