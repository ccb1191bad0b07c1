"""Privacy accounting: a run is a plan of Gaussian releases composed by dp-accounting.

* Every release the server makes (the private initialization, each round) is a Gaussian mechanism
  with noise multiplier ``z = noise_std / l2_sensitivity``; the sensitivity is stated by the
  algorithm for the chosen neighbouring relation.
* The budget is split between releases by *weights*: release ``j`` gets ``1/z_j^2 = w_j mu^2``.
  (Composed Gaussian mechanisms are exactly ``mu``-GDP with ``mu^2 = sum_j 1/z_j^2``, so weights
  are shares of the total privacy loss.) A single scale is then calibrated with dp-accounting so
  the composed plan meets the target (epsilon, delta), and checked to never overshoot it.
* ``Accountant`` composes the releases as they happen and keeps a ledger with the epsilon spent
  after each one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import dp_accounting
from dp_accounting import pld, rdp
from dp_accounting.mechanism_calibration import ExplicitBracketInterval, calibrate_dp_mechanism

ACCOUNTANTS = ("pld", "rdp")
NEIGHBOURING_RELATIONS = ("add-remove", "replace-one")

_RELATIONS = ("add-remove", "replace-one")


# The calibrated scale mu = 1/s is searched in this range; tiny multipliers (< 0.2) make the PLD
# grid enormous and are never useful for a private run.
_MU_RANGE = (1e-4, 5.0)


class InfeasiblePlanError(ValueError):
    """The requested privacy plan cannot meet its target."""


def mean_sensitivity(clip_norm: float, population: int, relation: str) -> float:
    """L2 sensitivity of ``sum_i clip(g_i, clip_norm) / population`` with ``population`` fixed.

    Adding or removing one user moves the sum by at most ``clip_norm``; replacing one user moves
    it by at most ``2 clip_norm`` (the two clipped contributions may point in opposite ways).
    """
    if relation not in _RELATIONS:
        raise ValueError(f"neighbouring relation must be one of {NEIGHBOURING_RELATIONS}")
    factor = 1.0 if relation == "add-remove" else 2.0
    return factor * clip_norm / population


def make_accountant(kind: str, relation: str) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant: PLD (tight, default) or RDP.

    The neighbouring relation enters through the L2 sensitivity the algorithm states (see
    ``mean_sensitivity``): a ``GaussianDpEvent`` here has ``noise_multiplier = std / Delta`` with
    Delta the largest distance between the released means of two neighbouring populations. The
    privacy loss of a Gaussian whose mean moves by at most Delta is the same whatever made it move,
    so the accountant is always built with dp-accounting's ADD_OR_REMOVE_ONE relation, whose
    unsampled Gaussian PLD is exactly that shift. (dp-accounting's REPLACE_ONE instead models a
    shift of 2 x the per-record bound; using it on top of a replace-one Delta would count the
    factor 2 twice.)
    """
    if relation not in _RELATIONS:
        raise ValueError(f"neighbouring relation must be one of {NEIGHBOURING_RELATIONS}")
    shift = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if kind == "pld":
        return pld.PLDAccountant(neighboring_relation=shift)
    if kind == "rdp":
        return rdp.RdpAccountant(neighboring_relation=shift)
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {kind!r}")


@dataclass(frozen=True)
class PlannedRelease:
    """``count`` identical Gaussian releases that each user takes part in, each with ``weight``
    of the budget. Releases over disjoint user groups count once per user (parallel composition):
    T rounds over T disjoint groups are ``count=1``."""

    name: str
    weight: float
    count: int = 1


def _plan_event(releases: Sequence[PlannedRelease], multipliers: Sequence[float]):
    """The plan as the run will compose it: every release in order, one event each, so the
    epsilon checked at calibration is exactly the one the run's accountant will report."""
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.GaussianDpEvent(z)
            for r, z in zip(releases, multipliers, strict=True)
            for _ in range(r.count)
        ]
    )


def plan_epsilon(
    releases: Sequence[PlannedRelease],
    multipliers: Sequence[float],
    delta: float,
    accountant: str = "pld",
    relation: str = "add-remove",
) -> float:
    """Epsilon at ``delta`` of the whole plan with the given noise multipliers."""
    acc = make_accountant(accountant, relation)
    acc.compose(_plan_event(releases, multipliers))
    return float(acc.get_epsilon(delta))


def calibrate_gaussian_plan(
    releases: Sequence[PlannedRelease],
    epsilon: float,
    delta: float,
    accountant: str = "pld",
    relation: str = "add-remove",
) -> list[float]:
    """Noise multipliers, one per release group, so the plan spends at most (epsilon, delta).

    Release ``j`` gets ``z_j = s / sqrt(w_j)`` with one scale ``s`` found by dp-accounting's
    calibration; the result is checked and nudged up until the accountant confirms it does not
    overshoot the target.
    """
    if not releases:
        raise InfeasiblePlanError("a privacy plan needs at least one release")
    if epsilon <= 0 or not 0 < delta < 1:
        raise InfeasiblePlanError(f"target must have epsilon > 0 and 0 < delta < 1, got "
                                  f"({epsilon}, {delta})")
    for r in releases:
        if r.weight <= 0 or r.count < 1:
            raise InfeasiblePlanError(f"release {r.name!r} needs weight > 0 and count >= 1")

    def multipliers(scale: float) -> list[float]:
        return [scale / math.sqrt(r.weight) for r in releases]

    # Parametrize by mu = 1/scale so epsilon increases with the parameter.
    def event(mu: float):
        return _plan_event(releases, multipliers(1.0 / max(mu, 1e-12)))

    try:
        mu = calibrate_dp_mechanism(
            lambda: make_accountant(accountant, relation),
            event,
            epsilon,
            delta,
            bracket_interval=ExplicitBracketInterval(_MU_RANGE[0], _MU_RANGE[1]),
            tol=1e-7,
        )
    except ValueError as err:
        raise InfeasiblePlanError(
            f"no noise level meets (epsilon={epsilon}, delta={delta}) with these releases: the "
            f"searched noise multipliers span [{1 / _MU_RANGE[1]:g}, {1 / _MU_RANGE[0]:g}]"
        ) from err
    scale = 1.0 / mu
    for _ in range(200):  # never overshoot: step the noise up until the accountant agrees
        if plan_epsilon(releases, multipliers(scale), delta, accountant, relation) <= epsilon:
            return multipliers(scale)
        scale *= 1.0 + 1e-6
    raise InfeasiblePlanError(f"could not calibrate a plan within epsilon={epsilon}")


class Accountant:
    """Composes the releases of one run as they happen and keeps a ledger.

    A release is either seen by every user (``group=None``) or only by the users of one disjoint
    group. A user's privacy loss composes the common releases and those of its own group only
    (parallel composition: the other groups' releases do not depend on its data, given what was
    released before), so the epsilon spent is the largest over groups of that composition.
    """

    def __init__(self, kind: str, relation: str, delta: float) -> None:
        self.kind = kind
        self.relation = relation
        self.delta = delta
        self._common: list[dp_accounting.DpEvent] = []
        self._accountants: dict[int | None, dp_accounting.PrivacyAccountant] = {
            None: make_accountant(kind, relation)
        }
        self._spent: dict[int | None, float] = {None: 0.0}
        self.ledger: list[dict] = []

    def record(
        self,
        name: str,
        noise_multiplier: float,
        parts: Sequence[dict] = (),
        group: int | None = None,
    ) -> float:
        """Compose one Gaussian release and return the epsilon spent so far.

        ``parts`` describes the arrays released (name, l2_sensitivity, noise_std, ...); they are
        saved in the ledger.
        """
        event = dp_accounting.GaussianDpEvent(noise_multiplier)
        if group is None:
            self._common.append(event)
            touched = list(self._accountants)
        else:
            if group not in self._accountants:
                acc = make_accountant(self.kind, self.relation)
                for previous in self._common:
                    acc.compose(previous)
                self._accountants[group] = acc
            touched = [group]
        for key in touched:
            self._accountants[key].compose(event)
            self._spent[key] = float(self._accountants[key].get_epsilon(self.delta))
        spent = self.epsilon()
        entry = {
            "release": name,
            "mechanism": "gaussian",
            "noise_multiplier": noise_multiplier,
            "user_group": group,
            "epsilon_spent": spent,
        }
        if len(parts) == 1:
            entry.update({k: v for k, v in parts[0].items() if k != "name"})
        elif parts:
            entry["parts"] = list(parts)
        self.ledger.append(entry)
        return spent

    def epsilon(self) -> float:
        """Largest epsilon (at ``delta``) any single user has spent so far."""
        if not self.ledger:
            return 0.0
        return max(self._spent.values())
