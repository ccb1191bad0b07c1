"""Private evaluation: the final metrics as one more planned, accounted Gaussian release.

With ``private-metrics = true`` every run gets an ``evaluate`` step just before its final one.
Each user computes its own evaluation values with the released model (e.g. its test squared
error, or a fresh task's transfer risk), clips each to ``[0, B]`` (``metric-clip`` for a loss, 1
for an accuracy or error), and the node sends the sums. The server bounds each node's sums,
divides by the fixed population n and adds Gaussian noise: one user moves each mean by at most
``B / n`` (add/remove; twice for replace-one), so the step is one Gaussian mechanism on the same
users and composes with the rest of the plan. It gets ``metrics-budget-fraction`` of the
privacy budget (in 1/z^2 units); the other releases share the rest in their usual proportions.
Nothing but the noisy means leaves the server: the exact clipped means stay in the operator
report, for comparison.

An algorithm takes part by providing ``evaluation_values(config, arrays, user_ids)`` (per-user
arrays, one per metric) and ``evaluation_bounds(config)`` ({metric: B}). ``with_evaluation(cls)``
derives the class that runs it; the server and the nodes both get it from
``algorithm_for(config)``, so they agree on the steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import cache
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease

EVALUATION = "evaluation"
EVALUATE = "evaluate"


def algorithm_for(config: Any) -> type:
    """The class that runs ``config``: the registered algorithm, with the private evaluation
    step when ``private-metrics`` is on."""
    from fedpriv.registry import get_algorithm

    cls = get_algorithm(config.algorithm)
    return with_evaluation(cls) if config.private_metrics else cls


def check(config: Any, cls: type) -> None:
    """Refuse ``private-metrics`` where it cannot be released (raises naming the key)."""
    if not config.private_metrics:
        return
    if not cls.private:
        raise ConfigError(f"private-metrics: {cls.name} is a non-private baseline; its releases "
                          "carry no noise, so a private metric of it would protect nothing")
    if any(r.mechanism != "gaussian" for r in cls(config).privacy_plan()):
        raise ConfigError(f"private-metrics: {cls.name} is pure epsilon-DP; a Gaussian "
                          "evaluation release would mix pure and approximate DP in one plan")
    if not hasattr(cls, "evaluation_values"):
        raise ConfigError(f"private-metrics: {cls.name} provides no per-user evaluation values")


@cache
def with_evaluation(cls: type) -> type:
    """``cls`` with the private evaluation step (see the module docstring)."""

    class Evaluated(cls):  # type: ignore[valid-type, misc]
        def privacy_plan(self) -> list[PlannedRelease]:
            base = super().privacy_plan()
            share = self.config.metrics_budget_fraction
            total = sum(r.count * r.weight for r in base)
            scaled = [dataclasses.replace(r, weight=r.weight * (1.0 - share) / total)
                      for r in base]
            return [*scaled, PlannedRelease(EVALUATION, share if base else 1.0)]

        def steps(self) -> list[Step]:
            base = super().steps()
            bounds = self.evaluation_bounds(self.config)
            parts = tuple(Part(name, (1,), bound, 1.0 / len(bounds))
                          for name, bound in bounds.items())
            return [*base[:-1], Step(EVALUATE, 0, EVALUATION, parts), base[-1]]

        def broadcast(self, step: Step) -> dict[str, np.ndarray]:
            return super().broadcast(Step("final") if step.kind == EVALUATE else step)

        def noise(self, step: Step, part: Part, std: float,
                  rng: np.random.Generator) -> np.ndarray:
            if step.kind == EVALUATE:  # plain Gaussian noise, whatever the algorithm's rounds use
                return Algorithm.noise(self, step, part, std, rng)
            return super().noise(step, part, std, rng)

        def charge(self, step: Step) -> tuple[list[int] | None, float]:
            return (None, 1.0) if step.kind == EVALUATE else super().charge(step)

        def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
            if step.kind != EVALUATE:
                return super().apply(step, noisy_means)
            self.private_metrics = {k: float(np.asarray(v).reshape(-1)[0])
                                    for k, v in noisy_means.items()}
            return {f"private_{k}": v for k, v in self.private_metrics.items()}

        @classmethod
        def participants(cls_, config: Any, step: Step, user_ids: np.ndarray) -> np.ndarray:
            if step.kind == EVALUATE:
                return user_ids  # every user of the fixed population, never a sample
            return super().participants(config, step, user_ids)

        @classmethod
        def user_step(cls_, config: Any, step: Step, arrays: Mapping[str, np.ndarray],
                      user_ids: np.ndarray) -> UserContribution:
            if step.kind != EVALUATE:
                return super().user_step(config, step, arrays, user_ids)
            return clipped_evaluation(cls_.evaluation_values(config, arrays, user_ids),
                                      cls_.evaluation_bounds(config), len(user_ids))

    Evaluated.__name__ = Evaluated.__qualname__ = f"{cls.__name__}WithPrivateEvaluation"
    return Evaluated


def clipped_evaluation(values: Mapping[str, np.ndarray], bounds: Mapping[str, float],
                       num_users: int) -> UserContribution:
    """Per-metric sums of the users' values clipped to ``[0, bound]``; the users with a clipped
    value are counted (operator information)."""
    totals, clipped = {}, np.zeros(num_users, dtype=bool)
    for name, bound in bounds.items():
        v = np.asarray(values[name], dtype=np.float64)
        clipped |= (v > bound) | (v < 0)
        totals[name] = np.array([np.clip(v, 0.0, bound).sum()])
    return UserContribution(totals, num_users, int(clipped.sum()))
