"""One round's private mean, in numpy: the replies' updates checked, clipped per user and summed.

Privacy argument (``PrivateStrategy`` adds the noise and the accounting on top). The server
releases ``(sum_u clip(delta_u, C) + N(0, (z C)^2 I)) / (q N)``: ``delta_u`` is user ``u``'s
update (its returned model minus the broadcast one, over the *released* keys: every key the
server sent but the personal ones), ``q N`` is the expected cohort (a public constant, never who
answered), so adding or removing one user moves the exact part by at most ``C / (q N)`` whatever
that user's data or model holds (twice that when one user is replaced). Reply weights are never
read. A reply that is not a finite update of the released keys' shapes is *rejected* (counted,
with its reason, in the operator report) and contributes nothing; the run goes on.

A node hosting several users sends ``sum_u clip(delta_u, C)`` itself with its count of users in
the metric ``fedpriv-users`` (``fedpriv_flwr.users.user_sum_reply``: a user whose training or
model fails adds a zero update and still counts, so one user never costs its node's reply); the
server checks the sum's norm against ``k C`` (a node cannot exceed what ``k`` clipped users can
move) and rejects it otherwise. The per-user sensitivity is then the same ``C`` (each user is
clipped on its node). If a node clips its sum instead of each user, one user can move that
clipped sum by up to ``2 C``: state ``user_sensitivity_factor = 2`` to the strategy (the node
then clips its sum to ``C``, and the server checks the sum against ``C``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedpriv.privacy.mechanisms import gaussian_noise

USERS_KEY = "fedpriv-users"  # a multi-user node's reply: how many users its sum holds
UNCLIPPED_KEY = "fedpriv-unclipped"  # ... and how many of them were not clipped


class RejectedReply(ValueError):
    """A reply that cannot be part of the private sum (the reason is the message)."""


@dataclass(frozen=True)
class Layout:
    """The released keys of the model, in order, with their shapes: how a dict of arrays becomes
    one float64 vector and back."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray], keys: Sequence[str]) -> Layout:
        return cls(tuple(keys), tuple(tuple(arrays[k].shape) for k in keys),
                   tuple(np.asarray(arrays[k]).dtype for k in keys))

    @property
    def size(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def flatten(self, arrays: Mapping[str, np.ndarray],
                out: np.ndarray | None = None) -> np.ndarray:
        """The arrays of the keys, in order, as one float64 vector (written into ``out`` when
        given: a round reuses one buffer for every reply instead of allocating per reply)."""
        vector = np.empty(self.size) if out is None else out
        start = 0
        for k, shape in zip(self.keys, self.shapes, strict=True):
            n = math.prod(shape)
            vector[start:start + n] = np.asarray(arrays[k]).reshape(-1)
            start += n
        return vector

    def unflatten(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        out, start = {}, 0
        for k, shape, dtype in zip(self.keys, self.shapes, self.dtypes, strict=True):
            n = math.prod(shape)
            out[k] = np.asarray(vector[start:start + n].reshape(shape), dtype=dtype)
            start += n
        return out


def reply_update(layout: Layout, current: np.ndarray, returned: Mapping[str, np.ndarray],
                 personal: frozenset[str], out: np.ndarray | None = None) -> np.ndarray:
    """The update ``returned - current`` over the released keys (in ``out`` when given), or
    ``RejectedReply``."""
    carried = set(returned) & personal
    if carried:
        raise RejectedReply(f"carries personal layers {sorted(carried)[:3]}")
    missing = [k for k in layout.keys if k not in returned]
    if missing:
        raise RejectedReply(f"misses released keys {missing[:3]} (personal layers not declared "
                            "to the strategy as personal_layers?)")
    extra = set(returned) - set(layout.keys)
    if extra:
        raise RejectedReply(f"has keys the server did not send: {sorted(extra)[:3]}")
    for k, shape in zip(layout.keys, layout.shapes, strict=True):
        if tuple(np.shape(returned[k])) != shape:
            raise RejectedReply(f"key {k!r} has shape {np.shape(returned[k])}, expected {shape}")
        if np.asarray(returned[k]).dtype.kind not in "biuf":
            raise RejectedReply(f"key {k!r} is not a real-valued array")
    vector = layout.flatten(returned, out)
    vector -= current
    if not math.isfinite(float(np.einsum("i,i->", vector, vector))):
        raise RejectedReply("holds non-finite values (or values too large to clip)")
    return vector


@dataclass
class RoundSum:
    """The exact clipped sum of one round, and the counts the operator report keeps."""

    size: int
    total: np.ndarray = field(init=False)
    users: int = 0
    unclipped: int = 0
    nodes: int = 0
    failed: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # the failed replies' reasons

    def __post_init__(self) -> None:
        self.total = np.zeros(self.size)

    def add_user(self, update: np.ndarray, clip_norm: float) -> None:
        """One user's update, clipped to ``clip_norm``."""
        norm = _norm(update)
        if norm <= clip_norm:
            self.unclipped += 1
            self.total += update
        else:  # scaled in place: ``update`` is the round's reply buffer
            update *= clip_norm / norm
            self.total += update
        self.users += 1
        self.nodes += 1

    def add_node_sum(self, clipped_sum: np.ndarray, users: int, unclipped: int,
                     clip_norm: float, sum_clipped: bool = False) -> None:
        """A multi-user node's sum of its users' clipped updates, checked against ``users C``
        (``sum_clipped``: a node that clips its sum, checked against ``C``)."""
        if users < 0 or not 0 <= unclipped <= users:
            raise RejectedReply(f"reports {users} users of which {unclipped} unclipped")
        norm = _norm(clipped_sum)
        limit = clip_norm if sum_clipped else users * clip_norm
        if not norm <= limit * (1.0 + 1e-6):
            raise RejectedReply(f"its sum has norm {norm:.4g}, more than its clip allows "
                                f"({limit:.4g})")
        self.total += clipped_sum
        self.users += users
        self.unclipped += unclipped
        self.nodes += 1

    def reject(self, reason: str) -> None:
        self.rejected[reason.split(":")[0]] += 1


def _norm(vector: np.ndarray) -> float:
    """The L2 norm (without BLAS: its threads only contend with the server's on small
    machines, and a vector of this size is memory-bound anyway)."""
    return math.sqrt(float(np.einsum("i,i->", vector, vector)))


def noisy_mean(exact_sum: np.ndarray, denominator: float, std: float,
               rng: np.random.Generator) -> np.ndarray:
    """``exact_sum / denominator`` plus ``N(0, std^2 I)`` noise (``std`` is the mean's: the
    noise multiplier times the mean's sensitivity), drawn as fedpriv's own releases draw it."""
    result: np.ndarray = exact_sum / denominator + gaussian_noise(exact_sum.shape, std, rng)
    return result
