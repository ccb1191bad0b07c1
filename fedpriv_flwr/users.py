"""Nodes that host several users (``PrivateStrategy(..., multi_user_nodes=True)``).

The node clips each of its users' updates to the round's clip norm (sent by the server in the
train config as ``fedpriv-clip-norm``) and replies with their *sum* and the count of users in
it, so the per-user sensitivity stays the clip norm: the server checks the sum's norm against
``users x clip`` and rejects a node that exceeds it. With a sampling rate below 1 the node
samples its users itself (``fedpriv-sampling-rate``), each independently, from OS entropy: the
server does not learn who took part beyond the count. Typical handler::

    @app.train()
    def train(msg, context):
        users = sample_users(my_user_ids, msg)
        models = {u: local_train(msg.content["arrays"], data_of(u)) for u in users}
        return Message(user_sum_reply(msg, list(models.values())), reply_to=msg)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from fedpriv_flwr.aggregate import UNCLIPPED_KEY, USERS_KEY
from fedpriv_flwr.strategy import CLIP_CONFIG, RATE_CONFIG


def _config(msg: Message, key: str) -> float:
    for record in msg.content.config_records.values():
        if key in record:
            value = record[key]
            if isinstance(value, (int, float)):
                return float(value)
    raise ValueError(f"{key} is missing from the train config: is the server a PrivateStrategy "
                     "with multi_user_nodes=True?")


def sample_users(user_ids: Sequence[Any], msg: Message) -> list[Any]:
    """This round's Poisson sample of the node's users, from OS entropy."""
    rate = _config(msg, RATE_CONFIG)
    if rate >= 1:
        return list(user_ids)
    keep = np.random.default_rng(np.random.SeedSequence()).random(len(user_ids)) < rate
    return [u for u, k in zip(user_ids, keep, strict=True) if k]


def user_sum_reply(msg: Message, user_models: Sequence[ArrayRecord | dict[str, np.ndarray]],
                   array_key: str = "arrays") -> RecordDict:
    """The reply of a multi-user node: the sum of its users' clipped updates (each user's model
    minus the broadcast one, clipped to the round's clip norm) and the counts. A user whose
    model misses a key, has a wrong shape or non-finite values adds nothing, so one user's
    model cannot get its node's sum rejected (which would remove the node's other users)."""
    clip = _config(msg, CLIP_CONFIG)
    sent = msg.content.array_records[array_key]
    base = {k: v.numpy().astype(np.float64) for k, v in sent.items()}
    total = {k: np.zeros_like(v) for k, v in base.items()}
    unclipped = 0
    for model in user_models:
        try:
            arrays = {k: _array(model[k]) for k in base}
            if any(arrays[k].shape != base[k].shape for k in base):
                continue  # a wrong shape: this user adds nothing (never its node's others)
        except (KeyError, TypeError, ValueError):
            continue  # a missing or non-numeric array: likewise
        delta = {k: arrays[k] - base[k] for k in base}
        norm = float(np.sqrt(sum(float(np.sum(d * d)) for d in delta.values())))
        if not np.isfinite(norm):  # likewise for non-finite values
            continue
        scale = 1.0 if norm <= clip else clip / norm
        unclipped += norm <= clip
        for k, d in delta.items():
            total[k] += d * scale
    kept = {k: Array(total[k]) for k in total}  # every key the server sent, always
    return RecordDict({array_key: ArrayRecord(kept),
                       "metrics": MetricRecord({USERS_KEY: len(user_models),
                                                UNCLIPPED_KEY: unclipped})})


def _array(value: Array | np.ndarray) -> np.ndarray:
    return np.asarray(value.numpy() if isinstance(value, Array) else value, dtype=np.float64)
