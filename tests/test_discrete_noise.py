"""Exact discrete samplers (fedpriv.privacy.discrete): distributions against exact pmfs,
exactness of the overflow fallbacks, and input checks.

Every statistical test uses a seeded CryptoRandom (deterministic) and a fixed tolerance; the
chi-square tests come with a power check showing that a plausible wrong sampler fails them."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from fedpriv.privacy import discrete
from fedpriv.privacy.discrete import (
    CryptoRandom,
    DiscreteGaussianSource,
    bernoulli_exp,
    bernoulli_exp_fraction,
    discrete_gaussian,
    discrete_laplace,
    exact_exponential_mechanism,
    grid_integers,
    grid_scores,
    power_of_two_at_most,
    skellam,
)
from fedpriv.privacy.mechanisms import (
    exponential_log_weights,
    exponential_mechanism,
    gaussian_noise,
    symmetric_gaussian_noise,
)

P_MIN = 1e-4  # smallest accepted chi-square p-value (the draws are seeded: no flakiness)


def chi_square_p(sample: np.ndarray, support: np.ndarray, pmf: np.ndarray) -> float:
    """Chi-square p-value of integer ``sample`` against ``pmf`` on ``support`` (summing to ~1),
    with the tails (expected count < 5) merged into one bin each."""
    n = sample.size
    expected = pmf / pmf.sum() * n
    keep = expected >= 5
    lo, hi = support[keep].min(), support[keep].max()
    inner = (support >= lo) & (support <= hi)
    counts = np.array([np.sum(sample == x) for x in support[inner]], dtype=float)
    exp_inner = expected[inner]
    left, right = np.sum(sample < lo), np.sum(sample > hi)
    e_left, e_right = expected[support < lo].sum(), expected[support > hi].sum()
    obs = np.concatenate([[left], counts, [right]])
    exp = np.concatenate([[e_left], exp_inner, [e_right]])
    used = exp > 0
    assert obs[~used].sum() == 0, "draws where the pmf is zero"
    exp = exp[used] * obs[used].sum() / exp[used].sum()
    return float(stats.chisquare(obs[used], exp).pvalue)


def gaussian_pmf(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    support = np.arange(-int(40 * sigma) - 10, int(40 * sigma) + 11)
    weights = np.exp(-support.astype(float) ** 2 / (2 * sigma**2))
    return support, weights / weights.sum()


def binomial_ok(hits: np.ndarray, p: float, width: float = 5.0) -> bool:
    n = hits.size
    return abs(hits.mean() - p) <= width * math.sqrt(p * (1 - p) / n) + 1e-12


# ------------------------------------------------------------------ CryptoRandom ----

def test_unseeded_sources_differ_and_seeded_ones_repeat() -> None:
    assert not np.array_equal(CryptoRandom().uint64(4), CryptoRandom().uint64(4))
    assert np.array_equal(CryptoRandom(7).uint64(8), CryptoRandom(7).uint64(8))
    assert not np.array_equal(CryptoRandom(7).uint64(8), CryptoRandom(8).uint64(8))
    words = CryptoRandom(2**256 - 1).uint64(1000)
    assert words.dtype == np.uint64 and len(np.unique(words)) == 1000


@pytest.mark.parametrize("seed", [-1, 2**256, 1.5, True, "1"])
def test_bad_seeds(seed: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        CryptoRandom(seed)  # type: ignore[arg-type]


def test_below_is_uniform_for_a_small_bound() -> None:
    draws = CryptoRandom(1).below(np.full(70_000, 7))
    assert draws.dtype == np.int64
    assert chi_square_p(draws, np.arange(7), np.full(7, 1 / 7)) > P_MIN


def test_below_has_no_modulo_bias_for_a_large_bound() -> None:
    # m = 3 * 2^60: 2^64 mod m = 2^60, so a plain ``word % m`` puts 6/16 of the mass in the
    # first third [0, 2^60) instead of 1/3. below() must be uniform over the thirds.
    m, n = 3 << 60, 30_000
    thirds = CryptoRandom(2).below(np.full(n, m, np.uint64)) >> 60
    assert chi_square_p(thirds, np.arange(3), np.full(3, 1 / 3)) > P_MIN
    naive = (CryptoRandom(2).uint64(n) % np.uint64(m)) >> np.uint64(60)  # the power check
    assert chi_square_p(naive.astype(np.int64), np.arange(3), np.full(3, 1 / 3)) < 1e-10


def test_below_per_entry_bounds_and_extremes() -> None:
    rng = CryptoRandom(3)
    m = np.tile(np.array([1, 2, 5, 2**62]), 20_000)
    draws = rng.below(m).reshape(-1, 4)
    assert np.all(draws[:, 0] == 0) and np.all((draws >= 0) & (draws < m[:4]))
    assert binomial_ok(draws[:, 1] == 1, 0.5) and binomial_ok(draws[:, 3] >= 2**61, 0.5)
    assert binomial_ok(draws[:, 2] == 4, 0.2)
    assert rng.below(np.array([[3, 4]])).shape == (1, 2)


@pytest.mark.parametrize("m", [[0], [-3], [2**62 + 1], [1.0, 2.0]])
def test_below_rejects_bad_bounds(m: list[float]) -> None:
    with pytest.raises((TypeError, ValueError)):
        CryptoRandom(0).below(np.array(m))


@pytest.mark.parametrize("shift", [60, 100])  # one buffered word; several words
def test_below_int_is_uniform(shift: int) -> None:
    rng, m = CryptoRandom(4), 3 << shift
    thirds = np.array([rng.below_int(m) >> shift for _ in range(9000)])
    assert chi_square_p(thirds, np.arange(3), np.full(3, 1 / 3)) > P_MIN
    with pytest.raises(ValueError):
        rng.below_int(0)


# --------------------------------------------------------------- bernoulli_exp ----

@pytest.mark.parametrize("num,den", [
    (1, 3), (3, 3), (5, 2), (7, 3), (23, 10), (9, 1),
    (2**61, 2**62),        # den*K passes 2^62 at K = 2: the exact Python-int continuation
    (2**62 - 1, 2**62),    # gamma just below 1, the same continuation
    (2**62 + 2**60 + 5, 2**62),  # gamma > 1 with the largest denominator
])
def test_bernoulli_exp_frequencies(num: int, den: int) -> None:
    hits = bernoulli_exp(np.full(200_000, num, np.int64), np.int64(den), CryptoRandom(num % 97))
    assert hits.dtype == np.bool_
    assert binomial_ok(hits, math.exp(-num / den))


def test_bernoulli_exp_certain_and_impossible_cases() -> None:
    rng = CryptoRandom(5)
    assert bernoulli_exp(np.zeros(1000, np.int64), np.int64(7), rng).all()
    huge = np.full(1000, np.iinfo(np.int64).max, np.int64)  # gamma ~ 9e18: never true
    assert not bernoulli_exp(huge, np.int64(1), rng).any()
    shaped = bernoulli_exp(np.arange(3).reshape(3, 1), np.arange(1, 5).reshape(1, 4), rng)
    assert shaped.shape == (3, 4) and shaped[0].all()


@pytest.mark.parametrize("num,den", [(-1, 1), (1, 0), (1, -2), (1, 2**62 + 1), (0.5, 1)])
def test_bernoulli_exp_rejects_bad_inputs(num: float, den: float) -> None:
    with pytest.raises((TypeError, ValueError)):
        bernoulli_exp(np.array([num]), np.array([den]), CryptoRandom(0))


def test_bernoulli_exp_fraction() -> None:
    rng = CryptoRandom(6)
    for gamma in (Fraction(1, 3), Fraction(7, 3), Fraction(2**200 + 1, 2**201)):
        hits = np.array([bernoulli_exp_fraction(gamma, rng) for _ in range(20_000)])
        assert binomial_ok(hits, math.exp(-float(gamma))), gamma
    assert all(bernoulli_exp_fraction(Fraction(0), rng) for _ in range(100))
    assert not any(bernoulli_exp_fraction(Fraction(10**400, 3), rng) for _ in range(100))
    with pytest.raises(ValueError):
        bernoulli_exp_fraction(Fraction(-1, 2), rng)


# ----------------------------------------------------- Laplace, Gaussian, Skellam ----

@pytest.mark.parametrize("t", [1, 5])
def test_discrete_laplace_pmf(t: int) -> None:
    draws = discrete_laplace(t, 100_000, CryptoRandom(10 + t))
    support = np.arange(-40 * t, 40 * t + 1)
    assert draws.dtype == np.int64
    assert chi_square_p(draws, support, np.exp(-np.abs(support) / t)) > P_MIN


@pytest.mark.parametrize("t", [0, -1, 2**31 + 1, 1.5])
def test_discrete_laplace_rejects_bad_scales(t: float) -> None:
    with pytest.raises((TypeError, ValueError)):
        discrete_laplace(t, 10, CryptoRandom(0))  # type: ignore[arg-type]


@pytest.mark.parametrize("sigma", [1, 3, 50])
def test_discrete_gaussian_pmf(sigma: int) -> None:
    draws = discrete_gaussian(sigma, 200_000, CryptoRandom(sigma))
    assert draws.dtype == np.int64 and draws.shape == (200_000,)
    assert chi_square_p(draws, *gaussian_pmf(sigma)) > P_MIN


def test_the_pmf_test_rejects_a_rounded_continuous_gaussian() -> None:
    rounded = np.rint(np.random.default_rng(0).standard_normal(200_000)).astype(np.int64)
    assert chi_square_p(rounded, *gaussian_pmf(1)) < 1e-10


@pytest.mark.parametrize("sigma", [1, 3])
def test_discrete_gaussian_python_int_fallback_is_exact(
        sigma: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Route every draw with |Y| != sigma through the Python-int acceptance (in real use only
    # ||Y| - sigma| >= 2^31 goes there): the distribution must not change.
    monkeypatch.setattr(discrete, "_MAX_SQUARE_ROOT", 1)
    draws = discrete_gaussian(sigma, 40_000, CryptoRandom(12))
    assert chi_square_p(draws, *gaussian_pmf(sigma)) > P_MIN


def test_discrete_gaussian_moments_at_large_sigma() -> None:
    sigma, n = 2**20, 200_000
    draws = discrete_gaussian(sigma, (n // 2, 2), CryptoRandom(13))
    assert draws.shape == (n // 2, 2) and draws.dtype == np.int64
    assert abs(draws.mean()) < 5 * sigma / math.sqrt(n)
    assert abs(draws.astype(float).var() / sigma**2 - 1) < 5 * math.sqrt(2 / n)


def test_discrete_gaussian_at_the_largest_sigma() -> None:
    sigma, n = 2**24, 100_000
    draws = discrete_gaussian(sigma, n, CryptoRandom(14))
    assert draws.dtype == np.int64 and np.abs(draws).max() < 10 * sigma
    assert abs(draws.astype(float).var() / sigma**2 - 1) < 5 * math.sqrt(2 / n)
    assert len(np.unique(draws)) > 0.99 * n  # genuinely fine-grained, not a coarse lattice


@pytest.mark.parametrize("sigma", [0, -3, 2**24 + 1])
def test_discrete_gaussian_rejects_sigma_out_of_range(sigma: int) -> None:
    with pytest.raises(ValueError, match="sigma"):
        discrete_gaussian(sigma, 3, CryptoRandom(0))
    with pytest.raises(ValueError, match="sigma"):
        DiscreteGaussianSource(sigma, CryptoRandom(0))
    with pytest.raises(TypeError, match="sigma"):
        discrete_gaussian(2.0, 3, CryptoRandom(0))  # type: ignore[arg-type]


@pytest.mark.parametrize("mu", [10.0, 2.0**40])
def test_skellam_moments(mu: float) -> None:
    n = 200_000
    draws = skellam(mu, (n,), CryptoRandom(15))
    assert draws.dtype == np.int64
    assert abs(draws.mean()) < 5 * math.sqrt(mu / n)
    assert abs(draws.astype(float).var() / mu - 1) < 5 * math.sqrt(2 / n)
    assert np.array_equal(skellam(mu, 5, CryptoRandom(1)), skellam(mu, 5, CryptoRandom(1)))


@pytest.mark.parametrize("mu", [0.0, -1.0, math.nan, math.inf])
def test_skellam_rejects_bad_mu(mu: float) -> None:
    with pytest.raises(ValueError):
        skellam(mu, 3, CryptoRandom(0))


# ------------------------------------------------- the Generator stand-in, grids ----

@pytest.mark.parametrize("granularity", [2.0**-10, 0.37])
def test_source_in_the_existing_noise_hooks(granularity: float) -> None:
    sigma = 2**20
    source = DiscreteGaussianSource(sigma, CryptoRandom(16))
    noise = gaussian_noise((300, 7), sigma * granularity, source)  # type: ignore[arg-type]
    k = grid_integers(noise, granularity)
    assert np.array_equal(k, discrete_gaussian(sigma, (300, 7), CryptoRandom(16)))
    sym = symmetric_gaussian_noise(6, sigma * granularity, source)  # type: ignore[arg-type]
    assert np.array_equal(sym, sym.T)
    assert grid_integers(sym, granularity).dtype == np.int64


def test_source_refuses_gumbel() -> None:
    source = DiscreteGaussianSource(4, CryptoRandom(0))
    assert source.standard_normal().shape == ()
    with pytest.raises(NotImplementedError, match="exact_exponential_mechanism"):
        source.gumbel(size=3)
    with pytest.raises(NotImplementedError):
        exponential_mechanism(np.zeros(3), 1.0, 1.0, source)  # type: ignore[arg-type]


def test_grid_integers_rejects_off_grid_noise() -> None:
    assert np.array_equal(grid_integers(np.array([0.5, -1.0]), 0.5), [1, -2])
    with pytest.raises(ValueError, match="off the grid"):
        grid_integers(np.array([0.5, 0.3]), 0.5)
    for bad in (np.array([np.inf]), np.array([np.nan])):
        with pytest.raises(ValueError):
            grid_integers(bad, 0.5)
    with pytest.raises(ValueError):
        grid_integers(np.zeros(2), 0.0)


def test_power_of_two_at_most() -> None:
    cases = {1.0: 1.0, 3.0: 2.0, 0.75: 0.5, 0.3: 0.25, 1e308: 2.0**1023, 5e-324: 5e-324,
             2.0**-1030 * 3: 2.0**-1029}
    for x, expected in cases.items():
        assert power_of_two_at_most(x) == expected
    for x in np.random.default_rng(0).lognormal(0, 30, 1000):
        p = power_of_two_at_most(float(x))
        assert p <= x < 2 * p and math.frexp(p)[0] == 0.5
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            power_of_two_at_most(bad)


def test_grid_scores() -> None:
    scores = np.random.default_rng(1).normal(0, 10, 1000)
    g = 2.0**-3
    rounded = grid_scores(scores, g)
    assert np.all(np.abs(rounded - scores) <= g / 2) and np.all(rounded / g == np.rint(rounded / g))
    with pytest.raises(ValueError):
        grid_scores(scores, 0.3)
    with pytest.raises(ValueError):
        grid_scores(np.array([np.nan]), g)


# ------------------------------------------------ exact exponential mechanism ----

def test_exact_exponential_mechanism_matches_the_softmax() -> None:
    scores, epsilon, sensitivity = np.array([0.0, 0.5, 1.0, 2.0, 0.25]), 2.0, 1.0
    rng = CryptoRandom(17)
    draws = np.array([exact_exponential_mechanism(scores, epsilon, sensitivity, rng)
                      for _ in range(30_000)])
    pmf = np.exp(exponential_log_weights(scores, epsilon, sensitivity))
    assert chi_square_p(draws, np.arange(5), pmf) > P_MIN
    uniform = np.random.default_rng(0).integers(0, 5, 30_000)  # the power check
    assert chi_square_p(uniform, np.arange(5), pmf) < 1e-10


def test_exact_exponential_mechanism_with_huge_score_gaps() -> None:
    rng = CryptoRandom(18)
    scores = np.array([1e308, -1e308, 0.0, 5e307])
    assert {exact_exponential_mechanism(scores, 1.0, 1e-300, rng) for _ in range(200)} == {1}
    tied = np.array([0.0, 1e300, 0.0])
    draws = np.array([exact_exponential_mechanism(tied, 1.0, 1.0, rng) for _ in range(4000)])
    assert set(draws) == {0, 2} and binomial_ok(draws == 0, 0.5)
    assert 0 <= exact_exponential_mechanism(np.arange(10.0), 1.0, 1.0) < 10  # OS-keyed source


@pytest.mark.parametrize("scores,epsilon,sensitivity", [
    ([0.0, math.nan], 1.0, 1.0), ([0.0, math.inf], 1.0, 1.0), ([], 1.0, 1.0),
    ([0.0, 1.0], 0.0, 1.0), ([0.0, 1.0], math.nan, 1.0), ([0.0, 1.0], math.inf, 1.0),
    ([0.0, 1.0], 1.0, -1.0), ([0.0, 1.0], 1.0, 0.0),
])
def test_exact_exponential_mechanism_rejects_bad_inputs(
        scores: list[float], epsilon: float, sensitivity: float) -> None:
    with pytest.raises(ValueError):
        exact_exponential_mechanism(np.array(scores), epsilon, sensitivity, CryptoRandom(0))
