"""The cryptography of secure aggregation: Flower's primitives, a ChaCha20 mask generator.

Key agreement, authenticated encryption and Shamir sharing are Flower's
(``flwr.supercore.primitives.asymmetric``: ECDH on SECP384R1;
``flwr.common.secure_aggregation.crypto``: HKDF-SHA256 to a Fernet key, Fernet's AES-CBC +
HMAC, pycryptodome's Shamir over GF(2^128) in 16-byte chunks). What fedpriv adds: mask
expansion by a cryptographic generator (ChaCha20, 20 rounds, keyed with 256 bits derived by
HKDF; Flower's ``pseudo_rand_gen`` folds its seed to 32 bits and draws from MT19937), and the
vector layout every node masks the same way (each segment modulo its own ``2^bits``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)
from randomgen import ChaCha  # type: ignore[import-untyped, unused-ignore]

__all__ = ["Layout", "Segment", "agree", "combine_shares", "create_shares", "decrypt",
           "encrypt", "key_pair", "mask", "pack_share", "private_key", "public_key",
           "unpack_share"]

SEED_BYTES = 32


def key_pair() -> tuple[bytes, bytes]:
    """A fresh ECDH key pair (private, public), serialized (OS entropy)."""
    sk, pk = generate_key_pairs()
    return private_key_to_bytes(sk), public_key_to_bytes(pk)


def private_key(data: bytes) -> ec.EllipticCurvePrivateKey:
    return bytes_to_private_key(data)


def public_key_bytes_of(sk: bytes) -> bytes:
    """The serialized public key of a serialized private key."""
    return public_key_to_bytes(private_key(sk).public_key())


def public_key(data: bytes) -> ec.EllipticCurvePublicKey:
    """A peer's public key; a ``ValueError`` if the bytes are not one."""
    try:
        return bytes_to_public_key(data)
    except Exception as err:  # noqa: BLE001 -- whatever the parser raises on garbage
        raise ValueError(f"not a public key: {err}") from None


def agree(sk: bytes, pk: bytes, purpose: bytes) -> bytes:
    """A 32-byte secret shared by the owners of (``sk``, peer's ``pk``), one per ``purpose``:
    HKDF-SHA256 of the ECDH secret. ``purpose`` binds it to the round and its use."""
    shared = private_key(sk).exchange(ec.ECDH(), public_key(pk))
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None,
                info=b"fedpriv-secagg/" + purpose).derive(shared)


def cipher_key(sk: bytes, pk: bytes) -> bytes:
    """The authenticated-encryption key of a pair (Flower's derivation: HKDF to Fernet)."""
    return generate_shared_key(private_key(sk), public_key(pk))


@dataclass(frozen=True)
class Segment:
    """A run of ``length`` coordinates summed modulo ``2^bits``."""

    name: str
    length: int
    bits: int


@dataclass(frozen=True)
class Layout:
    """The masked vector: segments in order. Every node of a round uses the same layout, so
    pairwise masks cancel coordinate by coordinate."""

    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return sum(s.length for s in self.segments)

    def moduli(self) -> np.ndarray:
        """Per coordinate: ``2^bits - 1`` (the reduction mask)."""
        return np.concatenate([np.full(s.length, (1 << s.bits) - 1, dtype=np.uint64)
                               for s in self.segments]) if self.segments else (
            np.zeros(0, dtype=np.uint64))

    def join(self, values: dict[str, np.ndarray]) -> np.ndarray:
        """The segments' ring values (each in ``[0, 2^bits)``) as one uint64 vector."""
        out = []
        for s in self.segments:
            v = np.asarray(values[s.name]).astype(np.uint64).reshape(-1)
            if v.shape != (s.length,):
                raise ValueError(f"segment {s.name!r} has {v.size} values, expected {s.length}")
            if v.size and v.max() > (1 << s.bits) - 1:
                raise ValueError(f"segment {s.name!r} has values outside [0, 2^{s.bits})")
            out.append(v)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)

    def split(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        out, start = {}, 0
        for s in self.segments:
            out[s.name] = vector[start:start + s.length]
            start += s.length
        return out

    def to_json(self) -> list[list[str | int]]:
        return [[s.name, s.length, s.bits] for s in self.segments]

    @staticmethod
    def from_json(rows: Sequence[Sequence[str | int]]) -> Layout:
        return Layout(tuple(Segment(str(n), int(length), int(b)) for n, length, b in rows))


def mask(seed: bytes, layout: Layout) -> np.ndarray:
    """The mask a 32-byte ``seed`` expands to: ChaCha20 words, each reduced modulo its
    segment's ``2^bits`` (exactly uniform: ``2^bits`` divides ``2^64``)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(seed)}")
    stream = ChaCha(key=int.from_bytes(seed, "little"), counter=0, rounds=20)
    words: np.ndarray = np.asarray(stream.random_raw(layout.size), dtype=np.uint64)
    masked: np.ndarray = words & layout.moduli()
    return masked


def add(a: np.ndarray, b: np.ndarray, layout: Layout, sign: int = 1) -> np.ndarray:
    """``a + sign b`` coordinate-wise modulo each segment's ``2^bits`` (uint64 wraps modulo
    ``2^64``, which every ``2^bits`` divides)."""
    total: np.ndarray = (a + b if sign > 0 else a - b) & layout.moduli()
    return total


def pack_share(src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    """The plaintext node ``src`` encrypts for ``dst``: both ids (so a share cannot be
    replayed to another pair) and its shares of its mask seed and of its mask key."""
    return struct.pack("<qqII", src, dst, len(seed_share), len(key_share)) + seed_share + (
        key_share)


def unpack_share(plain: bytes, src: int, dst: int) -> tuple[bytes, bytes]:
    """The two shares of a plaintext from ``src`` to ``dst``; ``ValueError`` if it is not
    one."""
    head = struct.calcsize("<qqII")
    if len(plain) < head:
        raise ValueError("share plaintext too short")
    s, d, n1, n2 = struct.unpack("<qqII", plain[:head])
    if (s, d) != (src, dst) or len(plain) != head + n1 + n2:
        raise ValueError(f"share plaintext is for {s}->{d}, not {src}->{dst}")
    return plain[head:head + n1], plain[head + n1:]


def digest(*parts: bytes) -> bytes:
    """SHA-256 of the parts (length-prefixed)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.digest()
