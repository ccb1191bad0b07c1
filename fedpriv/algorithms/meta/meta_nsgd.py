"""Meta-NSGD (Zhou & Bassily 2022, Alg. 1) and private clustering-based meta-learning (Alg. 2),
with their non-private versions: T rounds over Poisson samples of the tasks.

Privacy: each sampled task's meta-gradient is clipped to ``clip-norm`` and the sum is divided by
the public expected batch size m, so the sensitivity is ``clip-norm / m`` whoever was sampled; the
T releases are Poisson-subsampled Gaussian mechanisms (rate m/K), accounted exactly by the plan.
Private clustering releases a (q, d) array in which one task changes one row by at most
``clip-norm``: the same sensitivity and accounting (Theorem 6).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from fedpriv.algorithms.meta import meta_math as ml
from fedpriv.algorithms.meta.meta_algorithm import MetaAlgorithm
from fedpriv.algorithms.meta.params import ClusterMetaConfig, SampledMetaConfig
from fedpriv.algorithms.meta.schedule import SampledRounds

_CLUSTER_INIT_STREAM = 0xC1A
SC = TypeVar("SC", bound=SampledMetaConfig)


class _SampledMeta(SampledRounds[SC], MetaAlgorithm[SC]):
    """Algorithms 1 and 2 on the linear tasks."""

    config_type = SampledMetaConfig


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
