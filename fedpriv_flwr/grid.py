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
RDP accountant records (no Poisson amplification is claimed). The grid is fedpriv's own
(``fedpriv.privacy.grid.central_grid``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedpriv.privacy.discrete import CryptoRandom, discrete_gaussian
from fedpriv.privacy.grid import central_grid


def noisy_mean_on_grid(exact_sum: np.ndarray, denominator: float, multiplier: float,
                       sensitivity: float, rng: CryptoRandom
                       ) -> tuple[np.ndarray, dict[str, Any]]:
    """``(round(exact_sum / g) + N_Z(0, sigma^2)) g / denominator`` and the ledger entry of the
    part (its ``l2_sensitivity`` is the mean's, the grid's slack included)."""
    exact = np.asarray(exact_sum, dtype=np.float64)
    grid = central_grid(multiplier, sensitivity, max(exact.size, 1))
    g = grid.granularity
    units = np.rint(exact / g).astype(np.int64)
    noisy_sum = (units + discrete_gaussian(grid.sigma, exact.shape, rng)).astype(np.float64) * g
    return noisy_sum / denominator, {
        "mechanism": "discrete gaussian", "noise_multiplier": multiplier,
        "l2_sensitivity": grid.sensitivity / denominator, "granularity": g,
        "sigma_grid": grid.sigma, "noise_std": grid.sigma * g / denominator}
