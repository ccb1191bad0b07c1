"""Node replies: which ones the server uses, and how far each node's sums may move a release.

A node's reply is used only if it is well formed for the step: no error, one of the run's
partitions, its first reply in the step, the user count the server expects (a public value),
and exactly the step's parts, each a finite float32/float64 array of the part's shape (or, in
the final step, the finite metrics every honest node sends). Anything else is rejected, counted
under one of ``REJECTION_KINDS`` and reported, and the step goes on with the other nodes.

Privacy argument (the trusted-node bound): the accountant assumes one user moves a part's sum
by at most ``clip_norm`` (L2), or each candidate's score by at most ``clip_norm`` within
``[0, clip_norm]``. Nodes clip their own users, but the server does not rely on it: a node whose
expected user count is ``n`` has its sum scaled to norm ``<= n * clip_norm`` (score vectors
clamped entrywise to ``[0, n * clip_norm]``), which is all that ``n`` clipped users can send. So
a misbehaving node can move a release no further than its users could, and the sensitivity
behind the calibrated noise holds whatever the nodes send.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Part, Step, UserContribution
from fedpriv.server.discrete import check_ring_totals

# Why a node's reply was not used: each is counted per step and over the run.
REJECTION_KINDS = (
    "node-error",  # the node reported an error (crashed)
    "timeout",  # no reply before node-timeout
    "unavailable",  # the transport lost the node or its message (Flower's node/message
    # unavailable errors): like a timeout, nothing the node's users' data did
    "malformed",  # the message lacks records or has non-integer counts
    "unknown-partition",  # a partition id the server does not expect
    "duplicate",  # a second reply for the same partition
    "user-count",  # claims another number of users than take part in the step
    "missing-part",  # a released part is missing
    "unexpected-part",  # an array the step does not release
    "dtype",  # not a real floating-point array
    "shape",  # not the part's shape
    "non-finite",  # NaN or infinity
    "range",  # distributed: a value outside [0, 2^b)
    "metrics",  # final step: missing or non-finite metrics
)


# The rejections a node's users' data cannot cause: the node was lost on the way (its work is
# bounded by public values: max-rows-per-user). Only these make the missing-node rescale count
# a node as missing; a node that answered with an error or with unusable sums (which a bug
# meeting one user's data could cause) counts as present, its users contributing zero.
LOST_KINDS = frozenset({"timeout", "unavailable"})


@dataclass
class NodeReply:
    """A node's answer to one step, as the transport received it. ``error`` set: no usable
    contribution, for the reason ``failure`` (one of ``REJECTION_KINDS``)."""

    partition_id: int
    contribution: UserContribution | None = None
    error: str | None = None
    failure: str = "node-error"


@dataclass(frozen=True)
class Rejection:
    """One reply the server did not use: its partition, the kind and a readable detail."""

    partition_id: int
    kind: str
    detail: str


@dataclass(frozen=True)
class CheckedReplies:
    """The outcome of checking one step's replies."""

    accepted: list[UserContribution]  # the usable contributions, in reply order
    answered: set[int]  # the partitions they come from
    rejected: list[Rejection]  # the others, in reply order


def check_totals(step: Step, contrib: UserContribution) -> tuple[str, str] | None:
    """(kind, detail) of the first problem with a node's sums for ``step``, or None."""
    totals = contrib.totals if isinstance(contrib.totals, Mapping) else {}
    names = {part.name for part in step.parts}
    extra = sorted(str(k) for k in totals if k not in names)
    if extra:
        return "unexpected-part", f"arrays {extra} are not released in {step.label}"
    for part in step.parts:
        if part.name not in totals:
            return "missing-part", f"no array {part.name!r}"
        total = np.asarray(totals[part.name])
        if total.dtype not in (np.float32, np.float64):
            return "dtype", f"{part.name!r} has dtype {total.dtype}, expected float32 or float64"
        if total.shape != part.shape:
            return "shape", f"{part.name!r} has shape {total.shape}, expected {part.shape}"
        if not np.all(np.isfinite(total)):
            return "non-finite", f"non-finite values in {part.name!r}"
    return None


def common_metric_keys(replies: Sequence[NodeReply]) -> frozenset[str]:
    """The metric names most final replies carry (every honest node sends the same ones)."""
    sets = Counter(frozenset(r.contribution.metrics) for r in replies
                   if r.contribution is not None
                   and isinstance(r.contribution.metrics, Mapping))
    return sets.most_common(1)[0][0] if sets else frozenset()


def reply_problem(step: Step, reply: NodeReply, expected: Mapping[int, int | None],
                  seen: set[int], metric_keys: frozenset[str] | None,
                  ring: Mapping[str, tuple[int, int]] | None = None) -> tuple[str, str] | None:
    """(kind, detail) of why ``reply`` cannot be used, or None. ``expected``: {partition: users
    taking part, or None where the server cannot know it (natural users: the node's count is
    its own)}; ``seen``: partitions already accepted in the step; ``metric_keys``: the final
    step's metric names (None in other steps)."""
    contrib = reply.contribution
    if reply.error is not None or contrib is None:
        kind = reply.failure if reply.failure in REJECTION_KINDS else "node-error"
        return kind, reply.error or "no content"
    if reply.partition_id not in expected:
        return "unknown-partition", f"partition {reply.partition_id} is not one of this run's"
    if reply.partition_id in seen:
        return "duplicate", "a second reply for the partition"
    wanted = expected[reply.partition_id]
    if contrib.num_users < 0 or (wanted is not None and contrib.num_users != wanted):
        return "user-count", f"claims {contrib.num_users} users, {wanted} take part"
    if not 0 <= contrib.num_clipped <= contrib.num_users:
        return "malformed", f"{contrib.num_clipped} users clipped of {contrib.num_users}"
    if metric_keys is None:
        if ring is not None:  # distributed: vectors mod 2^b (``fedpriv.server.discrete``)
            totals = contrib.totals if isinstance(contrib.totals, Mapping) else {}
            return check_ring_totals(totals, ring)
        return check_totals(step, contrib)
    if (not isinstance(contrib.metrics, Mapping) or frozenset(contrib.metrics) != metric_keys
            or not all(np.isfinite(v) for v in contrib.metrics.values())):
        return "metrics", ("missing, unexpected or non-finite metrics (the final evaluation is "
                           "the nodes' own measurement)")
    return None


def bound_node_sum(part: Part, total: np.ndarray, num_users: int) -> tuple[np.ndarray, bool]:
    """A node's sum of ``part`` within what ``num_users`` clipped users can send, and whether
    it had to be bounded: scaled to L2 norm ``<= num_users * clip_norm`` (score vectors of the
    exponential mechanism: clamped entrywise to ``[0, num_users * clip_norm]``)."""
    value = np.asarray(total, dtype=np.float64)
    bound = num_users * part.clip_norm
    if part.mechanism == "exponential":
        clamped = np.clip(value, 0.0, bound)
        return clamped, not np.array_equal(clamped, value)
    peak = float(np.max(np.abs(value), initial=0.0))  # overflow-free norm
    norm = peak * float(np.linalg.norm(value / peak)) if peak > 0 else 0.0
    if norm > bound * (1.0 + 1e-9):
        return value * (bound / norm), True
    return value, False


class ReplyChecker:
    """Checks each step's replies and bounds the accepted nodes' sums, counting over the run
    the rejections (by kind) and the node sums that had to be bounded."""

    def __init__(self) -> None:
        self.rejections: Counter[str] = Counter()
        self.bounded = 0

    def check(self, step: Step, replies: Sequence[NodeReply],
              expected: Mapping[int, int | None],
              ring: Mapping[str, tuple[int, int]] | None = None) -> CheckedReplies:
        """Sort ``replies`` into usable contributions and counted rejections (``ring``: a
        distributed step's {part: (padded dimension, bits)})."""
        seen: set[int] = set()
        accepted: list[UserContribution] = []
        rejected: list[Rejection] = []
        metric_keys = common_metric_keys(replies) if step.is_final else None
        for reply in replies:
            problem = reply_problem(step, reply, expected, seen, metric_keys, ring)
            if problem is not None:
                self.rejections[problem[0]] += 1
                rejected.append(Rejection(reply.partition_id, *problem))
                continue
            seen.add(reply.partition_id)
            assert reply.contribution is not None  # reply_problem refuses a reply without one
            accepted.append(reply.contribution)
        return CheckedReplies(accepted, seen, rejected)

    def bounded_sum(self, part: Part, accepted: Sequence[UserContribution]) -> np.ndarray:
        """Sum of the accepted nodes' totals of ``part``, each within its users' bound."""
        total = np.zeros(part.shape)
        for contrib in accepted:
            value, bounded = bound_node_sum(part, contrib.totals[part.name], contrib.num_users)
            self.bounded += int(bounded)
            total += value
        return total

    def state(self) -> dict[str, Any]:
        """The counters, under their checkpoint keys."""
        return {"rejections": self.rejections, "bounded": self.bounded}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.rejections, self.bounded = state["rejections"], state["bounded"]
