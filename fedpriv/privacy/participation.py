"""Privacy of a record whose group takes part in random rounds: the record-level baseline's
accounting (``fewshot-dp-reptile``).

A record belongs to a task; each round the task is sampled with probability q, independently of
the data, and when sampled runs a ``mu``-GDP mechanism on its records (its DP-SGD steps). The
coins do **not** amplify the record's privacy the way sampling the record itself would: the
task's other records and its noise are there whether or not the record is, so the output with
and without the record differ in the whole of the sampled rounds' mechanisms, not only in
whether they happened. Conditioned on the coins (which rounds the task takes part in, k of
them), the record's rounds are a composition of k ``mu``-GDP mechanisms, exactly
``sqrt(k) mu``-GDP (Dong, Roth & Su 2019: adaptive composition); the coins have the same law
on both neighbouring datasets, so by joint convexity of the hockey-stick divergence

    delta(epsilon) <= sum_k Binomial(k; T, q) delta_GDP(sqrt(k) mu)(epsilon),

which holds whoever knows the coins (and is tight in the worst case when they are visible).
This module computes that profile, calibrates ``mu`` to a target (epsilon, delta), and inverts
it.
"""

from __future__ import annotations

import math

from fedpriv.privacy.bounds import InfeasiblePlanError, _gdp_delta

_NEGLIGIBLE = 1e-300  # binomial weights below this add nothing a float can hold
MAX_MU = 1e3  # a round's mu above this: epsilon in the hundreds of thousands, not calibrated
MAX_EPSILON = 1e7  # above any epsilon a calibrated mu reaches


def _weights(rounds: int, rate: float) -> list[tuple[int, float]]:
    """(k, P[k of ``rounds`` taken part in]) for k >= 1 with a weight a float holds."""
    from scipy.stats import binom

    if rate >= 1.0:
        return [(rounds, 1.0)]
    out = []
    for k in range(1, rounds + 1):
        w = float(binom.pmf(k, rounds, rate))
        if w > _NEGLIGIBLE:
            out.append((k, w))
    return out


def participation_delta(mu: float, rounds: int, rate: float, epsilon: float) -> float:
    """Delta at ``epsilon`` of ``rounds`` rounds, each taken part in with probability ``rate``
    (data-independent coins), each taking part a ``mu``-GDP mechanism (module docstring)."""
    if rounds <= 0 or mu <= 0.0:
        return 0.0
    return sum(w * _gdp_delta(math.sqrt(k) * mu, epsilon) for k, w in _weights(rounds, rate))


def participation_mu(epsilon: float, delta: float, rounds: int, rate: float) -> float:
    """The largest per-round ``mu`` whose ``participation_delta`` at ``epsilon`` is at most
    ``delta`` (within 1e-9 relative, from below)."""
    from scipy.optimize import brentq

    def gap(mu: float) -> float:
        return participation_delta(mu, rounds, rate, epsilon) - delta

    lo, hi = 1e-3, 1.0
    while gap(hi) < 0:
        lo, hi = hi, 2.0 * hi
        if hi > MAX_MU:
            raise InfeasiblePlanError(f"epsilon={epsilon} is beyond the record-level "
                                      f"calibration's range (a round's mu over {MAX_MU:g})")
    while gap(lo) >= 0:
        if lo < 1e-12:
            raise InfeasiblePlanError(f"(epsilon={epsilon}, delta={delta}) is below what any "
                                      "Gaussian plan can calibrate to")
        lo, hi = lo / 2.0, lo
    mu = float(brentq(gap, lo, hi, xtol=1e-14, rtol=1e-12))
    while gap(mu) > 0:  # never over the target: step down until the profile confirms it
        mu *= 1.0 - 1e-9
    return mu


def participation_epsilon(mu: float, rounds: int, rate: float, delta: float) -> float:
    """The least epsilon at which ``participation_delta`` is at most ``delta``, from above:
    bisection keeps the end of the bracket the profile confirms (within 1e-10 relative)."""

    def gap(eps: float) -> float:
        return participation_delta(mu, rounds, rate, eps) - delta

    if gap(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while gap(hi) > 0:
        if hi > MAX_EPSILON:
            return math.inf
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-10 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return hi
