"""Priv-AltMin (Jain, Rush, Smith, Song & Thakurta 2021, Algs. 1-3) and its non-private baseline.

Steps: ``init`` (by default Alg. 3, the private pair initialization), ``round-t`` for
t = 1..T, and ``final`` (each user fits ``v_i`` on its held-back half ``S1``).

User groups: a seeded random permutation of the user ids is split into ``G = user-groups``
near-equal groups, and round t uses group ``(t - 1) mod G``.

* ``G = T`` is Alg. 1 as written: each user takes part in exactly one round. A user's data then
  affects only its group's release, so the T rounds compose in parallel: the accountant charges
  each user one round (plus the initialization).
* ``G = 1`` is the paper's experiment (Sec. 6): every user every round, for T epochs, composed
  sequentially by the accountant.

The permutation depends only on the seed and the public user ids, never on data, so under both
neighbouring relations a user's data moves only its own group's statistics.

Each round releases two Gaussian parts of the same users' data: ``cov = sum W W^T`` (symmetric
noise) and ``corr = sum y~ W``, averaged over the group. ``cov-budget-share`` splits the round's
privacy loss (1/z^2 units) between them; 0.5 is the paper's equal multipliers. The dk x dk
statistic is the harder one to release (its noise has spectral norm ~ 2 sqrt(dk) sigma), so a
share above 0.5 can lower the error (docs/measurements.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Part, Step, UserContribution
from fedpriv.algorithms.personalization import altmin_math as altmin
from fedpriv.algorithms.personalization.embedding import EmbeddingAlgorithm
from fedpriv.algorithms.personalization.params import AltMinConfig
from fedpriv.algorithms.personalization.problem import clip_or_inf
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.randomness import user_groups


class PrivAltMin(EmbeddingAlgorithm[AltMinConfig]):
    """Private alternating minimization with perturbed sufficient statistics."""

    name = "priv-altmin"
    summary = "Priv-AltMin (Jain et al. 2021, Algs. 1-3)"
    default_init = "pairs"
    config_type = AltMinConfig

    @classmethod
    def validate(cls, config: AltMinConfig) -> None:
        super().validate(config)
        if config.samples_per_user // 2 < 2:
            raise ConfigError("samples-per-user: Priv-AltMin needs >= 2 training samples "
                              "(the first half of m): one part solves v, one forms statistics")

    def __init__(self, config: AltMinConfig) -> None:
        super().__init__(config)
        train = config.samples_per_user // 2
        self.stat_samples = train - altmin.sample_split(train)

    @property
    def epochs(self) -> int:
        """How many rounds each user takes part in."""
        return self.config.rounds // self.config.user_groups

    def round_plan(self, weight: float) -> list[PlannedRelease]:
        return [PlannedRelease("round", weight / self.epochs, self.epochs)]

    def round_steps(self) -> list[Step]:
        c = self.config
        eta = clip_or_inf(c.clipping, c.feature_clip)
        zeta = clip_or_inf(c.clipping, c.response_clip)
        cov_bound, corr_bound = altmin.statistic_bounds(self.stat_samples, eta, zeta)
        dk = c.dim * c.rank
        share = c.cov_budget_share
        parts = (Part("cov", (dk, dk), cov_bound, share, symmetric=True),
                 Part("corr", (dk,), corr_bound, 1.0 - share))
        sizes = np.bincount(user_groups(c.seed, c.num_users, c.user_groups),
                            minlength=c.user_groups)
        release = "round" if self.private else None
        steps = []
        for t in range(1, c.rounds + 1):
            g = (t - 1) % c.user_groups
            grouped = c.user_groups > 1
            steps.append(Step("round", t, release, parts,
                              population=int(sizes[g]) if grouped else None,
                              group=g if grouped else None))
        return steps

    @classmethod
    def participants(cls, config: AltMinConfig, step: Step, user_ids: np.ndarray) -> np.ndarray:
        if step.group is None:
            return user_ids
        groups = user_groups(config.seed, config.num_users, config.user_groups)
        taking_part: np.ndarray = user_ids[groups[user_ids] == step.group]
        return taking_part

    def round_update(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> np.ndarray:
        return altmin.solve_embedding(noisy_means["cov"], noisy_means["corr"], self.config.dim,
                                      self.config.rank)

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return {**super().finalize(metric_sums, num_users), "epochs": float(self.epochs)}

    @classmethod
    def round_contribution(cls, config: AltMinConfig, step: Step, embedding: np.ndarray,
                           data: Any) -> UserContribution:
        x0, y0 = data.features, data.labels  # the users' S0
        cov, corr, clipped = altmin.sufficient_statistics(
            embedding, x0, y0, clip_or_inf(config.clipping, config.feature_clip),
            clip_or_inf(config.clipping, config.response_clip))
        return UserContribution({"cov": cov, "corr": corr}, len(data.user_ids), clipped)


class AltMin(PrivAltMin):
    """Non-private alternating minimization: the same steps without noise."""

    name = "altmin"
    summary = "AltMin without noise (baseline; clipping optional)"
    private = False
