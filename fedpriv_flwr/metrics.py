"""The nodes' evaluation metrics as ``PrivateStrategy`` reads them: exact sums per metric name
(each value of a private metric clipped to ``[0, bound]`` first), how many nodes answered, and
how many replies were unreadable."""

from __future__ import annotations

import math
import re
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
    failed = Counter(error_reason(m) for m in replies if m.has_error())
    if failed or unreadable:
        log(WARNING, "fedpriv: round %d: %d of %d evaluation replies failed, %d unreadable%s "
            "(reasons in the operator report)", server_round, sum(failed.values()),
            len(replies), unreadable, "; no node's metrics arrived" if not answered else "")
    return {"failed_evaluations": sum(failed.values()),
            "failed_evaluation_reasons": dict(failed)}


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PIDS = re.compile(r"\b(pid=|ip=|actor_id=|at 0x)[0-9a-f.]+\b", re.I)
_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Interrupt|Exit))\b")


def error_reason(reply: Message, limit: int = 300) -> str:
    """A failed reply's reason for the operator report: without colour codes or process ids
    (so one failure on every node counts as one reason), and, where it is long (a traceback
    from Flower's simulation), its start and its end, which names the exception."""
    text = _PIDS.sub(r"\1...", _ANSI.sub("", str(reply.error.reason))).strip()
    if len(text) <= limit:
        return text
    return f"{text[:limit // 3]} ... {text[-(limit - limit // 3 - 5):]}"


def evaluation_summary(rows: list[dict[str, Any]]) -> str | None:
    """The run's closing line when evaluations failed on their nodes (None if none did)."""
    failed = [row for row in rows if row.get("failed_evaluations")]
    if not failed:
        return None
    empty = [row["round"] for row in failed if not row.get("evaluated_nodes")]
    reasons: Counter[str] = Counter()
    for row in failed:
        reasons.update(row.get("failed_evaluation_reasons") or {})
    reason, count = reasons.most_common(1)[0]
    kinds = _EXCEPTION.findall(reason)  # the type only: a node's message stays in the report
    return (f"evaluation replies failed in {len(failed)} of {len(rows)} rounds ({len(empty)} "
            f"with no node's metrics); commonest reason ({count} replies): "
            f"{kinds[-1] if kinds else 'an error'}, in the operator report")


def merge_row(rows: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """Add an evaluation row to the operator report's rows (into its round's, if there)."""
    for existing in rows:
        if existing["round"] == row["round"]:
            existing.update({k: v for k, v in row.items() if k != "round"})
            return
    rows.append(row)
