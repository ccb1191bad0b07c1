"""The private plan of a Flower run: its settings, checked before round 1, and its calibration.

``PrivatePlan`` holds what the user states (target (epsilon, delta), rounds, population, clip,
sampling, adaptive clipping, private metrics) and calibrates one noise multiplier per kind of
release with fedpriv's PLD accounting (``fedpriv.privacy.accounting``; with ``secure_noise``, the
integer-order RDP accounting of discrete noise, ``fedpriv_flwr.grid``), so the whole run spends
at most the target: ``num_rounds`` training releases (Poisson-sampled at ``sampling_rate``) and,
with private metrics, one evaluation release per evaluated round, sharing the budget by weights
(``metrics_budget_fraction`` of the privacy loss goes to the metrics). Nothing here imports Flower.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedpriv.config import NEIGHBOURING_RELATIONS
from fedpriv.privacy.accounting import (
    DISCRETE_ACCOUNTANT,
    Accountant,
    InfeasiblePlanError,
    PlannedRelease,
    calibrate_gaussian_plan,
    mean_sensitivity,
    plan_epsilon,
)

ROUND = "round"
EVALUATE = "evaluate"
UPDATE_PART = "update"
UNCLIPPED_PART = "unclipped"  # adaptive clipping: each user's centred bit 1[unclipped] - 1/2


class PlanError(ValueError):
    """A private plan that cannot run (the message names the setting to change)."""


@dataclass(frozen=True)
class PrivatePlan:
    """What a private Flower run will release, checked and calibrated at construction."""

    num_users: int
    num_rounds: int
    epsilon: float | None = 1.0
    delta: float = 1e-5
    clip_norm: float = 1.0
    noise_multiplier: float | None = None
    sampling_rate: float = 1.0
    clip_quantile: float | None = None
    clip_lr: float = 0.2
    clip_count_share: float = 0.05
    max_epsilon: float | None = None
    relation: str = "add-remove"
    private_metrics: Mapping[str, float] = field(default_factory=dict)
    metrics_budget_fraction: float = 0.1
    evaluate_rounds: tuple[int, ...] = ()
    user_sensitivity_factor: float = 1.0
    secure_noise: bool = False  # discrete noise on a grid (fedpriv_flwr.grid), RDP-accounted
    multipliers: dict[str, float] = field(init=False, default_factory=dict)
    projected_epsilon: float = field(init=False, default=0.0)  # the whole plan's

    def __post_init__(self) -> None:
        self._check()
        object.__setattr__(self, "multipliers", self._calibrate())

    # ----- checks ----------------------------------------------------------------------------
    def _check(self) -> None:
        def bad(name: str, why: str) -> PlanError:
            return PlanError(f"{name}: {why}")

        if not isinstance(self.num_users, int) or self.num_users < 1:
            raise bad("num_users", f"the population must be a positive integer, got "
                      f"{self.num_users!r}")
        if not isinstance(self.num_rounds, int) or self.num_rounds < 1:
            raise bad("num_rounds", f"must be a positive integer, got {self.num_rounds!r}")
        if self.epsilon is None and self.noise_multiplier is None:
            raise bad("epsilon", "state a target epsilon (or a noise_multiplier)")
        if self.epsilon is not None and not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise bad("epsilon", f"must be positive and finite, got {self.epsilon!r}")
        if not 0 < self.delta < 1:
            raise bad("delta", f"must lie in (0, 1), got {self.delta!r}")
        if self.delta >= 1.0 / self.num_users:
            raise bad("delta", f"{self.delta:g} is not below 1/num_users = "
                      f"{1.0 / self.num_users:g}: a mechanism that publishes one user's data "
                      "outright would meet it")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise bad("clip_norm", f"must be positive and finite, got {self.clip_norm!r}")
        if self.noise_multiplier is not None and not self.noise_multiplier > 0:
            raise bad("noise_multiplier", f"must be positive, got {self.noise_multiplier!r}")
        if not 0 < self.sampling_rate <= 1:
            raise bad("sampling_rate", f"must lie in (0, 1], got {self.sampling_rate!r}")
        if self.secure_noise and self.sampling_rate < 1:
            raise bad("sampling_rate", f"secure_noise cannot use Poisson sampling (rate "
                      f"{self.sampling_rate:g}): the discrete Gaussian's zCDP bound is accounted "
                      "without amplification; use sampling_rate = 1")
        if self.sampling_rate * self.num_users < 1:
            raise bad("sampling_rate", f"an expected cohort of {self.sampling_rate} x "
                      f"{self.num_users} users is below one user")
        if self.clip_quantile is not None:
            if not 0 < self.clip_quantile < 1:
                raise bad("clip_quantile", f"adaptive clipping needs a quantile in (0, 1), got "
                          f"{self.clip_quantile!r}")
            if not 0 < self.clip_count_share < 1:
                raise bad("clip_count_share", f"must lie in (0, 1), got "
                          f"{self.clip_count_share!r}")
            if not self.clip_lr > 0:
                raise bad("clip_lr", f"must be positive, got {self.clip_lr!r}")
        if self.relation not in NEIGHBOURING_RELATIONS:
            raise bad("relation", f"must be one of {NEIGHBOURING_RELATIONS}")
        for name, bound in self.private_metrics.items():
            if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0):
                raise bad("private_metrics", f"metric {name!r} needs a positive finite bound "
                          f"(each user's value is clipped to [0, bound]), got {bound!r}")
        if self.private_metrics and not 0 < self.metrics_budget_fraction < 1:
            raise bad("metrics_budget_fraction", f"must lie in (0, 1), got "
                      f"{self.metrics_budget_fraction!r}")
        wrong = [r for r in self.evaluate_rounds if not 1 <= r <= self.num_rounds]
        if wrong:
            raise bad("evaluate_rounds", f"rounds {wrong} are outside 1..{self.num_rounds}")
        if self.user_sensitivity_factor not in (1.0, 2.0):
            raise bad("user_sensitivity_factor", "1 (each user clipped) or 2 (a node clips the "
                      "sum of its users)")
        if (self.max_epsilon is not None and self.epsilon is not None
                and self.max_epsilon < self.epsilon):
            raise bad("max_epsilon", f"{self.max_epsilon} is below the target epsilon "
                      f"{self.epsilon}")

    # ----- calibration -----------------------------------------------------------------------
    @property
    def planned(self) -> list[PlannedRelease]:
        metrics = bool(self.private_metrics) and bool(self.evaluate_rounds)
        share = self.metrics_budget_fraction if metrics else 0.0
        plan = [PlannedRelease(ROUND, (1.0 - share) / self.num_rounds, self.num_rounds,
                               self.sampling_rate, multiplier=self.noise_multiplier)]
        if metrics:
            plan.append(PlannedRelease(EVALUATE, share / len(self.evaluate_rounds),
                                       len(self.evaluate_rounds)))
        return plan

    def _calibrate(self) -> dict[str, float]:
        plan = self.planned
        try:
            if self.epsilon is None or (self.noise_multiplier is not None and len(plan) == 1):
                assert self.noise_multiplier is not None
                values = [self.noise_multiplier]
                if len(plan) > 1:  # metrics with a fixed training noise: give them z too
                    values.append(self.noise_multiplier)
            else:
                values = calibrate_gaussian_plan(plan, self.epsilon, self.delta, self.kind,
                                                 self.relation)
        except InfeasiblePlanError as err:
            raise PlanError(f"epsilon: no noise level meets the target with {self.num_rounds} "
                            f"rounds at sampling rate {self.sampling_rate:g}: {err}. Raise "
                            "epsilon, or lower num_rounds / sampling_rate") from None
        multipliers = {r.name: float(v) for r, v in zip(plan, values, strict=True)}
        spent = plan_epsilon(plan, values, self.delta, self.kind, self.relation)
        if self.ceiling is not None and spent > self.ceiling * (1 + 1e-9):
            raise PlanError(f"max_epsilon: the plan spends epsilon {spent:.6g}, above "
                            f"{self.ceiling:g}; raise noise_multiplier or max_epsilon")
        object.__setattr__(self, "projected_epsilon", spent)
        return multipliers

    @property
    def kind(self) -> str:
        """The accountant: PLD, or integer-order RDP for discrete noise (``secure_noise``)."""
        return accountant_kind(self.secure_noise)

    @property
    def ceiling(self) -> float | None:
        return self.max_epsilon if self.max_epsilon is not None else self.epsilon

    # ----- what each release uses ------------------------------------------------------------
    @property
    def expected_cohort(self) -> float:
        return self.sampling_rate * self.num_users

    def round_parts(self, clip: float) -> list[tuple[str, float, float]]:
        """(part, per-user bound, noise multiplier of the part) of a training release: the
        update, and with adaptive clipping the centred unclipped bit (bound 1/2) sharing the
        round's multiplier by ``clip_count_share`` (so the round is one Gaussian mechanism with
        the planned multiplier)."""
        z = self.multipliers[ROUND]
        bound = clip * self.user_sensitivity_factor
        if self.clip_quantile is None:
            return [(UPDATE_PART, bound, z)]
        s = self.clip_count_share
        return [(UPDATE_PART, bound, z / math.sqrt(1.0 - s)),
                (UNCLIPPED_PART, 0.5, z / math.sqrt(s))]

    def metric_parts(self) -> list[tuple[str, float, float]]:
        """(metric, bound, noise multiplier) of an evaluation release: equal shares."""
        z = self.multipliers[EVALUATE]
        k = len(self.private_metrics)
        return [(name, float(bound), z * math.sqrt(k)) for name, bound in
                sorted(self.private_metrics.items())]

    def std(self, bound: float, multiplier: float, population: float) -> float:
        """Noise std of a mean over a fixed ``population`` whose per-user bound is ``bound``."""
        return multiplier * mean_sensitivity(bound, 1, self.relation) / population

    def accountant(self) -> Accountant:
        return self.accountant_for(self.secure_noise, self.relation, self.delta)

    @staticmethod
    def accountant_for(secure_noise: bool, relation: str, delta: float) -> Accountant:
        """The accountant a plan's releases are composed in (known before its rounds are)."""
        return Accountant(accountant_kind(secure_noise), relation, delta)

    def public(self) -> dict[str, Any]:
        """The plan as it may be published (no seeds, no paths)."""
        return {"num_users": self.num_users, "num_rounds": self.num_rounds,
                "epsilon": self.epsilon, "delta": self.delta, "clip_norm": self.clip_norm,
                "noise_multipliers": dict(self.multipliers),
                "sampling_rate": self.sampling_rate, "clip_quantile": self.clip_quantile,
                "clip_lr": self.clip_lr if self.clip_quantile else None,
                "clip_count_share": self.clip_count_share if self.clip_quantile else None,
                "max_epsilon": self.max_epsilon, "neighbouring_relation": self.relation,
                "accountant": ("rdp at integer orders (dp-accounting; discrete noise)"
                               if self.secure_noise else "pld (dp-accounting)"),
                "private_metrics": dict(self.private_metrics),
                "metrics_budget_fraction": (self.metrics_budget_fraction
                                            if self.private_metrics else None),
                # None: the nodes evaluate whenever the inner strategy has them evaluate
                "evaluate_rounds": list(self.evaluate_rounds) or None,
                "user_sensitivity_factor": self.user_sensitivity_factor,
                "projected_epsilon": self.projected_epsilon}


def accountant_kind(secure_noise: bool) -> str:
    """PLD, or integer-order RDP for discrete noise (``secure_noise``)."""
    return DISCRETE_ACCOUNTANT if secure_noise else "pld"


def evaluate_rounds(num_rounds: int, every: int | Sequence[int] | None) -> tuple[int, ...]:
    """The rounds after which nodes evaluate: None -> the last; k -> every k-th and the last;
    a sequence -> those rounds."""
    if every is None:
        return (num_rounds,)
    if isinstance(every, int):
        if every < 1:
            raise PlanError(f"evaluate_every: must be >= 1, got {every}")
        return tuple(sorted({*range(every, num_rounds + 1, every), num_rounds}))
    return tuple(sorted(set(every)))
