"""Secure-aggregation messages and node state as Flower records: arrays in an ArrayRecord,
everything else (bytes, numbers, strings and lists of them) in a ConfigRecord."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpriv import protocol as P


def to_records(payload: Mapping[str, Any], config_key: str = P.CONFIG,
               arrays_key: str = P.ARRAYS) -> RecordDict:
    arrays = {k: Array(np.ascontiguousarray(v)) for k, v in payload.items()
              if isinstance(v, np.ndarray)}
    values = {k: v for k, v in payload.items() if not isinstance(v, np.ndarray)}
    content = RecordDict({config_key: ConfigRecord(values)})
    if arrays:
        content[arrays_key] = ArrayRecord(arrays)
    return content


def from_records(content: RecordDict, config_key: str = P.CONFIG,
                 arrays_key: str = P.ARRAYS) -> dict[str, Any]:
    """The payload back; a ``TypeError`` if the records are not of the expected kinds."""
    out: dict[str, Any] = {}
    if config_key in content:
        record = content[config_key]
        if not isinstance(record, ConfigRecord):
            raise TypeError(f"{config_key} is a {type(record).__name__}, not a ConfigRecord")
        out.update(dict(record))
    if arrays_key in content:
        record = content[arrays_key]
        if not isinstance(record, ArrayRecord):
            raise TypeError(f"{arrays_key} is a {type(record).__name__}, not an ArrayRecord")
        out.update({k: v.numpy() for k, v in record.items()})
    return out


def load_state(state: RecordDict) -> dict[str, Any]:
    """A node's secure-aggregation state from its ``context.state``."""
    return from_records(state, P.SECAGG_STATE, P.SECAGG_STATE_ARRAYS)


def save_state(state: RecordDict, values: Mapping[str, Any]) -> None:
    """Replace the node's secure-aggregation state in its ``context.state``."""
    for key in (P.SECAGG_STATE, P.SECAGG_STATE_ARRAYS):
        if key in state:
            del state[key]
    records = to_records(values, P.SECAGG_STATE, P.SECAGG_STATE_ARRAYS)
    for key in records:
        state[key] = records[key]
