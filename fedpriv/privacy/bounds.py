"""Closed-form privacy bounds: Gaussian DP (Dong, Roth & Su 2019) and the Skellam mechanism's
zCDP bound (Agarwal, Kairouz & Liu 2021)."""

from __future__ import annotations

import math

from fedpriv.config import NEIGHBOURING_RELATIONS


class InfeasiblePlanError(ValueError):
    """The requested privacy plan cannot meet its target."""


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu at which a mu-GDP mechanism is exactly (epsilon, delta)-DP (Dong, Roth & Su)."""
    return _gdp_mu(epsilon, delta)


def _gdp_delta(mu: float, eps: float) -> float:
    """Delta at ``eps`` of a mu-GDP mechanism (Dong, Roth & Su 2019, Cor. 2.13)."""
    from scipy.stats import norm

    second = eps + norm.logcdf(-eps / mu - mu / 2)  # log of e^eps Phi(.), overflow-free
    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(min(second, 700.0)))


def _gdp_mu(epsilon: float, delta: float) -> float:
    """The mu at which a mu-GDP mechanism is exactly (epsilon, delta)-DP."""
    from scipy.optimize import brentq

    lo, hi = 1e-3, 1.0
    while _gdp_delta(hi, epsilon) < delta:
        lo, hi = hi, 2.0 * hi
    while _gdp_delta(lo, epsilon) >= delta:  # tiny targets need a tiny mu
        if lo < 1e-12:
            raise InfeasiblePlanError(f"(epsilon={epsilon}, delta={delta}) is below what any "
                                      "Gaussian plan can calibrate to")
        lo, hi = lo / 2.0, lo
    return float(brentq(lambda mu: _gdp_delta(mu, epsilon) - delta, lo, hi, xtol=1e-12,
                        rtol=1e-13))


def _gdp_epsilon(mu: float, delta: float) -> float:
    """Epsilon at ``delta`` of a mu-GDP mechanism."""
    from scipy.optimize import brentq

    def gap(eps: float) -> float:
        return _gdp_delta(mu, eps) - delta

    hi = 1.0
    while gap(hi) > 0:
        if hi > 1e4:
            return math.inf
        hi *= 2.0
    return 0.0 if gap(0.0) <= 0 else brentq(gap, 0.0, hi, xtol=1e-9)


def skellam_rho(l2: float, l1: float, variance: float) -> float:
    """The rho of a zCDP bound that covers the Skellam mechanism at every integer order >= 2.

    Agarwal, Kairouz & Liu (2021), multi-dimensional Skellam, noise ``Poisson(mu/2) -
    Poisson(mu/2)`` per coordinate (``variance`` = mu), integer sensitivities ``l2``, ``l1``:
    ``eps(a) <= a l2^2 / (2 mu) + ((2a - 1) l2^2 + 6 l1) / (4 mu^2)`` for integer ``a > 1``
    (their bound is the minimum of this term and ``3 l1 / (2 mu)``; the first is used). That is
    ``a rho' + xi`` with ``rho' = l2^2 / (2 mu) + l2^2 / (2 mu^2)`` and
    ``xi = (6 l1 - l2^2) / (4 mu^2)``; as ``xi <= a xi / 2`` for ``a >= 2``, the release is
    ``(rho' + max(xi, 0) / 2)``-zCDP on the integer orders the accountant evaluates."""
    if not (l2 > 0 and l1 > 0 and variance > 0):
        raise ValueError(f"Skellam bound needs l2, l1, variance > 0, got {l2}, {l1}, {variance}")
    mu = variance
    return l2 ** 2 / (2 * mu) + l2 ** 2 / (2 * mu ** 2) + max(6 * l1 - l2 ** 2, 0.0) / (
        8 * mu ** 2)


def mean_sensitivity(clip_norm: float, population: int, relation: str) -> float:
    """L2 sensitivity of ``sum_i clip(g_i, clip_norm) / population`` with ``population`` fixed.

    Adding or removing one user moves the sum by at most ``clip_norm``; replacing one user moves
    it by at most ``2 clip_norm`` (the two clipped contributions may point in opposite ways).
    """
    if relation not in NEIGHBOURING_RELATIONS:
        raise ValueError(f"neighbouring relation must be one of {NEIGHBOURING_RELATIONS}")
    factor = 1.0 if relation == "add-remove" else 2.0
    return factor * clip_norm / population
