"""The privacy bound tested from the outside: two datasets that differ in one user, the same
seeds, and the distance between the releases.

A run's release of a step is ``scale * (mean + noise)``: with the same seeds the noise is the
same on D and on a neighbour D' (the cryptographic streams of discrete and distributed noise
too: ``fedpriv.neighbour_noise`` keys them by seed, step, node and part while the harness
runs), so the difference of the two releases is how far one user moved them, and it must be
at most the step's stated sensitivity (the ledger's L2 sensitivity of each part, ``clip / n``,
twice that where the neighbour replaces a user's data under the add/remove relation; for the
exponential mechanism the largest move of one mean score, ``clip / n``).

**Whose history.** A run is an adaptive composition: step ``t`` releases ``M_t(D, h)``, where
``h`` is what was released before, and the guarantee needs, for every history ``h``, that
``M_t(D, h)`` and ``M_t(D', h)`` are at most the stated sensitivity apart. ``M_t(D', h)`` is
the whole mechanism on D': D' enters at every step, including what the server kept from the
replies of earlier steps. So D' runs with **its own server**, from the start, its own nodes
answering its own server's broadcasts; only the history is D's: each step, the values D''s
server releases are compared with D's and then replaced by D's before its algorithm applies
them (``apply`` gets D's noisy means, or D's choice of the exponential mechanism). A server
whose state is a function of released values alone then holds the same state on D and D'
before every step, and each of D''s releases is one step's move from D's; a server that kept
anything from the exact replies (a user count, a clipped sum) holds a different state on D',
and the next release shows it (or the next broadcast, ledger entry or release document).
Free-running D and D' (each applying its own releases) cannot be judged after the first
release: legitimately different releases make the histories, and so all later releases,
drift apart. The earlier judgement, a copy of D's server taken before each step
(``history="copy"``), is kept for comparison: it carries D's server state into D' and so
cannot see state kept from exact replies (issue 45). Only what ``apply`` is given is pinned:
a later step that read D''s own noisy values by another way would show as a difference (a
false alarm, never a miss). Nothing that stays in the operator report is compared (it is not
private), nor when the replies arrive.

**More than the released values** (``fedpriv.neighbour_view``): each step, what the server
received from the nodes (which answered, errors, rejections, counts, metrics, vectors: those
that ``must_match`` for the run's mode), and what it broadcast; the ledger entry of each
release; at the end, the release document. None of these may differ on D' beyond the released
values themselves. Every release is checked by default, the private evaluation's included.

The check runs the real path a release takes: the nodes' user steps, the server's reply
checks, node bounds, the missing-node rescale and the noise; in a secure run, a real SecAgg
round per step among the engine's in-process nodes. ``fedpriv audit --neighbours``
runs it on a user's own data file and model (``fedpriv.neighbour_data`` builds the
neighbours); ``tests/test_neighbours.py`` runs it over every private algorithm and data path.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Step
from fedpriv.config import RunConfig
from fedpriv.neighbour_noise import RepeatableNoise, repeatable_noise
from fedpriv.neighbour_view import (
    broadcast_differences,
    config_differences,
    document_differences,
    ledger_differences,
    received,
    summary,
    view_differences,
)
from fedpriv.nodes import node_step
from fedpriv.outputs import release_document
from fedpriv.secagg.local import LocalNodes
from fedpriv.server import NodeReply, PrivateServer
from fedpriv.server.secagg import SecureOutcome, SecureRound

# what the server of a step received: the nodes' replies, or a secure round's outcome
Answers = list[NodeReply] | SecureOutcome

RELATIONS = ("add", "remove", "replace")
# whose server judges D' (the module docstring): its own, carried from the start on D's
# history; or a copy of D's server taken before each step (the earlier, weaker judgement)
HISTORIES = ("own", "copy")
# the comparisons besides the released values (``fedpriv.neighbour_view``), one check each
COMPARED = ("server view", "broadcast", "ledger", "release document")

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
    the accountant was told, the rejections the neighbour's replies met, and whose server
    judged D' (``history``). A check of one of ``COMPARED`` instead (``part``) holds what
    differed in ``problem`` (empty: nothing did)."""

    neighbour: str
    step: str
    part: str
    distance: float
    bound: float
    tolerance: float
    rejected: dict[str, int] = field(default_factory=dict)
    history: str = "own"
    problem: str = ""

    @property
    def compared(self) -> bool:
        return self.part in COMPARED

    @property
    def ratio(self) -> float:
        if self.compared:
            return float("inf") if self.problem else 0.0
        return self.distance / self.bound if self.bound > 0 else float("inf")

    @property
    def ok(self) -> bool:
        if self.compared:
            return not self.problem
        return bool(self.distance <= self.bound * (1.0 + self.tolerance))


def replies(cls: type[Algorithm[Any]], config: RunConfig, step: Step, arrays: dict[str, np.ndarray],
            num_partitions: int, noise: RepeatableNoise | None = None) -> list[NodeReply]:
    """Every node's honest answer to ``step`` (as the in-process engine computes them); a node
    that raises answers with an error, as a Flower node would. ``noise``: the harness's keyed
    streams, named by the node while it computes."""
    out: list[NodeReply] = []
    for p in range(num_partitions):
        scope = noise.node(step.label, p) if noise is not None else contextlib.nullcontext()
        try:
            with scope:
                contrib = node_step(cls, config, step, arrays,
                                    cls.hosted_users(config, p, num_partitions))
            out.append(NodeReply(p, contrib))
        except Exception as err:  # noqa: BLE001 - any failure is the node's error reply
            out.append(NodeReply(p, error=f"{type(err).__name__}: {err}"[:300]))
    return out


class _Nodes(LocalNodes):
    """A secure round's nodes in process (the engine's), each node's noise keyed by the
    harness while it computes."""

    def __init__(self, config: RunConfig, algorithm: type[Algorithm[Any]], nodes: int,
                 noise: RepeatableNoise) -> None:
        super().__init__(config, algorithm, nodes)
        self.noise = noise

    def _compute(self, pid: int, step: Step, arrays: Mapping[str, np.ndarray]) -> Any:
        with self.noise.node(step.label, pid):
            return super()._compute(pid, step, arrays)


@dataclass
class _Released:
    """What a server released in one step: ``values`` (the noisy means, or the mean scores
    the exponential mechanism sampled from) and ``applied`` (what its algorithm was given)."""

    values: dict[str, np.ndarray] = field(default_factory=dict)
    applied: dict[str, np.ndarray] = field(default_factory=dict)


@contextlib.contextmanager
def _captured(server: PrivateServer, pinned: Mapping[str, np.ndarray] | None = None,
              ) -> Iterator[_Released]:
    """What ``server`` releases in the next step; with ``pinned``, its algorithm applies
    ``pinned`` (D's release) instead of its own (D' on D's history)."""
    seen = _Released()
    apply: Callable[[Step, Mapping[str, np.ndarray]], dict[str, float]] = server.algorithm.apply
    select: Callable[[Step, np.ndarray, int], dict[str, Any]] = server.release.select

    def on_apply(step: Step, noisy: Mapping[str, np.ndarray]) -> dict[str, float]:
        seen.values.update({k: np.array(v, dtype=np.float64) for k, v in noisy.items()
                            if k != "choice"})
        seen.applied.update({k: np.array(v, copy=True) for k, v in noisy.items()})
        given = noisy if pinned is None else {k: np.array(v, copy=True)
                                              for k, v in pinned.items()}
        return apply(step, given)

    def on_select(step: Step, scores: np.ndarray, population: int) -> dict[str, Any]:
        seen.values[step.parts[0].name] = np.array(scores, dtype=np.float64)
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


def _distance(step: Step, a: np.ndarray, b: np.ndarray) -> float:
    diff = a - b
    distance = (float(np.max(np.abs(diff), initial=0.0))
                if step.parts[0].mechanism == "exponential"
                else float(np.linalg.norm(diff.reshape(-1))))
    return distance if np.isfinite(distance) else float("inf")


def _sends(server: PrivateServer, step: Step) -> bool:
    """Whether the server sends ``step`` to the nodes (a distributed run's server sends no
    metrics step; a server without ``sends`` sends every step)."""
    sends: Callable[[Step], bool] | None = getattr(server, "sends", None)
    return True if sends is None else bool(sends(step))


class _Harness:
    """D's server and D''s own, step by step (the module docstring)."""

    def __init__(self, config: RunConfig, neighbour: Neighbour, num_partitions: int,
                 dtype: str, histories: Sequence[str], noise: RepeatableNoise) -> None:
        self.config, self.neighbour, self.parts = config, neighbour, num_partitions
        self.tolerance, self.histories, self.noise = TOLERANCE[dtype], histories, noise
        self.checks: list[StepCheck] = []
        self.found: dict[str, list[str]] = {item: [] for item in COMPARED}
        self.d = PrivateServer(config, num_partitions, log=lambda _: None)
        try:
            self.n = PrivateServer(neighbour.config, num_partitions, log=lambda _: None)
        except BaseException:
            self.d.close()
            raise

    def close(self) -> None:
        self.d.close()
        self.n.close()

    def run(self, max_releases: int | None) -> list[StepCheck]:
        done = 0
        while (step := self.d.next_step()) is not None and (max_releases is None
                                                             or done < max_releases):
            if step != self.n.next_step():
                other = getattr(self.n.next_step(), "label", None)
                self.found["server view"].append(
                    f"{step.label}: the neighbour's server runs {other} next (its steps are "
                    "not a function of the released values)")
                break
            done += self.step(step)
        self.found["ledger"] += ledger_differences(self.d.accountant.ledger,
                                                   self.n.accountant.ledger)
        ours, theirs = (release_document(s.results(0.0, "in-process")) for s in (self.d, self.n))
        self.found["release document"] += document_differences(
            ours, theirs, config_differences(self.config, self.neighbour.config))
        return self.checks + [self._compared(item) for item in COMPARED]

    def _compared(self, item: str) -> StepCheck:
        found = self.found[item]
        first = found[0].split(":", 1)[0] if found else "all"
        return StepCheck(self.neighbour.name, first, item, 0.0, 0.0, self.tolerance,
                         problem=summary(found))

    def step(self, step: Step) -> int:
        """Run ``step`` on D and on D'; the number of private releases it made (0 or 1)."""
        d, n, noise, nb = self.d, self.n, self.noise, self.neighbour
        arrays, arrays_n = d.payload(step), n.payload(step)
        self.found["broadcast"] += broadcast_differences(step.label, arrays, arrays_n)
        if not _sends(d, step):  # nothing goes to the nodes: nothing to compare
            d.record_unsent(step, 0.0)
            n.record_unsent(step, 0.0)
            return 0
        ours = self._answers(d, self.config, step, arrays, contextlib.nullcontext)
        theirs = self._answers(n, nb.config, step, arrays_n, nb.context)
        private = step.release is not None and not step.is_final
        copied = self._on_a_copy(step, arrays, arrays_n, theirs) if (
            private and "copy" in self.histories) else None
        before, before_n = Counter(d.rejections), Counter(n.rejections)
        with _captured(d) as mine, noise.server(step.label):
            report = _aggregate(d, step, ours)
        with _captured(n, pinned=mine.applied) as yours, noise.server(step.label):
            _aggregate(n, step, theirs)
        rejected = dict(n.rejections - before_n)
        self.found["server view"] += view_differences(
            self.config, received(step.label, ours, d.rejections - before),
            received(step.label, theirs, n.rejections - before_n), step.is_final)
        if not private:
            return 0  # a metrics step, or a non-private baseline's: nothing is claimed
        for name, bound in _bounds(d, step, report, nb.relation).items():
            for history, other in (("own", yours), ("copy", copied)):
                if history in self.histories and other is not None:
                    self.checks.append(StepCheck(
                        nb.name, step.label, name,
                        _distance(step, mine.values[name], other.values[name]), bound,
                        self.tolerance, rejected, history))
        return 1

    def _answers(self, server: PrivateServer, config: RunConfig, step: Step,
                 arrays: dict[str, np.ndarray],
                 context: Callable[[], contextlib.AbstractContextManager[Any]]) -> Answers:
        """The nodes' answers to ``step`` on ``config``'s data (``context`` active): their
        replies, or in a secure run the outcome of a real SecAgg round over them."""
        cls = type(server.algorithm)
        with context():
            if not server.secure:
                return replies(cls, config, step, arrays, self.parts, self.noise)
            nodes = _Nodes(config, cls, self.parts, self.noise)
            return SecureRound(nodes.send, step, arrays, range(self.parts), server.graph,
                               server.history(), lambda _: None, count=self.parts).run()

    def _on_a_copy(self, step: Step, arrays: dict[str, np.ndarray],
                   arrays_n: dict[str, np.ndarray], theirs: Answers) -> _Released:
        """D''s release of ``step`` by a copy of D's server taken before it (the earlier
        judgement, ``history="copy"``), D''s nodes answering D's broadcast."""
        if broadcast_differences(step.label, arrays, arrays_n):
            theirs = self._answers(self.d, self.neighbour.config, step, arrays,
                                   self.neighbour.context)
        twin = copy.deepcopy(self.d)
        try:
            with _captured(twin) as released, self.noise.server(step.label):
                _aggregate(twin, step, theirs)
        finally:
            twin.close()
        return released


def _aggregate(server: PrivateServer, step: Step, answers: Answers) -> dict[str, Any]:
    if isinstance(answers, SecureOutcome):
        return server.aggregate_secure(step, answers, 0.0)
    return server.aggregate(step, answers, 0.0)


def check_neighbour(config: RunConfig, neighbour: Neighbour, num_partitions: int = 2,
                    max_releases: int | None = None, dtype: str = "float64",
                    histories: Sequence[str] = ("own",)) -> list[StepCheck]:
    """Every private release of ``config``'s run on D and on ``neighbour`` (the first
    ``max_releases`` only, if given), each judged with D''s own server on D's history (and,
    in ``histories``, on a copy of D's server: ``"copy"``), then one check of each of
    ``COMPARED`` (see the module docstring). The nodes' and the server's cryptographic noise
    repeats on D and D' (``fedpriv.neighbour_noise``)."""
    if not histories or set(histories) - set(HISTORIES):
        raise ValueError(f"histories: some of {HISTORIES}, got {tuple(histories)}")
    with repeatable_noise(config.seed) as noise:
        harness = _Harness(config, neighbour, num_partitions, dtype, histories, noise)
        try:
            checks = harness.run(max_releases)
        finally:
            harness.close()
        if config.noise_shares and noise.draws["node"] == 0 and any(
                c.part not in COMPARED for c in checks):
            raise RuntimeError("the nodes' noise shares did not come from the harness's "
                               "repeatable streams (fedpriv.neighbour_noise patches "
                               "fedpriv.shares.CryptoRandom): D and D' drew independent noise")
    return checks


def check_neighbours(config: RunConfig, neighbours: Sequence[Neighbour],
                     num_partitions: int = 2, max_releases: int | None = None,
                     dtype: str = "float64", histories: Sequence[str] = ("own",),
                     ) -> list[StepCheck]:
    """``check_neighbour`` for each of ``neighbours``."""
    return [c for n in neighbours
            for c in check_neighbour(config, n, num_partitions, max_releases, dtype,
                                     histories)]


def table(checks: Sequence[StepCheck]) -> list[str]:
    """The checks as the lines of a table (one per released part, and per comparison)."""
    width = max([len(c.neighbour) for c in checks] + [9])
    copies = any(c.history != "own" for c in checks)
    lines = [f"{'neighbour':<{width}}  {'step':<9}{'part':<17}{'distance':>12}{'bound':>12}"
             f"{'ratio':>8}  " + ("history  " if copies else "") + "result"]
    for c in checks:
        history = f"{c.history:<9}" if copies else ""
        if c.compared:
            lines.append(f"{c.neighbour:<{width}}  {c.step:<9}{c.part:<17}{'':>32}  {history}"
                         + ("identical" if c.ok else f"DIFFERS: {c.problem}"))
            continue
        note = "" if not c.rejected else "  rejected: " + ", ".join(
            f"{k} {v}" for k, v in sorted(c.rejected.items()))
        lines.append(f"{c.neighbour:<{width}}  {c.step:<9}{c.part:<17}{c.distance:>12.4g}"
                     f"{c.bound:>12.4g}{c.ratio:>8.3f}  {history}"
                     f"{'ok' if c.ok else 'EXCEEDS'}{note}")
    return lines
