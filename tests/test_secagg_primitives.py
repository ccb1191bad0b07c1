"""fedpriv's secure-aggregation primitives on their standards' test vectors: X25519 (RFC 7748),
HKDF-SHA256 (RFC 5869), ChaCha20-Poly1305 (RFC 8439); fedpriv/secagg/crypto.py says why they
replace the SECP384R1 keys, Fernet tokens and GF(2^128) Shamir sharing of Flower's SecAgg+."""

from __future__ import annotations

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedpriv.secagg import crypto as C


def test_key_agreement_is_x25519_on_the_rfc_7748_vector_and_keys_are_32_bytes():
    # RFC 7748 section 6.1: Alice's and Bob's keys and their shared secret
    a_sk = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    a_pk = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    b_sk = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
    b_pk = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
    shared = bytes.fromhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")
    assert C.public_key_bytes_of(a_sk) == a_pk and C.public_key_bytes_of(b_sk) == b_pk
    expected = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                    info=b"fedpriv-secagg/pair/x").derive(shared)
    assert C.agree(a_sk, b_pk, b"pair/x") == C.agree(b_sk, a_pk, b"pair/x") == expected
    sk, pk = C.key_pair()
    assert len(sk) == len(pk) == 32 and C.public_key_bytes_of(sk) == pk
    assert C.key_pair_from_seed(bytes(32)) == C.key_pair_from_seed(bytes(32))
    with pytest.raises(ValueError, match="not a public key"):
        C.public_key(b"-----BEGIN PUBLIC KEY-----\ngarbage\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ValueError, match="not a usable public key"):
        C.agree(sk, bytes(32), b"pair/x")  # a low-order point: no shared secret


def test_key_derivation_is_hkdf_sha256_on_the_rfc_5869_vector():
    # RFC 5869 test case 3 (no salt, no info): the first 32 bytes of its output
    okm = bytes.fromhex("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d")
    assert C.hkdf(bytes([0x0B]) * 22, b"") == okm
    secret = bytes(range(32))
    assert C.hkdf(secret, b"fedpriv-secagg/x") == HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"fedpriv-secagg/x").derive(secret)


def test_shares_travel_encrypted_and_authenticated_for_one_pair_only():
    a_sk, a_pk = C.key_pair()
    b_sk, b_pk = C.key_pair()
    key = C.cipher_key(a_sk, b_pk)
    assert key == C.cipher_key(b_sk, a_pk) != C.agree(a_sk, b_pk, b"cipher")
    text = C.encrypt(key, b"share")
    assert len(text) == 12 + len(b"share") + 16 and text != C.encrypt(key, b"share")
    assert C.decrypt(key, text) == b"share"
    assert ChaCha20Poly1305(key).decrypt(text[:12], text[12:], None) == b"share"  # RFC 8439
    c_sk, _ = C.key_pair()
    with pytest.raises(InvalidTag):
        C.decrypt(C.cipher_key(c_sk, a_pk), text)
    with pytest.raises(InvalidTag):
        C.decrypt(key, text[:-1] + bytes([text[-1] ^ 1]))
