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
from collections.abc import Callable, Iterable, Sequence
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
from fedpriv.privacy.memo import remembered
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
    """The largest per-candidate epsilon whose tuning stays within the total target.

    The search (a few dozen compositions) runs once per tuning: its answer is remembered
    (``fedpriv.privacy.memo``), and a later process confirms a remembered one with two
    evaluations instead: the whole tuning at it spends at most the target (with the server's own
    calibration, as the candidates will run), and candidates a hair richer (1e-4, the search's
    precision) would not fit. A damaged or forged answer fails one of the two and is searched
    again."""
    target = spec.epsilon
    confirmed: dict[float, tuple[float, float | None, dict[int, dict[EventKey, int]]]] = {}

    def final_at(eps_c: float) -> tuple[float, float | None, dict[int, dict[EventKey, int]]]:
        if eps_c not in confirmed:  # the candidates' own calibration, as they will run
            try:
                confirmed[eps_c] = _spent(spec, composed, eps_c, confirm=True)
            except InfeasiblePlanError as err:
                raise InfeasiblePlanError(f"no tuning meets the total epsilon {target} at "
                                          f"delta {spec.delta}: {err}") from None
        return confirmed[eps_c]

    def maximal(eps_c: float) -> bool:
        """A remembered answer: within the target, and the largest to the search's precision."""
        if not isinstance(eps_c, float) or not 0.0 < eps_c <= target:
            return False  # a damaged file: the wrong shape or out of range
        try:
            if final_at(eps_c)[0] > target:  # the search's own rule, no float slack
                return False
            return eps_c == target or _spent(spec, composed, eps_c * (1 + 1e-4))[0] > target
        except InfeasiblePlanError:
            return False

    eps_c = remembered("tuning-budget", _budget_inputs(spec, composed),
                       lambda: _search(spec, composed, final_at), check=maximal)
    final = final_at(eps_c)  # within the target: checked by _search, or by maximal on read-back
    return Budget(eps_c, final[0], final[1], final[2], len(composed))


def _budget_inputs(spec: TuneSpec, composed: Sequence[int]) -> tuple[object, ...]:
    """What a tuning's budget depends on, as plain values: its target, its method and law of K,
    every candidate's run config (at a placeholder epsilon) and the candidates composed."""
    law = (spec.repetitions.eta, spec.repetitions.mean) if spec.repetitions else None
    points = tuple(tuple(sorted((k, repr(v)) for k, v in spec.candidate_values(p, 1.0).items()))
                   for p in spec.points)
    return (float(spec.epsilon), float(spec.delta), spec.method, law, points, tuple(composed))


def _spent(spec: TuneSpec, composed: Sequence[int], eps_c: float,
           confirm: bool = False) -> tuple[float, float | None, dict[int, dict[EventKey, int]]]:
    try:
        return total_epsilon(spec, eps_c, composed, confirm)
    except InfeasiblePlanError as err:
        raise InfeasiblePlanError(f"candidates at epsilon {eps_c:.4g}: {err}") from None


def _search(spec: TuneSpec, composed: Sequence[int],
            final_at: Callable[[float], tuple[float, float | None, object]]) -> float:
    """The per-candidate epsilon: halved until the tuning fits, then bisected (relative
    precision 1e-4) on the search's evaluations (without the PLD confirmation of closed
    forms); ``final_at`` confirms the answer with the server's own calibration."""
    target = spec.epsilon
    hi = float(target)
    if final_at(hi)[0] <= target:  # one candidate composed alone
        return hi
    lo = hi / 2.0  # halve until the tuning fits (or the floor is reached)
    while True:
        try:
            best = _spent(spec, composed, lo)
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
        if _spent(spec, composed, mid)[0] <= target:
            lo = mid
        else:
            hi = mid
        if hi / lo - 1.0 < 1e-4:
            break
    # the search skipped the PLD confirmation of closed forms; the server's own calibration may
    # only add noise (it never overshoots), so the final multipliers spend at most the search's
    spent = final_at(lo)[0]
    if spent > target * (1 + 1e-9):  # an error: raised here, so never remembered
        raise InfeasiblePlanError(f"the calibrated tuning spends {spent} > {target}")
    return lo


def _distinct(items: Iterable[dict[EventKey, int]]) -> list[dict[EventKey, int]]:
    seen, out = set(), []
    for counts in items:
        key = tuple(sorted(counts.items()))
        if key not in seen:
            seen.add(key)
            out.append(counts)
    return out
