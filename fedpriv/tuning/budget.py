"""The privacy budget of a tuning, fixed before any candidate runs.

Every candidate is calibrated to one per-candidate target ``(eps_c, delta)`` by the server's own
calibration (``fedpriv.server.calibrate``: the same multipliers the run will use). ``eps_c`` is
the largest value (bisection, relative precision 1e-4) at which the whole tuning stays within
its total target:

* ``random-stopping``: each distinct privacy plan of the space gives an RDP curve (dp-accounting's
  RDP accountant); their maximum bounds one candidate; Papernot & Steinke's bound for the chosen
  law of K gives the selection's curve, converted to (epsilon, delta)
  (``fedpriv.privacy.selection``).
* ``compose-all``: the candidates' plans composed with the PLD accountant (every release of
  every candidate counted; nothing needs to stay secret).

A search whose target cannot be met (say, the selection's overhead ``log E[K] / (lambda - 1)``
alone exceeds it) is refused, naming the reason, before anything runs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fedpriv.configure import parse_config
from fedpriv.evaluation import algorithm_for
from fedpriv.privacy.accounting import (
    EventKey,
    InfeasiblePlanError,
    PlannedRelease,
    calibrate_gaussian_plan,
    epsilon_of,
    plan_counts,
)
from fedpriv.privacy.selection import plan_rdp, selection_epsilon
from fedpriv.server import calibrate
from fedpriv.tuning.spec import TuneSpec

_BISECTIONS = 40
_FLOOR = 1e-2  # the smallest per-candidate epsilon tried, as a fraction of the total


@dataclass
class Budget:
    """The calibrated budget: ``candidate_epsilon`` per candidate (at the tuning's delta),
    ``total_epsilon`` of the whole tuning, and each point's accounted releases."""

    candidate_epsilon: float
    total_epsilon: float
    order: float | None  # the RDP order of the selection's bound (random stopping)
    counts: dict[int, dict[EventKey, int]] = field(default_factory=dict)  # point -> releases
    composed: int = 0  # compose-all: the number of candidates composed


def point_counts(spec: TuneSpec, epsilon: float,
                 confirm: bool = True) -> dict[int, dict[EventKey, int]]:
    """Each point's releases (noise multiplier, sampling rate) -> count, calibrated at the
    per-candidate target ``epsilon`` as the server will (``confirm=False``: without the PLD
    confirmation of an unsampled plan's closed form, for the search); points with the same plan
    share one calibration."""
    cache: dict[tuple[tuple[PlannedRelease, ...], str, str], dict[EventKey, int]] = {}
    out: dict[int, dict[EventKey, int]] = {}
    for i, point in enumerate(spec.points):
        config = parse_config(spec.candidate_values(point, epsilon), strict=True)
        plan = tuple(algorithm_for(config)(config).privacy_plan())
        key = (plan, config.accountant, config.neighbouring_relation)
        if key not in cache:
            if any(r.sampling_rate < 1.0 for r in plan):
                raise InfeasiblePlanError(
                    f"{config.algorithm} samples its users (Poisson): every candidate would "
                    "reuse the run seed's sample, so the candidates are not independent runs; "
                    "private tuning needs unsampled plans")
            multipliers = (calibrate(config, plan) if confirm else calibrate_gaussian_plan(
                plan, epsilon, spec.delta, config.accountant, config.neighbouring_relation,
                confirm=False))
            cache[key] = plan_counts(plan, multipliers)
        out[i] = cache[key]
    return out


def total_epsilon(spec: TuneSpec, epsilon: float, composed: Sequence[int] = (),
                  confirm: bool = True) -> tuple[float, float | None,
                                                 dict[int, dict[EventKey, int]]]:
    """(total epsilon, RDP order or None, point counts) of the tuning with candidates at
    ``epsilon``. ``composed``: the points a compose-all tuning runs (repeats allowed)."""
    counts = point_counts(spec, epsilon, confirm)
    relation = spec.base.get("neighbouring-relation", "add-remove")
    if spec.method == "random-stopping":
        curves = [plan_rdp(c, relation) for c in _distinct(counts.values())]
        eps, order = selection_epsilon(curves, spec.law, spec.delta)
        return eps, order, counts
    total: Counter[EventKey] = Counter()
    for i in composed:
        total.update(counts[i])
    return epsilon_of(dict(total), spec.delta, "pld", relation), None, counts


def calibrate_tuning(spec: TuneSpec, composed: Sequence[int] = ()) -> Budget:
    """The largest per-candidate epsilon whose tuning stays within the total target."""
    target = spec.epsilon

    def spent(eps_c: float, confirm: bool = False) -> tuple[float, float | None,
                                                             dict[int, dict[EventKey, int]]]:
        try:
            return total_epsilon(spec, eps_c, composed, confirm)
        except InfeasiblePlanError as err:
            raise InfeasiblePlanError(f"candidates at epsilon {eps_c:.4g}: {err}") from None

    hi = target
    high = spent(hi, confirm=True)
    if high[0] <= target:  # one candidate composed alone
        return Budget(hi, high[0], high[1], high[2], len(composed))
    lo = hi / 2.0  # halve until the tuning fits (or the floor is reached)
    while True:
        try:
            best = spent(lo)
        except InfeasiblePlanError as err:
            raise InfeasiblePlanError(f"no tuning meets the total epsilon {target} at delta "
                                      f"{spec.delta}: {err}") from None
        if best[0] <= target:
            break
        if lo <= target * _FLOOR:
            raise InfeasiblePlanError(
                f"no tuning meets the total epsilon {target} at delta {spec.delta}: even "
                f"candidates at epsilon {lo:.3g} give {best[0]:.4g}"
                + (f" (the selection's overhead, log E[K] / (lambda - 1) and the conversion "
                   f"to (epsilon, delta), is most of it: expect fewer candidates, E[K] = "
                   f"{spec.repetitions.mean:g}, or raise the target)"
                   if spec.repetitions else f" ({len(composed)} candidates composed: run "
                   "fewer, or use random stopping)"))
        hi, lo = lo, lo / 2.0
    for _ in range(_BISECTIONS):
        mid = math.sqrt(lo * hi)
        res = spent(mid)
        if res[0] <= target:
            lo, best = mid, res
        else:
            hi = mid
        if hi / lo - 1.0 < 1e-4:
            break
    # the search skipped the PLD confirmation of closed forms; the server's own calibration may
    # only add noise (it never overshoots), so the final multipliers spend at most the search's
    try:
        final = spent(lo, confirm=True)
    except InfeasiblePlanError as err:
        raise InfeasiblePlanError(f"no tuning meets the total epsilon {target} at delta "
                                  f"{spec.delta}: {err}") from None
    if final[0] > target * (1 + 1e-9):
        raise InfeasiblePlanError(f"the calibrated tuning spends {final[0]} > {target}")
    return Budget(lo, final[0], final[1], final[2], len(composed))


def _distinct(items: Iterable[dict[EventKey, int]]) -> list[dict[EventKey, int]]:
    seen, out = set(), []
    for counts in items:
        key = tuple(sorted(counts.items()))
        if key not in seen:
            seen.add(key)
            out.append(counts)
    return out
