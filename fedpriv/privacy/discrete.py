"""Exact discrete noise from a cryptographic random source.

Floating-point samplers (``numpy``'s ``standard_normal``, ``gumbel``) leak through the gaps and
rounding of their support (Mironov 2012), and a non-cryptographic generator's stream can be
predicted from its outputs. Everything here draws only uniform *integers* from ChaCha20
(``randomgen.ChaCha``, 20 rounds, a 256-bit key from the operating system) and turns them into
the target distribution with integer arithmetic, so the output distribution is *exactly* the
one the accounting assumes:

* ``bernoulli_exp``: Bernoulli(exp(-gamma)) for rational gamma, Canonne, Kamath & Steinke 2020,
  "The Discrete Gaussian for Differential Privacy" (CKS), Algorithm 1;
* ``discrete_laplace``: CKS Algorithm 2; ``discrete_gaussian``: CKS Algorithm 3 (the discrete
  Gaussian N_Z(0, sigma^2), as used with secure aggregation by Kairouz, Liu & Steinke 2021,
  "The Distributed Discrete Gaussian Mechanism for Federated Learning with Secure
  Aggregation");
* ``skellam``: the Skellam mechanism (Agarwal, Kairouz & Liu 2021), integer-valued but drawn
  with numpy's floating-point Poisson sampler (see its docstring);
* ``exact_exponential_mechanism``: the exponential mechanism by uniform proposal and exact
  rejection on the rational values of the float inputs (cf. Ilvento 2020, "Implementing the
  Exponential Mechanism with Base-2 Differential Privacy", on the float pitfalls it avoids).

Arithmetic stays within int64 on the vectorized paths (ranges are documented per function);
the astronomically rare draws that would leave them continue exactly on Python integers.
"""

from __future__ import annotations

import math
import secrets
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt
from randomgen import ChaCha  # type: ignore[import-untyped, unused-ignore]

Shape = int | tuple[int, ...]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

MAX_BOUND = 1 << 62  # largest modulus for CryptoRandom.below and den * K in bernoulli_exp
MAX_SIGMA = 1 << 24  # largest discrete Gaussian sigma (keeps every vectorized product < 2^63)
_MAX_SCALE = 1 << 31  # largest discrete Laplace scale t; X = U + t * V stays < 2^62 + 2^31
_MAX_SQUARE_ROOT = 1 << 31  # |a| below this: a * a < 2^62 fits int64


class CryptoRandom:
    """A cryptographically secure random source: ChaCha20 (20 rounds) keyed with 256 bits.

    ``CryptoRandom()`` takes its key from ``secrets`` (the operating system's CSPRNG): the only
    form to use for a published release. ``CryptoRandom(seed)`` uses the integer ``seed``
    (0 <= seed < 2^256) directly as the key: reproducible, for TESTS ONLY, never for a release
    (anyone knowing the seed can subtract the noise).
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is None:
            key = secrets.randbits(256)
        else:
            if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
                raise TypeError(f"CryptoRandom seed must be an int or None, got {seed!r}")
            key = int(seed)
            if not 0 <= key < 1 << 256:
                raise ValueError(f"CryptoRandom seed must be in [0, 2^256), got {seed}")
        self._bits = ChaCha(key=key, counter=0, rounds=20)
        self.generator = np.random.Generator(self._bits)
        """The numpy Generator on the same ChaCha20 stream (for Poisson draws)."""
        self._pool: list[int] = []

    def uint64(self, n: int) -> npt.NDArray[np.uint64]:
        """``n`` raw uniform 64-bit words of the ChaCha20 stream."""
        words: npt.NDArray[np.uint64] = np.asarray(self._bits.random_raw(int(n)), np.uint64)
        return words

    def below(self, m: npt.ArrayLike) -> IntArray:
        """Exact uniform integers in [0, m_i) per entry, for integer 1 <= m_i <= 2^62.

        Rejection sampling: a 64-bit word u is kept only when u >= 2^64 mod m; the kept range
        [2^64 mod m, 2^64) holds a whole number of periods of m, so u mod m is exactly uniform
        (no modulo bias). Each word is kept with probability > 3/4; only rejected entries are
        redrawn."""
        bound = _integer_array(m, "below: m")
        if bound.size and (bound.min() < 1 or bound.max() > MAX_BOUND):
            raise ValueError(f"below: m must be in [1, 2^62], got range "
                             f"[{bound.min()}, {bound.max()}]")
        return _below(self, bound.astype(np.uint64).ravel()).reshape(bound.shape)

    def word(self) -> int:
        """One raw 64-bit word as a Python int (buffered: for the scalar, exact-int paths)."""
        if not self._pool:
            self._pool = self._bits.random_raw(256).tolist()
        word: int = self._pool.pop()
        return word

    def below_int(self, m: int) -> int:
        """One exact uniform integer in [0, m) for any Python int m >= 1 (no size limit).
        m <= 2^64: one word u, kept when u >= 2^64 mod m, then u mod m (as ``below``).
        Larger m: just enough words, masked to m - 1's bit length, redrawn when >= m
        (kept with probability > 1/2)."""
        if m < 1:
            raise ValueError(f"below_int: m must be >= 1, got {m}")
        if m <= 1 << 64:
            threshold = (1 << 64) % m
            while True:
                u = self.word()
                if u >= threshold:
                    return u % m
        bits = (m - 1).bit_length()
        while True:
            value = 0
            for _ in range(-(-bits // 64)):
                value = (value << 64) | self.word()
            value &= (1 << bits) - 1
            if value < m:
                return value


def _integer_array(values: npt.ArrayLike, what: str) -> IntArray:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{what} exceeds int64")
    return array.astype(np.int64)


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _below(rng: CryptoRandom, m: npt.NDArray[np.uint64]) -> IntArray:
    """``CryptoRandom.below`` without the checks: 1-D uint64 m in [1, 2^62]."""
    threshold = (np.uint64(0) - m) % m  # 2^64 mod m, in wrapping uint64 arithmetic
    words = rng.uint64(m.size)
    kept = words >= threshold
    out = (words % m).astype(np.int64)
    todo = np.flatnonzero(~kept)
    while todo.size:  # rare: each word is rejected with probability < 1/4
        words = rng.uint64(todo.size)
        kept = words >= threshold[todo]
        out[todo[kept]] = (words[kept] % m[todo[kept]]).astype(np.int64)
        todo = todo[~kept]
    return out


def _below_scalar(rng: CryptoRandom, m: int, n: int) -> IntArray:
    """``n`` exact uniform integers in [0, m) for one bound 1 <= m <= 2^62 (as ``below``)."""
    threshold = np.uint64((1 << 64) % m)
    out = np.empty(n, np.int64)
    todo = np.arange(n)
    while todo.size:
        words = rng.uint64(todo.size)
        kept = words >= threshold
        out[todo[kept]] = (words[kept] % np.uint64(m)).astype(np.int64)
        todo = todo[~kept]
    return out


def _random_bits(rng: CryptoRandom, n: int) -> BoolArray:
    """``n`` fair coins, 64 per ChaCha word."""
    words = rng.uint64(-(-n // 64))
    bits: BoolArray = np.unpackbits(words.view(np.uint8))[:n].astype(np.bool_)
    return bits


def _bernoulli_exp_minus_one(n: int, rng: CryptoRandom) -> BoolArray:
    """``n`` exact Bernoulli(exp(-1)) draws: CKS Algorithm 1 at gamma = 1, where A_K ~
    Bernoulli(1/K) = (below(K) == 0) and A_1 = 1 surely (so the loop starts at K = 2)."""
    out = np.empty(n, np.bool_)
    todo = np.arange(n)
    k = 2
    while todo.size:
        going_on = _below_scalar(rng, k, todo.size) == 0
        out[todo[~going_on]] = k % 2 == 1
        todo = todo[going_on]
        k += 1
    return out


def _bernoulli_exp_unit_int(num: int, den: int, rng: CryptoRandom, k: int = 1) -> bool:
    """CKS Algorithm 1 for gamma = num/den in [0, 1] on Python ints, from loop index k: draw
    A_k ~ Bernoulli(gamma/k) as (uniform in [0, den*k) < num) until A_k = 0; return k odd.
    The loop passes index k with probability gamma^(k-1)/(k-1)!, so it stops at k with
    probability gamma^(k-1)/(k-1)! - gamma^k/k!, and the odd k sum to sum_j (-gamma)^j/j! =
    exp(-gamma)."""
    while rng.below_int(den * k) < num:
        k += 1
    return k % 2 == 1


def bernoulli_exp_fraction(gamma: Fraction, rng: CryptoRandom) -> bool:
    """One exact Bernoulli(exp(-gamma)) draw for a rational gamma >= 0 of any size (Python ints).

    CKS Algorithm 1: exp(-gamma) = exp(-1)^floor(gamma) * exp(-(gamma - floor(gamma))), so
    floor(gamma) Bernoulli(exp(-1)) draws, stopping at the first 0, then one for the fractional
    part, each by the K-loop. Expected work is O(1) however large gamma is."""
    gamma = Fraction(gamma)
    if gamma < 0:
        raise ValueError(f"bernoulli_exp_fraction: gamma must be >= 0, got {gamma}")
    whole, rest = divmod(gamma.numerator, gamma.denominator)
    for _ in range(whole):
        if not _bernoulli_exp_unit_int(1, 1, rng, 2):  # at gamma = 1, A_1 = 1 surely
            return False
    return _bernoulli_exp_unit_int(rest, gamma.denominator, rng)


def _bernoulli_exp_unit(num: IntArray, den: IntArray, rng: CryptoRandom) -> BoolArray:
    """Vectorized CKS Algorithm 1 for 0 <= num <= den <= 2^62 (1-D). All undecided entries are
    at the same loop index K; an entry whose den * K would pass 2^62 (probability < 1/K! of
    getting there) continues exactly on Python ints."""
    out = np.empty(num.shape, np.bool_)
    todo = np.arange(num.size)
    k = 1
    while todo.size:
        d = den[todo]
        large = d > MAX_BOUND // k
        for i in todo[large]:
            out[i] = _bernoulli_exp_unit_int(int(num[i]), int(den[i]), rng, k)
        todo, d = todo[~large], d[~large]
        going_on = _below(rng, (d * k).astype(np.uint64)) < num[todo]
        out[todo[~going_on]] = k % 2 == 1
        todo = todo[going_on]
        k += 1
    return out


def bernoulli_exp(num: npt.ArrayLike, den: npt.ArrayLike, rng: CryptoRandom) -> BoolArray:
    """Exact Bernoulli(exp(-num/den)) per entry (broadcast), for integer 0 <= num < 2^63 and
    1 <= den <= 2^62.

    CKS Algorithm 1, vectorized: gamma = q + r/den with q = num // den; q Bernoulli(exp(-1))
    rounds (an entry stops, False, at its first 0: the set shrinks by 1 - 1/e per round), then
    Bernoulli(exp(-r/den)) by the K-loop with Bernoulli(r/(den*K)) = (below(den*K) < r).
    Every product den*K is checked against 2^62 (see ``_bernoulli_exp_unit``): no overflow."""
    n, d = np.broadcast_arrays(_integer_array(num, "bernoulli_exp: num"),
                               _integer_array(den, "bernoulli_exp: den"))
    if n.size and (n.min() < 0 or d.min() < 1 or d.max() > MAX_BOUND):
        raise ValueError("bernoulli_exp: need num >= 0 and 1 <= den <= 2^62")
    whole, rest = np.divmod(n.ravel(), d.ravel())
    alive = np.ones(whole.shape, np.bool_)
    looping = np.flatnonzero(whole > 0)
    while looping.size:
        survived = _bernoulli_exp_minus_one(looping.size, rng)
        alive[looping[~survived]] = False
        looping = looping[survived]
        whole[looping] -= 1
        looping = looping[whole[looping] > 0]
    out = np.zeros(whole.shape, np.bool_)
    live = np.flatnonzero(alive)
    out[live] = _bernoulli_exp_unit(rest[live], d.ravel()[live], rng)
    return out.reshape(n.shape)


def _geometric_exp1(n: int, rng: CryptoRandom) -> IntArray:
    """V = number of Bernoulli(exp(-1)) successes before the first failure, n times (CKS
    Algorithm 2's inner loop). V only grows by one per vectorized round, so it can reach 2^31
    only after 2^31 rounds (probability exp(-2^31)); that raises instead of overflowing."""
    v = np.zeros(n, np.int64)
    todo = np.arange(n)
    while todo.size:
        todo = todo[_bernoulli_exp_minus_one(todo.size, rng)]
        v[todo] += 1
        if todo.size and v[todo[0]] >= _MAX_SCALE:
            raise OverflowError("discrete Laplace: geometric count reached 2^31")
    return v


def discrete_laplace(t: int, n: int, rng: CryptoRandom) -> IntArray:
    """``n`` exact draws of the discrete Laplace distribution P(x) ~ exp(-|x|/t) on the integers,
    integer scale 1 <= t <= 2^31 (CKS Algorithm 2 with s = 1).

    Per draw: U uniform in [0, t), kept with probability exp(-U/t) (so U is distributed as
    x mod t), V ~ Geometric(1 - 1/e) (the x div t part), X = U + t*V has P(X = x) ~ exp(-x/t);
    a uniform sign, rejecting (-, 0) so that 0 is not counted twice. Rejected draws are redrawn.
    X < t * 2^31 + t <= 2^62 + 2^31: int64 throughout (see ``_geometric_exp1``)."""
    t = _as_int(t, "discrete_laplace: t")
    n = _as_int(n, "discrete_laplace: n")
    if not 1 <= t <= _MAX_SCALE or n < 0:
        raise ValueError(f"discrete_laplace: need 1 <= t <= 2^31 and n >= 0, got t={t}, n={n}")
    out = np.empty(n, np.int64)
    todo = np.arange(n)
    while todo.size:
        m = todo.size
        u = _below_scalar(rng, t, m)
        kept = bernoulli_exp(u, np.full(m, t, np.int64), rng)
        u, slots = u[kept], todo[kept]
        x = u + t * _geometric_exp1(u.size, rng)
        negative = _random_bits(rng, u.size)
        valid = ~(negative & (x == 0))
        out[slots[valid]] = np.where(negative, -x, x)[valid]
        todo = np.concatenate([todo[~kept], slots[~valid]])
    return out


def _size(shape: Shape) -> int:
    dims = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    return math.prod(_as_int(s, "shape") for s in dims)


def discrete_gaussian(sigma: int, shape: Shape, rng: CryptoRandom) -> IntArray:
    """Exact draws of the discrete Gaussian N_Z(0, sigma^2), P(x) ~ exp(-x^2 / (2 sigma^2)) on
    the integers, for an integer 1 <= sigma <= 2^24.

    CKS Algorithm 3 with Laplace scale t = sigma: Y ~ DLap(t), accepted with probability
    exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)) = exp(-(|Y| - sigma)^2 / (2 sigma^2)); CKS prove the
    accepted Y is exactly N_Z(0, sigma^2) for every t > 0 (t only sets the acceptance rate).
    The acceptance is ``bernoulli_exp((|Y| - sigma)^2, 2 sigma^2)`` with 2 sigma^2 <= 2^49.
    For ||Y| - sigma| >= 2^31 (then |Y| >= 2^31, probability < exp(-127) at sigma = 2^24) the
    square would leave int64: those entries are decided exactly on Python ints
    (``bernoulli_exp_fraction``), never rejected or clipped."""
    sigma = _as_int(sigma, "discrete_gaussian: sigma")
    if not 1 <= sigma <= MAX_SIGMA:
        raise ValueError(f"discrete_gaussian: sigma must be in [1, 2^24], got {sigma}")
    size = _size(shape)
    den = 2 * sigma * sigma
    out = np.empty(size, np.int64)
    todo = np.arange(size)
    while todo.size:
        y = discrete_laplace(sigma, todo.size, rng)
        a = np.abs(y) - sigma
        small = np.abs(a) < _MAX_SQUARE_ROOT
        accept = np.zeros(todo.size, np.bool_)
        accept[small] = bernoulli_exp(a[small] * a[small], np.int64(den), rng)
        for i in np.flatnonzero(~small):
            accept[i] = bernoulli_exp_fraction(Fraction(int(a[i]) ** 2, den), rng)
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out.reshape(shape)


def skellam(mu: float, shape: Shape, rng: CryptoRandom) -> IntArray:
    """Skellam(mu) draws: Poisson(mu/2) - Poisson(mu/2), mean 0 and variance mu per coordinate
    (Agarwal, Kairouz & Liu 2021), from the ChaCha20 stream.

    The output is integer-valued, so there is no floating-point support to leak; but numpy's
    Poisson sampler (PTRS transformed rejection for mu/2 >= 10) computes its acceptance test in
    floating point, so the draws follow the Poisson law only up to that rounding error, which is
    NOT in the privacy accounting. Use ``discrete_gaussian`` where exactness is required."""
    mu = float(mu)
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"skellam: mu must be finite and > 0, got {mu}")
    size = _size(shape)
    left = rng.generator.poisson(mu / 2, size)
    right = rng.generator.poisson(mu / 2, size)
    return (left - right).astype(np.int64).reshape(shape)


class DiscreteGaussianSource:
    """Stands in for a ``numpy.random.Generator`` in noise hooks that draw
    ``rng.standard_normal(shape) * std`` (``mechanisms.gaussian_noise``,
    ``symmetric_gaussian_noise``, the meta-learning tree noise).

    ``standard_normal`` returns discrete_gaussian(sigma) / sigma. With std = sigma * g the hook's
    output is k * g for k ~ N_Z(0, sigma^2): the discrete Gaussian on the grid g Z (privacy as
    CKS / Kairouz et al. for L2 sensitivity measured in units of g). ``grid_integers`` recovers
    k exactly. Only ``standard_normal`` is offered: anything else raises."""

    def __init__(self, sigma: int, rng: CryptoRandom) -> None:
        sigma = _as_int(sigma, "DiscreteGaussianSource: sigma")
        if not 1 <= sigma <= MAX_SIGMA:
            raise ValueError(f"DiscreteGaussianSource: sigma must be in [1, 2^24], got {sigma}")
        self.sigma = sigma
        self.rng = rng

    def standard_normal(self, size: Shape | None = None) -> npt.NDArray[np.float64]:
        """discrete_gaussian(sigma, size) / sigma as float64 (correctly rounded division)."""
        shape: Shape = () if size is None else size
        draws = discrete_gaussian(self.sigma, shape, self.rng)
        return np.asarray(draws / self.sigma, np.float64)

    def gumbel(self, *args: Any, **kwargs: Any) -> npt.NDArray[np.float64]:
        """Not supported: a floating-point Gumbel-max selection is not exact."""
        raise NotImplementedError("DiscreteGaussianSource has no gumbel: use "
                                  "exact_exponential_mechanism for private selection")


def grid_integers(noise: npt.ArrayLike, granularity: float) -> IntArray:
    """The integers k with noise = k * granularity up to float rounding (np.rint(noise / g)).

    For noise = (k / sigma) * (sigma * g) the float error is a few ulps of |k|, far below 0.5
    for |k| < 2^40, so the recovery is exact; a distance above 1e-3 from the grid means the
    noise was not drawn on this grid, and raises ValueError."""
    g = float(granularity)
    if not (math.isfinite(g) and g > 0):
        raise ValueError(f"grid_integers: granularity must be finite and > 0, got {g}")
    scaled = np.asarray(noise, np.float64) / g
    if not np.all(np.isfinite(scaled)):
        raise ValueError("grid_integers: non-finite noise")
    k = np.rint(scaled)
    error = float(np.max(np.abs(scaled - k), initial=0.0))
    if error >= 1e-3:
        raise ValueError(f"grid_integers: noise is {error:.3g} grid steps off the grid "
                         f"of granularity {g}")
    return k.astype(np.int64)


def power_of_two_at_most(x: float) -> float:
    """The largest power of two 2^k <= x, for finite x > 0 (exact: frexp gives x = m 2^e with
    0.5 <= m < 1, so the answer is 2^(e-1))."""
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"power_of_two_at_most: x must be finite and > 0, got {x}")
    return math.ldexp(1.0, math.frexp(x)[1] - 1)


def grid_scores(scores: npt.ArrayLike, granularity: float) -> npt.NDArray[np.float64]:
    """Scores rounded to the nearest multiple of a power-of-two granularity g.

    Grid values are dyadic with few significant bits, which keeps the exact rationals of
    ``exact_exponential_mechanism`` short. Rounding moves each score by at most g/2, so a
    user who moves a score by at most ``sensitivity`` moves the rounded score by at most
    sensitivity + g: the caller passes sensitivity + g to the mechanism."""
    g = float(granularity)
    if not (math.isfinite(g) and g > 0) or power_of_two_at_most(g) != g:
        raise ValueError(f"grid_scores: granularity must be a power of two, got {granularity}")
    values = np.asarray(scores, np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError("grid_scores: non-finite scores")
    rounded: npt.NDArray[np.float64] = np.rint(values / g) * g
    return rounded


def exact_exponential_mechanism(scores: npt.ArrayLike, epsilon: float, sensitivity: float,
                                rng: CryptoRandom | None = None) -> int:
    """One exact draw of P(c) ~ exp(-epsilon * score_c / (2 * sensitivity)) (low scores
    preferred, as ``mechanisms.exponential_mechanism``); epsilon-DP when one user moves every
    score by at most ``sensitivity``.

    Every float is a dyadic rational, so gamma_c = epsilon (s_c - s_min) / (2 sensitivity) is
    computed exactly as a Fraction. Propose c uniformly (``below``), accept with an exact
    Bernoulli(exp(-gamma_c)) (``bernoulli_exp_fraction``), else repeat: a try returns c with
    probability exp(-gamma_c) / n, so the output is exactly the target distribution. The best
    candidate has gamma = 0, so a try succeeds with probability >= 1/n: at most n expected
    tries. No exponential is ever evaluated in floating point (no overflow, no underflow)."""
    values = np.asarray(scores, np.float64).ravel()
    if values.size == 0:
        raise ValueError("exact_exponential_mechanism: no candidates")
    if not np.all(np.isfinite(values)):
        raise ValueError("exact_exponential_mechanism: non-finite scores")
    for name, value in (("epsilon", epsilon), ("sensitivity", sensitivity)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"exact_exponential_mechanism: {name} must be finite and > 0, "
                             f"got {value}")
    rng = CryptoRandom() if rng is None else rng
    scale = Fraction(epsilon) / (2 * Fraction(sensitivity))
    best = Fraction(float(values.min()))
    gammas: dict[int, Fraction] = {}
    n = values.size
    while True:
        for c in rng.below(np.full(min(n, 256), n, np.int64)):
            c = int(c)
            if c not in gammas:
                gammas[c] = scale * (Fraction(float(values[c])) - best)
            if bernoulli_exp_fraction(gammas[c], rng):
                return c
