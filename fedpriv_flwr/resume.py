"""The checkpoint of a ``PrivateStrategy`` run: written after each round (and each private
evaluation) before its release leaves the server, so a resumed run counts every release and
never reuses a noise stream (``fedpriv.checkpoint``: atomic writes, a plan check on load)."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import Strategy

from fedpriv import checkpoint
from fedpriv.privacy.accounting import Accountant
from fedpriv_flwr.plan import PrivatePlan


class Resumable(Protocol):
    """What the checkpoint holds of a ``PrivateStrategy``."""

    checkpoint_path: Path | None
    strategy: Strategy
    accountant: Accountant
    clip: float
    releases: int
    offset: int
    rows: list[dict[str, Any]]

    @property
    def plan(self) -> PrivatePlan: ...


def save_state(strategy: Resumable, r: int, arrays: ArrayRecord) -> None:
    """Write the strategy's state after round ``r`` (nothing without a checkpoint path)."""
    if strategy.checkpoint_path is None:
        return
    try:
        inner: bytes | None = pickle.dumps(strategy.strategy)
    except Exception:  # a strategy holding unpicklable callables restarts its own state
        inner = None
    checkpoint.save(strategy.checkpoint_path, {
        "completed": r, "total_steps": strategy.plan.num_rounds,
        "epsilon_spent": strategy.accountant.epsilon(), "plan": strategy.plan.public(),
        "arrays": {k: v.numpy() for k, v in arrays.items()},
        "accountant": copy.deepcopy(strategy.accountant), "clip": strategy.clip,
        "releases": strategy.releases, "rows": strategy.rows, "inner": inner})


def load_state(strategy: Resumable) -> ArrayRecord:
    """Restore the strategy's state from its checkpoint; the model to continue from."""
    assert strategy.checkpoint_path is not None
    state = checkpoint.load(strategy.checkpoint_path)
    if state["plan"] != strategy.plan.public():
        raise checkpoint.CheckpointError(
            f"checkpoint {strategy.checkpoint_path} belongs to another plan: "
            f"{state['plan']} != {strategy.plan.public()}")
    strategy.offset, strategy.clip = state["completed"], state["clip"]
    strategy.releases = state["releases"]
    strategy.accountant, strategy.rows = state["accountant"], state["rows"]
    if state["inner"] is not None:
        strategy.strategy = pickle.loads(state["inner"])
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in state["arrays"].items()})
