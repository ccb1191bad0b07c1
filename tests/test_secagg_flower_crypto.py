"""fedpriv's secure-aggregation primitives are Flower's SecAgg+ primitives: each reads and writes
exactly what Flower's functions do (the core calls the same libraries without importing
Flower; see fedpriv/secagg/crypto.py)."""

from __future__ import annotations

import pytest
from cryptography.fernet import InvalidToken
from flwr.common.secure_aggregation.crypto import shamir as flower_shamir
from flwr.common.secure_aggregation.crypto import symmetric_encryption as flower_sym
from flwr.supercore.primitives import asymmetric as flower_keys

from fedpriv.secagg import crypto as C


def test_key_pairs_are_flowers_format_both_ways():
    sk, pk = C.key_pair()
    assert flower_keys.public_key_to_bytes(flower_keys.bytes_to_private_key(sk).public_key()) \
        == pk
    fsk, fpk = flower_keys.generate_key_pairs()
    fsk_b, fpk_b = flower_keys.private_key_to_bytes(fsk), flower_keys.public_key_to_bytes(fpk)
    assert C.public_key_bytes_of(fsk_b) == fpk_b
    assert C.public_key(fpk_b).public_numbers() == fpk.public_numbers()
    with pytest.raises(ValueError, match="not a public key"):
        C.public_key(b"-----BEGIN PUBLIC KEY-----\ngarbage\n-----END PUBLIC KEY-----\n")


def test_the_encryption_key_and_ciphertexts_are_flowers():
    a_sk, a_pk = C.key_pair()
    b_sk, b_pk = C.key_pair()
    ours = C.cipher_key(a_sk, b_pk)
    flowers = flower_sym.generate_shared_key(flower_keys.bytes_to_private_key(b_sk),
                                             flower_keys.bytes_to_public_key(a_pk))
    assert ours == flowers  # the same key from either end, by either implementation
    assert flower_sym.decrypt(flowers, C.encrypt(ours, b"share")) == b"share"
    assert C.decrypt(ours, flower_sym.encrypt(flowers, b"share")) == b"share"
    c_sk, c_pk = C.key_pair()
    with pytest.raises(InvalidToken):
        C.decrypt(C.cipher_key(c_sk, a_pk), C.encrypt(ours, b"share"))


@pytest.mark.parametrize("secret_len", [32, 306])
def test_shamir_shares_combine_with_flowers_and_back(secret_len):
    secret = bytes(range(256))[:secret_len] if secret_len <= 256 else bytes(secret_len)
    ours = C.create_shares(secret, 3, 5)
    assert [len(s) for s in ours] == [len(s) for s in flower_shamir.create_shares(secret, 3, 5)]
    assert flower_shamir.combine_shares(ours[1:4]) == secret
    assert C.combine_shares(flower_shamir.create_shares(secret, 3, 5)[::2]) == secret
    assert C.combine_shares([ours[4], ours[0], ours[2]]) == secret
    try:  # below the threshold: not the secret (usually not even a padded string)
        below = C.combine_shares(ours[:2])
    except ValueError:
        below = None
    assert below != secret
