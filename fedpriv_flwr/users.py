"""Nodes that host several users (``PrivateStrategy(..., multi_user_nodes=True)``).

The node clips each of its users' updates to the round's clip norm (sent by the server in the
train config as ``fedpriv-clip-norm``) and replies with their *sum* and the count of users in
it, so the per-user sensitivity stays the clip norm: the server checks the sum's norm against
``users x clip`` and rejects a node that exceeds it. With a sampling rate below 1 the node
samples its users itself (``fedpriv-sampling-rate``), each independently, from OS entropy: the
server does not learn who took part beyond the count.

**A failure on one user costs only that user.** Each user's training and model are isolated:
any exception while training that user (``per_user``) or while reading its model (a missing
key, a wrong shape, a non-real dtype, a value that overflows float64, a tensor numpy cannot
take), or a non-finite update, makes that user's contribution zero: it still counts as a user
taking part (with a zero update), and the node's other users and its reply are unchanged.
Typical handler::

    @app.train()
    def train(msg, context):
        users = sample_users(my_user_ids, msg)
        work = per_user(lambda u: local_train(msg.content["arrays"], data_of(u)), users)
        return Message(user_sum_reply(msg, work), reply_to=msg)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log

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


def per_user(fn: Callable[[Any], Any], user_ids: Iterable[Any]) -> list[Callable[[], Any]]:
    """One isolated call ``fn(user_id)`` per user, for ``user_sum_reply``: each runs there, one
    user at a time, and one that raises (any ``Exception``) is that user's zero contribution."""
    return [partial(fn, u) for u in user_ids]


def user_sum_reply(msg: Message, user_models: Iterable[Any],
                   array_key: str = "arrays") -> RecordDict:
    """The reply of a multi-user node: the sum of its users' clipped updates (each user's model
    minus the broadcast one, clipped to the round's clip norm) and the counts. Each entry of
    ``user_models`` is one user taking part: its model (an ArrayRecord or a dict of arrays),
    a call that returns it (``per_user``: run here, isolated), or None. A user whose call
    raises, whose model misses a key or holds a wrong shape, a non-real dtype, a value float64
    cannot hold or non-finite values adds nothing (it is counted, with a zero update), so one
    user cannot get its node's sum rejected or its reply lost (which would remove the node's
    other users). Keys the server did not send are ignored."""
    clip = _config(msg, CLIP_CONFIG)
    sent = msg.content.array_records[array_key]
    base = {k: v.numpy().astype(np.float64) for k, v in sent.items()}
    total = {k: np.zeros_like(v) for k, v in base.items()}
    users = unclipped = failed = 0
    for entry in user_models:
        users += 1
        try:
            delta, norm = _update(entry, base)
        except Exception:  # noqa: BLE001 -- any failure on this user costs this user only
            failed += 1
            continue
        scale = 1.0 if norm <= clip else clip / norm
        unclipped += norm <= clip
        for k, d in delta.items():
            total[k] += d * scale
    if failed:  # no user id, no reason: the node's log only
        log(WARNING, "fedpriv: %d user(s) of this node added a zero update (a failure in their "
            "training or model)", failed)
    kept = {k: Array(total[k]) for k in total}  # every key the server sent, always
    return RecordDict({array_key: ArrayRecord(kept),
                       "metrics": MetricRecord({USERS_KEY: users,
                                                UNCLIPPED_KEY: unclipped})})


def _update(entry: Any, base: dict[str, np.ndarray]
            ) -> tuple[dict[str, np.ndarray], float]:
    """One user's update and its finite norm, or an exception (the user adds nothing)."""
    model = entry() if callable(entry) else entry
    if model is None:
        raise ValueError("no model")
    arrays = {k: _array(model[k]) for k in base}
    for k, v in base.items():
        if arrays[k].shape != v.shape:
            raise ValueError(f"{k}: shape {arrays[k].shape}, expected {v.shape}")
    delta = {k: arrays[k] - base[k] for k in base}
    norm = float(np.sqrt(sum(float(np.sum(d * d)) for d in delta.values())))
    if not np.isfinite(norm):
        raise ValueError("non-finite update (or too large to clip)")
    return delta, norm


def _array(value: Any) -> np.ndarray:
    raw = np.asarray(value.numpy() if isinstance(value, Array) else value)
    if raw.dtype.kind not in "biuf":  # object, complex, strings...: not a real array
        raise TypeError(f"dtype {raw.dtype} is not real-valued")
    return raw.astype(np.float64)
