"""The nodes' evaluation metrics as ``PrivateStrategy`` reads them: exact sums per metric name
(each value of a private metric clipped to ``[0, bound]`` first), how many nodes answered, and
how many replies were unreadable."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from logging import WARNING
from typing import Any

from flwr.app import Message
from flwr.common import log


def read_metrics(replies: Iterable[Message], bounds: Mapping[str, float],
                 skip: Collection[str]) -> tuple[dict[str, float], dict[str, int], int, int]:
    """(sum of each metric, how many nodes gave it, nodes answered, replies rejected); the
    names in ``skip`` (counts, weights) are not metrics."""
    exact: dict[str, float] = {}
    counts: dict[str, int] = {}
    answered, rejected = 0, 0
    for reply in replies:
        if reply.has_error() or len(reply.content.metric_records) != 1:
            rejected += not reply.has_error()
            continue
        metrics = next(iter(reply.content.metric_records.values()))
        answered += 1
        for name, value in metrics.items():
            if name in skip or not isinstance(value, (int, float)) or not finite(value):
                continue
            bound = bounds.get(name)
            # private metrics: each user's value clipped to [0, bound]
            v = min(max(float(value), 0.0), bound) if bound is not None else float(value)
            exact[name] = exact.get(name, 0.0) + v
            counts[name] = counts.get(name, 0) + 1
    return exact, counts, answered, rejected


def finite(value: int | float) -> bool:
    """A number float64 holds, finite (an int beyond it is not, rather than an error)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def failed_evaluations(server_round: int, replies: list[Message], unreadable: int,
                       answered: int) -> dict[str, Any]:
    """The operator report's count of evaluation replies that failed on their node (and why),
    said in Flower's log as Flower's own flow says it ("Received 0 results and 10 failures")."""
    failed = Counter(str(m.error.reason)[:300] for m in replies if m.has_error())
    if failed or unreadable:
        log(WARNING, "fedpriv: round %d: %d of %d evaluation replies failed, %d unreadable%s "
            "(reasons in the operator report)", server_round, sum(failed.values()),
            len(replies), unreadable, "; no node's metrics arrived" if not answered else "")
    return {"failed_evaluations": sum(failed.values()),
            "failed_evaluation_reasons": dict(failed)}

