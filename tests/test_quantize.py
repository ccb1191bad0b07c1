"""The distributed quantization pipeline (fedpriv.privacy.quantize): rotation, randomized and
conditional rounding, ring arithmetic mod 2^b, and the wrap-probability bound."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats
from scipy.linalg import hadamard as dense_hadamard

from fedpriv.privacy.quantize import (
    conditional_bound,
    conditional_round,
    from_ring,
    hadamard,
    modulus_bits_needed,
    padded_dim,
    randomized_round,
    ring_sum,
    rotate,
    rotation_signs,
    to_ring,
    unrotate,
    wrap_probability,
)

# ------------------------------------------------------------------------ rotation ----

# rotation_signs(0, "step", "part", 16), frozen: a change breaks agreement between versions
PINNED_SIGNS = [1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0,
                1.0, 1.0]


def test_padded_dim_is_the_next_power_of_two():
    assert [padded_dim(d) for d in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == \
        [1, 2, 4, 4, 8, 1024, 1024, 2048]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="d must"):
            padded_dim(bad)


def test_rotation_signs_are_a_pure_public_function_of_their_inputs():
    s = rotation_signs(7, "round-3", "body", 4096)
    assert s.dtype == np.float64 and s.shape == (4096,)
    assert set(np.unique(s)) == {-1.0, 1.0}
    assert np.array_equal(s, rotation_signs(7, "round-3", "body", 4096))
    assert abs(s.mean()) < 4 / math.sqrt(4096)  # balanced
    for other in (rotation_signs(8, "round-3", "body", 4096),
                  rotation_signs(7, "round-4", "body", 4096),
                  rotation_signs(7, "round-3", "head", 4096),
                  rotation_signs(7, "round-3b", "ody", 4096),  # no concatenation collision
                  rotation_signs(-7, "round-3", "body", 4096)):
        assert np.mean(other != s) > 0.4
    # pinned: nodes and the server (other processes, other numpy versions) derive these
    first = rotation_signs(0, "step", "part", 16)
    assert first.tolist() == PINNED_SIGNS
    with pytest.raises(ValueError, match="dim"):
        rotation_signs(0, "a", "b", 12)
    with pytest.raises(ValueError, match="label"):
        rotation_signs(0, 3, "b", 16)  # type: ignore[arg-type]


@pytest.mark.parametrize("d", [1, 2, 8, 1024])
def test_hadamard_is_orthonormal_and_its_own_inverse(d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal(d)
    y = hadamard(x)
    assert np.allclose(y, dense_hadamard(d) @ x / math.sqrt(d), atol=1e-12)
    assert np.allclose(hadamard(y), x, atol=1e-12)
    assert math.isclose(np.linalg.norm(y), np.linalg.norm(x), rel_tol=1e-12)
    batch = rng.standard_normal((5, 3, d))
    hb = hadamard(batch)
    assert hb.shape == batch.shape
    assert np.allclose(hb[2, 1], hadamard(batch[2, 1]), atol=1e-12)
    assert np.allclose(hadamard(hb), batch, atol=1e-12)
    assert np.allclose(np.linalg.norm(hb, axis=-1), np.linalg.norm(batch, axis=-1))


def test_hadamard_rejects_non_power_of_two_lengths():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(np.ones(6))
    with pytest.raises(ValueError, match="axis"):
        hadamard(np.float64(1.0))


def test_rotate_unrotate_round_trip_with_padding():
    rng = np.random.default_rng(1)
    d = 1000
    signs = rotation_signs(3, "s", "p", padded_dim(d))
    x = rng.standard_normal(d)
    y = rotate(x, signs)
    assert y.shape == (1024,)
    assert math.isclose(np.linalg.norm(y), np.linalg.norm(x), rel_tol=1e-12)
    assert np.allclose(unrotate(y, signs, d), x, atol=1e-12)
    # the padding comes back as zeros, and batches work
    assert np.allclose(unrotate(y, signs, 1024)[d:], 0.0, atol=1e-12)
    xb = rng.standard_normal((4, d))
    assert np.allclose(unrotate(rotate(xb, signs), signs, d), xb, atol=1e-12)
    with pytest.raises(ValueError, match="x_flat"):
        rotate(np.ones(1025), signs)
    with pytest.raises(ValueError, match="d must"):
        unrotate(y, signs, 2000)


@pytest.mark.parametrize("k", [0, 5, 999])
def test_a_rotated_spike_is_flat(k):
    d = padded_dim(1000)
    spike = np.zeros(1000)
    spike[k] = 3.0
    y = rotate(spike, rotation_signs(0, "s", "p", d))
    assert np.allclose(np.abs(y), 3.0 / math.sqrt(d), atol=1e-12)


# ------------------------------------------------------------------------ rounding ----


def test_randomized_round_is_unbiased():
    rng = np.random.default_rng(2)
    y = np.array([-2.75, -0.5, -0.1, 0.0, 0.3, 0.5, 0.9, 7.25, 1e6 + 0.125])
    n = 40_000
    q = randomized_round(np.broadcast_to(y, (n, y.size)), rng.random((n, y.size)))
    assert q.dtype == np.int64
    assert np.all(np.abs(q - y) < 1)
    frac = y - np.floor(y)
    se = np.sqrt(frac * (1 - frac) / n) + 1e-12
    assert np.all(np.abs(q.mean(axis=0) - y) < 5 * se)
    assert np.array_equal(q[:, 3], np.zeros(n))  # integers are kept exactly


def test_randomized_round_floors_the_exact_real_sum():
    # float64 addition rounds 3.5 + (0.5 - 2^-60) up to 4.0; the real sum's floor is 3
    below_half = np.nextafter(0.5, 0.0)  # 0.5 - 2^-54
    y = np.array([3.5, -2.5, 2.0**-60, 1.0 - 2.0**-53, 1e9 + 0.5])
    u = np.array([below_half, below_half, 1.0 - 2.0**-53, 2.0**-60, below_half])
    q = randomized_round(y, u)
    exact = [math.floor(Fraction(a) + Fraction(b)) for a, b in zip(y, u, strict=True)]
    assert q.tolist() == exact == [3, -3, 0, 0, 1_000_000_000]
    assert np.floor(y + u).tolist() == [4, -2, 0, 0, 1_000_000_001]  # the naive float floor
    rng = np.random.default_rng(3)  # near-integer sums, many binades
    y = np.floor(rng.uniform(-1e6, 1e6, 4000)) + rng.choice([0.5, 0.25, 2.0**-40], 4000)
    u = 1.0 - (y - np.floor(y)) + rng.choice([-1, 1], 4000) * 2.0**-56
    u = np.clip(u, 0.0, np.nextafter(1.0, 0.0))
    q = randomized_round(y, u)
    exact = [math.floor(Fraction(a) + Fraction(b)) for a, b in zip(y, u, strict=True)]
    assert q.tolist() == exact
    assert np.sum(np.floor(y + u) != exact) > 100  # cases the float sum gets wrong


def test_randomized_round_coupling_bound_with_the_same_uniforms():
    rng = np.random.default_rng(4)
    d, n = 256, 200
    a = np.round(rng.normal(0, 50, (n, d)) * 2**20) / 2**20  # on a grid: a - b is exact
    deltas = [np.round(rng.normal(0, 3, (n, d)) * 2**20) / 2**20,  # random
              np.full((n, d), 1e-6 * 2**20 // 1 / 2**20),  # tiny shifts: ceil = 1
              rng.integers(-3, 4, (n, d)) + 2.0**-20,  # integer + tiny
              np.full((n, d), 0.5)]
    for delta in deltas:
        b = a + delta
        u = rng.random((n, d))
        qa, qb = randomized_round(a, u), randomized_round(b, u)
        diff = np.abs(qa - qb)
        assert np.all(diff <= np.ceil(np.abs(a - b)))
        dist = np.linalg.norm(a - b, axis=1)
        assert np.all(np.linalg.norm(qa - qb, axis=1) <= dist + math.sqrt(d))
        assert np.all(diff.sum(axis=1) < np.abs(a - b).sum(axis=1) + d)
    # equal inputs with the same uniforms round identically (independent ones do not)
    u = rng.random((n, d))
    assert np.array_equal(randomized_round(a, u), randomized_round(a.copy(), u))
    assert not np.array_equal(randomized_round(a, u), randomized_round(a, rng.random((n, d))))


def test_randomized_round_rejects_bad_inputs():
    with pytest.raises(ValueError, match="uniforms must have"):
        randomized_round(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="uniforms must lie"):
        randomized_round(np.zeros(2), np.array([0.2, 1.0]))
    with pytest.raises(ValueError, match="y must be finite"):
        randomized_round(np.array([np.nan]), np.array([0.2]))
    with pytest.raises(ValueError, match="y must be finite"):
        randomized_round(np.array([2.0**60]), np.array([0.2]))


def test_conditional_bound_holds_empirically():
    """All fractional parts 1/2 (the largest rounding variance, E||q||^2 = ||y||^2 + d/4)."""
    rng = np.random.default_rng(5)
    beta, n = 1e-3, 20_000
    for d, level in ((64, 4), (256, 2), (1024, 0)):
        y = np.full(d, level + 0.5)
        y[::2] *= -1
        c = float(np.linalg.norm(y))
        bound = conditional_bound(c, d, beta)
        norms = np.linalg.norm(randomized_round(np.broadcast_to(y, (n, d)),
                                                rng.random((n, d))), axis=1)
        assert np.mean(norms > bound) <= beta
        # the test has power: without the deviation term about half the draws exceed
        assert np.mean(norms > math.sqrt(c**2 + d / 4)) > 0.3


def test_conditional_bound_formula_and_limits():
    c, d, beta = 3.0, 100, 0.01
    expected = math.sqrt(9 + 25 + math.sqrt(2 * math.log(100)) * (3 + 5))
    assert math.isclose(conditional_bound(c, d, beta), expected, rel_tol=1e-12)
    assert conditional_bound(0.0, 4, 1e-300) == 2.0  # capped by norm + sqrt(d)
    assert conditional_bound(1e6, 4, 0.5) >= 1e6
    assert conditional_bound(c, d, 1e-6) > conditional_bound(c, d, 1e-2)
    for kwargs, name in (({"norm": -1.0}, "norm"), ({"dim": 0}, "dim"), ({"beta": 0.0}, "beta"),
                         ({"beta": 1.0}, "beta"), ({"norm": math.inf}, "norm")):
        args = {"norm": 1.0, "dim": 4, "beta": 0.1} | kwargs
        with pytest.raises(ValueError, match=name):
            conditional_bound(**args)


def test_conditional_round_enforces_the_bound_at_the_clip():
    rng = np.random.default_rng(6)
    d, c = 256, 40.0
    signs = rotation_signs(1, "s", "p", d)
    x = rng.standard_normal(200)
    y = rotate(x * c / np.linalg.norm(x), signs)
    y = np.floor(y) + 0.5  # adversarial fractional parts...
    y *= c / np.linalg.norm(y)  # ...at the clip
    calls: list[tuple[int, ...]] = []

    def draw(shape: tuple[int, ...]) -> np.ndarray:
        calls.append(shape)
        return rng.random(shape)

    tight = math.sqrt(c**2 + d / 4)  # about half the draws exceed it
    total_tries = 0
    for _ in range(300):
        q, tries = conditional_round(y, tight, draw)
        assert np.linalg.norm(q) <= tight
        assert np.all(np.abs(q - y) < 1)
        total_tries += tries
    assert total_tries > 330  # redraws really happened
    assert calls and all(s == (d,) for s in calls)
    q, tries = conditional_round(y, conditional_bound(c, d, 1e-3), draw)
    assert tries >= 1 and np.linalg.norm(q) <= conditional_bound(c, d, 1e-3)


def test_conditional_round_gives_up_naming_the_norms():
    y = np.full(16, 0.5)
    with pytest.raises(RuntimeError, match=r"bound 0\.1 after 20 tries.*input norm 2"):
        conditional_round(y, 0.1, np.random.default_rng(7).random, max_tries=20)
    with pytest.raises(ValueError, match="max_tries"):
        conditional_round(y, 1.0, np.random.default_rng(7).random, max_tries=0)
    with pytest.raises(ValueError, match="bound"):
        conditional_round(y, -1.0, np.random.default_rng(7).random)


# ---------------------------------------------------------------------------- ring ----


def test_ring_round_trip_equals_the_plain_sum_when_in_range():
    rng = np.random.default_rng(8)
    bits, k, d = 20, 7, 500
    vectors = rng.integers(-(2**15), 2**15, (k, d))
    encoded = [to_ring(v, bits) for v in vectors]
    assert all(e.dtype == np.uint64 and e.max() < 2**bits for e in encoded)
    assert np.array_equal(from_ring(ring_sum(encoded, bits), bits), vectors.sum(axis=0))


def test_ring_wraps_out_of_range_sums_and_handles_many_large_vectors():
    bits = 8
    a, b = np.array([100, -100, 127, -128, 5]), np.array([100, -100, 1, -1, 5])
    got = from_ring(ring_sum([to_ring(a, bits), to_ring(b, bits)], bits), bits)
    assert got.tolist() == [-56, 56, -128, 127, 10]  # 200 - 256, -200 + 256, ...
    # 62 bits, 100 vectors near 2^61: the uint64 accumulator wraps mod 2^64 and stays exact
    rng = np.random.default_rng(9)
    vals = rng.integers(-(2**61), 2**61, (100, 50))
    total = [sum(int(v) for v in col) for col in vals.T]
    half = 2**61
    centered = [((t + half) % 2**62) - half for t in total]
    got = from_ring(ring_sum([to_ring(v, 62) for v in vals], 62), 62)
    assert got.tolist() == centered


def test_ring_rejects_bad_inputs():
    for bits in (1, 63, True, 2.0):
        with pytest.raises(ValueError, match="bits"):
            to_ring(np.zeros(2, dtype=np.int64), bits)
    with pytest.raises(ValueError, match="q must be an integer"):
        to_ring(np.zeros(2), 8)
    with pytest.raises(ValueError, match=r"vectors\[1\]"):
        ring_sum([np.zeros(2, np.uint64), np.array([0, 256], np.uint64)], 8)
    with pytest.raises(ValueError, match=r"vectors\[1\]"):
        ring_sum([np.zeros(2, np.uint64), np.zeros(3, np.uint64)], 8)
    with pytest.raises(ValueError, match="vectors"):
        ring_sum([], 8)
    with pytest.raises(ValueError, match="v holds"):
        from_ring(np.array([256], np.uint64), 8)
    with pytest.raises(ValueError, match="v must be uint64"):
        from_ring(np.array([3]), 8)


# ------------------------------------------------------------------------ modulus ----


@pytest.mark.parametrize(("variance", "bits"), [(64.0, 6), (100.0, 7), (1000.0, 8)])
def test_wrap_probability_bounds_the_exact_noise_only_probability(variance, bits):
    d, m = 64, 2 ** (bits - 1)
    mu = variance / 2
    p = stats.skellam.sf(m - 1, mu, mu) + stats.skellam.cdf(-m - 1, mu, mu)  # |n| leaves
    exact = 1 - (1 - p) ** d
    bound = wrap_probability(0.0, variance, d, bits, 0.0)
    assert exact <= bound <= 25 * exact


def test_wrap_probability_signal_part_is_hoeffding_and_holds_empirically():
    d, c, bits = 256, 200.0, 7
    m = 2 ** (bits - 1)
    hoeffding = d * 2 * math.exp(-(m**2) * d / (2 * c**2))
    assert hoeffding <= wrap_probability(c, 0.0, d, bits, 0.0) <= 1.01 * hoeffding
    rng = np.random.default_rng(10)
    x = rng.standard_normal(d)
    x *= 160.0 / np.linalg.norm(x)  # norm 160: wraps at rate ~1e-2 at 6 bits
    n = 4000
    s = hadamard(x * (1 - 2 * rng.integers(0, 2, (n, d))))
    m = 2 ** (6 - 1)
    rate = np.mean(np.any((s >= m) | (s < -m), axis=1))
    assert 0.002 < rate <= wrap_probability(160.0, 0.0, d, 6, 0.0)


def test_wrap_probability_bounds_the_simulated_pipeline():
    """Two nodes rotate, round and add Skellam noise; the server's decode differs from the
    integer sum exactly when a coordinate wrapped. The rate is measurable (~1e-2) and below
    the bound; at two more bits the bound is tiny and nothing wraps."""
    rng = np.random.default_rng(11)
    d0, k, variance, n = 60, 2, 70.0, 5000
    d = padded_dim(d0)
    xs = rng.standard_normal((k, d0))
    xs *= 3.0 / np.linalg.norm(xs, axis=1, keepdims=True)
    c = float(np.linalg.norm(xs.sum(axis=0)))
    signs = 1.0 - 2.0 * rng.integers(0, 2, (n, 1, d))  # a fresh rotation per trial
    y = hadamard(np.pad(xs, ((0, 0), (0, d - d0)))[None] * signs)
    q = randomized_round(y, rng.random(y.shape))
    z = q + rng.poisson(variance / (2 * k), q.shape) - rng.poisson(variance / (2 * k), q.shape)
    for bits, lowest in ((6, 0.004), (8, 0.0)):
        decoded = from_ring(ring_sum([to_ring(z[:, j], bits) for j in range(k)], bits), bits)
        rate = np.mean(np.any(decoded != z.sum(axis=1), axis=1))
        bound = wrap_probability(c, variance, d, bits, float(k))
        assert lowest <= rate <= bound < 1.0
    assert wrap_probability(c, variance, d, 8, float(k)) < 1e-6


def test_wrap_probability_is_monotone_in_bits():
    for c, v, d, slack in ((10.0, 50.0, 64, 2.0), (1e4, 1e6, 2**16, 100.0), (0.0, 0.0, 1, 0.0)):
        probs = [wrap_probability(c, v, d, b, slack) for b in range(2, 63)]
        assert all(p2 <= p1 for p1, p2 in zip(probs, probs[1:], strict=False))
        assert probs[-1] < 1e-9
    assert wrap_probability(1.0, 1.0, 16, 4, 8.0) == 1.0  # the slack eats the range


def test_modulus_bits_needed_is_the_smallest_sufficient():
    for c, v, d, slack, target in ((10.0, 50.0, 64, 2.0, 1e-9), (1e3, 1e5, 2**20, 16.0, 1e-6),
                                   (0.0, 1.0, 8, 1.0, 0.5)):
        b = modulus_bits_needed(c, v, d, slack, target)
        assert wrap_probability(c, v, d, b, slack) <= target
        assert b == 2 or wrap_probability(c, v, d, b - 1, slack) > target
    assert modulus_bits_needed(1.0, 1.0, 4, 1.0, 1e-300) <= 62  # log space: no underflow
    with pytest.raises(ValueError, match="no modulus"):
        modulus_bits_needed(1e20, 1e38, 1024, 1.0)
    for args, name in (((-1.0, 1.0, 4, 1.0), "total_norm_bound"),
                       ((1.0, -1.0, 4, 1.0), "noise_variance"),
                       ((1.0, 1.0, 6, 1.0), "dim"),
                       ((1.0, 1.0, 4, -1.0), "rounding_slack")):
        with pytest.raises(ValueError, match=name):
            modulus_bits_needed(*args)
        with pytest.raises(ValueError, match=name):
            wrap_probability(*args[:3], 8, args[3])
    with pytest.raises(ValueError, match="target"):
        modulus_bits_needed(1.0, 1.0, 4, 1.0, 0.0)
    with pytest.raises(ValueError, match="bits"):
        wrap_probability(1.0, 1.0, 4, 63, 1.0)
