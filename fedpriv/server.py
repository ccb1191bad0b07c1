"""The server side of a run, free of Flower: privacy plan, node-reply checks, noise, accounting.

The Flower strategy (``strategies/``) and the in-process engine (``fedpriv.engine``) both drive a
``PrivateServer``: they only move arrays between it and the nodes.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedpriv import checkpoint
from fedpriv.algorithms.base import Part, Step, UserContribution
from fedpriv.checkpoint import CheckpointError
from fedpriv.cohorts import partition_users
from fedpriv.config import RunConfig, resumable_keys
from fedpriv.privacy.accounting import (
    Accountant,
    InfeasiblePlanError,
    calibrate_gaussian_plan,
    mean_sensitivity,
    pure_plan_epsilons,
)
from fedpriv.privacy.mechanisms import exponential_mechanism
from fedpriv.randomness import noise_generator
from fedpriv.registry import get_algorithm

# Why a node's reply was not used: each is counted per step and over the run.
REJECTION_KINDS = (
    "node-error",  # the node reported an error (crashed)
    "timeout",  # no reply before node-timeout
    "malformed",  # the message lacks records or has non-integer counts
    "unknown-partition",  # a partition id the server does not expect
    "duplicate",  # a second reply for the same partition
    "user-count",  # claims another number of users than take part in the step
    "missing-part",  # a released part is missing
    "unexpected-part",  # an array the step does not release
    "dtype",  # not a real floating-point array
    "shape",  # not the part's shape
    "non-finite",  # NaN or infinity
    "metrics",  # final step: missing or non-finite metrics
)


class BudgetExceededError(InfeasiblePlanError):
    """The run would spend more epsilon than its ceiling (max-epsilon) allows."""


@dataclass
class NodeReply:
    """A node's answer to one step, as the transport received it. ``error`` set: no usable
    contribution, for the reason ``failure`` (one of ``REJECTION_KINDS``)."""

    partition_id: int
    contribution: UserContribution | None = None
    error: str | None = None
    failure: str = "node-error"


@dataclass
class PrivateServer:
    config: RunConfig
    num_partitions: int
    log: Callable[[str], None] = print
    checkpoint_path: Path | None = None  # None: no checkpoints (tests, sweeps)
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
        releases = [s for s in self.steps() if s.release is not None]
        self._last_release = releases[-1].label if releases else None
        self.resumed_from: int | None = None
        # one server per checkpoint: two servers resuming one run would publish its next
        # releases twice (released by the OS when the process dies, so a crash frees it)
        self._lock = checkpoint.lock(self.checkpoint_path) if self.checkpoint_path else None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        """Resume (or refuse to overwrite an interrupted run), then check the budget."""
        c = self.config
        if c.resume:
            self._restore()
        elif self.checkpoint_path is not None and self.checkpoint_path.exists():
            raise CheckpointError(
                f"an interrupted run left a checkpoint at {self.checkpoint_path} "
                f"({checkpoint.describe(self.checkpoint_path)}). Continue it with --resume "
                "(resume = true). Delete the file only to start over knowingly: the releases "
                "already made stay spent, so a restart spends the budget again (and with the "
                "same seeded noise, two releases of different sums would cancel it)")
        self.projected_epsilon = self._check_budget()

    # ----- budget guard and checkpoints ------------------------------------------------------
    def _check_budget(self) -> float:
        """Refuse to start (or resume) a run whose releases so far plus those still planned
        would compose to more than the ceiling (max-epsilon, or the target). Returns that
        projected total."""
        c = self.config
        noiseless = any(s.release is None and not s.is_final for s in self.steps())
        if noiseless and c.max_epsilon:
            raise BudgetExceededError(
                f"refusing to start: {c.algorithm} releases sums without noise (epsilon is "
                f"unbounded), but max-epsilon = {c.max_epsilon} is set")
        # each release must use the noise this check verified (see _conforms)
        self._verified = {**self.multipliers, **self.pure_epsilons}
        if not self.plan:
            return 0.0
        projected = self._projected_epsilon()
        if projected > c.ceiling * (1.0 + 1e-9):
            spent = self.accountant.epsilon()
            raise BudgetExceededError(
                f"refusing to {'resume' if self.resumed_from is not None else 'start'}: "
                f"the run would spend epsilon {projected:.6g} in all ({spent:.6g} already "
                f"spent), above the ceiling {c.ceiling:g} "
                f"({'max-epsilon' if c.max_epsilon else 'the target epsilon'})")
        return projected

    def _projected_epsilon(self) -> float:
        """Epsilon after every remaining planned release, composed on a copy of the
        accountant exactly as the run will compose them."""
        accountant = copy.deepcopy(self.accountant)
        for step in self.pending_steps():
            if step.release is None or step.is_final:
                continue
            if self.pure:
                accountant.record_pure(step.label, self.pure_epsilons[step.release])
                continue
            groups, rate = self.algorithm.charge(step)
            accountant.record(step.label, self.multipliers[step.release], groups=groups,
                              sampling_rate=rate, evaluate=False)
        return accountant.epsilon()

    @property
    def completed(self) -> int:
        """Steps done: one report each (the next step is ``steps()[completed]``)."""
        return len(self.rounds)

    def pending_steps(self) -> list[Step]:
        """The steps still to run (all of them, or those after a resumed checkpoint)."""
        return self.steps()[self.completed:]

    def _state(self) -> dict[str, Any]:
        spent = [e["epsilon_spent"] for e in self.accountant.ledger
                 if e.get("epsilon_spent") is not None]
        return {
            "config": self.config.to_mapping(), "completed": self.completed,
            "total_steps": len(self.steps()), "multipliers": self.multipliers,
            "pure_epsilons": self.pure_epsilons,
            "algorithm": _algorithm_state(self.algorithm), "accountant": self.accountant,
            "rejections": self.rejections, "bounded": self.bounded, "rounds": self.rounds,
            "metrics": self.metrics, "releases": self._releases, "unnoised": self._unnoised,
            "epsilon_spent": spent[-1] if spent else 0.0, "pid": os.getpid(),
        }

    def _restore(self) -> None:
        if self.checkpoint_path is None:
            raise CheckpointError("resume = true needs a checkpoint path")
        state = checkpoint.load(self.checkpoint_path)
        stored, wanted = state["config"], self.config.to_mapping()
        changed = sorted(k for k in set(stored) | set(wanted)
                         if k not in resumable_keys() and stored.get(k) != wanted.get(k))
        if changed:
            raise CheckpointError(
                f"checkpoint {self.checkpoint_path} belongs to another run; these keys differ: "
                + ", ".join(f"{k} = {stored.get(k)!r} there, {wanted.get(k)!r} now"
                            for k in changed[:5]))
        if state["multipliers"] != self.multipliers or (
                state["pure_epsilons"] != self.pure_epsilons):
            raise CheckpointError(
                "the privacy plan calibrated now differs from the checkpoint's (another "
                "dp-accounting version?); resuming would mix two plans")
        self.algorithm.__dict__.update(state["algorithm"])
        self.accountant = state["accountant"]
        self.rejections, self.bounded = state["rejections"], state["bounded"]
        self.rounds, self.metrics = state["rounds"], state["metrics"]
        self._releases, self._unnoised = state["releases"], state["unnoised"]
        self.resumed_from = self.completed
        self.log(f"fedpriv: resumed from {self.checkpoint_path}: {self.completed} of "
                 f"{len(self.steps())} steps done, epsilon spent {state['epsilon_spent']:.4g}")

    def _save_checkpoint(self) -> None:
        if self.checkpoint_path is not None:
            checkpoint.save(self.checkpoint_path, self._state())
            checkpoint.pause_for_tests(self.completed)

    def discard_checkpoint(self) -> None:
        """Remove the checkpoint once the results are safely written."""
        if self.checkpoint_path is not None:
            checkpoint.remove(self.checkpoint_path)
        self.close()

    def close(self) -> None:
        """Release the checkpoint lock (a process that dies releases it too)."""
        if self._lock is not None:
            checkpoint.unlock(self._lock)
            self._lock = None

    @functools.cached_property
    def _steps(self) -> list[Step]:
        return self.algorithm.steps()

    def steps(self) -> list[Step]:
        return self._steps

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
    def _reject(self, step: Step, reply: NodeReply, kind: str, detail: str) -> None:
        self.rejections[kind] += 1
        self.log(f"  {step.label}: rejected node (partition {reply.partition_id}): {kind}: "
                 f"{detail}")

    @staticmethod
    def _check_totals(step: Step, contrib: UserContribution) -> tuple[str, str] | None:
        """(kind, detail) of the first problem with a node's sums, or None."""
        totals = contrib.totals if isinstance(contrib.totals, Mapping) else {}
        names = {part.name for part in step.parts}
        extra = sorted(str(k) for k in totals if k not in names)
        if extra:
            return "unexpected-part", f"arrays {extra} are not released in {step.label}"
        for part in step.parts:
            if part.name not in totals:
                return "missing-part", f"no array {part.name!r}"
            total = np.asarray(totals[part.name])
            if total.dtype not in (np.float32, np.float64):
                return "dtype", (f"{part.name!r} has dtype {total.dtype}, expected float32 or "
                                 "float64")
            if total.shape != part.shape:
                return "shape", f"{part.name!r} has shape {total.shape}, expected {part.shape}"
            if not np.all(np.isfinite(total)):
                return "non-finite", f"non-finite values in {part.name!r}"
        return None

    def _accepted(self, step: Step,
                  replies: Sequence[NodeReply]) -> tuple[list[UserContribution], set[int]]:
        """The usable contributions, and the partitions they come from."""
        expected = self.expected_users(step)
        seen: set[int] = set()
        accepted = []
        metric_keys = _common_metric_keys(replies) if step.is_final else None
        for reply in replies:
            contrib = reply.contribution
            if reply.error is not None or contrib is None:
                kind = reply.failure if reply.failure in REJECTION_KINDS else "node-error"
                self._reject(step, reply, kind, reply.error or "no content")
                continue
            if reply.partition_id not in expected:
                self._reject(step, reply, "unknown-partition",
                             f"partition {reply.partition_id} is not one of this run's")
                continue
            if reply.partition_id in seen:
                self._reject(step, reply, "duplicate", "a second reply for the partition")
                continue
            if contrib.num_users != expected[reply.partition_id]:
                self._reject(step, reply, "user-count",
                             f"claims {contrib.num_users} users, "
                             f"{expected[reply.partition_id]} take part")
                continue
            if not 0 <= contrib.num_clipped <= contrib.num_users:
                self._reject(step, reply, "malformed",
                             f"{contrib.num_clipped} users clipped of {contrib.num_users}")
                continue
            if not step.is_final:
                problem = self._check_totals(step, contrib)
                if problem is not None:
                    self._reject(step, reply, *problem)
                    continue
            elif (not isinstance(contrib.metrics, Mapping)
                  or frozenset(contrib.metrics) != metric_keys
                  or not all(np.isfinite(v) for v in contrib.metrics.values())):
                self._reject(step, reply, "metrics", "missing, unexpected or non-finite "
                             "metrics (the final evaluation is the nodes' own measurement)")
                continue
            seen.add(reply.partition_id)
            accepted.append(contrib)
        return accepted, seen

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
            peak = float(np.max(np.abs(value), initial=0.0))  # overflow-free norm
            norm = peak * float(np.linalg.norm(value / peak)) if peak > 0 else 0.0
            if norm > bound * (1.0 + 1e-9):
                self.bounded += 1
                total += value * (bound / norm)
            else:
                total += value
        return total

    # ----- one step --------------------------------------------------------------------------
    def aggregate(self, step: Step, replies: Sequence[NodeReply], started: float) -> dict:
        """Check the replies, release the step (noise, accounting), checkpoint, report."""
        if step != self.pending_steps()[0]:
            raise RuntimeError(f"step {step.label} is out of order; next is "
                               f"{self.pending_steps()[0].label}")
        rejections, bounded = Counter(self.rejections), self.bounded
        accepted, answered = self._accepted(step, replies)
        users = sum(a.num_users for a in accepted)
        report: dict[str, Any] = {
            "step": step.label,
            "nodes_answered": len(accepted),
            "nodes_failed": self.num_partitions - len(accepted),
            "users_contributing": users,
            "rejected": dict(self.rejections - rejections),
        }
        if step.group is not None:
            report["user_group"] = step.group
        if step.is_final:
            keys = accepted[0].metrics.keys() if accepted else []
            sums = {k: sum(a.metrics[k] for a in accepted) for k in keys}
            if users == 0:  # keep the run (and its ledger); there is nothing to measure
                self.metrics = {}
                report["error"] = "no node answered the final evaluation"
                self.log("  final: no node answered; the results carry no metrics")
            else:
                self.metrics = self.algorithm.finalize(sums, users)
            report.update(self.metrics)
        else:
            report.update(self._release(step, accepted, answered))
            report["nodes_bounded"] = self.bounded - bounded
            report["users_clipped"] = sum(a.num_clipped for a in accepted)
        report["seconds"] = time.perf_counter() - started
        self.rounds.append(report)
        self._save_checkpoint()  # before anything of this step leaves the server
        self.log(_progress_line(report, len(self.steps()), len(self.rounds)))
        return report

    def _release(self, step: Step, accepted: Sequence[UserContribution],
                 answered: set[int]) -> dict[str, Any]:
        """Noisy population means of the step's parts, applied and (if private) accounted."""
        c = self.config
        population = step.population or c.num_users
        if step.parts[0].mechanism == "exponential":
            return self._select(step, accepted, population)
        scale = self._missing_node_scale(step, answered)
        means: dict[str, np.ndarray] = {}
        ledger_parts = []
        z = self.multipliers[step.release] if step.release is not None else None
        if z is not None:
            self._conforms(step, z)
        for part in step.parts:
            mean = self._bounded_sum(part, accepted) / population
            if z is None:
                self._unnoised += 1
                means[part.name] = mean
                continue
            z_part = z / math.sqrt(part.share)
            sensitivity = mean_sensitivity(part.clip_norm, population, c.neighbouring_relation)
            std = z_part * sensitivity
            rng = noise_generator(c, self._releases)
            self._releases += 1
            means[part.name] = scale * (mean + self.algorithm.noise(step, part, std, rng))
            ledger_parts.append({"name": part.name, "noise_multiplier": z_part,
                                 "l2_sensitivity": sensitivity, "noise_std": std})
        report = dict(self.algorithm.apply(step, means))
        if scale != 1.0:
            report["missing_node_rescale"] = scale
        if z is not None:
            groups, rate = self.algorithm.charge(step)
            count = len(self.accountant.ledger) + 1
            evaluate = rate >= 1 or count & (count - 1) == 0 or step.label == self._last_release
            spent = self.accountant.record(step.label, z, ledger_parts, groups=groups,
                                           sampling_rate=rate, evaluate=evaluate)
            if spent is not None:
                self._guard(spent)
                report["epsilon_spent"] = spent
        return report

    def _missing_node_scale(self, step: Step, answered: set[int]) -> float:
        """Post-processing for nodes that did not answer (``rescale-missing-nodes``): the
        noisy mean, taken over the population fixed in advance, is multiplied by (users taking
        part) / (users taking part in the nodes that answered). It is applied after the noise,
        so the sensitivity, the noise and the accounting are those of the plan; it keeps a
        step's size from shrinking with the share of nodes that failed. The counts are public:
        the step's participants (a public rule), or for a Poisson-sampled step the users the
        nodes host (the sample itself must stay secret)."""
        if not (self.config.rescale_missing_nodes and self.algorithm.rescale_for_missing_nodes):
            return 1.0
        if self.algorithm.charge(step)[1] < 1.0:
            counts = {p: len(ids) for p, ids in self._partition_users.items()}
        else:
            counts = self.expected_users(step)
        answering = sum(counts[p] for p in answered)
        return sum(counts.values()) / answering if answering else 1.0

    def _conforms(self, step: Step, value: float) -> None:
        """Per-release budget guard, before any noise is drawn: the release must be the next
        pending step (``aggregate`` checks the order) with exactly the noise the start-up
        check composed into the projected epsilon, so the run cannot spend more than that
        projection, which is within the ceiling."""
        verified = self._verified
        if step.release not in verified or value != verified[step.release]:
            raise BudgetExceededError(
                f"release {step.label} would use {value!r} for plan entry {step.release!r}, "
                f"not the {verified.get(step.release)!r} the budget check verified; it was not "
                "released and the run stops")

    def _guard(self, spent: float) -> None:
        """Last line of the budget guard: stop before a release over the ceiling leaves the
        server (it cannot happen when the plan check passed; it is checked anyway)."""
        if spent > self.config.ceiling * (1.0 + 1e-9):
            raise BudgetExceededError(
                f"epsilon spent {spent:.6g} would exceed the ceiling {self.config.ceiling:g}; "
                "the release was not published and the run stops")

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
        self._conforms(step, epsilon)
        # one user moves each mean score by at most bound / population, under either relation
        # (add/remove with the population fixed: a removed user's scores are 0)
        sensitivity = part.clip_norm / population
        rng = noise_generator(self.config, self._releases)
        self._releases += 1
        choice = exponential_mechanism(scores, epsilon, sensitivity, rng)
        report = dict(self.algorithm.apply(step, {"choice": np.array(choice)}))
        # only what the mechanism releases (the index): the exact scores are not released
        spent = self.accountant.record_pure(step.label, epsilon, {
            "candidates": int(np.prod(part.shape)), "score_sensitivity": sensitivity,
            "chosen": choice})
        self._guard(spent)
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
                "max_epsilon": c.ceiling,
                "noise": "os-entropy" if c.secure_noise else "seeded",
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
            "node_faults": {"rate": c.node_fault_rate, "kind": c.node_fault_kind},
            "resumed_from_step": self.resumed_from,
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
    if report.get("rejected"):
        parts.append("rejected=" + ",".join(f"{k}:{n}" for k, n in report["rejected"].items()))
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


def _common_metric_keys(replies: Sequence[NodeReply]) -> frozenset[str]:
    """The metric names most final replies carry (every honest node sends the same ones)."""
    sets = Counter(frozenset(r.contribution.metrics) for r in replies
                   if r.contribution is not None
                   and isinstance(r.contribution.metrics, Mapping))
    return sets.most_common(1)[0][0] if sets else frozenset()


def _algorithm_state(algorithm: Any) -> dict[str, Any]:
    """The algorithm's server state: its attributes, less the config and cached values that
    are recomputed from the config."""
    cached = {name for cls in type(algorithm).__mro__ for name, value in vars(cls).items()
              if isinstance(value, functools.cached_property)}
    return {k: v for k, v in vars(algorithm).items() if k != "config" and k not in cached}


def _calibrate(config: RunConfig, plan) -> list[float]:
    try:
        if any(r.mechanism == "exponential" for r in plan):
            return pure_plan_epsilons(plan, config.epsilon)
        return calibrate_gaussian_plan(plan, config.epsilon, config.delta, config.accountant,
                                       config.neighbouring_relation)
    except InfeasiblePlanError as err:
        raise InfeasiblePlanError(f"refusing to start: {err}") from None


def check_run(config: RunConfig, checkpoint_path: Path | None = None) -> PrivateServer:
    """Everything the server checks before its first step, without running: the privacy plan,
    the budget ceiling and, when resuming, the checkpoint. Raises if the run cannot start."""
    server = PrivateServer(config, 1, log=lambda _: None, checkpoint_path=checkpoint_path)
    server.close()
    return server


def check_plan(config: RunConfig) -> list[float]:
    """Calibrate the config's privacy plan without running; raises if it cannot be met."""
    plan = get_algorithm(config.algorithm)(config).privacy_plan()
    return _calibrate(config, plan) if plan else []
