"""The checkpoint store of one run: the file, its lock, and whether a checkpoint is this run's.

The file format and the atomic write are ``fedpriv.checkpoint``'s. The store adds what the server
needs around it: one server per checkpoint (an exclusive lock held while the server lives, so
two servers resuming one run cannot publish its next releases twice; the OS releases it when the
process dies), no silent restart over an interrupted run (its releases stay spent), and resuming
only a checkpoint of the same run: the same config (up to the resumable keys) and the same
calibrated plan. ``path = None``: no checkpoints (tests, sweeps); saving does nothing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpriv import checkpoint
from fedpriv.algorithms.base import Algorithm
from fedpriv.checkpoint import CheckpointError
from fedpriv.config import PLUGIN_CONFIG, resumable_keys


def algorithm_state(algorithm: Algorithm[Any]) -> dict[str, Any]:
    """The algorithm's server state: its attributes, less the config and cached values that
    are recomputed from the config."""
    cached = {name for cls in type(algorithm).__mro__ for name, value in vars(cls).items()
              if isinstance(value, functools.cached_property)}
    return {k: v for k, v in vars(algorithm).items() if k != "config" and k not in cached}


def changed_keys(stored: Mapping[str, Any], wanted: Mapping[str, Any],
                 defaults: Mapping[str, Any] | None = None) -> list[str]:
    """Keys of this run's config (the core keys and the algorithm's own) whose value differs in
    the checkpoint, less those a resume may change. Keys the algorithm does not read cannot
    change what it computes (a checkpoint written before keys became algorithm-owned holds
    every family's keys), and ``plugin-config`` only carries keys that are compared one by one.
    A key the checkpoint lacks (it was added later) counts as its default (``defaults``)."""
    defaults = defaults or {}
    return sorted(k for k in wanted
                  if k not in resumable_keys() and k != PLUGIN_CONFIG
                  and stored.get(k, defaults.get(k)) != wanted.get(k))


class CheckpointStore:
    """The checkpoint file at ``path`` (None: none), locked from construction to ``close``."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = checkpoint.lock(path) if path is not None else None

    def refuse_overwrite(self) -> None:
        """Raise if an interrupted run left a checkpoint here (a fresh start would spend its
        budget again)."""
        if self.path is not None and self.path.exists():
            raise CheckpointError(
                f"an interrupted run left a checkpoint at {self.path} "
                f"({checkpoint.describe(self.path)}). Continue it with --resume "
                "(resume = true). Delete the file only to start over knowingly: the releases "
                "already made stay spent, so a restart spends the budget again (and with the "
                "same seeded noise, two releases of different sums would cancel it)")

    def load(self, config: Mapping[str, Any], multipliers: Mapping[str, float],
             pure_epsilons: Mapping[str, float],
             defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The checkpoint's state, if it belongs to the run with this config mapping and this
        calibrated plan; raises ``CheckpointError`` otherwise."""
        if self.path is None:
            raise CheckpointError("resume = true needs a checkpoint path")
        state = checkpoint.load(self.path)
        stored = state["config"]
        changed = changed_keys(stored, config, defaults)
        if changed:
            raise CheckpointError(
                f"checkpoint {self.path} belongs to another run; these keys differ: "
                + ", ".join(f"{k} = {stored.get(k)!r} there, {config.get(k)!r} now"
                            for k in changed[:5]))
        if state["multipliers"] != multipliers or state["pure_epsilons"] != pure_epsilons:
            raise CheckpointError(
                "the privacy plan calibrated now differs from the checkpoint's (another "
                "dp-accounting version?); resuming would mix two plans")
        return state

    def save(self, state: Mapping[str, Any]) -> None:
        """Write ``state`` (with this process's id) atomically; then the test pause hook."""
        if self.path is not None:
            checkpoint.save(self.path, {**state, "pid": os.getpid()})
            checkpoint.pause_for_tests(state["completed"])

    def discard(self) -> None:
        """Remove the checkpoint (the results are safely written) and release the lock."""
        if self.path is not None:
            checkpoint.remove(self.path)
        self.close()

    def close(self) -> None:
        """Release the lock (a process that dies releases it too). Where no checkpoint is left
        (a run refused before its first step, or one that ended), its lock file goes too,
        removed while still held (``checkpoint.lock`` takes a lock only on the file that is at
        the path, so a server that opened the removed one tries again)."""
        if self._lock is not None:
            if self.path is not None and not self.path.exists():
                checkpoint.lock_file(self.path).unlink(missing_ok=True)
            checkpoint.unlock(self._lock)
            self._lock = None
