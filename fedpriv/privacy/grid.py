"""The power-of-two grid of discrete noise: a part's granularity, and a publishable part's
integer sigma and rounded sensitivity (``fedpriv.server.discrete`` explains the bounds; the
Flower wrapper's publishable noise uses the same rule, ``fedpriv_flwr.grid``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedpriv.privacy.discrete import MAX_SIGMA, power_of_two_at_most

# the grid: rounding slack sqrt(d) g at most 1 / SLACK_FACTOR of the sensitivity
SLACK_FACTOR = 2.0 ** 10
# relative allowance for floating-point error in a sum (and a node's rotation)
FLOAT_SLACK = 2.0 ** -20


def granularity(sensitivity: float, dim: int) -> float:
    """The power-of-two grid of a part whose sum has L2 ``sensitivity``: the rounding slack
    ``g sqrt(dim)`` is at most ``sensitivity / SLACK_FACTOR``."""
    return power_of_two_at_most(sensitivity / (SLACK_FACTOR * math.sqrt(dim)))


@dataclass(frozen=True)
class CentralGrid:
    """A publishable part: grid ``granularity``, discrete Gaussian ``sigma`` (grid units) and
    the rounded sum's L2 sensitivity (``sensitivity + granularity sqrt(d)``)."""

    granularity: float
    sigma: int
    sensitivity: float


def central_grid(multiplier: float, sensitivity: float, dim: int) -> CentralGrid:
    """The grid and the integer sigma of one publishable part (``sigma <= MAX_SIGMA``: the
    grid is made coarser until it fits)."""
    g = granularity(sensitivity, dim)
    while True:  # FLOAT_SLACK: the float error of the sum (n C 2^-52 <= C 2^-20, n <= 2^32)
        rounded = sensitivity * (1.0 + FLOAT_SLACK) + g * math.sqrt(dim)
        sigma = math.ceil(multiplier * rounded / g)
        if sigma <= MAX_SIGMA:
            return CentralGrid(g, max(sigma, 1), rounded)
        g *= 2.0
