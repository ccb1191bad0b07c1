"""Private selection: the best of a random number of private runs (Papernot & Steinke, ICLR 2022,
"Hyperparameter Tuning with Renyi Differential Privacy").

Tuning runs candidate configurations of a private algorithm on the same users and keeps the
best. Run once each and composed, K candidates cost K runs' budget. Papernot & Steinke's random
stopping costs far less: draw the number of runs K from a distribution, run K candidates (each
one a fresh draw from the search space), and release **only** the best by its (private) score.
If one candidate, a random configuration from the space followed by its run, is ``(lambda,
eps(lambda))``-RDP at every order, the selection is ``(lambda, eps'(lambda))``-RDP with

* K truncated negative binomial, shape ``eta >= 0`` (``eta = 0``: logarithmic, ``eta = 1``:
  geometric), ``gamma`` solved from the mean (their Theorem 2)::

      eps'(lambda) = eps(lambda) + log(E[K]) / (lambda - 1)
                     + (1 + eta) * min over lambda_hat of [(1 - 1/lambda_hat) eps(lambda_hat)
                                                           + log(1/gamma) / lambda_hat]

* K Poisson with mean mu (their Theorem 6), with ``eps_hat = log(1 + 1/(lambda - 1))`` and
  ``delta_hat`` the delta of one candidate at ``eps_hat``::

      eps'(lambda) = eps(lambda) + mu * delta_hat + log(mu) / (lambda - 1)

and RDP is monotone in the order, so each order also takes the smallest bound of the orders above
it. The bound is then converted to (epsilon, delta) with the conversion dp-accounting's RDP
accountant uses (Canonne, Kamath & Steinke 2020, Prop. 12).

One candidate's curve ``eps(lambda)``: each configuration of the space has a privacy plan (its
releases and their noise multipliers, calibrated before anything runs); dp-accounting's RDP
accountant gives that plan's curve. A candidate draws its configuration from the space, so its
output distribution is a mixture over configurations with data-independent weights, and Renyi
divergence is jointly quasi-convex (van Erven & Harremoes 2014, Thm. 13): the mixture's curve is
at most the pointwise maximum of the configurations' curves, which is what is used.

What must stay secret for the bound to hold: everything about the runs that were not selected,
and K itself (given K, the best of K costs about K times more). ``fedpriv tune`` therefore puts
the candidates' table in the operator report only; the release holds the winner alone.

The plain baseline (every candidate run once, nothing secret) is accounted by composing every
candidate's plan with the tight PLD accountant (``fedpriv.privacy.accounting``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import dp_accounting
import numpy as np
import numpy.typing as npt
from dp_accounting import rdp

from fedpriv.privacy.accounting import EventKey, InfeasiblePlanError, composed_event

# An RDP curve (or its orders): a sequence of floats or a float64 array.
Curve = Sequence[float] | npt.NDArray[np.float64]

# RDP orders: dp-accounting's defaults, with more resolution between 1 and 3 and up to 4096
# (small epsilons want large orders; the selection's log(E[K]) / (lambda - 1) wants them too).
ORDERS: tuple[float, ...] = tuple(sorted(set(
    [1.0 + x / 100.0 for x in range(2, 200, 2)]
    + list(rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    + [1536.0, 2048.0, 3072.0, 4096.0])))

_ADD_OR_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE  # see make_accountant
DISTRIBUTIONS = ("logarithmic", "geometric", "truncated-negative-binomial", "poisson")


@dataclass(frozen=True)
class Repetitions:
    """The distribution of the number K of candidates: a truncated negative binomial with shape
    ``eta >= 0`` on {1, 2, ...} (``eta = 0``: logarithmic; ``eta = 1``: geometric), or Poisson
    (``eta = inf``; K may then be 0: nothing runs and nothing is released), with mean ``mean``."""

    eta: float
    mean: float

    def __post_init__(self) -> None:
        if math.isnan(self.eta) or self.eta < 0:
            raise InfeasiblePlanError(f"the shape eta of the number of candidates must be >= 0 "
                                      f"(or inf for Poisson), got {self.eta}")
        if not (math.isfinite(self.mean) and self.mean > 1.0):
            raise InfeasiblePlanError(f"the expected number of candidates must be a finite "
                                      f"number > 1, got {self.mean}")

    @classmethod
    def named(cls, name: str, mean: float, eta: float | None = None) -> Repetitions:
        shapes = {"logarithmic": 0.0, "geometric": 1.0, "poisson": math.inf}
        if name == "truncated-negative-binomial":
            if eta is None:
                raise InfeasiblePlanError("a truncated-negative-binomial number of candidates "
                                          "needs its shape eta")
            return cls(float(eta), mean)
        if name not in shapes:
            raise InfeasiblePlanError(f"unknown distribution {name!r}; expected one of "
                                      f"{DISTRIBUTIONS}")
        return cls(shapes[name], mean)

    @property
    def poisson(self) -> bool:
        return math.isinf(self.eta)

    @cached_property
    def gamma(self) -> float:
        """The TNB parameter gamma in (0, 1) with ``E[K] = mean`` (mean decreases in gamma)."""
        if self.poisson:
            raise ValueError("a Poisson number of candidates has no gamma")
        if self.eta == 1.0:
            return 1.0 / self.mean
        lo, hi = 1e-300, 1.0 - 1e-15
        for _ in range(200):
            mid = math.sqrt(lo * hi) if hi / lo > 4 else 0.5 * (lo + hi)
            if tnb_mean(self.eta, mid) > self.mean:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-15 * hi:
                break
        return hi  # conservative: the mean at hi is <= the target, log(1/gamma) is not overstated

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if self.poisson:
            return math.exp(-self.mean + k * math.log(self.mean) - math.lgamma(k + 1))
        if k < 1:
            return 0.0
        g, eta = self.gamma, self.eta
        if eta == 0.0:
            return math.exp(k * math.log1p(-g) - math.log(k) - math.log(math.log(1.0 / g)))
        # prod_{l < k} (l + eta) / (l + 1) = Gamma(k + eta) / (Gamma(eta) Gamma(k + 1))
        log_terms = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1)
        return math.exp(k * math.log1p(-g) + log_terms
                        - math.log(math.expm1(-eta * math.log(g))))  # gamma^-eta - 1

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of K (inverse CDF over the pmf; exact up to float rounding)."""
        if self.poisson:
            return int(rng.poisson(self.mean))
        u, k, p = rng.random(), 1, self.pmf(1)
        cdf, g = p, self.gamma
        while u > cdf and k < 1_000_000:  # P[k+1] / P[k] = (1 - gamma) (k + eta) / (k + 1)
            p *= (1.0 - g) * (k + self.eta) / (k + 1)
            cdf += p
            k += 1
        return k

    def describe(self) -> str:
        if self.poisson:
            return f"Poisson(mean {self.mean:g})"
        name = {0.0: "logarithmic", 1.0: "geometric"}.get(self.eta, "truncated negative "
                                                        f"binomial (eta {self.eta:g})")
        return f"{name} (mean {self.mean:g}, gamma {self.gamma:.6g})"


def tnb_mean(eta: float, gamma: float) -> float:
    """E[K] of the truncated negative binomial with shape ``eta`` and parameter ``gamma``
    (Papernot & Steinke, Definition 1)."""
    if eta == 0.0:
        return (1.0 / gamma - 1.0) / math.log(1.0 / gamma)
    # 1 - gamma^eta, accurate for small eta
    return eta * (1.0 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


def plan_rdp(counts: Mapping[EventKey, int], relation: str = "add-remove",
             orders: Sequence[float] = ORDERS) -> np.ndarray:
    """The RDP curve (one epsilon per order) of one run's composed Gaussian releases, from
    dp-accounting's RDP accountant (same events, same multiplier convention as the run's own
    accountant; see ``fedpriv.privacy.accounting.make_accountant``)."""
    if any(q == 0.0 for _, q in counts):
        raise InfeasiblePlanError("private selection needs Gaussian releases: a pure epsilon-DP "
                                  "(exponential mechanism) plan has no RDP curve here")
    sampled = any(q < 1.0 for _, q in counts)
    if sampled and relation == "replace-one":
        raise InfeasiblePlanError("dp-accounting's RDP accountant has no Poisson-sampling "
                                  "analysis under replace-one; tune under add-remove")
    accountant = rdp.RdpAccountant(orders=list(orders), neighboring_relation=_ADD_OR_REMOVE)
    accountant.compose(composed_event(counts, relation))
    return np.asarray(accountant.rdp, dtype=np.float64)


def repeat_and_select_rdp(curve: Curve, repetitions: Repetitions,
                          orders: Sequence[float] = ORDERS) -> np.ndarray:
    """The RDP curve of releasing the best of K runs, K ~ ``repetitions``, each run with RDP
    curve ``curve`` (Papernot & Steinke, Theorems 2 and 6; see the module docstring)."""
    lam = np.asarray(orders, dtype=np.float64)
    eps = np.asarray(curve, dtype=np.float64)
    if lam.shape != eps.shape or np.any(lam <= 1.0) or np.any(np.diff(lam) <= 0):
        raise ValueError("orders must be increasing, > 1, and match the curve")
    mean = repetitions.mean
    if repetitions.poisson:
        out = np.empty_like(eps)
        for i, order in enumerate(lam):
            eps_hat = math.log1p(1.0 / (order - 1.0))
            delta_hat = rdp_delta(eps, lam, eps_hat)
            out[i] = eps[i] + mean * delta_hat + math.log(mean) / (order - 1.0)
    else:
        log_inv_gamma = math.log(1.0 / repetitions.gamma)
        constant = (1.0 + repetitions.eta) * float(np.min((1.0 - 1.0 / lam) * eps
                                                          + log_inv_gamma / lam))
        out = eps + math.log(mean) / (lam - 1.0) + constant
    # monotone in the order: a lower order is bounded by every higher order's bound
    return np.minimum.accumulate(out[::-1])[::-1]


def rdp_delta(curve: Curve, orders: Curve, epsilon: float) -> float:
    """Delta at ``epsilon`` from an RDP curve (dp-accounting's conversion)."""
    delta, _ = rdp.rdp_privacy_accountant.compute_delta(list(orders), list(curve), epsilon)
    return float(delta)


def rdp_epsilon(curve: Curve, delta: float,
                orders: Sequence[float] = ORDERS) -> tuple[float, float]:
    """(epsilon at ``delta``, the optimal order) from an RDP curve (dp-accounting's conversion,
    Canonne, Kamath & Steinke 2020, Prop. 12)."""
    eps, order = rdp.compute_epsilon(list(orders), list(curve), delta)
    return float(eps), float(order)


def selection_epsilon(curves: Sequence[Curve], repetitions: Repetitions, delta: float,
                      orders: Sequence[float] = ORDERS) -> tuple[float, float]:
    """(epsilon, optimal order) at ``delta`` of the random-stopping selection whose candidates
    are drawn from configurations with these RDP curves (their pointwise maximum bounds a
    candidate; see the module docstring)."""
    if not curves:
        raise InfeasiblePlanError("a selection needs at least one candidate configuration")
    worst = np.max(np.asarray(curves, dtype=np.float64), axis=0)
    return rdp_epsilon(repeat_and_select_rdp(worst, repetitions, orders), delta, orders)
