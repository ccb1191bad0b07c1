"""``PrivateServer``: the step loop of a run, free of Flower, delegating to the units it owns.

Each step: check the nodes' replies and bound each node's sums (``ReplyChecker``), release the
step with calibrated noise under the accountant and the budget guard (``Releaser``), checkpoint
(``CheckpointStore``) *before* anything of the step leaves the server, and report
(``fedpriv.server.report``). The Flower strategy (``strategies/``) and the in-process engine
(``fedpriv.engine``) both drive a ``PrivateServer``: they only move arrays between it and the
nodes.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.configure import config_defaults
from fedpriv.evaluation import EVALUATE, EvaluatedAlgorithm, algorithm_for
from fedpriv.faults import failing_partitions
from fedpriv.privacy.accounting import Accountant
from fedpriv.server.discrete import (
    SharePlan,
    check_delta_slack,
    check_discrete,
    honest_count,
    honest_minimum,
    ring_layout,
    share_plan,
)
from fedpriv.server.discrete import payload as share_payload
from fedpriv.server.release import Releaser, calibrate
from fedpriv.server.replies import LOST_KINDS, CheckedReplies, NodeReply, Rejection, ReplyChecker
from fedpriv.server.report import progress_line, results_dict, step_report
from fedpriv.server.secagg import SecureOutcome, check_threshold
from fedpriv.server.store import CheckpointStore, algorithm_state
from fedpriv.shares import DISTRIBUTED_KEY, decode_sum


class PrivateServer:
    """One run's server: the algorithm's steps in order, each checked, released, checkpointed
    and reported. ``checkpoint_path`` None: no checkpoints (tests, sweeps)."""

    def __init__(self, config: RunConfig, num_partitions: int,
                 log: Callable[[str], None] = print, checkpoint_path: Path | None = None) -> None:
        self.config, self.num_partitions = config, num_partitions
        self.log, self.checkpoint_path = log, checkpoint_path
        self.algorithm: Algorithm[Any] = algorithm_for(config)(config)
        self.plan = self.algorithm.privacy_plan()
        check_discrete(config, self.algorithm, self.plan)
        check_delta_slack(config, self.plan, num_partitions)
        calibrated = calibrate(config, self.plan)
        releases = [s for s in self.steps() if s.release is not None]
        self.release = Releaser(config, self.algorithm, self.plan, calibrated,
                                releases[-1].label if releases else None)
        self.replies = ReplyChecker()
        self.rounds: list[dict[str, Any]] = []  # one report per step done
        self.metrics: dict[str, float] = {}  # the final step's
        # who each node hosts, where that is public; else (natural users of a file, which the
        # server does not read) each node's count is its own reply's, and the missing-node
        # rescale weighs the nodes equally (they host users by a hash of their ids)
        cls = type(self.algorithm)
        self._partition_users = ({p: cls.hosted_users(config, p, num_partitions)
                                  for p in range(num_partitions)}
                                 if cls.public_hosting(config) else {})
        self._hosted = ({p: len(ids) for p, ids in self._partition_users.items()}
                        or dict.fromkeys(range(num_partitions), 1))
        self._expected_cache: tuple[str, dict[int, int | None]] | None = None
        self._share_cache: tuple[str, list[SharePlan]] | None = None
        self.resumed_from: int | None = None
        self.distributed = config.noise_shares and bool(self.plan)
        self.secure = config.aggregation == "secure" and bool(self.plan)
        if self.secure:
            self.graph = check_threshold(config, num_partitions)
        if self.distributed:  # a modulus too small fails now, before round 1
            seen = set()
            for step in self.steps():
                key = (step.release, step.population, tuple((p.name, p.shape, p.share)
                                                             for p in step.parts))
                if step.release is not None and key not in seen:
                    seen.add(key)
                    self.share_plans(step)
        self.store = CheckpointStore(checkpoint_path)  # locked: one server per checkpoint
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        """Resume (or refuse to overwrite an interrupted run), then check the budget."""
        if self.config.resume:
            self._restore()
        else:
            self.store.refuse_overwrite()
        self.projected_epsilon = self.release.check_budget(
            self.steps(), self.pending_steps(), resuming=self.resumed_from is not None)

    # ----- what the units hold ---------------------------------------------------------------
    @property
    def accountant(self) -> Accountant:
        return self.release.accountant

    @property
    def multipliers(self) -> dict[str, float]:
        return self.release.multipliers

    @property
    def pure_epsilons(self) -> dict[str, float]:
        return self.release.pure_epsilons

    @property
    def pure(self) -> bool:
        return self.release.pure

    @property
    def rejections(self) -> Counter[str]:
        return self.replies.rejections

    @property
    def bounded(self) -> int:
        return self.replies.bounded

    def _bounded_sum(self, part: Part, accepted: Sequence[UserContribution]) -> np.ndarray:
        return self.replies.bounded_sum(part, accepted)

    # ----- steps -----------------------------------------------------------------------------
    # The algorithm's steps are read again after every step: a step may depend on earlier
    # releases (adaptive clipping moves the next round's clip norm), never on exact user data.
    @functools.cached_property
    def _steps(self) -> list[Step]:
        return self.algorithm.steps()

    def steps(self) -> list[Step]:
        return self._steps

    def next_step(self) -> Step | None:
        """The step to run now (None: the run is done)."""
        pending = self.pending_steps()
        return pending[0] if pending else None

    @property
    def completed(self) -> int:
        """Steps done: one report each (the next step is ``steps()[completed]``)."""
        return len(self.rounds)

    def pending_steps(self) -> list[Step]:
        """The steps still to run (all of them, or those after a resumed checkpoint)."""
        return self.steps()[self.completed:]

    def payload(self, step: Step) -> dict[str, np.ndarray]:
        """The step's broadcast; a distributed release adds the nodes' share parameters."""
        arrays = self.algorithm.broadcast(step)
        if self.distributed and step.release is not None:
            arrays = {**arrays, DISTRIBUTED_KEY: share_payload(self.share_plans(step))}
        return arrays

    def share_plans(self, step: Step) -> list[SharePlan]:
        """A distributed step's per-part parameters (``fedpriv.server.discrete``)."""
        key = step.to_json()
        if self._share_cache is None or self._share_cache[0] != key:
            assert step.release is not None
            z = self.multipliers[step.release]
            population = step.population or self.config.num_users
            self._share_cache = (key, [
                share_plan(self.config, part, z / np.sqrt(part.share), population,
                           self.num_partitions) for part in step.parts])
        return self._share_cache[1]

    def expected_users(self, step: Step) -> dict[int, int | None]:
        """{partition: how many of its users take part in ``step``} (public values only; with
        Poisson sampling, values of the server's sampling seed); None for every partition
        where hosting is not public (the server reads no user data)."""
        if not self._partition_users:
            return dict.fromkeys(range(self.num_partitions))
        key = step.to_json()
        if self._expected_cache is None or self._expected_cache[0] != key:
            cls = type(self.algorithm)
            self._expected_cache = (key, {
                p: len(cls.participants(self.config, step, ids))
                for p, ids in self._partition_users.items()
            })
        return self._expected_cache[1]

    def sends(self, step: Step) -> bool:
        """Whether ``step`` goes to the nodes. A distributed or secure run sends no metrics
        step (the final one, exact evaluations): its nodes send nothing exact about their
        users, so its metrics are released with noise (``private-metrics``) or not at all."""
        return not (self.config.noise_shares and step.is_final)

    def record_unsent(self, step: Step, started: float) -> dict[str, Any]:
        """Finish a step that ``sends`` keeps from the nodes: no reply, no metrics."""
        if self.sends(step) or step != self.pending_steps()[0]:
            raise RuntimeError(f"step {step.label} goes to the nodes or is out of order")
        return self._finish(step, [], [], set(), Counter(self.rejections), self.bounded,
                            started)

    # ----- one step --------------------------------------------------------------------------
    def aggregate(self, step: Step, replies: Sequence[NodeReply],
                  started: float) -> dict[str, Any]:
        """Check the replies, release the step (noise, accounting), checkpoint, report."""
        if step != self.pending_steps()[0]:
            raise RuntimeError(f"step {step.label} is out of order; next is "
                               f"{self.pending_steps()[0].label}")
        rejections, bounded = Counter(self.rejections), self.bounded
        ring = (ring_layout(step, self.share_plans(step))
                if self.distributed and step.release is not None and not step.is_final
                else None)
        checked = self.replies.check(step, replies, self.expected_users(step), ring)
        return self._finish(step, checked.accepted, checked.rejected,
                            self._present(step, replies, checked), rejections, bounded,
                            started)

    def aggregate_secure(self, step: Step, outcome: SecureOutcome,
                         started: float) -> dict[str, Any]:
        """A securely aggregated step: ``outcome.total`` is the sum over the surviving nodes
        (ring vectors; counts and metrics), the only thing the server learned of their
        contributions. The nodes lost on the way are counted as rejections; the present ones
        are those of a central or distributed run (a node lost in transit is missing, one
        that failed on its data counts with zero)."""
        if step != self.pending_steps()[0]:
            raise RuntimeError(f"step {step.label} is out of order; next is "
                               f"{self.pending_steps()[0].label}")
        rejections, bounded = Counter(self.rejections), self.bounded
        rejected = [Rejection(n, kind, f"{stage}: {detail}")
                    for n, (stage, kind, detail) in sorted(outcome.failures.items())]
        self.replies.rejections.update(r.kind for r in rejected)
        expected = self.expected_users(step)
        if all(v is not None for v in expected.values()):
            want = sum(int(expected[n] or 0) for n in outcome.survivors)
            if outcome.total.num_users != want:
                self.replies.rejections["user-count"] += 1
                rejected.append(Rejection(-1, "user-count", f"the surviving nodes' sum claims "
                                          f"{outcome.total.num_users} users, not {want}"))
        lost = {n for n, (_, kind, _) in outcome.failures.items() if kind in LOST_KINDS}
        lost |= failing_partitions(self.config.seed, step.label, self.num_partitions,
                                   self.config.node_fault_rate)
        present = set(range(self.num_partitions)) - lost
        report = self._finish(step, [outcome.total], rejected, present, rejections, bounded,
                              started, contributors=len(outcome.survivors))
        report["secure_bytes_to_nodes"] = outcome.bytes_to_nodes
        report["secure_bytes_from_nodes"] = outcome.bytes_from_nodes
        return report

    def history(self) -> dict[str, float]:
        """{release label: rho} of the zCDP releases so far (what a secure round's nodes check
        their budget against)."""
        return {str(e["release"]): float(e["rho"]) for e in self.accountant.ledger
                if "rho" in e}

    def _finish(self, step: Step, accepted: Sequence[UserContribution],
                rejected: Sequence[Rejection], present: set[int], rejections: Counter[str],
                bounded: int, started: float, contributors: int | None = None,
                ) -> dict[str, Any]:
        """Release (or finalize) the step from the accepted contributions, checkpoint, report.
        ``contributors``: how many nodes' contributions ``accepted`` sums (secure: one sum)."""
        for r in rejected:
            self.log(f"  {step.label}: rejected node (partition {r.partition_id}): {r.kind}: "
                     f"{r.detail}")
        count = len(accepted) if contributors is None else contributors
        users = sum(a.num_users for a in accepted)
        report = step_report(step, count, self.num_partitions, users,
                             self.rejections - rejections)
        if self.config.noise_shares:  # the counts are public ones (or none at all)
            public = self.expected_users(step)
            report["users_contributing"] = (None if any(v is None for v in public.values())
                                            else users)
        if not self.sends(step):
            self.metrics = {}
            report["users_contributing"] = None
            report["nodes_failed"] = 0
            report["note"] = (f"not sent: {self.config.aggregation} nodes send no exact "
                              "metrics (private-metrics = true releases them with noise)")
        elif step.is_final:
            # every accepted reply of a metrics step has the same metrics (ReplyChecker)
            metrics = [a.metrics for a in accepted if a.metrics is not None]
            keys = metrics[0].keys() if metrics else []
            sums = {k: sum(m[k] for m in metrics) for k in keys}
            if users == 0:  # keep the run (and its ledger); there is nothing to measure
                self.metrics = {}
                report["error"] = f"no node answered the {step.label} evaluation"
                self.log(f"  {step.label}: no node answered; "
                         + ("the results carry no metrics" if step.kind == "final"
                            else "no point of the learning curve here"))
            else:
                self.metrics = self.algorithm.finalize(sums, users)
            report.update(self.metrics)
        else:
            report.update(self._release(step, accepted, present, count))
            report["nodes_bounded"] = self.bounded - bounded
            report["users_clipped"] = (None if self.config.noise_shares  # never sent
                                       else sum(a.num_clipped for a in accepted))
        report["seconds"] = time.perf_counter() - started
        self.rounds.append(report)
        self.__dict__.pop("_steps", None)  # the algorithm's state moved: its steps may too
        self.store.save(self._state())  # before anything of this step leaves the server
        self.log(progress_line(report, len(self.steps()), len(self.rounds)))
        return report

    def _present(self, step: Step, replies: Sequence[NodeReply],
                 checked: CheckedReplies) -> set[int]:
        """The partitions the missing-node rescale counts as present: all but those lost to
        events no user's data can cause (no reply at all, or ``LOST_KINDS``: a timeout, a lost
        node or message) and those the public fault simulation made fail (``node-fault-rate``,
        a function of the seed and the step). A node that answered with an error or unusable
        sums counts as present, with zero: one user's data must never change how a release
        is scaled."""
        lost = set(range(self.num_partitions)) - {r.partition_id for r in replies}
        lost |= {r.partition_id for r in checked.rejected if r.kind in LOST_KINDS}
        lost |= failing_partitions(self.config.seed, step.label, self.num_partitions,
                                   self.config.node_fault_rate)
        return set(range(self.num_partitions)) - lost

    def _release(self, step: Step, accepted: Sequence[UserContribution],
                 answered: set[int], contributors: int) -> dict[str, Any]:
        """Population means of the bounded node sums, released by the release unit."""
        population = step.population or self.config.num_users
        if step.parts[0].mechanism == "exponential":
            scores = self.replies.bounded_sum(step.parts[0], accepted) / population
            return self.release.select(step, scores, population)
        scale = self.release.rescale(step, answered, self._hosted, self.expected_users(step))
        if self.distributed and step.release is not None:
            plans = self.share_plans(step)
            sums = {part.name: decode_sum([a.totals[part.name] for a in accepted],
                                          plan.granularity, plan.bits, self.config.seed,
                                          step.label, part.name, int(np.prod(part.shape)))
                    for part, plan in zip(step.parts, plans, strict=True)}
            honest = honest_count(self.config, self.num_partitions, contributors)
            if honest < honest_minimum(self.config, self.num_partitions):
                self.log(f"  {step.label}: only {honest} honest nodes' noise shares (more nodes "
                         "dropped out than collusion-threshold allows): the ledger records the "
                         "noise that was present")
            report = self.release.distributed(step, sums, plans, population, honest, scale)
            if step.kind == EVALUATE:  # the server never sees the exact mean here
                report.update({f"exact_private_{p.name}": None for p in step.parts})
                report["evaluation_scale"] = scale
            return report
        means = {part.name: self.replies.bounded_sum(part, accepted) / population
                 for part in step.parts}
        exact: dict[str, Any] = {}
        if step.kind == EVALUATE:  # operator report only, never released
            # the same rescale as the noisy means, and the centring B/2 (part.clip_norm) back
            exact = {f"exact_private_{p.name}": float(means[p.name].reshape(-1)[0]) * scale
                     + p.clip_norm for p in step.parts}
            exact["evaluation_scale"] = scale
            if not accepted:
                exact["error"] = "no node answered the evaluation: its release is noise alone"
        return {**exact, **self.release.gaussian(step, means, population, scale)}

    # ----- checkpoints and results -----------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """The checkpoint: every unit's state under the checkpoint keys."""
        return {"config": self.config.to_mapping(), "completed": self.completed,
                "total_steps": len(self.steps()), **self.release.state(),
                "algorithm": algorithm_state(self.algorithm), **self.replies.state(),
                "rounds": self.rounds, "metrics": self.metrics}

    def _restore(self) -> None:
        state = self.store.load(self.config.to_mapping(), self.multipliers, self.pure_epsilons,
                                config_defaults(self.config))
        self.algorithm.__dict__.update(state["algorithm"])
        self.__dict__.pop("_steps", None)
        self.release.load_state(state)
        self.replies.load_state(state)
        self.rounds, self.metrics = state["rounds"], state["metrics"]
        self.resumed_from = self.completed
        self.log(f"fedpriv: resumed from {self.checkpoint_path}: {self.completed} of "
                 f"{len(self.steps())} steps done, epsilon spent {state['epsilon_spent']:.4g}")

    def discard_checkpoint(self) -> None:
        """Remove the checkpoint once the results are safely written."""
        self.store.discard()

    def close(self) -> None:
        """Release the checkpoint lock (a process that dies releases it too)."""
        self.store.close()

    def results(self, wall_time_s: float, runtime: str) -> dict[str, Any]:
        return results_dict(
            self.config, num_nodes=self.num_partitions, runtime=runtime,
            private=self.algorithm.private, epsilon=self.release.epsilon(), pure=self.pure,
            multipliers=self.multipliers, ledger=self.accountant.ledger, metrics=self.metrics,
            rounds=self.rounds, rejections=self.rejections, bounded=self.bounded,
            resumed_from=self.resumed_from, server_state=self.algorithm.state(),
            private_metrics=self._private_metrics(), wall_time_s=wall_time_s,
            record_level=self.algorithm.record_level_privacy())

    def _private_metrics(self) -> dict[str, dict[str, float | None]]:
        """The evaluation release (``private-metrics``): each metric's noisy mean (released),
        its exact clipped mean (operator only; None in a distributed run, whose server never
        sees it), clip and noise std."""
        noisy = getattr(self.algorithm, "private_metrics", None)
        report = next((r for r in self.rounds if r["step"] == EVALUATE), None)
        if not noisy or report is None or "error" in report:
            return {}  # off, not reached, or nobody answered (then the release is pure noise)
        entry = next(e for e in self.accountant.ledger if e["release"] == EVALUATE)
        stds = ({p["name"]: p["noise_std"] for p in entry["parts"]} if "parts" in entry
                else dict.fromkeys(noisy, entry["noise_std"]))
        # it released private metrics, so it is a with_evaluation class, whose steps read
        # evaluation_bounds (the type checker cannot follow the class made at run time)
        bounds = cast(EvaluatedAlgorithm, self.algorithm).evaluation_bounds(self.config)
        scale = report["evaluation_scale"]  # public: users hosted / users that answered
        return {name: {"value": value, "exact_clipped": report.get(f"exact_private_{name}"),
                       "clip": bounds[name], "noise_std": stds[name] * scale,
                       "users": self.config.num_users} for name, value in noisy.items()}


def check_run(config: RunConfig, checkpoint_path: Path | None = None,
              num_partitions: int | None = None, here: bool = True) -> PrivateServer:
    """Everything the server checks before its first step, without running: first the run's
    estimated size (``fedpriv.cost.check_size``, before the plan, the steps or any user id is
    made; ``here = False``: the run is not on this machine, so its memory is not compared with
    this machine's), then the privacy plan, the budget ceiling and, when resuming, the
    checkpoint (with ``num_partitions`` nodes; default: the run's own layout, which a
    distributed run's modulus depends on). Raises if the run cannot start."""
    from fedpriv.cost import check_size
    from fedpriv.nodes import auto_num_nodes  # the node layout (nodes import no server)

    check_size(config, machine=here)
    nodes = num_partitions or (auto_num_nodes(config.num_users, config.users_per_node)
                               if config.noise_shares else 1)
    server = PrivateServer(config, nodes, log=lambda _: None, checkpoint_path=checkpoint_path)
    server.close()
    return server


def check_plan(config: RunConfig) -> list[float]:
    """Calibrate the config's privacy plan without running; raises if it cannot be met."""
    return calibrate(config, algorithm_for(config)(config).privacy_plan())
