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
* A release may instead be **pure epsilon-DP** (the exponential mechanism). A plan of pure
  releases splits epsilon by the same weights; pure releases compose additively at delta = 0
  (tight), which is what is reported. dp-accounting has no pure-DP event for its accountants
  (its ``RandomizedResponseDpEvent`` requires REPLACE_ONE), and pure and Gaussian releases are
  not mixed in one plan (no algorithm needs it; such a plan is refused).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from fedpriv.config import ACCOUNTANTS, NEIGHBOURING_RELATIONS
from fedpriv.privacy.bounds import InfeasiblePlanError as InfeasiblePlanError
from fedpriv.privacy.bounds import _gdp_epsilon, _gdp_mu
from fedpriv.privacy.bounds import gdp_mu as gdp_mu
from fedpriv.privacy.bounds import mean_sensitivity as mean_sensitivity
from fedpriv.privacy.memo import remembered

if TYPE_CHECKING:  # dp-accounting (a second of scipy imports) loads where it is used: not on nodes
    import dp_accounting

_RELATIONS = ("add-remove", "replace-one")


# Calibration searches mu = 1/scale (epsilon grows with mu) upwards from a 0.5-GDP plan; plans
# that would need a multiplier below _MIN_MULTIPLIER are refused (never useful for a private run).
_MU_FLOOR = 1e-6
_MAX_DOUBLINGS = 40
_MIN_MULTIPLIER = 0.05


def make_accountant(kind: str, relation: str,
                    sampled: bool = False) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant: PLD (tight, default) or RDP.

    The neighbouring relation enters through the L2 sensitivity the algorithm states (see
    ``mean_sensitivity``): a ``GaussianDpEvent`` here has ``noise_multiplier = std / Delta`` with
    Delta the largest distance between the released means of two neighbouring populations. The
    privacy loss of a Gaussian whose mean moves by at most Delta is the same whatever made it move,
    so without sampling the accountant is built with dp-accounting's ADD_OR_REMOVE_ONE relation,
    whose unsampled Gaussian PLD is exactly that shift. (dp-accounting's REPLACE_ONE instead models
    a shift of 2 x the per-record bound; using it on top of a replace-one Delta would count the
    factor 2 twice.)

    Poisson sampling is different: whether the differing user is in the batch is itself random,
    and replacing a user is not two independent shifts. A plan with sampled releases under
    ``replace-one`` is therefore accounted with dp-accounting's own REPLACE_ONE PLD (the mixture
    analysis), with every event's multiplier converted back to the per-user bound (see
    ``_dp_event``). dp-accounting's RDP accountant has no Poisson analysis under REPLACE_ONE, so
    that combination is refused. Sampled plans use a PLD grid of 1e-3 instead of 1e-4: the
    estimate stays pessimistic (an upper bound) and close to the finer grid's, at a fraction of
    the cost (docs/measurements.md).
    """
    import dp_accounting
    from dp_accounting import pld, rdp
    if relation not in _RELATIONS:
        raise ValueError(f"neighbouring relation must be one of {NEIGHBOURING_RELATIONS}")
    shift = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if sampled and relation == "replace-one":
        if kind == "rdp":
            raise InfeasiblePlanError(
                "the rdp accountant cannot account Poisson sampling under replace-one "
                "(dp-accounting has no such analysis); use accountant = \"pld\" or "
                "neighbouring-relation = \"add-remove\"")
        shift = dp_accounting.NeighboringRelation.REPLACE_ONE
    if kind == "pld":
        return pld.PLDAccountant(neighboring_relation=shift,
                                 value_discretization_interval=1e-3 if sampled else 1e-4)
    if kind == "rdp":
        return rdp.RdpAccountant(neighboring_relation=shift)
    if kind == DISCRETE_ACCOUNTANT:
        if sampled:
            raise InfeasiblePlanError("discrete noise (secure-noise, distributed aggregation) "
                                      "is accounted without Poisson sampling")
        return rdp.RdpAccountant(orders=list(INTEGER_ORDERS), neighboring_relation=shift)
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {kind!r}")


@dataclass(frozen=True)
class PlannedRelease:
    """``count`` identical Gaussian releases that each user takes part in, each with ``weight``
    of the budget. Releases over disjoint user groups count once per user (parallel composition):
    T rounds over T disjoint groups are ``count=1``. ``sampling_rate < 1``: each release uses a
    Poisson sample of the users, each user independently with that probability (the sample is
    secret: only the noisy sum is released). ``mechanism = "exponential"``: a pure epsilon-DP
    release (its epsilon is ``weight`` of the target, over the plan's total weight).
    ``multiplier``: a noise multiplier fixed in advance (not calibrated; ``weight`` is then
    unused); the others are calibrated around it."""

    name: str
    weight: float
    count: int = 1
    sampling_rate: float = 1.0
    mechanism: str = "gaussian"
    multiplier: float | None = None


# An accounted release: (noise multiplier z = std / Delta, Poisson sampling rate q) for a
# Gaussian release; (epsilon, 0.0) for a pure epsilon-DP release (rate 0 marks it); (rho, -1.0)
# for a rho-zCDP release (discrete noise: ``ZCDP`` marks it).
EventKey = tuple[float, float]
PURE = 0.0
ZCDP = -1.0

# The accountant of discrete noise (secure-noise, distributed aggregation): dp-accounting's RDP
# evaluated at integer orders only. The Skellam bound (Agarwal, Kairouz & Liu 2021) is stated
# for integer orders; the discrete Gaussian's zCDP bound holds at every order. Gaussian and
# zCDP releases of one run are composed on the same orders, so the plan's calibration and the
# ledger agree.
DISCRETE_ACCOUNTANT = "rdp-int"
INTEGER_ORDERS = tuple(range(2, 129)) + tuple(range(136, 257, 8)) + (320, 384, 512, 768, 1024)


def _is_pure(key: EventKey) -> bool:
    return key[1] == PURE


def _sampled(keys: Iterable[EventKey]) -> bool:
    return any(0.0 < q < 1.0 for _, q in keys)


def _dp_event(key: EventKey, relation: str, sampled_plan: bool) -> dp_accounting.DpEvent:
    import dp_accounting
    z, q = key
    if q == ZCDP:
        return dp_accounting.ZCDpEvent(z)
    if sampled_plan and relation == "replace-one":
        # REPLACE_ONE accountant: multiplier relative to the per-user bound (Delta / 2)
        z = 2.0 * z
    gaussian = dp_accounting.GaussianDpEvent(z)
    return gaussian if q >= 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)


def composed_event(counts: Mapping[EventKey, int], relation: str) -> dp_accounting.DpEvent:
    """The composition of ``counts[key]`` releases of each kind (order does not matter for the
    composed privacy loss), as one dp-accounting event."""
    import dp_accounting
    sampled = _sampled(counts)
    return dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(_dp_event(key, relation, sampled), n)
        for key, n in sorted(counts.items()) if n > 0
    ])


def epsilon_of(counts: Mapping[EventKey, int], delta: float, kind: str = "pld",
               relation: str = "add-remove") -> float:
    """Epsilon at ``delta`` of the composition described by ``counts``."""
    if not any(counts.values()):
        return 0.0
    live = [k for k, n in counts.items() if n > 0]
    if any(map(_is_pure, live)):
        if not all(map(_is_pure, live)):
            raise InfeasiblePlanError("pure epsilon-DP and Gaussian releases cannot be mixed in "
                                      "one run")
        return _pure_epsilon(tuple(sorted((k[0], counts[k]) for k in live)))
    return _epsilon_cached(tuple(sorted((k, n) for k, n in counts.items() if n > 0)), delta,
                           kind, relation)


@lru_cache(maxsize=4096)  # memory only: every process computes the epsilons it reports
def _epsilon_cached(items: tuple[tuple[EventKey, int], ...], delta: float, kind: str,
                    relation: str) -> float:
    counts = dict(items)
    acc = make_accountant(kind, relation, sampled=_sampled(counts))
    acc.compose(composed_event(counts, relation))
    return float(acc.get_epsilon(delta))


def _pure_epsilon(items: tuple[tuple[float, int], ...]) -> float:
    """Epsilon at delta = 0 of composed pure-DP releases: exactly their sum (pure DP composes
    additively at delta = 0, and the sum is attained by randomized response, so it is tight).
    dp-accounting's PLD of pure DP agrees up to its grid (tested); it is not used here because
    its grid rounds every epsilon up and ten or more compositions leave mass at infinity."""
    return float(sum(eps * n for eps, n in items))


def plan_counts(releases: Sequence[PlannedRelease],
                 multipliers: Sequence[float]) -> dict[EventKey, int]:
    """The plan as the run will compose it, so the epsilon checked at calibration is exactly the
    one the run's accountant will report."""
    counts: dict[EventKey, int] = {}
    for r, z in zip(releases, multipliers, strict=True):
        key = (float(z), float(r.sampling_rate))
        counts[key] = counts.get(key, 0) + r.count
    return counts


def plan_epsilon(releases: Sequence[PlannedRelease], multipliers: Sequence[float], delta: float,
                 accountant: str = "pld", relation: str = "add-remove") -> float:
    """Epsilon at ``delta`` of the whole plan with the given noise multipliers."""
    return epsilon_of(plan_counts(releases, multipliers), delta, accountant, relation)


def calibrate_gaussian_plan(
    releases: Sequence[PlannedRelease],
    epsilon: float,
    delta: float,
    accountant: str = "pld",
    relation: str = "add-remove",
    confirm: bool = True,
) -> list[float]:
    """Noise multipliers, one per release group, so the plan spends at most (epsilon, delta).
    Computed once per plan (``fedpriv.privacy.memo``: a later process reads it back and
    confirms it with one composition).

    ``confirm=False`` skips the accountant's confirmation of the closed form (unsampled PLD
    plans only; a search over many targets, such as a tuning's budget, confirms its final one).

    Release ``j`` gets ``z_j = s / sqrt(w_j)`` with one scale ``s``. Unsampled plans under the
    PLD accountant are exactly mu-GDP, so ``s`` is solved from the closed form (dp-accounting's
    PLD agrees with it closely; bisecting PLDs instead was slow at large epsilon);
    otherwise ``s`` comes from dp-accounting's ``calibrate_dp_mechanism``. Either way the result
    is checked with the composition the run will perform and nudged up until the accountant
    confirms it does not overshoot the target.
    """
    plan = tuple(PlannedRelease(str(r.name), float(r.weight), int(r.count),
                                float(r.sampling_rate), str(r.mechanism),
                                None if r.multiplier is None else float(r.multiplier))
                 for r in releases)  # plain Python values: the key is exactly what is computed
    eps, delta = float(epsilon), float(delta)

    def confirmed(z: list[float]) -> bool:
        """A calibration read from a file, confirmed here by the accountant: one multiplier per
        release, the fixed ones unchanged, and the whole plan spending its target (within 1%)
        and no more."""
        if not isinstance(z, list) or len(z) != len(plan) or any(
                r.multiplier is not None and v != r.multiplier for r, v in zip(plan, z,
                                                                              strict=True)):
            return False
        return 0.99 * eps <= plan_epsilon(plan, z, delta, accountant, relation) <= eps

    if not confirm:  # unconfirmed (a search's intermediate plans): computed, never kept
        return _calibrate(plan, eps, delta, accountant, relation, confirm)
    return remembered("calibrate", (plan, eps, delta, accountant, relation, confirm),
                      lambda: _calibrate(plan, eps, delta, accountant, relation, confirm),
                      check=confirmed)


def _calibrate(releases: Sequence[PlannedRelease], epsilon: float, delta: float,
               accountant: str, relation: str, confirm: bool) -> list[float]:
    if not releases:
        raise InfeasiblePlanError("a privacy plan needs at least one release")
    if any(r.mechanism != "gaussian" for r in releases):
        raise InfeasiblePlanError("a Gaussian plan cannot hold exponential-mechanism releases "
                                  "(see fedpriv.privacy.pure)")
    if epsilon <= 0 or not 0 < delta < 1:
        raise InfeasiblePlanError(f"target must have epsilon > 0 and 0 < delta < 1, got "
                                  f"({epsilon}, {delta})")
    for r in releases:
        if (r.weight <= 0 and r.multiplier is None) or r.count < 1 or not (
                0 < r.sampling_rate <= 1) or (r.multiplier is not None and r.multiplier <= 0):
            raise InfeasiblePlanError(f"release {r.name!r} needs weight > 0 (or a fixed "
                                      "multiplier > 0), count >= 1 and a sampling rate in "
                                      "(0, 1]")
    fixed = [r for r in releases if r.multiplier is not None]
    fixed_z = [r.multiplier for r in releases if r.multiplier is not None]  # fixed's multipliers
    if fixed and plan_epsilon(fixed, fixed_z, delta, accountant, relation) >= epsilon:
        names = ", ".join(r.name for r in fixed)
        raise InfeasiblePlanError(f"the releases with fixed noise ({names}) alone spend the "
                                  f"target epsilon={epsilon}")
    if len(fixed) == len(releases):
        return [float(z) for z in fixed_z]  # every release is fixed: fixed_z is in their order
    free = [r for r in releases if r.multiplier is None]
    fixed_mu2 = sum(r.count / z**2 for r, z in zip(fixed, fixed_z, strict=True))

    def multipliers(scale: float) -> list[float]:
        return [r.multiplier if r.multiplier is not None else scale / math.sqrt(r.weight)
                for r in releases]

    def _never_overshoot(scale: float) -> list[float]:
        for _ in range(200):  # step the noise up until the accountant agrees
            if plan_epsilon(releases, multipliers(scale), delta, accountant, relation) <= epsilon:
                return multipliers(scale)
            scale *= 1.0 + 1e-6
        raise InfeasiblePlanError(f"could not calibrate a plan within epsilon={epsilon}")

    # Parametrize by mu = 1/scale so epsilon increases with the parameter.
    def event(mu: float) -> dp_accounting.DpEvent:
        return composed_event(plan_counts(releases, multipliers(1.0 / max(mu, 1e-12))),
                              relation)

    sampled = any(r.sampling_rate < 1.0 for r in releases)
    make_accountant(accountant, relation, sampled)  # raises for an unsupported combination

    def spent(mu: float) -> float:
        return plan_epsilon(releases, multipliers(1.0 / mu), delta, accountant, relation)

    # Bracket: start where the plan is 0.5-GDP and double mu until the target is exceeded, so
    # the PLD is never built for noise far smaller than needed (tiny multipliers make its grid
    # enormous and slow to build).
    if not sampled and accountant == "pld":
        # Unsampled Gaussian plans are exactly mu-GDP and dp-accounting's PLD agrees closely with
        # the closed form: solve it, then let the accountant confirm (loop below).
        # mu_target^2 = sum_free count w / scale^2 + sum_fixed count / z^2
        scale = math.sqrt(sum(r.count * r.weight for r in free)
                          / (_gdp_mu(epsilon, delta) ** 2 - fixed_mu2))
        if min(multipliers(scale)) < _MIN_MULTIPLIER:
            raise InfeasiblePlanError(
                f"no noise level meets (epsilon={epsilon}, delta={delta}) with these releases: "
                f"it would need noise multipliers below {_MIN_MULTIPLIER:g}")
        return _never_overshoot(scale) if confirm else multipliers(scale)

    # The multiplier floor is checked before the accountant is asked: a huge epsilon target
    # would otherwise double mu until the PLD grid exhausts memory. At the floor, the plan
    # without sampling is exactly mu-GDP (sampling only lowers epsilon): if even that stays
    # below the target, no multiplier above the floor can reach it.
    floor_mu = math.sqrt(sum(r.count * r.weight for r in free) / (
        _MIN_MULTIPLIER**2 * max(r.weight for r in free)) + fixed_mu2)
    if _gdp_epsilon(floor_mu, delta) < epsilon:
        raise InfeasiblePlanError(
            f"no noise level meets (epsilon={epsilon}, delta={delta}) with these releases: "
            f"it would need noise multipliers below {_MIN_MULTIPLIER:g}")
    mu_max = 1.0 / (_MIN_MULTIPLIER * math.sqrt(max(r.weight for r in free)))
    hi: float | None
    lo, hi = _MU_FLOOR, min(0.5 / math.sqrt(sum(r.count * r.weight for r in free)), mu_max)
    for _ in range(_MAX_DOUBLINGS):
        if spent(hi) >= epsilon:
            break
        if hi >= mu_max:  # the multiplier floor reached without meeting the target
            hi = None
            break
        lo, hi = hi, min(2.0 * hi, mu_max)
    else:
        hi = None
    if hi is None:
        raise InfeasiblePlanError(
            f"no noise level meets (epsilon={epsilon}, delta={delta}) with these releases: "
            f"it would need noise multipliers below {_MIN_MULTIPLIER:g}")
    from dp_accounting.mechanism_calibration import ExplicitBracketInterval, calibrate_dp_mechanism
    try:
        mu = calibrate_dp_mechanism(
            lambda: make_accountant(accountant, relation, sampled),
            event,
            epsilon,
            delta,
            bracket_interval=ExplicitBracketInterval(lo, hi),
            tol=1e-7,
        )
    except ValueError as err:
        raise InfeasiblePlanError(
            f"no noise level meets (epsilon={epsilon}, delta={delta}) with these releases"
        ) from err
    return _never_overshoot(1.0 / mu)


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
        self._common: Counter[EventKey] = Counter()
        self._groups: dict[int, Counter[EventKey]] = {}
        self._spent: dict[int | None, float] = {None: 0.0}
        self._stale: set[int | None] = set()
        self.ledger: list[dict[str, Any]] = []

    def record(
        self,
        name: str,
        noise_multiplier: float,
        parts: Sequence[Mapping[str, Any]] = (),
        group: int | None = None,
        *,
        groups: Sequence[int] | None = None,
        sampling_rate: float = 1.0,
        evaluate: bool = True,
    ) -> float | None:
        """Compose one Gaussian release and return the epsilon spent so far.

        ``group``/``groups``: the disjoint user group(s) whose users the release depends on (a
        tree-aggregation node covers several rounds' groups); None: every user. A user of one of
        them is charged this release once. ``sampling_rate < 1``: a Poisson-subsampled release.
        ``parts`` describes the arrays released (name, l2_sensitivity, noise_std, ...); they are
        saved in the ledger. ``evaluate=False`` defers the epsilon computation (returns None and
        leaves ``epsilon_spent`` None in the ledger): subsampled PLDs are slow to build, so
        long sampled runs evaluate at checkpoints only; ``epsilon()`` is always exact.
        """
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        key = (float(noise_multiplier), float(sampling_rate))
        if groups is None and group is not None:
            groups = [group]
        if groups is None:
            self._common[key] += 1
            self._stale.update(self._spent)
        else:
            for g in groups:
                self._groups.setdefault(int(g), Counter())[key] += 1
                self._stale.add(int(g))
        spent = self.epsilon() if evaluate else None
        entry: dict[str, Any] = {
            "release": name,
            "mechanism": "gaussian" if sampling_rate >= 1 else "poisson-sampled gaussian",
            "noise_multiplier": noise_multiplier,
            "user_group": groups[0] if groups is not None and len(groups) == 1 else None,
            "epsilon_spent": spent,
        }
        if groups is not None and len(groups) > 1:
            entry["user_groups"] = [int(g) for g in groups]
        if sampling_rate < 1:
            entry["sampling_rate"] = sampling_rate
        if len(parts) == 1:
            entry.update({k: v for k, v in parts[0].items() if k != "name"})
        elif parts:
            entry["parts"] = list(parts)
        self.ledger.append(entry)
        return spent

    def record_zcdp(self, name: str, rho: float, details: Mapping[str, Any],
                    groups: Sequence[int] | None = None) -> float:
        """Compose one rho-zCDP release (discrete noise: the distributed Skellam sum,
        ``skellam_rho``) that every user takes part in, or (``groups``) the users of those
        disjoint groups only, as ``record``; returns the epsilon spent so far. Needs the
        integer-order RDP accountant (``DISCRETE_ACCOUNTANT``)."""
        if self.kind != DISCRETE_ACCOUNTANT:
            raise ValueError(f"a zCDP release needs the {DISCRETE_ACCOUNTANT} accountant, "
                             f"not {self.kind}")
        if not rho > 0:
            raise ValueError(f"rho must be > 0, got {rho}")
        key: EventKey = (float(rho), ZCDP)
        entry = {"mechanism": "zcdp", "rho": float(rho), **details}
        if groups is None:
            return self._record_common(name, key, entry)
        for g in groups:
            self._groups.setdefault(int(g), Counter())[key] += 1
            self._stale.add(int(g))
        spent = self.epsilon()
        self.ledger.append({"release": name, **entry,
                            "user_group": groups[0] if len(groups) == 1 else None,
                            **({"user_groups": [int(g) for g in groups]}
                               if len(groups) > 1 else {}),
                            "epsilon_spent": spent})
        return spent

    def _record_common(self, name: str, key: EventKey, entry: Mapping[str, Any]) -> float:
        """Compose one release every user takes part in; ledger it; the epsilon spent."""
        self._common[key] += 1
        self._stale.update(self._spent)
        spent = self.epsilon()
        self.ledger.append({"release": name, **entry, "user_group": None,
                            "epsilon_spent": spent})
        return spent

    def record_pure(self, name: str, epsilon: float,
                    details: Mapping[str, Any] | None = None) -> float:
        """Compose one pure epsilon-DP release that every user takes part in (the exponential
        mechanism); returns the epsilon spent so far (at delta = 0)."""
        if not epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        return self._record_common(name, (float(epsilon), PURE), {
            "mechanism": "exponential", "epsilon": epsilon, "delta": 0.0, **(details or {})})

    @property
    def pure(self) -> bool:
        """Every release so far is pure epsilon-DP (the epsilon is then at delta = 0)."""
        keys = list(self._common) + [k for g in self._groups.values() for k in g]
        return bool(keys) and all(map(_is_pure, keys))

    def counts(self, group: int | None = None) -> dict[EventKey, int]:
        """The releases a user of ``group`` (None: a user in no group) has taken part in."""
        counts = Counter(self._common)
        if group is not None:
            counts.update(self._groups.get(group, {}))
        return dict(counts)

    def epsilon(self) -> float:
        """Largest epsilon (at ``delta``) any single user has spent so far."""
        if not self._common and not self._groups:
            return 0.0
        for g in self._stale:
            self._spent[g] = epsilon_of(self.counts(g), self.delta, self.kind, self.relation)
        self._stale.clear()
        return max(self._spent.values())
