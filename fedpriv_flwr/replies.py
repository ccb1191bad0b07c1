"""A node's train reply as ``PrivateStrategy`` reads it: one ArrayRecord of arrays Flower can
decode, and whole-number counts; anything else is a ``RejectedReply`` naming why."""

from __future__ import annotations

import numpy as np
from flwr.app import Message, MetricRecord

from fedpriv_flwr.aggregate import USERS_KEY, RejectedReply
from fedpriv_flwr.metrics import finite


def reply_arrays(reply: Message) -> tuple[dict[str, np.ndarray], MetricRecord]:
    """The reply's arrays (its only ArrayRecord) and its metrics (empty if none)."""
    content = reply.content
    if len(content.array_records) != 1:
        raise RejectedReply(f"holds {len(content.array_records)} ArrayRecords, not one")
    record = next(iter(content.array_records.values()))
    metrics = (next(iter(content.metric_records.values())) if content.metric_records
               else MetricRecord())
    try:
        arrays = {k: v.numpy() for k, v in record.items()}
    except Exception as err:  # an array Flower cannot decode
        raise RejectedReply(f"holds an undecodable array ({type(err).__name__})") from None
    return arrays, metrics


def count_metric(metrics: MetricRecord, key: str, default: int = 0) -> int:
    """The whole number ``metrics[key]`` (``default`` if absent)."""
    value = metrics.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not finite(value) or value != int(value)):
        raise RejectedReply(f"{key} must be a whole number, got {value!r}")
    return int(value)


def users_of(metrics: MetricRecord, num_users: int) -> int:
    """A multi-user node's count of users (at most the declared population)."""
    users = count_metric(metrics, USERS_KEY, 1)
    if not 0 <= users <= num_users:
        raise RejectedReply(f"claims {users} users (0 to num_users)")
    return users
