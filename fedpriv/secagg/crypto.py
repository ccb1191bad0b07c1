"""The cryptography of secure aggregation: Flower's SecAgg+ primitives, a ChaCha20 mask generator.

Key agreement, authenticated encryption and Shamir sharing are the constructions of Flower's
SecAgg+ (``flwr.supercore.primitives.asymmetric``, ``flwr.common.secure_aggregation.crypto``):
ECDH on SECP384R1 with PEM-serialized keys; HKDF-SHA256 of the shared secret to a Fernet key
(AES-CBC + HMAC-SHA256); pycryptodome's Shamir over GF(2^128), the secret padded to 16-byte
chunks, each share prefixed by its 4-byte index. They are called here on the same libraries
(``cryptography``, ``pycryptodome``: Flower's own dependencies) because fedpriv's core imports
no Flower module; tests/test_secure_aggregation.py checks that each one reads and writes
exactly what Flower's functions do. What fedpriv adds: mask expansion by a cryptographic
generator (ChaCha20, 20 rounds, keyed with 256 bits derived by HKDF; Flower's
``pseudo_rand_gen`` folds its seed to 32 bits and draws from MT19937), and the vector layout
every node masks the same way (each segment modulo its own ``2^bits``).
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from Crypto.Util.Padding import pad, unpad
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from randomgen import ChaCha  # type: ignore[import-untyped, unused-ignore]

SEED_BYTES = 32


# ----- key agreement and encryption (Flower's constructions) ---------------------------------
def key_pair() -> tuple[bytes, bytes]:
    """A fresh ECDH key pair on SECP384R1 (private, public), PEM-serialized (OS entropy)."""
    sk = ec.generate_private_key(ec.SECP384R1())
    return (sk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()),
            _public_bytes(sk.public_key()))


def key_pair_from_seed(seed: bytes) -> tuple[bytes, bytes]:
    """The SECP384R1 key pair a 32-byte ``seed`` determines (HKDF-SHA256 to 64 bytes, reduced
    to a scalar in [1, n - 1]; bias below 2^-128): a mask key is shared as its 32-byte seed,
    not its 306-byte PEM encoding (Shamir sharing costs per 16-byte chunk)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a key seed has {SEED_BYTES} bytes, got {len(seed)}")
    wide = HKDF(algorithm=hashes.SHA256(), length=64, salt=None,
                info=b"fedpriv-secagg/mask-key").derive(seed)
    scalar = int.from_bytes(wide, "big") % (_P384_ORDER - 1) + 1
    sk = ec.derive_private_key(scalar, ec.SECP384R1())
    return (sk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()),
            _public_bytes(sk.public_key()))


_P384_ORDER = int("ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf"
                  "581a0db248b0a77aecec196accc52973", 16)


def _public_bytes(pk: ec.EllipticCurvePublicKey) -> bytes:
    return pk.public_bytes(serialization.Encoding.PEM,
                           serialization.PublicFormat.SubjectPublicKeyInfo)


def private_key(data: bytes) -> ec.EllipticCurvePrivateKey:
    return cast(ec.EllipticCurvePrivateKey,
                serialization.load_pem_private_key(data, password=None))


def public_key_bytes_of(sk: bytes) -> bytes:
    """The serialized public key of a serialized private key."""
    return _public_bytes(private_key(sk).public_key())


def public_key(data: bytes) -> ec.EllipticCurvePublicKey:
    """A peer's public key; a ``ValueError`` if the bytes are not one."""
    try:
        key = serialization.load_pem_public_key(data)
    except Exception as err:  # noqa: BLE001 -- whatever the parser raises on garbage
        raise ValueError(f"not a public key: {err}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError(f"not an elliptic-curve public key: {type(key).__name__}")
    return key


def agree(sk: bytes | ec.EllipticCurvePrivateKey, pk: bytes, purpose: bytes) -> bytes:
    """A 32-byte secret shared by the owners of (``sk``, peer's ``pk``), one per ``purpose``:
    HKDF-SHA256 of the ECDH secret. ``purpose`` binds it to the round and its use. ``sk``:
    serialized, or loaded once for many peers."""
    key = private_key(sk) if isinstance(sk, bytes) else sk
    shared = key.exchange(ec.ECDH(), public_key(pk))
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None,
                info=b"fedpriv-secagg/" + purpose).derive(shared)


def cipher_key(sk: bytes | ec.EllipticCurvePrivateKey, pk: bytes) -> bytes:
    """The authenticated-encryption key of a pair (Flower's ``generate_shared_key``: HKDF-SHA256
    without salt or info, URL-safe base64 for Fernet)."""
    key = private_key(sk) if isinstance(sk, bytes) else sk
    shared = key.exchange(ec.ECDH(), public_key(pk))
    return base64.urlsafe_b64encode(
        HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=None).derive(shared))


def encrypt(key: bytes, plaintext: bytes) -> bytes:
    return Fernet(key).encrypt(plaintext)


def decrypt(key: bytes, ciphertext: bytes) -> bytes:
    """The plaintext; ``cryptography.fernet.InvalidToken`` if the key or the text is wrong."""
    return Fernet(key).decrypt(ciphertext)


# ----- Shamir sharing (Flower's format) ------------------------------------------------------
def create_shares(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """``num`` shares of ``secret``, any ``threshold`` of which rebuild it: each share is its
    4-byte index, then one 16-byte share per 16-byte chunk of the padded secret."""
    padded = pad(secret, 16)
    shares = [bytearray(i.to_bytes(4, "little")) for i in range(1, num + 1)]
    for start in range(0, len(padded), 16):
        for index, share in Shamir.split(threshold, num, padded[start:start + 16], ssss=False):
            shares[index - 1] += share
    return [bytes(s) for s in shares]


def combine_shares(shares: Sequence[bytes]) -> bytes:
    """The secret from at least ``threshold`` shares (``ValueError`` if they do not fit)."""
    chunks = (len(shares[0]) - 4) // 16
    secret = bytearray()
    for c in range(chunks):
        parts = [(int.from_bytes(s[:4], "little"), s[4 + 16 * c:20 + 16 * c]) for s in shares]
        secret += Shamir.combine(parts, ssss=False)
    try:
        return unpad(bytes(secret), 16)
    except ValueError:
        raise ValueError("the shares do not combine to a secret") from None


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
