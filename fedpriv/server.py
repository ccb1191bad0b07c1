"""The server side of a run, free of Flower: privacy plan, node-reply checks, noise, accounting.

The Flower strategy (``strategies/``) and the in-process engine (``fedpriv.engine``) both drive a
``PrivateServer``: they only move arrays between it and the nodes.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Part, Step, UserContribution
from fedpriv.cohorts import partition_users
from fedpriv.config import RunConfig
from fedpriv.privacy.accounting import (
    Accountant,
    InfeasiblePlanError,
    calibrate_gaussian_plan,
    mean_sensitivity,
    pure_plan_epsilons,
)
from fedpriv.privacy.mechanisms import exponential_mechanism
from fedpriv.randomness import server_generator
from fedpriv.registry import get_algorithm


@dataclass
class NodeReply:
    """A node's answer to one step, as the transport received it."""

    partition_id: int
    contribution: UserContribution | None = None
    error: str | None = None


@dataclass
class PrivateServer:
    config: RunConfig
    num_partitions: int
    log: Callable[[str], None] = print
    algorithm: Any = field(init=False)
    multipliers: dict[str, float] = field(init=False)
    accountant: Accountant = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.algorithm = get_algorithm(c.algorithm)(c)
        self.plan = self.algorithm.privacy_plan()
        z = _calibrate(c, self.plan) if self.plan else []
        # Gaussian plans: noise multiplier per release; pure plans: epsilon per release
        self.pure = bool(self.plan) and all(r.mechanism == "exponential" for r in self.plan)
        values = {r.name: zi for r, zi in zip(self.plan, z, strict=True)}
        self.multipliers = {} if self.pure else values
        self.pure_epsilons = values if self.pure else {}
        self.accountant = Accountant(c.accountant, c.neighbouring_relation, c.delta)
        self.rejections: Counter[str] = Counter()
        self.bounded = 0
        self.rounds: list[dict] = []
        self.metrics: dict[str, float] = {}
        self._releases = 0
        self._unnoised = 0
        self._partition_users = {
            p: partition_users(c.num_users, p, self.num_partitions)
            for p in range(self.num_partitions)
        }
        self._expected_cache: tuple[str, dict[int, int]] | None = None
        releases = [s for s in self.algorithm.steps() if s.release is not None]
        self._last_release = releases[-1].label if releases else None

    def steps(self) -> list[Step]:
        return self.algorithm.steps()

    def payload(self, step: Step) -> dict[str, np.ndarray]:
        return self.algorithm.broadcast(step)

    def expected_users(self, step: Step) -> dict[int, int]:
        """{partition: how many of its users take part in ``step``} (public values only; with
        Poisson sampling, values of the server's sampling seed)."""
        key = step.to_json()
        if self._expected_cache is None or self._expected_cache[0] != key:
            cls = type(self.algorithm)
            self._expected_cache = (key, {
                p: len(cls.participants(self.config, step, ids))
                for p, ids in self._partition_users.items()
            })
        return self._expected_cache[1]

    # ----- checks ----------------------------------------------------------------------------
    def _reject(self, step: Step, reply: NodeReply, reason: str) -> None:
        self.rejections[reason] += 1
        self.log(f"  {step.label}: rejected node (partition {reply.partition_id}): {reason}")

    def _check_totals(self, step: Step, contrib: UserContribution) -> str | None:
        totals = contrib.totals if isinstance(contrib.totals, Mapping) else {}
        for part in step.parts:
            if part.name not in totals:
                return f"missing part {part.name!r}"
            total = np.asarray(totals[part.name])
            if total.shape != part.shape or total.dtype.kind != "f":
                return (f"shape/dtype {total.shape}/{total.dtype} of {part.name!r}, "
                        f"expected {part.shape}/float")
            if not np.all(np.isfinite(total)):
                return f"non-finite values in {part.name!r}"
        return None

    def _accepted(self, step: Step, replies: Sequence[NodeReply]) -> list[UserContribution]:
        expected = self.expected_users(step)
        seen: set[int] = set()
        accepted = []
        for reply in replies:
            contrib = reply.contribution
            if reply.error is not None or contrib is None:
                self._reject(step, reply, f"node error: {reply.error or 'no content'}")
                continue
            if reply.partition_id in seen or reply.partition_id not in expected:
                self._reject(step, reply, "duplicate or unknown partition")
                continue
            if contrib.num_users != expected[reply.partition_id]:
                self._reject(step, reply, f"claims {contrib.num_users} users, "
                                          f"{expected[reply.partition_id]} take part")
                continue
            if not step.is_final:
                problem = self._check_totals(step, contrib)
                if problem is not None:
                    self._reject(step, reply, problem)
                    continue
            elif contrib.metrics is None or not all(
                np.isfinite(v) for v in contrib.metrics.values()
            ):
                self._reject(step, reply, "missing or non-finite metrics")
                continue
            seen.add(reply.partition_id)
            accepted.append(contrib)
        return accepted

    def _bounded_sum(self, part: Part, accepted: Sequence[UserContribution]) -> np.ndarray:
        """Sum of node totals, each scaled to norm <= users * clip (the trusted-node bound);
        score vectors (exponential mechanism) are clamped entrywise to [0, users * bound]."""
        total = np.zeros(part.shape)
        for contrib in accepted:
            value = np.asarray(contrib.totals[part.name], dtype=np.float64)
            bound = contrib.num_users * part.clip_norm
            if part.mechanism == "exponential":
                clamped = np.clip(value, 0.0, bound)
                self.bounded += int(not np.array_equal(clamped, value))
                total += clamped
                continue
            norm = float(np.linalg.norm(value))
            if norm > bound * (1.0 + 1e-9):
                self.bounded += 1
                total += value * (bound / norm)
            else:
                total += value
        return total

    # ----- one step --------------------------------------------------------------------------
    def aggregate(self, step: Step, replies: Sequence[NodeReply], started: float) -> dict:
        accepted = self._accepted(step, replies)
        users = sum(a.num_users for a in accepted)
        report: dict[str, Any] = {
            "step": step.label,
            "nodes_answered": len(accepted),
            "nodes_failed": self.num_partitions - len(accepted),
            "users_contributing": users,
        }
        if step.group is not None:
            report["user_group"] = step.group
        if step.is_final:
            keys = accepted[0].metrics.keys() if accepted else []
            sums = {k: sum(a.metrics[k] for a in accepted) for k in keys}
            if users == 0:
                raise RuntimeError("no node answered the final step")
            self.metrics = self.algorithm.finalize(sums, users)
            report.update(self.metrics)
        else:
            report.update(self._release(step, accepted))
            report["users_clipped"] = sum(a.num_clipped for a in accepted)
        report["seconds"] = time.perf_counter() - started
        self.rounds.append(report)
        self.log(_progress_line(report, len(self.steps()), len(self.rounds)))
        return report

    def _release(self, step: Step, accepted: Sequence[UserContribution]) -> dict[str, Any]:
        """Noisy population means of the step's parts, applied and (if private) accounted."""
        c = self.config
        population = step.population or c.num_users
        if step.parts[0].mechanism == "exponential":
            return self._select(step, accepted, population)
        means: dict[str, np.ndarray] = {}
        ledger_parts = []
        z = self.multipliers[step.release] if step.release is not None else None
        for part in step.parts:
            mean = self._bounded_sum(part, accepted) / population
            if z is None:
                self._unnoised += 1
                means[part.name] = mean
                continue
            z_part = z / math.sqrt(part.share)
            sensitivity = mean_sensitivity(part.clip_norm, population, c.neighbouring_relation)
            std = z_part * sensitivity
            rng = server_generator(c.seed, self._releases)
            self._releases += 1
            means[part.name] = mean + self.algorithm.noise(step, part, std, rng)
            ledger_parts.append({"name": part.name, "noise_multiplier": z_part,
                                 "l2_sensitivity": sensitivity, "noise_std": std})
        report = dict(self.algorithm.apply(step, means))
        if z is not None:
            groups, rate = self.algorithm.charge(step)
            count = len(self.accountant.ledger) + 1
            evaluate = rate >= 1 or count & (count - 1) == 0 or step.label == self._last_release
            spent = self.accountant.record(step.label, z, ledger_parts, groups=groups,
                                           sampling_rate=rate, evaluate=evaluate)
            if spent is not None:
                report["epsilon_spent"] = spent
        return report

    def _select(self, step: Step, accepted: Sequence[UserContribution],
                population: int) -> dict[str, Any]:
        """The exponential mechanism over the candidates' mean scores (lower is better)."""
        (part,) = step.parts
        scores = self._bounded_sum(part, accepted) / population
        if step.release is None:  # non-private: the best candidate
            self._unnoised += 1
            choice = int(np.argmin(scores))
            return dict(self.algorithm.apply(step, {"choice": np.array(choice)}))
        epsilon = self.pure_epsilons[step.release]
        # one user moves each mean score by at most bound / population, under either relation
        # (add/remove with the population fixed: a removed user's scores are 0)
        sensitivity = part.clip_norm / population
        rng = server_generator(self.config.seed, self._releases)
        self._releases += 1
        choice = exponential_mechanism(scores, epsilon, sensitivity, rng)
        report = dict(self.algorithm.apply(step, {"choice": np.array(choice)}))
        # only what the mechanism releases (the index): the exact scores are not released
        spent = self.accountant.record_pure(step.label, epsilon, {
            "candidates": int(np.prod(part.shape)), "score_sensitivity": sensitivity,
            "chosen": choice})
        report["epsilon_spent"] = spent
        return report

    def results(self, wall_time_s: float, runtime: str) -> dict:
        c = self.config
        return {
            "algorithm": c.algorithm,
            "num_users": c.num_users,
            "runtime": runtime,
            "num_nodes": self.num_partitions,
            "config": c.to_mapping(),
            "privacy": {
                "private": self.algorithm.private,
                # None: sums were released without noise (a non-private baseline)
                "epsilon": self.accountant.epsilon() if self._unnoised == 0 else None,
                "target_epsilon": c.epsilon,
                # pure epsilon-DP runs (exponential mechanism): delta 0
                "delta": 0.0 if self.pure else c.delta,
                "accountant": c.accountant,
                "neighbouring_relation": c.neighbouring_relation,
                "level": "user",
                "noise_multipliers": self.multipliers,
                "ledger": self.accountant.ledger,
            },
            "metrics": self.metrics,
            "rounds": self.rounds,
            "rejections": dict(self.rejections),
            "norm_bounded_nodes": self.bounded,
            "server_state": self.algorithm.state(),
            "wall_time_s": wall_time_s,
        }


def _progress_line(report: dict, total_steps: int, done: int) -> str:
    parts = [f"[{done}/{total_steps}] {report['step']:<9}"]
    if "epsilon_spent" in report:
        parts.append(f"epsilon_spent={report['epsilon_spent']:.4f}")
    for key in ("subspace_distance", "population_mse", "test_mse", "local_only_mse",
                "meta_model_norm", "transfer_risk", "local_risk", "cluster_purity",
                "test_accuracy", "local_only_accuracy"):
        if key in report:
            parts.append(f"{key}={report[key]:.4g}")
    if report["step"] != "final":
        parts.append(f"users={report['users_contributing']}")
    parts.append(f"nodes={report['nodes_answered']}")
    if report["nodes_failed"]:
        parts.append(f"failed={report['nodes_failed']}")
    parts.append(f"{report['seconds']:.2f}s")
    return "  ".join(parts)


def summary_lines(results: dict) -> list[str]:
    m, p = results["metrics"], results["privacy"]
    if "transfer_risk" in m:  # meta-learning: risk of fresh tasks
        quality = (f"  transfer risk {m['transfer_risk']:.4g} on {m['fresh_tasks']:.0f} fresh tasks"
                   f"   local training {m['local_risk']:.4g}")
        if "cluster_purity" in m:
            quality += f"   cluster purity {m['cluster_purity']:.3f}"
    elif "test_accuracy" in m:  # classification
        quality = (f"  test accuracy {m['test_accuracy']:.4f}   each user alone "
                   f"{m['local_only_accuracy']:.4f}   known embedding "
                   f"{m['known_embedding_accuracy']:.4f}")
    else:
        quality = (f"  population MSE {m.get('population_mse', float('nan')):.4g}   "
                   f"local-only MSE {m.get('local_only_mse', float('nan')):.4g}   "
                   f"test MSE {m.get('test_mse', float('nan')):.4g}")
    lines = [
        f"fedpriv: {results['algorithm']} on {results['num_users']} users "
        f"({results['num_nodes']} nodes, {results['runtime']})",
        quality,
        _privacy_line(p),
        f"  wall time {results['wall_time_s']:.1f}s",
    ]
    if results["rejections"]:
        lines.append(f"  rejected node replies: {results['rejections']}")
    return lines


def _privacy_line(p: dict) -> str:
    if p["epsilon"] is None:
        return "  privacy: none (a non-private baseline: sums released without noise)"
    if not p["ledger"]:
        return "  privacy: nothing released from user data (epsilon 0)"
    if p["delta"] == 0.0:
        return (f"  privacy: pure epsilon-DP, epsilon spent {p['epsilon']:.4f} (target "
                f"{p['target_epsilon']}), exponential mechanism, {p['neighbouring_relation']} "
                "user-level")
    return (f"  privacy: epsilon spent {p['epsilon']:.4f} (target {p['target_epsilon']}), "
            f"delta {p['delta']:g}, {p['accountant'].upper()} accountant, "
            f"{p['neighbouring_relation']} user-level")


def _calibrate(config: RunConfig, plan) -> list[float]:
    try:
        if any(r.mechanism == "exponential" for r in plan):
            return pure_plan_epsilons(plan, config.epsilon)
        return calibrate_gaussian_plan(plan, config.epsilon, config.delta, config.accountant,
                                       config.neighbouring_relation)
    except InfeasiblePlanError as err:
        raise InfeasiblePlanError(f"refusing to start: {err}") from None


def check_plan(config: RunConfig) -> list[float]:
    """Calibrate the config's privacy plan without running; raises if it cannot be met."""
    plan = get_algorithm(config.algorithm)(config).privacy_plan()
    return _calibrate(config, plan) if plan else []
