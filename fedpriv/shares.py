"""A node's share of distributed noise: its sum rotated, quantized, noised and reduced mod 2^b.

``aggregation = "distributed"`` (the argument is in ``fedpriv.server.discrete``). For each part
of a noised step the node: bounds its exact sum to what its ``n`` clipped users can send
(``n * clip_norm``; a non-finite sum becomes zero); divides it by the grid's granularity ``g``;
rotates it (public random signs from the run seed, step and part, then an orthonormal
Walsh-Hadamard transform, which flattens the coordinates so a small modulus holds them);
rounds it randomly, re-drawing while its norm exceeds Kairouz et al.'s bound for a vector of
norm ``n * clip_norm / g`` (conditional rounding, enforced here on the node); adds its share of
Skellam noise; and reduces modulo ``2^b``. Every random draw comes from a ChaCha20 stream keyed
by the node's own OS entropy, never from the run's seeds. The server's parameters (granularity,
the share's variance, ``b``) arrive with the step's broadcast under ``DISTRIBUTED_KEY``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.privacy.discrete import CryptoRandom, skellam
from fedpriv.privacy.mechanisms import clip_by_norm
from fedpriv.privacy.quantize import (
    conditional_bound,
    conditional_round,
    from_ring,
    padded_dim,
    ring_sum,
    rotate,
    rotation_signs,
    to_ring,
    unrotate,
)

# the broadcast entry that carries a distributed step's parameters to the nodes
DISTRIBUTED_KEY = "__fedpriv_distributed__"
# conditional rounding: the chance that a node must re-draw its rounding, per part and release
BETA = 2.0 ** -128


def within_bound(total: np.ndarray, bound: float) -> np.ndarray:
    """``total`` (flattened, float64) scaled to L2 norm ``<= bound``; zero if not finite (the
    clip of ``fedpriv.privacy.mechanisms``, on the node's one vector)."""
    x = np.asarray(total, dtype=np.float64).reshape(1, -1)
    return clip_by_norm(x, bound)[0] if bound > 0 else np.zeros(x.shape[1])


def quantize_part(total: np.ndarray, num_users: int, clip_norm: float, signs: np.ndarray,
                  granularity: float, rng: CryptoRandom) -> tuple[np.ndarray, float, int]:
    """One part's rotated sum in grid units, conditionally rounded: the integer vector, the
    norm bound it was held to (Kairouz et al.'s, for a sum of norm ``num_users * clip_norm``)
    and how many roundings were drawn."""
    bound = num_users * clip_norm / granularity
    y = rotate(within_bound(total, num_users * clip_norm) / granularity, signs)
    limit = conditional_bound(bound, len(signs), BETA)
    q, tries = conditional_round(y, limit, rng.generator.random)
    return q, limit, tries


def encode_part(total: np.ndarray, num_users: int, clip_norm: float, signs: np.ndarray,
                granularity: float, node_variance: float, bits: int,
                rng: CryptoRandom) -> tuple[np.ndarray, int]:
    """One part's vector mod ``2^bits`` (int64) and how many roundings were drawn."""
    q, _, tries = quantize_part(total, num_users, clip_norm, signs, granularity, rng)
    noisy = q + skellam(node_variance, q.shape, rng)
    return to_ring(noisy, bits).astype(np.int64), tries


def encode_shares(seed: int, step: Step, contrib: UserContribution, params: np.ndarray,
                  rng: CryptoRandom | None = None) -> UserContribution:
    """The node's reply in a distributed step: each part's share (``encode_part``); the user
    counts travel as before. ``params``: one row per part (granularity, share variance,
    bits). ``rng``: the node's CSPRNG (a fresh OS-seeded one by default)."""
    rng = rng if rng is not None else CryptoRandom()
    rows = np.asarray(params, dtype=np.float64)
    if rows.shape != (len(step.parts), 3) or not np.all(np.isfinite(rows)):
        raise ValueError(f"{step.label}: malformed noise-share parameters {rows.shape}")
    for g, variance, bits in rows:  # the node's own sanity checks (the plan: issue 37)
        if not (g > 0 and math.frexp(g)[0] == 0.5 and variance > 0 and bits == int(bits)
                and 2 <= bits <= 62):
            raise ValueError(f"{step.label}: refusing noise-share parameters granularity={g}, "
                             f"variance={variance}, bits={bits}")
    totals: dict[str, np.ndarray] = {}
    for part, (g, variance, bits) in zip(step.parts, rows, strict=True):
        size = int(np.prod(part.shape))
        signs = rotation_signs(seed, step.label, part.name, padded_dim(size))
        totals[part.name], _ = encode_part(contrib.totals[part.name], contrib.num_users,
                                           part.clip_norm, signs, float(g), float(variance),
                                           int(bits), rng)
    return UserContribution(totals, contrib.num_users, contrib.num_clipped, contrib.metrics)


def decode_sum(vectors: Sequence[np.ndarray], granularity: float, bits: int, seed: int,
               label: str, part: str, size: int) -> np.ndarray:
    """The server's side: the nodes' vectors summed mod ``2^bits``, lifted to signed
    integers, un-rotated and multiplied by the granularity: the parts' exact sum plus the
    shares' noise (flattened, ``size`` entries)."""
    dim = padded_dim(size)
    total = (ring_sum([np.asarray(v).astype(np.uint64) for v in vectors], bits) if vectors
             else np.zeros(dim, dtype=np.uint64))
    lifted = from_ring(total, bits).astype(np.float64)
    return np.asarray(unrotate(lifted, rotation_signs(seed, label, part, dim), size)
                      * granularity)


def split_parameters(arrays: Mapping[str, np.ndarray]
                     ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The broadcast without the distributed parameters, and those parameters (or None)."""
    if DISTRIBUTED_KEY not in arrays:
        return dict(arrays), None
    rest = {k: v for k, v in arrays.items() if k != DISTRIBUTED_KEY}
    return rest, np.asarray(arrays[DISTRIBUTED_KEY])
