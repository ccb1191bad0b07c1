"""The distributed quantization pipeline: node encoding into Z_{2^b}, server decoding.

In ``aggregation = "distributed"`` each node turns its exact float sum ``x`` of clipped user
updates (one released part, flattened) into an integer vector modulo ``2^b``:

1. ``rotate``: pad to a power of two ``d`` and apply ``H D`` (``D`` a public diagonal of random
   signs, ``H`` the orthonormal Walsh-Hadamard matrix). Norms are kept exactly (in real
   arithmetic), and a vector of norm ``c`` has coordinates of size about ``c / sqrt(d)``
   (flattening), so a small modulus suffices (Kairouz, Liu & Steinke 2021, "The Distributed
   Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", Sec. 4).
2. ``randomized_round`` (or ``conditional_round``): unbiased rounding to ``Z^d`` with uniforms
   from the caller's CSPRNG. The caller then adds integer noise (discrete Gaussian, Canonne,
   Kamath & Steinke 2020; or Skellam, Agarwal, Kairouz & Liu 2021).
3. ``to_ring``; the server adds the nodes' vectors with ``ring_sum`` and lifts the result back
   with ``from_ring``, then ``unrotate``. Decoding is exact whenever no coordinate of the true
   integer sum leaves ``[-2^(b-1), 2^(b-1))``; ``wrap_probability`` bounds the chance that one
   does and ``modulus_bits_needed`` picks ``b``.

All functions are pure (explicit arguments, no global random state) and vectorized.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np

MIN_BITS, MAX_BITS = 2, 62
# |y| above this: floor(y) and y - floor(y) would not be exact in float64 / int64.
_MAX_ROUNDABLE = float(2**52)
_U = 2.0**-53  # unit roundoff of float64


# ------------------------------------------------------------------------ rotation ----
def padded_dim(d: int) -> int:
    """The smallest power of two ``>= d`` (``d >= 1``)."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d must be a positive integer, got {d!r}")
    return 1 << (int(d) - 1).bit_length()


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def rotation_signs(seed: int, label: str, part: str, dim: int) -> np.ndarray:
    """The public random signs ``D`` (float64 ``+-1``, length ``dim``) for one released part.

    A pure function of ``(seed, label, part, dim)``: the four are encoded unambiguously
    (length-prefixed), hashed with SHA-256, and the digest seeds a ``numpy`` ``SeedSequence``
    driving ``PCG64``; the signs are the low-to-high bits of the generator's raw 64-bit words
    (``random_raw``), which NEP 19 keeps stable across numpy versions (``Generator`` methods
    need not be), so every node and the server derive the same signs. Python's ``hash()`` is
    not used (it is salted per process). The signs need not be secret: the flattening bound
    of ``wrap_probability`` holds because they are uniform and independent of the data, not
    because they are hidden."""
    if not isinstance(label, str):
        raise ValueError(f"label must be a str, got {type(label).__name__}")
    if not isinstance(part, str):
        raise ValueError(f"part must be a str, got {type(part).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) \
            or not _is_power_of_two(int(dim)):
        raise ValueError(f"dim must be a power of two (padded_dim), got {dim!r}")
    fields = ["fedpriv.rotation.v1", str(int(seed)), label, part, str(int(dim))]
    encoded = b"".join(len(f.encode()).to_bytes(8, "little") + f.encode() for f in fields)
    digest = hashlib.sha256(encoded).digest()
    sequence = np.random.SeedSequence(int.from_bytes(digest, "little"))
    words = np.random.PCG64(sequence).random_raw((int(dim) + 63) // 64)
    bits = np.unpackbits(np.asarray(words, dtype="<u8").view(np.uint8), bitorder="little")
    signs: np.ndarray = 1.0 - 2.0 * bits[: int(dim)].astype(np.float64)
    return signs


def hadamard(x: np.ndarray) -> np.ndarray:
    """Orthonormal fast Walsh-Hadamard transform along the last axis (a power of two ``d``).

    Sylvester's ``H_d / sqrt(d)`` is symmetric and orthogonal, so the transform is its own
    inverse and keeps L2 norms (up to float64 rounding). ``log2(d)`` vectorized butterfly
    stages (``(a, b) -> (a + b, a - b)`` on a reshaped view), O(d log d); works on ``(d,)``
    and batched ``(..., d)`` input. Returns a new float64 array."""
    out = np.array(x, dtype=np.float64, copy=True)
    if out.ndim == 0:
        raise ValueError("x must have at least one axis")
    d = out.shape[-1]
    if not _is_power_of_two(d):
        raise ValueError(f"x's last axis must have a power-of-two length, got {d}")
    lead = out.shape[:-1]
    h = 1
    while h < d:
        pairs = out.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        out = np.stack((a + b, a - b), axis=-2).reshape(*lead, d)
        h *= 2
    scaled: np.ndarray = out / math.sqrt(d)
    return scaled


def rotate(x_flat: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``H D pad(x)``: zero-pad the last axis of ``x_flat`` to ``len(signs)``, multiply by the
    signs, transform. Orthogonal, so ``||rotate(x)|| = ||x||`` (up to rounding)."""
    x = np.asarray(x_flat, dtype=np.float64)
    s = np.asarray(signs, dtype=np.float64)
    if s.ndim != 1 or not _is_power_of_two(s.shape[0]):
        raise ValueError(f"signs must be 1-D with a power-of-two length, got {s.shape}")
    if x.ndim == 0 or x.shape[-1] > s.shape[0]:
        raise ValueError(f"x_flat's last axis ({x.shape}) must not exceed len(signs) "
                         f"({s.shape[0]})")
    pad = [(0, 0)] * (x.ndim - 1) + [(0, s.shape[0] - x.shape[-1])]
    return hadamard(np.pad(x, pad) * s)


def unrotate(y: np.ndarray, signs: np.ndarray, d: int) -> np.ndarray:
    """Inverse of ``rotate``: ``(H y * signs)[..., :d]`` (``D H H D = I``)."""
    s = np.asarray(signs, dtype=np.float64)
    yy = np.asarray(y, dtype=np.float64)
    if yy.ndim == 0 or yy.shape[-1] != s.shape[0]:
        raise ValueError(f"y's last axis ({yy.shape}) must equal len(signs) ({s.shape})")
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d <= s.shape[0]:
        raise ValueError(f"d must be an integer in [0, {s.shape[0]}], got {d!r}")
    out: np.ndarray = (hadamard(yy) * s)[..., : int(d)]
    return out


# ------------------------------------------------------------------------ rounding ----
def randomized_round(y: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """``floor(y + U)`` per coordinate (int64), with ``U`` the caller's uniforms in ``[0, 1)``.

    Unbiased: ``P(floor(y + U) = floor(y) + 1) = y - floor(y)``, so ``E = y`` (exactly for real
    uniforms; within ``2^-53`` for uniforms on the float grid). The floor is of the REAL sum
    ``y + U``, not of its float64 rounding (which can round ``3.5 + (0.5 - 2^-60)`` up to 4): with
    ``f = y - floor(y)`` (exact), ``floor(y + U) = floor(y) + [f + U >= 1]``, and the test is
    made exactly as ``f >= 1 - U`` when ``U >= 1/2`` and as ``U >= 1 - f`` otherwise (each
    subtraction is exact by Sterbenz's lemma whenever it can matter). ``|y| <= 2^52``.

    Coupling (the sensitivity argument for neighbouring inputs rounded with the SAME ``U``):
    floor is monotone and commutes with integer shifts, so for reals ``a >= b``,
    ``floor(b + U) <= floor(a + U) <= floor(b + U + ceil(a - b)) = floor(b + U) + ceil(a - b)``,
    i.e. ``|floor(a + U) - floor(b + U)| <= ceil(|a - b|) < |a - b| + 1`` per coordinate. Hence
    two inputs whose difference has L2 norm ``D`` round to vectors at L2 distance
    ``< || |a - b| + 1 ||_2 <= D + sqrt(d)`` and L1 distance ``< ||a - b||_1 + d``. Also
    ``|floor(y + U) - y| < 1`` per coordinate, always."""
    yy = np.asarray(y, dtype=np.float64)
    u = np.asarray(uniforms, dtype=np.float64)
    if yy.shape != u.shape:
        raise ValueError(f"uniforms must have y's shape {yy.shape}, got {u.shape}")
    if not np.all(np.abs(yy) <= _MAX_ROUNDABLE):  # also catches nan
        raise ValueError("y must be finite with |y| <= 2^52")
    if not np.all((u >= 0.0) & (u < 1.0)):
        raise ValueError("uniforms must lie in [0, 1)")
    base = np.floor(yy)
    frac = yy - base  # exact: same binade bits as y, below 1
    up = np.where(u >= 0.5, frac >= 1.0 - u, u >= 1.0 - frac)
    rounded: np.ndarray = base.astype(np.int64) + up.astype(np.int64)
    return rounded


def conditional_bound(norm: float, dim: int, beta: float) -> float:
    """An L2 bound that ``randomized_round`` of any ``y`` with ``||y||_2 <= norm`` in ``dim``
    coordinates meets with probability ``>= 1 - beta``: the conditional randomized rounding
    bound of Kairouz, Liu & Steinke 2021 (Sec. 4.1, the norm bound entering their Theorem 1
    with granularity ``gamma = 1``):

        ``||q||_2^2 <= norm^2 + dim/4 + sqrt(2 log(1/beta)) (norm + sqrt(dim)/2)``.

    Proof (Hoeffding): ``q_i^2 - y_i^2`` are independent, take two values whose gap is
    ``|ceil(y_i)^2 - floor(y_i)^2| <= 2|y_i| + 1``, and have mean ``p_i(1 - p_i) <= 1/4``; with
    ``sum (2|y_i| + 1)^2 <= (2||y|| + sqrt(dim))^2`` (Cauchy-Schwarz on ``||y||_1``), Hoeffding
    gives deviation ``sqrt(log(1/beta)/2) (2||y|| + sqrt(dim))`` above the mean with
    probability ``<= beta``. The right side increases in ``||y||``, so ``norm`` may be any
    upper bound (the clip). The result is also capped by the deterministic bound
    ``norm + sqrt(dim)`` (``|q_i - y_i| < 1``) and is never below ``norm``."""
    if not (math.isfinite(norm) and norm >= 0):
        raise ValueError(f"norm must be finite and non-negative, got {norm}")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must lie in (0, 1), got {beta}")
    root_d = math.sqrt(dim)
    squared = norm**2 + dim / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (norm + root_d / 2)
    return max(float(norm), min(math.sqrt(squared), norm + root_d))


def _certainly_within(q: np.ndarray, bound: float) -> tuple[bool, float]:
    """Whether ``||q||_2 <= bound`` holds for the exact integer norm, and the float norm.

    The float64 sum of squares of ``n`` terms has relative error at most
    ``gamma_{n+1} = (n+1)u / (1 - (n+1)u)`` (Higham, Accuracy and Stability, Sec. 4.2 and
    3.1; squares included), so accepting only ``s_hat <= bound^2 (1 - 2 gamma - 4u)`` never
    accepts a vector whose exact norm exceeds ``bound``; it may reject one at relative
    distance ~``n 2^-52`` below the bound, which only costs a redraw."""
    flat = q.astype(np.float64).ravel()
    s_hat = float(np.dot(flat, flat))
    n = flat.size + 1
    gamma = n * _U / (1.0 - n * _U)
    return s_hat <= bound * bound * (1.0 - 2.0 * gamma - 4.0 * _U), math.sqrt(s_hat)


def conditional_round(y: np.ndarray, bound: float,
                      draw_uniforms: Callable[[tuple[int, ...]], np.ndarray],
                      max_tries: int = 1000) -> tuple[np.ndarray, int]:
    """Conditional randomized rounding (Kairouz, Liu & Steinke 2021, Sec. 4.1): redraw
    ``randomized_round(y, draw_uniforms(y.shape))`` until ``||q||_2 <= bound``; returns
    ``(q, tries)``. Every returned ``q`` has exact L2 norm ``<= bound`` (checked with a
    float-error margin, ``_certainly_within``), so ``bound`` is a valid L2 sensitivity for
    adding/removing the whole vector. With ``bound = conditional_bound(c, d, beta)`` and
    ``||y|| <= c`` each try succeeds with probability ``>= 1 - beta``. Caveat: rejection breaks
    the same-uniforms coupling of ``randomized_round`` (neighbours may need different numbers
    of tries), so the ``D + sqrt(d)`` replacement bound does not carry over to this output.
    Raises RuntimeError after ``max_tries`` failures."""
    yy = np.asarray(y, dtype=np.float64)
    if not (math.isfinite(bound) and bound >= 0):
        raise ValueError(f"bound must be finite and non-negative, got {bound}")
    if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
        raise ValueError(f"max_tries must be a positive integer, got {max_tries!r}")
    smallest = math.inf
    for tries in range(1, max_tries + 1):
        q = randomized_round(yy, draw_uniforms(yy.shape))
        ok, measured = _certainly_within(q, bound)
        if ok:
            return q, tries
        smallest = min(smallest, measured)
    raise RuntimeError(
        f"conditional_round: no rounding within bound {bound:.6g} after {max_tries} tries "
        f"(input norm {float(np.linalg.norm(yy)):.6g}, smallest rounded norm {smallest:.6g})")


# ---------------------------------------------------------------------------- ring ----
def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) \
            or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
    return int(bits)


def to_ring(q: np.ndarray, bits: int) -> np.ndarray:
    """``q mod 2^bits`` as uint64 in ``[0, 2^bits)`` (``q`` an integer array)."""
    b = _check_bits(bits)
    qq = np.asarray(q)
    if not np.issubdtype(qq.dtype, np.integer):
        raise ValueError(f"q must be an integer array, got dtype {qq.dtype}")
    reduced: np.ndarray = np.mod(qq.astype(np.int64), np.int64(1) << b).astype(np.uint64)
    return reduced


def ring_sum(vectors: Sequence[np.ndarray], bits: int) -> np.ndarray:
    """Sum of ring elements mod ``2^bits`` (uint64). Exact for any number of vectors: uint64
    addition wraps mod ``2^64``, and ``2^bits`` divides ``2^64``, so reducing at the end gives
    the sum mod ``2^bits``."""
    b = _check_bits(bits)
    if len(vectors) == 0:
        raise ValueError("vectors must hold at least one vector")
    modulus = np.uint64(1) << np.uint64(b)
    total = np.zeros(np.shape(vectors[0]), dtype=np.uint64)
    for i, v in enumerate(vectors):
        vv = np.asarray(v)
        if vv.dtype != np.uint64 or vv.shape != total.shape:
            raise ValueError(f"vectors[{i}] must be uint64 of shape {total.shape}, "
                             f"got {vv.dtype} {vv.shape}")
        if vv.size and vv.max() >= modulus:
            raise ValueError(f"vectors[{i}] holds values outside [0, 2^{b})")
        np.add(total, vv, out=total)  # wraps mod 2^64
    reduced: np.ndarray = total % modulus
    return reduced


def from_ring(v: np.ndarray, bits: int) -> np.ndarray:
    """Centered lift of ring elements to int64 in ``[-2^(bits-1), 2^(bits-1))``."""
    b = _check_bits(bits)
    vv = np.asarray(v)
    if vv.dtype != np.uint64:
        raise ValueError(f"v must be uint64, got {vv.dtype}")
    if vv.size and vv.max() >= np.uint64(1) << np.uint64(b):
        raise ValueError(f"v holds values outside [0, 2^{b})")
    lifted = vv.astype(np.int64)
    half = np.int64(1) << (b - 1)
    out: np.ndarray = np.where(lifted >= half, lifted - (np.int64(1) << b), lifted)
    return out


# ------------------------------------------------------------------------ modulus ----
def _log_noise_tail(t: np.ndarray, variance: float) -> np.ndarray:
    """``log`` of a bound on ``P(|N| >= t)`` for Skellam noise of variance ``v``:
    the exact Chernoff bound ``2 exp(v (cosh s - 1) - s t)`` at ``sinh s = t / v``, i.e.
    ``2 exp(v (sqrt(1 + (t/v)^2) - 1) - t asinh(t / v))``, capped at 1 (log 0); 0 noise: 0
    beyond ``t > 0``."""
    t = np.asarray(t, dtype=np.float64)
    out = np.zeros_like(t)
    pos = t > 0
    if variance == 0.0:
        out[pos] = -np.inf
        return out
    r = t[pos] / variance
    out[pos] = np.minimum(0.0, math.log(2.0)
                          + variance * (np.hypot(1.0, r) - 1.0) - t[pos] * np.arcsinh(r))
    return out


def _log_signal_tail(a: np.ndarray, proxy: float) -> np.ndarray:
    """``log`` of Hoeffding's ``P(|S| >= a) <= 2 exp(-a^2 / (2 proxy))``, capped at 1."""
    a = np.asarray(a, dtype=np.float64)
    if proxy == 0.0:
        zero: np.ndarray = np.where(a > 0, -np.inf, 0.0)
        return zero
    tail: np.ndarray = np.minimum(0.0, math.log(2.0) - a * a / (2.0 * proxy))
    return tail


def _check_wrap_args(total_norm_bound: float, noise_variance: float, dim: int,
                     rounding_slack: float) -> None:
    if not (math.isfinite(total_norm_bound) and total_norm_bound >= 0):
        raise ValueError(f"total_norm_bound must be finite and >= 0, got {total_norm_bound}")
    if not (math.isfinite(noise_variance) and noise_variance >= 0):
        raise ValueError(f"noise_variance must be finite and >= 0, got {noise_variance}")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) \
            or not _is_power_of_two(int(dim)):
        raise ValueError(f"dim must be a power of two (the padded dim), got {dim!r}")
    if not (math.isfinite(rounding_slack) and rounding_slack >= 0):
        raise ValueError(f"rounding_slack must be finite and >= 0, got {rounding_slack}")


def _log_wrap_bound(total_norm_bound: float, noise_variance: float, dim: int, bits: int,
                    rounding_slack: float) -> float:
    half = float(2 ** (bits - 1))
    room = half - rounding_slack  # the range left for signal + noise
    if room <= 0:
        return 0.0
    proxy = total_norm_bound**2 / dim

    def total(a: np.ndarray) -> np.ndarray:
        both: np.ndarray = np.logaddexp(_log_signal_tail(a, proxy),
                                        _log_noise_tail(room - a, noise_variance))
        return both

    grid = np.linspace(0.0, room, 2049)
    values = total(grid)
    best = int(np.argmin(values))
    step = room / 2048
    fine = np.linspace(max(0.0, grid[best] - step), min(room, grid[best] + step), 257)
    log_p = min(float(values[best]), float(np.min(total(fine))))
    return min(0.0, math.log(dim) + log_p)


def wrap_probability(total_norm_bound: float, noise_variance: float, dim: int, bits: int,
                     rounding_slack: float) -> float:
    """Upper bound on P(some coordinate of the rotated, rounded, noisy sum leaves
    ``[-2^(b-1), 2^(b-1))``), i.e. on P(``from_ring(ring_sum(...))`` differs from the integer
    sum). Coordinate ``j`` of the sum is ``s_j + r_j + n_j``:

    * signal ``s = H D x`` with ``||x|| <= total_norm_bound = c`` (the nodes' rotations add up
      to the rotation of the total) and ``dim = d`` the padded dim: ``s_j = sum_i (H_ji x_i)
      D_i`` is a Rademacher sum with ``sum_i H_ji^2 x_i^2 = c^2 / d``, so by Hoeffding
      ``P(|s_j| >= a) <= 2 exp(-a^2 d / (2 c^2))`` (the signs uniform, independent of x);
    * rounding: each node's ``|q - y| < 1``, so ``|r_j| < rounding_slack`` (= number of nodes);
    * noise: Skellam of variance ``v`` (difference of two Poisson(v/2)), log-MGF
      ``v (cosh s - 1)``; the exact Chernoff bound is ``P(|n_j| >= t) <= 2 exp(v (sqrt(1 +
      (t/v)^2) - 1) - t asinh(t/v))``, below Bernstein's ``2 exp(-t^2 / (2 (v + t/3)))``
      (unit-jump increments). As ``v (cosh s - 1) >= v s^2 / 2``, the bound also covers any
      noise that is sub-Gaussian with proxy ``v``, e.g. a sum of discrete Gaussians of total
      variance proxy ``v`` (Canonne, Kamath & Steinke 2020; Kairouz et al. 2021).

    With ``M = 2^(b-1)``: if ``|s_j| < a`` and ``|n_j| < M - slack - a`` then ``|s_j + r_j +
    n_j| < M`` (no wrap); a union bound over the two events and the ``d`` coordinates,
    minimized over ``a`` on a grid (any ``a`` gives a valid bound), gives the result (at most 1).
    Non-increasing in ``bits`` (the minimum over ``b' <= bits``: a wrap at ``bits`` is a wrap
    at every smaller ``b'``)."""
    _check_wrap_args(total_norm_bound, noise_variance, dim, rounding_slack)
    b = _check_bits(bits)
    # The true wrap probability is non-increasing in bits, so the bound for any b' <= b is
    # also a bound at b: the running minimum keeps the grid-minimized bound monotone.
    return math.exp(min(_log_wrap_bound(total_norm_bound, noise_variance, int(dim), k,
                                        rounding_slack) for k in range(MIN_BITS, b + 1)))


def modulus_bits_needed(total_norm_bound: float, noise_variance: float, dim: int,
                        rounding_slack: float, target: float = 1e-9) -> int:
    """The smallest ``bits`` in ``[2, 62]`` with ``wrap_probability <= target`` (compared in
    log space, so tiny targets work). ValueError if even 62 bits do not reach it."""
    _check_wrap_args(total_norm_bound, noise_variance, dim, rounding_slack)
    if not 0.0 < target < 1.0:
        raise ValueError(f"target must lie in (0, 1), got {target}")
    log_target = math.log(target)
    for bits in range(MIN_BITS, MAX_BITS + 1):
        if _log_wrap_bound(total_norm_bound, noise_variance, int(dim), bits,
                           rounding_slack) <= log_target:
            return bits
    raise ValueError(f"no modulus of at most {MAX_BITS} bits keeps the wrap probability "
                     f"below target={target} (total_norm_bound={total_norm_bound}, "
                     f"noise_variance={noise_variance}, dim={dim})")
