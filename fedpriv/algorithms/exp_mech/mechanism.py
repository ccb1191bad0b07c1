"""The base class of the exponential-mechanism algorithms: one pure epsilon-DP selection over a
data-independent candidate set, then each user's local fit (see the package docstring)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step
from fedpriv.algorithms.exp_mech.params import COST
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease


class ExponentialMechanism(Algorithm):
    """One exponential-mechanism step over a data-independent candidate set, then local fits."""

    components = (COST,)

    @classmethod
    def num_candidates(cls, config: Any) -> int:
        raise NotImplementedError

    @classmethod
    def score_bound(cls, config: Any) -> float:
        raise NotImplementedError

    @classmethod
    def validate(cls, config: Any) -> None:
        super().validate(config)
        if config.samples_per_user < 4:
            raise ConfigError("samples-per-user: needs >= 2 samples in each half")
        cost = cls.num_candidates(config) * config.num_users
        if cost > config.max_score_evaluations:
            raise ConfigError(
                f"max-score-evaluations: {cls.name} would score {cls.num_candidates(config):,} "
                f"candidates x {config.num_users:,} users = {cost:.3g} user scores, above the "
                f"limit {config.max_score_evaluations:.3g} (about "
                f"{cost / cls.scores_per_second(config) / 60:.0f} min on one core); "
                f"{cls.size_advice} or num-users (or raise max-score-evaluations)")

    @classmethod
    def scores_per_second(cls, config: Any) -> float:
        """User scores per second on one core, for the run-time estimate in the refusal (where
        measured: docs/measurements.md)."""
        return 2e6 if config.rank == 1 else 2e5

    size_advice: ClassVar[str] = "lower candidates"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.choice: int | None = None

    def privacy_plan(self) -> list[PlannedRelease]:
        if not self.private:
            return []
        return [PlannedRelease("select", 1.0, mechanism="exponential")]

    def steps(self) -> list[Step]:
        c = self.config
        part = Part("scores", (self.num_candidates(c),), self.score_bound(c),
                    mechanism="exponential")
        return [Step("select", 0, "select" if self.private else None, (part,)), Step("final")]

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        self.choice = int(noisy_means["choice"])
        return {"chosen_candidate": float(self.choice)}

    def state(self) -> dict[str, Any]:
        return {"chosen_candidate": self.choice, "candidates": self.num_candidates(self.config)}
