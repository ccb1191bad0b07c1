"""Shamir secret sharing over the prime field GF(2^521 - 1), with Lagrange weights computed
once per set of share points.

A secret of at most 64 bytes is one field element (``0x01 || secret`` read big-endian, so
leading zero bytes survive); a share is its point ``x`` (4 bytes) and the polynomial's value
there (66 bytes). Any ``threshold`` shares rebuild the secret; fewer reveal nothing about it
(each share value is uniform given any ``threshold - 1`` others). A share's point is its holder's
index in the round's node list plus one, so when many secrets are rebuilt from the same
holders (the complete graph: every node's seed from the same answering nodes) the Lagrange
weights at zero are computed once (``lagrange_at_zero`` is cached per point set) and each
secret costs ``threshold`` multiplications.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from functools import lru_cache

PRIME = (1 << 521) - 1  # a Mersenne prime
MAX_SECRET = 64
_VALUE = 66  # bytes of a field element
_POINT = 4


def split(secret: bytes, threshold: int, points: Sequence[int]) -> list[bytes]:
    """One share of ``secret`` for each point in ``points`` (distinct integers in [1, 2^32));
    any ``threshold`` of them rebuild it. The polynomial's other coefficients come from the
    OS's generator."""
    if len(secret) > MAX_SECRET:
        raise ValueError(f"a secret has at most {MAX_SECRET} bytes, got {len(secret)}")
    if not 1 <= threshold <= len(points):
        raise ValueError(f"threshold {threshold} outside [1, {len(points)}] shares")
    if len(set(points)) != len(points) or not all(0 < x < 1 << 32 for x in points):
        raise ValueError("share points must be distinct integers in [1, 2^32)")
    coefficients = [int.from_bytes(b"\x01" + secret, "big")] + [
        secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    coefficients.reverse()
    out = []
    for x in points:
        value = 0
        for c in coefficients:  # Horner
            value = (value * x + c) % PRIME
        out.append(x.to_bytes(_POINT, "little") + value.to_bytes(_VALUE, "little"))
    return out


def point(share: bytes) -> int:
    """The point a share was evaluated at."""
    return int.from_bytes(share[:_POINT], "little")


@lru_cache(maxsize=4096)
def lagrange_at_zero(points: tuple[int, ...]) -> tuple[int, ...]:
    """The weights ``l_j`` with ``f(0) = sum_j l_j f(x_j)`` for every polynomial of degree
    below ``len(points)``: ``l_j = prod_{m != j} x_m / (x_m - x_j)`` modulo the prime."""
    weights = []
    for j, xj in enumerate(points):
        num = den = 1
        for m, xm in enumerate(points):
            if m != j:
                num *= xm
                den *= xm - xj
        weights.append(num * pow(den % PRIME, -1, PRIME) % PRIME)
    return tuple(weights)


def combine(shares: Sequence[bytes]) -> bytes:
    """The secret from ``threshold`` shares (more are allowed: every share given is used, so
    pass exactly the threshold for the cached weights to be shared across secrets). A
    ``ValueError`` if they are malformed or do not rebuild a secret."""
    if not shares or any(len(s) != _POINT + _VALUE for s in shares):
        raise ValueError("malformed shares")
    points = tuple(point(s) for s in shares)
    if len(set(points)) != len(points) or 0 in points:
        raise ValueError("shares at repeated or zero points")
    weights = lagrange_at_zero(points)
    value = sum(w * int.from_bytes(s[_POINT:], "little") for w, s in zip(
        weights, shares, strict=True)) % PRIME
    raw = value.to_bytes(_VALUE, "big").lstrip(b"\x00")
    if not raw or raw[0] != 1 or len(raw) > MAX_SECRET + 1:
        raise ValueError("the shares do not combine to a secret")
    return raw[1:]
