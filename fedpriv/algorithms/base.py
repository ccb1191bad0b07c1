"""The contract between an algorithm and the runtime (Flower or in-process).

An algorithm is a sequence of ``Step``s. In each step the server broadcasts arrays; each node
computes, for the users it hosts, one contribution per user, clips it to ``Step.clip_norm`` and
returns the *sum* with the user count; the server bounds every node's sum (so a misbehaving node
cannot break the sensitivity), adds the planned Gaussian noise to the population mean and applies
the update. Non-private steps (the final evaluation) return metric sums instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import gaussian_noise


@dataclass(frozen=True)
class Step:
    """One server-node exchange. ``release`` names the privacy-plan group for private steps."""

    kind: str  # e.g. "init", "round", "final"
    index: int = 0
    release: str | None = None  # None: the step releases nothing private
    clip_norm: float = 0.0
    shape: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.kind}-{self.index}" if self.kind == "round" else self.kind


@dataclass(frozen=True)
class UserContribution:
    """What a node sends for one step: the sum over its users and how many users it covers."""

    total: np.ndarray
    num_users: int
    num_clipped: int = 0
    metrics: Mapping[str, float] | None = None


class Algorithm:
    """Base class of a registered algorithm; subclasses set ``name`` and implement the hooks."""

    name: ClassVar[str] = ""

    def __init__(self, config: Any) -> None:
        self.config = config

    # ----- configuration ---------------------------------------------------------------------
    @classmethod
    def validate(cls, config: Any) -> None:
        """Raise ``fedpriv.config.ConfigError`` naming the key when the config cannot run."""

    def privacy_plan(self) -> list[PlannedRelease]:
        """Every private release the run will make, with budget weights."""
        raise NotImplementedError

    def steps(self) -> list[Step]:
        raise NotImplementedError

    # ----- server side -----------------------------------------------------------------------
    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        """Arrays sent to every node for this step."""
        raise NotImplementedError

    def noise(self, step: Step, std: float, rng: np.random.Generator) -> np.ndarray:
        """Privacy noise for the population mean of this step (i.i.d. Gaussian by default)."""
        return gaussian_noise(step.shape, std, rng)

    def apply(self, step: Step, noisy_mean: np.ndarray) -> dict[str, float]:
        """Update server state from the privatized mean; returns metrics for the round report."""
        raise NotImplementedError

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        """Final metrics from the summed per-user metrics of the final step."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """Server state worth saving with the results (JSON-serializable)."""
        return {}

    # ----- user side (runs on the nodes; must not touch server state) ------------------------
    @classmethod
    def user_step(
        cls, config: Any, step: Step, arrays: Mapping[str, np.ndarray], user_ids: np.ndarray
    ) -> UserContribution:
        raise NotImplementedError
