"""Private FedRep (Snedeker, Zhou & Bassily 2025, Alg. 1) and its non-private baseline.

Steps: ``init`` (by default Alg. 2: clipped U-statistics, symmetric noise, top-k eigenvectors),
``round-t`` for t = 1..T (disjoint-batch local solve and embedding gradient, clip, noisy mean, QR),
and ``final`` (each user fits ``v_i`` on its held-back half; metrics).

Privacy (user level): each user's gradient is clipped before anything is summed, so the mean
over the fixed population ``n`` has L2 sensitivity ``psi / n`` (add/remove) or ``2 psi / n``
(replace-one). The init release and the T rounds are one plan calibrated by dp-accounting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Part, Step, UserContribution
from fedpriv.algorithms.personalization import fedrep_math as fedrep
from fedpriv.algorithms.personalization.embedding import EmbeddingAlgorithm
from fedpriv.algorithms.personalization.params import FedRepConfig
from fedpriv.algorithms.personalization.problem import clip_or_inf
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import clipped_outer_sum


def batch_size_of(config: FedRepConfig) -> int:
    policy = config.batch_size if config.batch_size in ("max", "paper") else int(config.batch_size)
    return fedrep.resolve_batch_size(policy, config.samples_per_user, config.rounds, config.rank)


class PrivateFedRep(EmbeddingAlgorithm[FedRepConfig]):
    """Private FedRep (Alg. 1) initialized by the private U-statistic method (Alg. 2)."""

    name = "private-fedrep"
    summary = "Private FedRep (Snedeker, Zhou & Bassily 2025, Algs. 1-2)"
    default_init = "u-statistic"
    config_type = FedRepConfig

    @classmethod
    def validate(cls, config: FedRepConfig) -> None:
        super().validate(config)
        try:
            batch_size_of(config)
        except ValueError as err:
            raise ConfigError(f"batch-size: {err}") from None

    def __init__(self, config: FedRepConfig) -> None:
        super().__init__(config)
        self.batch_size = batch_size_of(config)

    def round_plan(self, weight: float) -> list[PlannedRelease]:
        return [PlannedRelease("round", weight / self.config.rounds, self.config.rounds)]

    def round_steps(self) -> list[Step]:
        c = self.config
        part = Part("total", (c.dim, c.rank), clip_or_inf(c.clipping, c.clip_norm))
        release = "round" if self.private else None
        return [Step("round", t, release, (part,)) for t in range(1, c.rounds + 1)]

    def round_update(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> np.ndarray:
        assert self.embedding is not None
        return fedrep.server_update(self.embedding, noisy_means["total"],
                                    self.config.learning_rate)

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return {**super().finalize(metric_sums, num_users), "batch_size": float(self.batch_size)}

    @classmethod
    def round_contribution(cls, config: FedRepConfig, step: Step, embedding: np.ndarray,
                           data: Any) -> UserContribution:
        g, v = fedrep.gradient_factors(embedding, data.features, data.labels, data.user_ids,
                                       config.seed, step.index, batch_size_of(config))
        total, clipped = clipped_outer_sum(g, v, step.parts[0].clip_norm)
        return UserContribution({"total": total}, len(data.user_ids), clipped)


class FedRep(PrivateFedRep):
    """Non-private FedRep: the same steps without noise (``clipping = false`` drops clipping)."""

    name = "fedrep"
    summary = "FedRep without noise (baseline; clipping optional)"
    private = False
