"""Private evaluation: the final metrics as one more planned, accounted Gaussian release.

With ``private-metrics = true`` every run gets an ``evaluate`` step just before its final one.
Each user computes its own evaluation values with the released model (e.g. its test squared
error, or a fresh task's transfer risk), clips each to ``[0, B]`` (a loss to ``metric-clip``, or
the family's bound from public problem parameters when it is 0; a 0-1 error to [0, 1]; a
non-finite value counts as B) and centres it, ``v - B/2``, so that it lies in ``[-B/2, B/2]``;
the node sends the sums. The server bounds each node's sums, divides by the fixed population n,
adds Gaussian noise and adds ``B/2`` back (public, post-processing). One user moves each centred
mean by at most ``B / (2n)`` under add/remove and ``B / n`` under replace-one, so the step is one
Gaussian mechanism on the same users and composes with the rest of the plan.

Budget: the evaluation's noise multiplier is fixed before the rest is calibrated, at
``z = 1 / (sqrt(f) mu)``, where ``mu`` is the Gaussian-DP parameter of the target (epsilon,
delta) and ``f = metrics-budget-fraction``: alone, the evaluation is ``sqrt(f) mu``-GDP, a share
``f`` of the target in GDP units; the other releases are then calibrated to what is left (for an
unsampled plan exactly ``1 - f`` of ``mu^2``; a Poisson-sampled plan's rounds get what the
accountant says remains). Nothing but the noisy means leaves the server: the exact clipped
means stay in the operator report, for comparison.

``metrics-split = "validation"`` evaluates each user's held-back validation points instead of its
test points (a family that has them declares ``validation-samples-per-user``): the signal
``fedpriv tune`` selects candidates on, so the reported test metrics stay untouched by tuning.

An algorithm takes part by providing ``evaluation_values(config, arrays, user_ids)`` (per-user
arrays, one per metric) and ``evaluation_bounds(config)`` ({metric: B}). ``with_evaluation(cls)``
derives the class that runs it; the server and the nodes both get it from
``algorithm_for(config)``, so they agree on the steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease, gdp_mu

EVALUATION = "evaluation"
EVALUATE = "evaluate"


class EvaluatedAlgorithm(Protocol):
    """What the server reads of an algorithm run by ``with_evaluation``'s class once the
    evaluation is released: the noisy means and the family's bounds."""

    private_metrics: dict[str, float]

    def evaluation_bounds(self, config: RunConfig) -> Mapping[str, float]: ...


def algorithm_for(config: RunConfig) -> type[Algorithm[Any]]:
    """The class that runs ``config``: the registered algorithm, with the private evaluation
    step when ``private-metrics`` is on."""
    from fedpriv.registry import get_algorithm

    cls = get_algorithm(config.algorithm)
    return with_evaluation(cls) if config.private_metrics else cls


def check(config: RunConfig, cls: type[Algorithm[Any]]) -> None:
    """Refuse ``private-metrics`` where it cannot be released (raises naming the key)."""
    if config.metrics_split != "test" and not config.private_metrics:
        raise ConfigError(f"metrics-split: {config.metrics_split!r} chooses the data of the "
                          "private evaluation; it needs private-metrics = true")
    if config.metrics_split == "validation" and not config.has("validation-samples-per-user"):
        raise ConfigError(f"metrics-split: {cls.name} has no held-back validation data (its "
                          "family declares no validation-samples-per-user); use \"test\"")
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


# with_evaluation's classes, one per algorithm class (functools.cache would do, but mypy
# cannot see that a class is hashable)
_EVALUATED: dict[type[Algorithm[Any]], type[Algorithm[Any]]] = {}


def with_evaluation(cls: type[Algorithm[Any]]) -> type[Algorithm[Any]]:
    """``cls`` with the private evaluation step (see the module docstring); the same class
    on every call."""
    made = _EVALUATED.get(cls)
    if made is None:
        made = _EVALUATED.setdefault(cls, _with_evaluation(cls))
    return made


def _with_evaluation(cls: type[Algorithm[Any]]) -> type[Algorithm[Any]]:
    """A class made at run time on a base known at run time only: for the type checker its
    base is ``Any`` (so the evaluation hooks, which ``check`` confirmed, need no declaration),
    and what a method returns from ``super()`` is annotated."""

    # valid-type, misc: mypy cannot check a class whose base is a variable
    class Evaluated(cls):  # type: ignore[valid-type, misc]
        def privacy_plan(self) -> list[PlannedRelease]:
            base = super().privacy_plan()
            if not base:  # nothing else is released: the evaluation takes the whole budget
                return [PlannedRelease(EVALUATION, 1.0)]
            c = self.config
            z = 1.0 / (math.sqrt(c.metrics_budget_fraction) * gdp_mu(c.epsilon, c.delta))
            return [*base, PlannedRelease(EVALUATION, 1.0, multiplier=z)]

        def steps(self) -> list[Step]:
            base = super().steps()
            bounds = self.evaluation_bounds(self.config)
            parts = tuple(Part(name, (1,), bound / 2.0, 1.0 / len(bounds))
                          for name, bound in bounds.items())  # values centred: |v - B/2| <= B/2
            return [*base[:-1], Step(EVALUATE, 0, EVALUATION, parts), base[-1]]

        def broadcast(self, step: Step) -> dict[str, np.ndarray]:
            arrays: dict[str, np.ndarray] = super().broadcast(
                Step("final") if step.kind == EVALUATE else step)
            return arrays

        def noise(self, step: Step, part: Part, std: float,
                  rng: np.random.Generator) -> np.ndarray:
            if step.kind == EVALUATE:  # plain Gaussian noise, whatever the algorithm's rounds use
                return Algorithm.noise(self, step, part, std, rng)
            noise: np.ndarray = super().noise(step, part, std, rng)
            return noise

        def charge(self, step: Step) -> tuple[list[int] | None, float]:
            return (None, 1.0) if step.kind == EVALUATE else super().charge(step)

        def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
            if step.kind != EVALUATE:
                metrics: dict[str, float] = super().apply(step, noisy_means)
                return metrics
            half = {p.name: p.clip_norm for p in step.parts}  # B/2, public
            self.private_metrics = {k: float(np.asarray(v).reshape(-1)[0]) + half[k]
                                    for k, v in noisy_means.items()}
            return {f"private_{k}": v for k, v in self.private_metrics.items()}

        @classmethod
        def participants(cls_, config: RunConfig, step: Step,
                         user_ids: np.ndarray) -> np.ndarray:
            if step.kind == EVALUATE:
                return user_ids  # every user of the fixed population, never a sample
            taking_part: np.ndarray = super().participants(config, step, user_ids)
            return taking_part

        @classmethod
        def user_step(cls_, config: RunConfig, step: Step, arrays: Mapping[str, np.ndarray],
                      user_ids: np.ndarray) -> UserContribution:
            if step.kind != EVALUATE:
                contribution: UserContribution = super().user_step(config, step, arrays,
                                                                   user_ids)
                return contribution
            return clipped_evaluation(cls_.evaluation_values(config, arrays, user_ids),
                                      cls_.evaluation_bounds(config), len(user_ids))

    Evaluated.__name__ = Evaluated.__qualname__ = f"{cls.__name__}WithPrivateEvaluation"
    return Evaluated


def clipped_evaluation(values: Mapping[str, np.ndarray], bounds: Mapping[str, float],
                       num_users: int) -> UserContribution:
    """Per-metric sums of the users' values clipped to ``[0, bound]`` and centred (``v - B/2``);
    a non-finite value counts as the bound. The users with a clipped value are counted
    (operator information)."""
    totals, clipped = {}, np.zeros(num_users, dtype=bool)
    for name, bound in bounds.items():
        v = np.asarray(values[name], dtype=np.float64)
        v = np.nan_to_num(v, nan=bound, posinf=bound, neginf=0.0)
        clipped |= (v > bound) | (v < 0)
        totals[name] = np.array([(np.clip(v, 0.0, bound) - bound / 2.0).sum()])
    return UserContribution(totals, num_users, int(clipped.sum()))
