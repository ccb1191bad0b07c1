"""The privacy bound tested from the outside: two datasets that differ in one user, the same
seeds, and the distance between the releases.

A run's release of a step is ``scale * (mean + noise)``: with the same seeds the noise is the
same on D and on a neighbour D', so the difference of the two releases is exactly how far one
user moved them, and it must be at most the step's stated sensitivity (the ledger's L2
sensitivity of each part, ``clip / n``, twice that where the neighbour replaces a user's data
under the add/remove relation; for the exponential mechanism the largest move of one mean
score, ``clip / n``). Each step is judged **on D's history**: both datasets' nodes answer the
broadcast of D's server, and the neighbour's replies go to a copy of D's server taken just
before the step (later steps of free-running D and D' legitimately drift apart). The check
runs the real path a release takes: the nodes' user steps, the server's reply checks, node
bounds, the missing-node rescale and the noise.

``fedpriv audit --neighbours`` runs it on a user's own data file and model
(``fedpriv.neighbour_data`` builds the neighbours); ``tests/test_neighbours.py`` runs it over
every private algorithm and data path.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Step
from fedpriv.config import RunConfig
from fedpriv.nodes import node_step
from fedpriv.server import NodeReply, PrivateServer

RELATIONS = ("add", "remove", "replace")

# How far past the stated sensitivity rounding may carry a release, relative to it: float64
# sums of clipped contributions (the linear, meta-learning and exponential-mechanism
# families) stay far inside 1e-9; a torch model runs in float32, and another user's presence
# may change the shape of the batch its chunk runs in (and so the kernel's rounding of every
# row): further, though well inside 1e-3 in the tests' runs (docs/measurements.md).
TOLERANCE = {"float64": 1e-9, "float32": 1e-3}


@dataclass(frozen=True)
class Neighbour:
    """A dataset D' that differs from the run's D in one user. ``config``: D''s run config
    (e.g. another data-file); ``context``: entered while D''s nodes compute (for data that a
    config cannot name: the synthetic problems, a built-in dataset's rows); ``relation``: how
    D' differs (``add``, ``remove`` or ``replace``: its bound is twice the add/remove one)."""

    name: str
    relation: str
    config: RunConfig
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def __post_init__(self) -> None:
        if self.relation not in RELATIONS:
            raise ValueError(f"relation must be one of {RELATIONS}, got {self.relation!r}")


@dataclass(frozen=True)
class StepCheck:
    """One released part of one step: the distance between D's and D''s releases, the bound
    the accountant was told, and the rejections the neighbour's replies met."""

    neighbour: str
    step: str
    part: str
    distance: float
    bound: float
    tolerance: float
    rejected: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.distance / self.bound if self.bound > 0 else float("inf")

    @property
    def ok(self) -> bool:
        return bool(self.distance <= self.bound * (1.0 + self.tolerance))


def replies(cls: type[Algorithm[Any]], config: RunConfig, step: Step, arrays: dict[str, np.ndarray],
            num_partitions: int) -> list[NodeReply]:
    """Every node's honest answer to ``step`` (as the in-process engine computes them); a node
    that raises answers with an error, as a Flower node would."""
    out: list[NodeReply] = []
    for p in range(num_partitions):
        try:
            contrib = node_step(cls, config, step, arrays, cls.hosted_users(config, p,
                                                                             num_partitions))
            out.append(NodeReply(p, contrib))
        except Exception as err:  # noqa: BLE001 - any failure is the node's error reply
            out.append(NodeReply(p, error=f"{type(err).__name__}: {err}"[:300]))
    return out


@contextlib.contextmanager
def _captured(server: PrivateServer) -> Iterator[dict[str, np.ndarray]]:
    """What ``server`` releases in the next step: the noisy means handed to the algorithm,
    or the mean scores the exponential mechanism samples from."""
    seen: dict[str, np.ndarray] = {}
    apply: Callable[[Step, Mapping[str, np.ndarray]], dict[str, float]] = server.algorithm.apply
    select: Callable[[Step, np.ndarray, int], dict[str, Any]] = server.release.select

    def on_apply(step: Step, noisy: Mapping[str, np.ndarray]) -> dict[str, float]:
        seen.update({k: np.array(v, dtype=np.float64) for k, v in noisy.items()
                     if k != "choice"})
        return apply(step, noisy)

    def on_select(step: Step, scores: np.ndarray, population: int) -> dict[str, Any]:
        seen[step.parts[0].name] = np.array(scores, dtype=np.float64)
        return select(step, scores, population)

    # instance attributes that shadow the two methods for one step (deleted after)
    setattr(server.algorithm, "apply", on_apply)  # noqa: B010 -- mypy: no assigning methods
    setattr(server.release, "select", on_select)  # noqa: B010
    try:
        yield seen
    finally:
        del server.algorithm.apply, server.release.select


def _bounds(server: PrivateServer, step: Step, report: dict[str, Any], relation: str,
            ) -> dict[str, float]:
    """Each part's stated bound on one user's move of the release of ``step``."""
    entry = server.accountant.ledger[-1]
    if step.parts[0].mechanism == "exponential":
        return {step.parts[0].name: float(entry["score_sensitivity"])}
    scale = float(report.get("missing_node_rescale", 1.0))
    twice = 2.0 if relation == "replace" and server.config.neighbouring_relation == \
        "add-remove" else 1.0
    parts = entry.get("parts") or [{"name": step.parts[0].name, **entry}]
    return {p["name"]: scale * twice * float(p["l2_sensitivity"]) for p in parts}


def check_neighbour(config: RunConfig, neighbour: Neighbour, num_partitions: int = 2,
                    max_releases: int = 2, dtype: str = "float64") -> list[StepCheck]:
    """The first ``max_releases`` private releases of ``config``'s run on D and on
    ``neighbour``, each step judged on D's history (see the module docstring)."""
    server = PrivateServer(config, num_partitions, log=lambda _: None)
    cls = type(server.algorithm)
    checks: list[StepCheck] = []
    done = 0
    try:
        while (step := server.next_step()) is not None and done < max_releases:
            arrays = server.payload(step)
            if step.is_final:  # nothing released: the metrics step of D alone moves on
                if step.kind == "final":
                    break
                server.aggregate(step, replies(cls, config, step, arrays, num_partitions), 0.0)
                continue
            ours = replies(cls, config, step, arrays, num_partitions)
            with neighbour.context():
                theirs = replies(cls, neighbour.config, step, arrays, num_partitions)
            twin = copy.deepcopy(server)
            try:
                before = copy.copy(twin.rejections)
                with _captured(twin) as released_n:
                    twin.aggregate(step, theirs, 0.0)
                rejected = dict(twin.rejections - before)
            finally:
                twin.close()
            with _captured(server) as released:
                report = server.aggregate(step, ours, 0.0)
            if step.release is None:
                continue  # a non-private baseline's step: nothing is claimed
            done += 1
            bounds = _bounds(server, step, report, neighbour.relation)
            for name, bound in bounds.items():
                a, b = released[name], released_n[name]
                diff = a - b
                distance = (float(np.max(np.abs(diff), initial=0.0))
                            if step.parts[0].mechanism == "exponential"
                            else float(np.linalg.norm(diff.reshape(-1))))
                if not np.isfinite(distance):
                    distance = float("inf")
                checks.append(StepCheck(neighbour.name, step.label, name, distance, bound,
                                        TOLERANCE[dtype], rejected))
    finally:
        server.close()
    return checks


def check_neighbours(config: RunConfig, neighbours: Sequence[Neighbour],
                     num_partitions: int = 2, max_releases: int = 2,
                     dtype: str = "float64") -> list[StepCheck]:
    """``check_neighbour`` for each of ``neighbours``."""
    return [c for n in neighbours
            for c in check_neighbour(config, n, num_partitions, max_releases, dtype)]


def table(checks: Sequence[StepCheck]) -> list[str]:
    """The checks as the lines of a table (one per released part)."""
    width = max([len(c.neighbour) for c in checks] + [9])
    lines = [f"{'neighbour':<{width}}  {'step':<9}{'part':<12}{'distance':>12}{'bound':>12}"
             f"{'ratio':>8}  result"]
    for c in checks:
        note = "" if not c.rejected else "  rejected: " + ", ".join(
            f"{k} {v}" for k, v in sorted(c.rejected.items()))
        lines.append(f"{c.neighbour:<{width}}  {c.step:<9}{c.part:<12}{c.distance:>12.4g}"
                     f"{c.bound:>12.4g}{c.ratio:>8.3f}  {'ok' if c.ok else 'EXCEEDS'}{note}")
    return lines
