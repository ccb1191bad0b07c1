"""Per-user random streams at the cost of the draws alone.

A user's synthetic data is drawn from ``np.random.default_rng([*key, user_id])``: a pure
function of (seed, stream, user), so any node regenerates exactly the users it hosts. Built one
user at a time, that generator costs more than the data it draws (a ``SeedSequence``, a
``PCG64`` and a ``Generator`` per user, several times the draws of a paper-setting user), so at
many users the seeding alone would dominate a pass over the data.

This module gives the *same* streams faster, bit for bit:

* ``pcg64_states`` computes, for a whole block of users at once in NumPy, the state that
  ``PCG64(SeedSequence([*key, uid]))`` starts in: NumPy's ``SeedSequence`` entropy mixing
  (``mix_entropy`` and ``generate_state``, 32-bit hash arithmetic) followed by PCG64's seeding
  (``pcg64_srandom_r``: two steps of the 128-bit LCG, done in 32-bit limbs).
* ``StreamWriter`` keeps one ``PCG64`` and one ``Generator`` and, per user, writes that state
  into the bit generator (through its ctypes view of the state struct), then draws with the
  usual ``Generator`` methods, so the values are NumPy's own.

Writing the state through ctypes relies on the layout of NumPy's ``pcg64_state``; the writer
checks the layout when it is built (it writes a state and reads it back through the public
``state`` property) and falls back to the public setter if the check fails. The tests compare
both the states and the draws with ``np.random.default_rng`` itself.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

_MASK32 = 0xFFFFFFFF
# numpy/random/bit_generator.pyx
_INIT_A = 0x43B0D7E5
_MULT_A = 0x931E8875
_INIT_B = 0x8B51F9DD
_MULT_B = 0x58F38DED
_MIX_MULT_L = 0xCA01F9DD
_MIX_MULT_R = 0x4973F715
_XSHIFT = np.uint32(16)
_POOL_SIZE = 4
# numpy/random/src/pcg64/pcg64.h: PCG_DEFAULT_MULTIPLIER_128
_PCG_MULT = (0x2360ED051FC65DA4 << 64) | 0x4385DF649FCCF645


def _words32(value: int) -> list[int]:
    """``SeedSequence``'s coercion of one non-negative int: little-endian 32-bit words."""
    if value < 0:
        raise ValueError(f"seed words must be non-negative, got {value}")
    if value == 0:
        return [0]
    words = []
    while value:
        words.append(value & _MASK32)
        value >>= 32
    return words


def seed_sequence_states(key: Sequence[int], user_ids: np.ndarray) -> np.ndarray:
    """``SeedSequence([*key, uid]).generate_state(4, np.uint64)`` for every uid, (n, 4)."""
    ids = np.asarray(user_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > _MASK32):
        raise ValueError("user ids must lie in [0, 2**32)")
    n = ids.shape[0]
    entropy = [np.full(n, w, dtype=np.uint32) for part in key for w in _words32(int(part))]
    entropy.append(ids.astype(np.uint32))
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = value * np.uint32(hash_const)
        return value ^ (value >> _XSHIFT)

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result: np.ndarray = np.uint32(_MIX_MULT_L) * x - np.uint32(_MIX_MULT_R) * y
        mixed: np.ndarray = result ^ (result >> _XSHIFT)
        return mixed

    with np.errstate(over="ignore"):
        zero = np.zeros(n, dtype=np.uint32)
        pool = [hashmix(entropy[i] if i < len(entropy) else zero) for i in range(_POOL_SIZE)]
        for src in range(_POOL_SIZE):
            for dst in range(_POOL_SIZE):
                if src != dst:
                    pool[dst] = mix(pool[dst], hashmix(pool[src]))
        for src in range(_POOL_SIZE, len(entropy)):
            for dst in range(_POOL_SIZE):
                pool[dst] = mix(pool[dst], hashmix(entropy[src]))
        hash_b = _INIT_B
        words = np.empty((n, 8), dtype=np.uint32)
        for i in range(8):
            value = pool[i % _POOL_SIZE] ^ np.uint32(hash_b)
            hash_b = (hash_b * _MULT_B) & _MASK32
            value = value * np.uint32(hash_b)
            words[:, i] = value ^ (value >> _XSHIFT)
    return words.astype("<u4").view("<u8").astype(np.uint64)  # little-endian pairs, as NumPy


def _limbs(hi: np.ndarray, lo: np.ndarray) -> list[np.ndarray]:
    """A 128-bit number as four 32-bit limbs (least significant first), in uint64 arrays."""
    m = np.uint64(_MASK32)
    s = np.uint64(32)
    return [lo & m, lo >> s, hi & m, hi >> s]


def _mul_add_128(hi: np.ndarray, lo: np.ndarray, const: int, add_hi: np.ndarray,
                 add_lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(hi:lo) * const + (add_hi:add_lo) mod 2**128``, vectorized over 32-bit limbs."""
    a = _limbs(hi, lo)
    c = [np.uint64((const >> (32 * i)) & _MASK32) for i in range(4)]
    b = _limbs(add_hi, add_lo)
    m, s = np.uint64(_MASK32), np.uint64(32)
    out = []
    carry = np.zeros_like(lo)
    with np.errstate(over="ignore"):
        for k in range(4):  # limb k of the product: sum of a_i c_j with i + j = k, plus carries
            total = carry + b[k]
            high = np.zeros_like(lo)
            for i in range(k + 1):
                p = a[i] * c[k - i]  # < 2**64
                total_lo = (total & m) + (p & m)
                high = high + (total >> s) + (p >> s) + (total_lo >> s)
                total = total_lo & m
            out.append(total)
            carry = high
    return (out[3] << s) | out[2], (out[1] << s) | out[0]


def pcg64_states(key: Sequence[int], user_ids: np.ndarray) -> np.ndarray:
    """The initial state of ``PCG64(SeedSequence([*key, uid]))`` for every uid: (n, 4) uint64
    words ``[state_lo, state_hi, inc_lo, inc_hi]`` (``pcg64_srandom_r``: ``inc = 2 seq + 1``,
    ``state = (inc + initstate) * A + inc``)."""
    seeds = seed_sequence_states(key, user_ids)
    init_hi, init_lo, seq_hi, seq_lo = seeds[:, 0], seeds[:, 1], seeds[:, 2], seeds[:, 3]
    inc_hi = (seq_hi << np.uint64(1)) | (seq_lo >> np.uint64(63))
    inc_lo = (seq_lo << np.uint64(1)) | np.uint64(1)
    with np.errstate(over="ignore"):
        lo = inc_lo + init_lo
        hi = inc_hi + init_hi + (lo < inc_lo).astype(np.uint64)
    state_hi, state_lo = _mul_add_128(hi, lo, _PCG_MULT, inc_hi, inc_lo)
    return np.stack([state_lo, state_hi, inc_lo, inc_hi], axis=1)


class StreamWriter:
    """One ``Generator`` that is rewound to a given user's stream before each user's draws."""

    def __init__(self) -> None:
        self.bit_generator = np.random.PCG64(0)
        self.generator = np.random.Generator(self.bit_generator)
        self._words: np.ndarray | None = None
        self._flags: np.ndarray | None = None
        try:
            address = self.bit_generator.ctypes.state_address
            pointer = ctypes.c_void_p.from_address(address).value
            if pointer is None:  # a null state pointer: not the layout this expects
                return
            words = np.ctypeslib.as_array((ctypes.c_uint64 * 4).from_address(pointer))
            flags = np.ctypeslib.as_array((ctypes.c_uint32 * 2).from_address(address + 8))
        except (AttributeError, TypeError, ValueError):  # not the layout this expects
            return
        probe = np.array([0x0123456789ABCDEF, 0x0FEDCBA987654321, 0x1111, 0x2223],
                         dtype=np.uint64)
        words[:] = probe
        state = self.bit_generator.state["state"]
        if (state["state"] == (int(probe[1]) << 64) | int(probe[0])
                and state["inc"] == (int(probe[3]) << 64) | int(probe[2])):
            self._words, self._flags = words, flags

    @property
    def fast(self) -> bool:
        """Whether states are written directly (else through the public ``state`` setter)."""
        return self._words is not None

    def start(self, state: np.ndarray) -> np.random.Generator:
        """The generator, at the start of the stream whose initial state is ``state`` (a row
        of ``pcg64_states``)."""
        if self._words is not None and self._flags is not None:  # set together
            self._words[:] = state
            self._flags[:] = 0  # no buffered 32-bit half-draw
        else:
            self.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": (int(state[1]) << 64) | int(state[0]),
                          "inc": (int(state[3]) << 64) | int(state[2])},
                "has_uint32": 0, "uinteger": 0}
        return self.generator
