"""Publishable noise of the Flower wrapper (``PrivateStrategy(..., secure_noise=True)``): exact
discrete Gaussian noise on a power-of-two grid, drawn from a ChaCha20 stream keyed by the OS.

As fedpriv's own publishable runs (``secure-noise = true``, docs/concepts/discrete-noise.md):
the exact sum of a part is rounded to the grid ``g Z`` (to nearest), integer noise
``N_Z(0, s^2)`` is added (``fedpriv.privacy.discrete.discrete_gaussian``, exact, from
``CryptoRandom``), and only then is the result divided by the denominator (post-processing).
Rounding moves one user's effect by less than ``g`` per coordinate, so the rounded sum's L2
sensitivity is at most ``Delta (1 + 2^-20) + g sqrt(d)`` (the grid's slack, recorded in the
ledger as the part's ``l2_sensitivity``); ``s = ceil(z (Delta_g / g))``, so the release is
``1 / (2 z^2)``-zCDP: the RDP curve of the Gaussian with multiplier ``z``, which the integer-order
RDP accountant records (no Poisson amplification is claimed). The grid is that of
``fedpriv.server.discrete.central_grid`` (a test checks they agree; this package builds on
fedpriv's privacy layer only, so the few lines are repeated here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedpriv.privacy.discrete import CryptoRandom, discrete_gaussian, power_of_two_at_most

SLACK_FACTOR = 2.0 ** 10  # the rounding slack g sqrt(d) is at most Delta / SLACK_FACTOR
MAX_SIGMA = 2 ** 24  # the largest sigma (grid units) the exact sampler takes
FLOAT_SLACK = 2.0 ** -20  # relative allowance for the float error of the exact sum


@dataclass(frozen=True)
class Grid:
    """A part's grid ``granularity``, its discrete Gaussian ``sigma`` (grid units) and the
    rounded sum's L2 ``sensitivity``."""

    granularity: float
    sigma: int
    sensitivity: float


def grid_of(multiplier: float, sensitivity: float, dim: int) -> Grid:
    """The grid of a part whose exact sum has L2 ``sensitivity`` over ``dim`` coordinates."""
    g = power_of_two_at_most(sensitivity / (SLACK_FACTOR * math.sqrt(dim)))
    while True:
        rounded = sensitivity * (1.0 + FLOAT_SLACK) + g * math.sqrt(dim)
        sigma = math.ceil(multiplier * rounded / g)
        if sigma <= MAX_SIGMA:
            return Grid(g, max(sigma, 1), rounded)
        g *= 2.0


def noisy_mean_on_grid(exact_sum: np.ndarray, denominator: float, multiplier: float,
                       sensitivity: float, rng: CryptoRandom
                       ) -> tuple[np.ndarray, dict[str, Any]]:
    """``(round(exact_sum / g) + N_Z(0, sigma^2)) g / denominator`` and the ledger entry of the
    part (its ``l2_sensitivity`` is the mean's, the grid's slack included)."""
    exact = np.asarray(exact_sum, dtype=np.float64)
    grid = grid_of(multiplier, sensitivity, max(exact.size, 1))
    g = grid.granularity
    units = np.rint(exact / g).astype(np.int64)
    noisy_sum = (units + discrete_gaussian(grid.sigma, exact.shape, rng)).astype(np.float64) * g
    return noisy_sum / denominator, {
        "mechanism": "discrete gaussian", "noise_multiplier": multiplier,
        "l2_sensitivity": grid.sensitivity / denominator, "granularity": g,
        "sigma_grid": grid.sigma, "noise_std": grid.sigma * g / denominator}
