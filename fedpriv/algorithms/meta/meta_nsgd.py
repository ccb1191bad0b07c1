"""Meta-NSGD (Zhou & Bassily 2022, Alg. 1) and private clustering-based meta-learning (Alg. 2),
with their non-private versions: T rounds over Poisson samples of the tasks.

Privacy: each sampled task's meta-gradient is clipped to ``clip-norm`` and the sum is divided by
the public expected batch size m, so the sensitivity is ``clip-norm / m`` whoever was sampled; the
T releases are Poisson-subsampled Gaussian mechanisms (rate m/K), accounted exactly by the plan.
Private clustering releases a (q, d) array in which one task changes one row by at most
``clip-norm``: the same sensitivity and accounting (Theorem 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import numpy as np

from fedpriv.algorithms.base import Part, Step
from fedpriv.algorithms.meta import meta_math as ml
from fedpriv.algorithms.meta.meta_algorithm import MetaAlgorithm, clip_of
from fedpriv.algorithms.meta.params import ClusterMetaConfig, SampledMetaConfig
from fedpriv.algorithms.meta.problem import paper_tasks_per_round
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.randomness import user_uniforms

_SAMPLING_PURPOSE = 0x5A3
_CLUSTER_INIT_STREAM = 0xC1A
SC = TypeVar("SC", bound=SampledMetaConfig)


class _SampledMeta(MetaAlgorithm[SC]):
    """Algorithms 1 and 2: T rounds over Poisson samples of the tasks."""

    config_type = SampledMetaConfig

    @classmethod
    def tasks_per_round(cls, config: SC) -> int:
        return config.tasks_per_round or paper_tasks_per_round(config)

    @classmethod
    def sampling_rate(cls, config: SC) -> float:
        return cls.tasks_per_round(config) / config.num_users

    @classmethod
    def validate(cls, config: SC) -> None:
        super().validate(config)
        if config.tasks_per_round > config.num_users:
            raise ConfigError(f"tasks-per-round: {config.tasks_per_round} exceeds num-users "
                              f"({config.num_users}), the number of tasks")

    def privacy_plan(self) -> list[PlannedRelease]:
        if not self.private:
            return []
        rate = self.sampling_rate(self.config)
        return [PlannedRelease("round", 1.0 / self.config.rounds, self.config.rounds, rate)]

    def steps(self) -> list[Step]:
        c = self.config
        part = Part("grads", (self.num_models(c), c.dim), clip_of(c))
        release = "round" if self.private else None
        m = self.tasks_per_round(c)
        return [*(Step("round", t, release, (part,), population=m)
                  for t in range(1, c.rounds + 1)), Step("final")]

    def charge(self, step: Step) -> tuple[list[int] | None, float]:
        return None, self.sampling_rate(self.config)

    @classmethod
    def participants(cls, config: SC, step: Step, user_ids: np.ndarray) -> np.ndarray:
        if step.is_final:
            return user_ids  # every fresh task is evaluated
        u = user_uniforms(config.seed, _SAMPLING_PURPOSE, step.index, user_ids, 1)[:, 0]
        return user_ids[u < cls.sampling_rate(config)]

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        c = self.config
        self.models = ml.project_to_ball(self.models - c.learning_rate * noisy_means["grads"],
                                         c.meta_radius)
        return self._record_iterate()


class MetaNSGD(_SampledMeta[SampledMetaConfig]):
    name = "meta-nsgd"
    summary = "Meta-NSGD (Zhou & Bassily 2022, Alg. 1): task-level DP meta-learning"


class MetaSGD(_SampledMeta[SampledMetaConfig]):
    name = "meta-sgd"
    private = False
    summary = "Meta-NSGD without noise (non-private meta-learning baseline)"


class _ClusterMeta(_SampledMeta[ClusterMetaConfig]):
    average_iterates = False
    config_type = ClusterMetaConfig

    @classmethod
    def num_models(cls, config: ClusterMetaConfig) -> int:
        return config.meta_models

    @classmethod
    def starting_models(cls, config: ClusterMetaConfig) -> np.ndarray:
        """Algorithm 2: q random starting points of norm meta-init-scale (data-free, seeded)."""
        q = config.meta_models
        if q == 1:
            return super().starting_models(config)
        rng = np.random.default_rng([config.seed, _CLUSTER_INIT_STREAM])
        start = rng.standard_normal((q, config.dim))
        start *= config.meta_init_scale / np.linalg.norm(start, axis=1, keepdims=True)
        return ml.project_to_ball(start, config.meta_radius)


class PrivateMetaCluster(_ClusterMeta):
    name = "private-meta-cluster"
    summary = "private clustering-based meta-learning (Zhou & Bassily 2022, Alg. 2)"


class MetaCluster(_ClusterMeta):
    name = "meta-cluster"
    private = False
    summary = "clustering-based meta-learning without noise (baseline)"
