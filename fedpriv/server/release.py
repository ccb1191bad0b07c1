"""Releasing a step: calibrated noise, the accountant and the budget guard, in one unit.

Privacy argument. ``calibrate`` fits the plan (every release the run will make) to the target
(epsilon, delta): one noise multiplier ``z`` per Gaussian plan entry, or one epsilon per
exponential-mechanism entry. A Gaussian step releases, for each part ``j``, the mean of the
bounded node sums over the step's public population ``n`` (fixed in advance, never who
answered) plus Gaussian noise of std ``z / sqrt(share_j) * Delta_j``, where ``Delta_j`` is the
sensitivity of that mean to one user (``clip_norm / n``, twice that under replace-one); the
shares sum to 1, so the step is one Gaussian mechanism with multiplier ``z``, which is what the
accountant records. An exponential-mechanism step samples one candidate from the mean scores,
whose sensitivity is ``clip_norm / n`` under either relation, and is recorded as pure epsilon-DP.
Each release draws from its own generator (``noise_generator``, by release index). With
``secure-noise`` a Gaussian part is instead the exact sum rounded to a power-of-two grid plus
exact discrete Gaussian noise from an OS-keyed ChaCha20 stream, and the exponential mechanism is
sampled exactly; with ``aggregation = "distributed"`` the nodes add Skellam shares and the
release is recorded as zCDP (both: ``fedpriv.server.discrete``).

The budget guard stops the run before a release over the ceiling (max-epsilon, or the target)
leaves the server, in three places: ``check_budget`` composes, on a copy of the accountant, the
ledger so far plus every pending planned release and refuses to start (or resume) above the
ceiling; ``conforms`` checks, before any noise is drawn, that a release uses exactly the value
that check composed; ``guard`` checks the epsilon after recording. The missing-node rescale
multiplies a noisy mean after the noise by public counts: post-processing, privacy unchanged.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step
from fedpriv.config import RunConfig
from fedpriv.evaluation import EVALUATE
from fedpriv.privacy.accounting import (
    Accountant,
    InfeasiblePlanError,
    PlannedRelease,
    calibrate_gaussian_plan,
    mean_sensitivity,
)
from fedpriv.privacy.discrete import (
    CryptoRandom,
    DiscreteGaussianSource,
    exact_exponential_mechanism,
    grid_integers,
    grid_scores,
    power_of_two_at_most,
)
from fedpriv.privacy.grid import FLOAT_SLACK, central_grid
from fedpriv.privacy.mechanisms import exponential_mechanism
from fedpriv.privacy.pure import pure_plan_epsilons
from fedpriv.randomness import noise_generator
from fedpriv.server.discrete import SharePlan, accountant_kind, accounting_delta, ledger_parts


class BudgetExceededError(InfeasiblePlanError):
    """The run would spend more epsilon than its ceiling (max-epsilon) allows."""


def calibrate(config: RunConfig, plan: Sequence[PlannedRelease]) -> list[float]:
    """The plan's calibrated values, one per entry: noise multipliers (Gaussian plans) or
    epsilons (pure plans). Raises ``InfeasiblePlanError`` if the target cannot be met."""
    if not plan:
        return []
    try:
        if any(r.mechanism == "exponential" for r in plan):
            return pure_plan_epsilons(plan, config.epsilon)
        return calibrate_gaussian_plan(plan, config.epsilon, accounting_delta(config),
                                       accountant_kind(config), config.neighbouring_relation)
    except InfeasiblePlanError as err:
        raise InfeasiblePlanError(f"refusing to start: {err}") from None


def missing_node_scale(counts: Mapping[int, int], answered: set[int]) -> float:
    """(users over all partitions) / (users in the partitions that answered); 1 if none did."""
    answering = sum(counts[p] for p in answered)
    return sum(counts.values()) / answering if answering else 1.0


class Releaser:
    """Noise, accounting and the budget guard of one run.

    Owns the accountant, the calibrated plan (``multipliers`` for a Gaussian plan,
    ``pure_epsilons`` for a pure one), the index of the next noise stream (``releases``) and the
    count of parts released without noise (``unnoised``, non-private baselines).
    ``last_release``: the label of the run's last release (its epsilon is always evaluated).
    """

    def __init__(self, config: RunConfig, algorithm: Algorithm[Any],
                 plan: Sequence[PlannedRelease],
                 calibrated: Sequence[float], last_release: str | None) -> None:
        self.config, self.algorithm, self.last_release = config, algorithm, last_release
        self.has_plan = bool(plan)
        self.pure = bool(plan) and all(r.mechanism == "exponential" for r in plan)
        values = {r.name: v for r, v in zip(plan, calibrated, strict=True)}
        self.multipliers: dict[str, float] = {} if self.pure else values
        self.pure_epsilons: dict[str, float] = values if self.pure else {}
        self.accountant = Accountant(accountant_kind(config), config.neighbouring_relation,
                                     accounting_delta(config))
        self.releases = 0
        self.unnoised = 0
        self.verified: dict[str, float] = {}  # the plan values check_budget composed
        self.last_grid_sums: dict[str, np.ndarray] = {}  # secure-noise: the noisy sums on grid

    # ----- budget guard ----------------------------------------------------------------------
    def check_budget(self, steps: Sequence[Step], pending: Sequence[Step],
                     resuming: bool = False) -> float:
        """Refuse to start (or resume) a run whose releases so far plus the ``pending`` ones
        would compose to more than the ceiling; returns that projected epsilon. From here on
        each release must use exactly the plan values composed now (``conforms``)."""
        c = self.config
        noiseless = any(s.release is None and not s.is_final for s in steps)
        if noiseless and c.max_epsilon:
            raise BudgetExceededError(
                f"refusing to start: {c.algorithm} releases sums without noise (epsilon is "
                f"unbounded), but max-epsilon = {c.max_epsilon} is set")
        self.verified = {**self.multipliers, **self.pure_epsilons}
        if not self.has_plan:
            return 0.0
        projected = self.projected_epsilon(pending)
        if projected > c.ceiling * (1.0 + 1e-9):
            spent = self.accountant.epsilon()
            raise BudgetExceededError(
                f"refusing to {'resume' if resuming else 'start'}: "
                f"the run would spend epsilon {projected:.6g} in all ({spent:.6g} already "
                f"spent), above the ceiling {c.ceiling:g} "
                f"({'max-epsilon' if c.max_epsilon else 'the target epsilon'})")
        return projected

    def projected_epsilon(self, pending: Sequence[Step]) -> float:
        """Epsilon after every ``pending`` planned release, composed on a copy of the
        accountant exactly as the run will compose them."""
        accountant = copy.deepcopy(self.accountant)
        for step in pending:
            if step.release is None or step.is_final:
                continue
            if self.pure:
                accountant.record_pure(step.label, self.pure_epsilons[step.release])
                continue
            groups, rate = self.algorithm.charge(step)
            accountant.record(step.label, self.multipliers[step.release], groups=groups,
                              sampling_rate=rate, evaluate=False)
        return accountant.epsilon()

    def conforms(self, step: Step, value: float) -> None:
        """Per-release budget guard, before any noise is drawn: the release must use exactly
        the noise the start-up check composed into the projected epsilon (the caller checks
        that it is the next pending step), so the run cannot spend more than that projection,
        which is within the ceiling."""
        planned = self.verified.get(step.release) if step.release is not None else None
        if planned is None or value != planned:
            raise BudgetExceededError(
                f"release {step.label} would use {value!r} for plan entry {step.release!r}, "
                f"not the {planned!r} the budget check verified; it was not "
                "released and the run stops")

    def guard(self, spent: float) -> None:
        """Last line of the budget guard: stop before a release over the ceiling leaves the
        server (it cannot happen when the plan check passed; it is checked anyway)."""
        if spent > self.config.ceiling * (1.0 + 1e-9):
            raise BudgetExceededError(
                f"epsilon spent {spent:.6g} would exceed the ceiling {self.config.ceiling:g}; "
                "the release was not published and the run stops")

    # ----- releases --------------------------------------------------------------------------
    def gaussian(self, step: Step, means: Mapping[str, np.ndarray], population: int,
                 scale: float = 1.0) -> dict[str, Any]:
        """Release ``step``: each part's exact population mean (``means``, by part name) plus
        its planned noise, times the missing-node ``scale``; applied to the algorithm and
        recorded. A step without a plan entry releases the means without noise. Returns the
        step's report entries."""
        c = self.config
        noisy: dict[str, np.ndarray] = {}
        ledger_parts = []
        z = self.multipliers[step.release] if step.release is not None else None
        if z is not None:
            self.conforms(step, z)
        for part in step.parts:
            mean = means[part.name]
            if z is None:
                self.unnoised += 1
                noisy[part.name] = mean
                continue
            z_part = z / math.sqrt(part.share)
            sensitivity = mean_sensitivity(part.clip_norm, population, c.neighbouring_relation)
            self.releases += 1
            if c.secure_noise:
                value, entry = self._on_grid(step, part, mean, z_part, sensitivity, population)
                noisy[part.name] = scale * value
                ledger_parts.append(entry)
                continue
            std = z_part * sensitivity
            rng = noise_generator(c, self.releases - 1)
            noisy[part.name] = scale * (mean + self.algorithm.noise(step, part, std, rng))
            ledger_parts.append({"name": part.name, "noise_multiplier": z_part,
                                 "l2_sensitivity": sensitivity, "noise_std": std})
        report = dict(self.algorithm.apply(step, noisy))
        if scale != 1.0:
            report["missing_node_rescale"] = scale
        if z is not None:
            groups, rate = self.algorithm.charge(step)
            count = len(self.accountant.ledger) + 1
            evaluate = rate >= 1 or count & (count - 1) == 0 or step.label == self.last_release
            spent = self.accountant.record(step.label, z, ledger_parts, groups=groups,
                                           sampling_rate=rate, evaluate=evaluate)
            if spent is not None:
                self.guard(spent)
                report["epsilon_spent"] = spent
        return report

    def crypto_stream(self, step: Step, part: Part) -> CryptoRandom:
        """The cryptographic stream of one publishable part's noise: a fresh ChaCha20 key from
        the OS every time (the neighbouring-dataset tests replace it by a seeded one)."""
        return CryptoRandom()

    def _on_grid(self, step: Step, part: Part, mean: np.ndarray, z_part: float,
                 sensitivity: float, population: int) -> tuple[np.ndarray, dict[str, Any]]:
        """A publishable part (``fedpriv.server.discrete``): the exact sum rounded to the grid
        plus exact discrete Gaussian noise from a fresh OS-seeded ChaCha20 stream, divided by
        the population only after. The algorithm's noise hook draws it (so symmetric and
        tree-aggregated noise keep their structure) from a source whose standard normals are
        discrete Gaussians over sigma; its integers are recovered exactly."""
        grid = central_grid(z_part, sensitivity * population, int(np.prod(part.shape)))
        g = grid.granularity
        source = DiscreteGaussianSource(grid.sigma, self.crypto_stream(step, part))
        noise = self.algorithm.noise(step, part, grid.sigma * g, source)  # type: ignore[arg-type]
        units = np.rint(np.asarray(mean, dtype=np.float64) * population / g).astype(np.int64)
        noisy_sum = (units + grid_integers(noise, g)).astype(np.float64) * g  # on the grid
        self.last_grid_sums[part.name] = noisy_sum
        return noisy_sum / population, {
            "name": part.name, "mechanism": "discrete gaussian", "noise_multiplier": z_part,
            "l2_sensitivity": grid.sensitivity / population, "granularity": g,
            "sigma_grid": grid.sigma, "noise_std": grid.sigma * g / population}

    def distributed(self, step: Step, sums: Mapping[str, np.ndarray],
                    plans: Sequence[SharePlan], population: int, honest: int,
                    scale: float = 1.0) -> dict[str, Any]:
        """Release a distributed step from the decoded sums of the nodes' noisy shares (each
        part's exact sum plus the honest nodes' Skellam noise): the population mean, times
        the missing-node ``scale``; recorded as one zCDP release whose rho is that of the noise
        the ``honest`` nodes' shares carry."""
        z = self.multipliers[step.release] if step.release is not None else None
        if z is None:
            raise ValueError(f"{step.label} has no noise plan: it is not distributed")
        self.conforms(step, z)
        self.releases += 1
        noisy: dict[str, np.ndarray] = {}
        for part in step.parts:
            value = np.asarray(sums[part.name], dtype=np.float64).reshape(part.shape)
            if part.symmetric:  # the nodes noised the whole matrix: keep it symmetric
                value = (value + value.T) / 2.0
            noisy[part.name] = scale * value / population
        report = dict(self.algorithm.apply(step, noisy))
        if scale != 1.0:
            report["missing_node_rescale"] = scale
        parts = ledger_parts(step, plans, honest, population)
        rho = sum(p["rho"] for p in parts)
        groups, _ = self.algorithm.charge(step)  # disjoint user groups: only theirs charged
        spent = self.accountant.record_zcdp(step.label, rho, {
            "mechanism": "distributed skellam", "noise_multiplier": z, "honest_nodes": honest,
            "parts": parts}, groups=groups)
        self.guard(spent)
        report["epsilon_spent"] = spent
        report["honest_nodes"] = honest
        return report

    def select(self, step: Step, scores: np.ndarray, population: int) -> dict[str, Any]:
        """The exponential mechanism over the candidates' mean ``scores`` (lower is better);
        without a plan entry, the best candidate. Applied to the algorithm and recorded."""
        (part,) = step.parts
        if step.release is None:  # non-private: the best candidate
            self.unnoised += 1
            choice = int(np.argmin(scores))
            return dict(self.algorithm.apply(step, {"choice": np.array(choice)}))
        epsilon = self.pure_epsilons[step.release]
        self.conforms(step, epsilon)
        # one user moves each mean score by at most bound / population, under either relation
        # (add/remove with the population fixed: a removed user's scores are 0)
        sensitivity = part.clip_norm / population
        if self.config.secure_noise:  # exact sampler on grid-rounded scores (CSPRNG)
            grid = power_of_two_at_most(sensitivity * FLOAT_SLACK)
            sensitivity = sensitivity * (1.0 + FLOAT_SLACK) + grid
            choice = exact_exponential_mechanism(grid_scores(scores, grid), epsilon,
                                                 sensitivity, CryptoRandom())
        else:
            choice = exponential_mechanism(scores, epsilon, sensitivity,
                                           noise_generator(self.config, self.releases))
        self.releases += 1
        report = dict(self.algorithm.apply(step, {"choice": np.array(choice)}))
        # only what the mechanism releases (the index): the exact scores are not released
        spent = self.accountant.record_pure(step.label, epsilon, {
            "candidates": int(np.prod(part.shape)), "score_sensitivity": sensitivity,
            "chosen": choice})
        self.guard(spent)
        report["epsilon_spent"] = spent
        return report

    def rescale(self, step: Step, answered: set[int], hosted: Mapping[int, int],
                participating: Mapping[int, int | None]) -> float:
        """The missing-node rescale of a noisy Gaussian ``step`` (``rescale-missing-nodes``;
        1 when off, when the algorithm opts out, or for a release without noise, which is not
        rescaled): by the users taking part (``participating``, a public rule), or for a
        Poisson-sampled step by the users the nodes host (``hosted``; the sample itself must
        stay secret). Applied after the noise, it keeps a step's size from shrinking with the
        share of nodes that failed. The private evaluation is always rescaled (a mean that
        shrank with the failed nodes would publish a wrong utility figure)."""
        opted_in = self.algorithm.rescale_for_missing_nodes or step.kind == EVALUATE
        if step.release is None or not (self.config.rescale_missing_nodes and opted_in):
            return 1.0
        sampled = self.algorithm.charge(step)[1] < 1.0
        known = {p: n for p, n in participating.items() if n is not None}
        if sampled or len(known) != len(participating):  # sampled, or a count not public
            return missing_node_scale(hosted, answered)
        return missing_node_scale(known, answered)

    def epsilon(self) -> float | None:
        """Epsilon spent so far; None if anything was released without noise."""
        return self.accountant.epsilon() if self.unnoised == 0 else None

    # ----- checkpoint state ------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The plan, the accountant and the noise counters, under their checkpoint keys."""
        spent = [e["epsilon_spent"] for e in self.accountant.ledger
                 if e.get("epsilon_spent") is not None]
        return {"multipliers": self.multipliers, "pure_epsilons": self.pure_epsilons,
                "accountant": self.accountant, "releases": self.releases,
                "unnoised": self.unnoised, "epsilon_spent": spent[-1] if spent else 0.0}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint whose plan is this one (the store checks it)."""
        self.accountant = state["accountant"]
        self.releases, self.unnoised = state["releases"], state["unnoised"]
