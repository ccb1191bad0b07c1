"""The base class of the exponential-mechanism algorithms: one pure epsilon-DP selection over a
data-independent candidate set, then each user's local fit (see the package docstring)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step
from fedpriv.algorithms.exp_mech.params import CostKeys
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease

CK = TypeVar("CK", bound=CostKeys)


class ExponentialMechanism(Algorithm[CK]):
    """One exponential-mechanism step over a data-independent candidate set, then local fits.

    A subclass reads its problem's component besides the cost guard; it states the problem's
    size (``problem_size``), how many candidates it scores and the range of a user's score."""

    config_type = CostKeys

    @classmethod
    def num_candidates(cls, config: CK) -> int:
        raise NotImplementedError

    @classmethod
    def score_bound(cls, config: CK) -> float:
        raise NotImplementedError

    @classmethod
    def problem_size(cls, config: CK) -> tuple[int, int]:
        """``(rank, samples-per-user)`` of the run's problem (its own component declares
        them, not the cost guard): the checks and the run-time estimate below read them."""
        raise NotImplementedError

    @classmethod
    def validate(cls, config: CK) -> None:
        super().validate(config)
        if cls.problem_size(config)[1] < 4:
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
    def scores_per_second(cls, config: CK) -> float:
        """User scores per second on one core, for the run-time estimate in the refusal (where
        measured: docs/measurements.md)."""
        return 2e6 if cls.problem_size(config)[0] == 1 else 2e5

    size_advice: ClassVar[str] = "lower candidates"

    def __init__(self, config: CK) -> None:
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
