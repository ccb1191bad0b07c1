"""Reliability and privacy assurance: node faults, hostile updates through the real strategy,
the budget guard, checkpoint/resume and secure noise -- for every private algorithm."""

import copy
import functools
import os
import pickle
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord, RecordDict

from fedpriv import checkpoint
from fedpriv import protocol as P
from fedpriv.checkpoint import CheckpointError
from fedpriv.cli import main as cli_main
from fedpriv.config import ConfigError, RunConfig
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.faults import failing_partitions
from fedpriv.server import BudgetExceededError, NodeReply, PrivateServer, check_run

UNIT_BALL = {"feature-dist": "unit-ball", "label-noise": 0.5, "dim": 12, "delta": 1e-5,
             "clip-norm": 2.0, "learning-rate": 20.0, "meta-lambda": 0.05}
# a small config of every private algorithm that releases something
PRIVATE = {
    "private-fedrep": {"num-users": 600, "dim": 10, "epsilon": 4.0, "rounds": 3},
    "priv-altmin": {"num-users": 600, "dim": 8, "epsilon": 4.0, "rounds": 2, "user-groups": 2,
                    "feature-clip": 1e-4, "response-clip": 1e-4},
    "dp-global-model": {"num-users": 600, "dim": 10, "epsilon": 4.0, "rounds": 3},
    "meta-nsgd": {**UNIT_BALL, "num-users": 600, "rounds": 4, "epsilon": 2.0},
    "private-meta-cluster": {**UNIT_BALL, "num-users": 600, "rounds": 3, "epsilon": 4.0,
                             "meta-models": 2, "task-clusters": 2, "task-std": 0.5},
    "dp-ftmrl": {**UNIT_BALL, "num-users": 600, "rounds": 5, "epsilon": 2.0},
    "a-exp": {"num-users": 600, "dim": 6, "rank": 1, "samples-per-user": 6,
              "label-noise": 0.1, "candidates": 400, "epsilon": 1.0},
    "jl-exp": {"num-users": 600, "dim": 4, "rank": 1, "samples-per-user": 4,
               "feature-dist": "unit-ball", "jl-dim": 4, "cover-radius": 0.5, "epsilon": 1.0},
    # a torch body on real data, with adaptive clipping (two parts: the update and the count)
    "deep-private-fedrep": {"dataset": "digits", "num-users": 60, "hidden-sizes": "16",
                            "rounds": 3, "epsilon": 4.0, "delta": 1e-5, "clip-quantile": 0.5},
}


def make_config(algorithm: str, **overrides) -> RunConfig:
    values = {"algorithm": algorithm, **PRIVATE[algorithm]}
    if not algorithm.startswith("deep-"):
        values["test-samples-per-user"] = 5
    values.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return parse_config(values)


def quiet(config: RunConfig, parts: int = 10, **kwargs) -> dict:
    return run_in_process(config, num_partitions=parts, log=lambda _: None, **kwargs)


def release_record(results: dict) -> list[tuple]:
    """What the accountant charged and the noise it planned, release by release."""
    return [(e["release"], e["mechanism"], e.get("noise_multiplier"), e.get("noise_std"),
             e.get("epsilon"), e.get("user_group"), e.get("user_groups"))
            for e in results["privacy"]["ledger"]]


# ----- node faults ------------------------------------------------------------------------------
def test_the_failing_nodes_are_the_stated_fraction_chosen_per_step():
    chosen = [failing_partitions(0, f"round-{t}", 10, 0.2) for t in range(1, 40)]
    assert all(len(c) == 2 and c <= set(range(10)) for c in chosen)
    assert len(set(chosen)) > 10  # a fresh choice each step
    assert failing_partitions(0, "round-1", 10, 0.2) == chosen[0]  # reproducible
    assert failing_partitions(0, "round-1", 3, 0.99) != frozenset(range(3))  # one answers
    assert failing_partitions(0, "init", 10, 0.0) == frozenset()


@pytest.mark.parametrize("algorithm", sorted(PRIVATE))
def test_a_fifth_of_the_nodes_failing_each_step_keeps_the_run_and_its_noise(algorithm):
    """20% of the nodes crash in every step: the run completes, the failures are recorded per
    step, and the noise and the accountant are exactly those of the fault-free run (the mean
    is over the population fixed in advance, not over who answered)."""
    clean = quiet(make_config(algorithm))
    faulty = quiet(make_config(algorithm, node_fault_rate=0.2))
    for report in faulty["rounds"]:
        assert report["nodes_failed"] == 2 and report["nodes_answered"] == 8
        assert report["rejected"] == {"node-error": 2}
    assert faulty["rejections"] == {"node-error": len(faulty["rounds"]) * 2}
    # Gaussian releases are rescaled for the missing fifth after the noise (post-processing);
    # the exponential mechanism's scores are not (a rescale would change its privacy)
    # (by the public count of the step's participants: exactly 10/8 when every user takes
    # part, near it when a step covers one user group)
    gaussian = algorithm not in ("a-exp", "jl-exp", "dp-ftmrl")  # DP-FTMRL opts out
    exact = algorithm in ("private-fedrep", "dp-global-model", "meta-nsgd",
                          "private-meta-cluster")
    for report in faulty["rounds"][:-1]:
        expected = (pytest.approx(1.25, rel=1e-12 if exact else 0.15) if gaussian else None)
        assert report.get("missing_node_rescale") == expected
    assert release_record(faulty) == release_record(clean)
    assert faulty["privacy"]["epsilon"] == clean["privacy"]["epsilon"]
    assert faulty["privacy"]["noise_multipliers"] == clean["privacy"]["noise_multipliers"]
    assert faulty["metrics"] and all(np.isfinite(v) for v in faulty["metrics"].values())


def test_the_missing_node_rescale_leaves_the_plan_alone_and_can_be_turned_off():
    on = quiet(make_config("private-fedrep", node_fault_rate=0.2))
    off = quiet(make_config("private-fedrep", node_fault_rate=0.2, rescale_missing_nodes=False))
    assert all("missing_node_rescale" not in r for r in off["rounds"])
    assert release_record(on) == release_record(off)
    assert on["server_state"] != off["server_state"]


def test_the_missing_node_rescale_multiplies_the_noise_too():
    """Post-processing, not a cheaper release: with every contribution zero, what the
    algorithm receives is pure noise, and its std is the planned std times the rescale."""
    from fedpriv.algorithms.base import UserContribution

    config = make_config("private-fedrep", dim=40, rank=5)
    server = PrivateServer(config, 10, log=lambda _: None)
    captured = []
    original = server.algorithm.apply
    server.algorithm.apply = lambda step, noisy: (captured.append(noisy), original(step,
                                                                                noisy))[1]
    for step in server.pending_steps()[:3]:
        zero = {part.name: np.zeros(part.shape) for part in step.parts}
        replies = [NodeReply(p, UserContribution(zero, server.expected_users(step)[p]))
                   for p in range(8)]  # partitions 8 and 9 failed
        report = server.aggregate(step, replies, 0.0)
        assert report["missing_node_rescale"] == pytest.approx(1.25)
    planned = [e["noise_std"] for e in server.accountant.ledger]
    for noisy, std in zip(captured, planned, strict=True):
        (value,) = noisy.values()
        sample = value[np.triu_indices(value.shape[0])] if value.shape[0] == value.shape[1] \
            else value.ravel()
        assert sample.std() == pytest.approx(1.25 * std, rel=0.15)


@pytest.mark.parametrize("kind,reason,final_reason", [
    ("timeout", "timeout", "timeout"), ("corrupt", "non-finite", "metrics")])
def test_timeouts_and_corrupt_nodes_are_counted_under_their_own_reason(kind, reason,
                                                                       final_reason):
    results = quiet(make_config("private-fedrep", node_fault_rate=0.3, node_fault_kind=kind))
    *steps, final = results["rounds"]
    assert all(r["rejected"] == {reason: 3} for r in steps)
    assert final["rejected"] == {final_reason: 3}
    assert results["metrics"]["population_mse"] < results["metrics"]["local_only_mse"]


def test_utility_with_a_fifth_of_the_nodes_failing_is_close_to_the_fault_free_run():
    """The stated factor (README): population MSE within 1.5x of the fault-free run."""
    config = dict(num_users=4000, dim=20, epsilon=2.0, rounds=5)
    clean = quiet(make_config("private-fedrep", **config))
    faulty = quiet(make_config("private-fedrep", node_fault_rate=0.2, **config))
    ratio = faulty["metrics"]["population_mse"] / clean["metrics"]["population_mse"]
    assert ratio < 1.5
    assert faulty["privacy"]["epsilon"] == clean["privacy"]["epsilon"]


# ----- hostile updates through the real Flower strategy -----------------------------------------
@pytest.fixture
def task_identity():
    """Flower stamps messages with the identity of the running task; a ServerApp process has
    one, a test process must set it."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class LoopbackGrid:
    """Delivers the strategy's messages to the real ClientApp handlers of N nodes in this
    process; ``tamper(step_message, reply)`` may replace one node's reply."""

    def __init__(self, config: RunConfig, num_nodes: int,
                 tamper: Callable[[Message, Message], list[Message]] | None = None,
                 hostile_node: int = 100) -> None:
        run_config = {k: v for k, v in config.to_mapping().items()}
        self.contexts = {
            100 + p: Context(run_id=1, node_id=100 + p, state=RecordDict(),
                             node_config={P.KEY_PARTITION: p, P.KEY_NUM_PARTITIONS: num_nodes},
                             run_config=run_config)
            for p in range(num_nodes)}
        self.tamper, self.hostile_node = tamper, hostile_node

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        from clients.app import _answer

        replies = []
        for msg in messages:
            reply = _answer(msg, self.contexts[msg.metadata.dst_node_id])
            if self.tamper is not None and msg.metadata.dst_node_id == self.hostile_node:
                replies.extend(self.tamper(msg, reply))
            else:
                replies.append(reply)
        return replies


def _rebuilt(reply: Message, arrays: dict | None = None,
             metrics: dict | None = None) -> list[RecordDict]:
    content = RecordDict()
    content[P.METRICS] = MetricRecord(metrics if metrics is not None else dict(
        reply.content[P.METRICS]))
    if arrays is None:
        arrays = {k: v.numpy() for k, v in reply.content[P.ARRAYS].items()}
    content[P.ARRAYS] = ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})
    return [content]


def _arrays(reply):
    return {k: v.numpy() for k, v in reply.content[P.ARRAYS].items()}


def _first(arrays, change):
    name = sorted(arrays)[0]
    return {**arrays, name: change(arrays[name])}


def _users(reply, delta):
    metrics = dict(reply.content[P.METRICS])
    metrics[P.KEY_NUM_USERS] = int(metrics[P.KEY_NUM_USERS]) + delta
    return metrics


# kind of bad update -> (how the hostile node builds its reply, the reason the server reports)
HOSTILE = {
    "nan": (lambda r: _rebuilt(r, _first(_arrays(r), lambda a: np.full(a.shape, np.nan))),
            "non-finite"),
    "inf": (lambda r: _rebuilt(r, _first(_arrays(r), lambda a: np.full(a.shape, np.inf))),
            "non-finite"),
    "wrong-shape": (lambda r: _rebuilt(r, _first(_arrays(r), lambda a: np.zeros(a.size + 1))),
                    "shape"),
    "int-dtype": (lambda r: _rebuilt(r, _first(_arrays(r), lambda a: a.astype(np.int64))),
                  "dtype"),
    "complex-dtype": (lambda r: _rebuilt(r, _first(_arrays(r),
                                                   lambda a: a.astype(np.complex128))),
                      "dtype"),
    "missing-part": (lambda r: _rebuilt(r, dict(list(_arrays(r).items())[1:])),
                     "missing-part"),
    "extra-part": (lambda r: _rebuilt(r, {**_arrays(r), "backdoor": np.ones(3)}),
                   "unexpected-part"),
    "more-users": (lambda r: _rebuilt(r, metrics=_users(r, +50)), "user-count"),
    "fewer-users": (lambda r: _rebuilt(r, metrics=_users(r, -1)), "user-count"),
    "fractional-users": (lambda r: _rebuilt(r, metrics={**dict(r.content[P.METRICS]),
                                                        P.KEY_NUM_USERS: 10.5}), "malformed"),
    "no-metrics": (lambda r: [RecordDict({P.ARRAYS: r.content[P.ARRAYS]})], "malformed"),
    "error-reply": (lambda r: [Error(code=0, reason="boom")], "node-error"),
    "duplicate": (lambda r: [r.content, r.content], "duplicate"),
    "float128": (lambda r: _rebuilt(r, _first(_arrays(r), lambda a: np.full(
        a.shape, np.float128("1e400")))), "dtype"),
    "more-clipped-than-users": (lambda r: _rebuilt(r, metrics={
        **dict(r.content[P.METRICS]), P.KEY_NUM_CLIPPED: 10**6}), "malformed"),
    "silent": (lambda r: [], "timeout"),
}


def _final_metrics(reply, change):
    return _rebuilt(reply, metrics=change(dict(reply.content[P.METRICS])))


def _drop_one(metrics):
    key = sorted(k for k in metrics if k.startswith(P.METRIC_PREFIX))[0]
    return {k: v for k, v in metrics.items() if k != key}


# the final evaluation: what a hostile node can send instead of its users' metric sums
HOSTILE_FINAL = {
    "missing-metric": lambda r: _final_metrics(r, _drop_one),
    "extra-metric": lambda r: _final_metrics(r, lambda m: {**m, P.METRIC_PREFIX + "bogus": 1.0}),
    "nan-metric": lambda r: _final_metrics(r, lambda m: {
        k: (float("nan") if k.startswith(P.METRIC_PREFIX) else v) for k, v in m.items()}),
}


def _tamper_with(kind: str | None, final: str | None = None):
    """A hostile node: its release replies built by HOSTILE[kind], its final one by
    HOSTILE_FINAL[final] (None: honest there)."""
    def tamper(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type == P.MSG_FINAL:
            build = HOSTILE_FINAL[final] if final else None
        else:
            build = HOSTILE[kind][0] if kind else None
        return [Message(c, reply_to=request) for c in build(reply)] if build else [reply]
    return tamper


def _strategy_run(config, grid):
    from strategies.private import PrivateStrategy

    strategy = PrivateStrategy(config, {node: p for p, node in enumerate(grid.contexts)})
    strategy.server.log = lambda _: None
    return strategy.run(grid)


HOSTILE_CASES = [(a, k) for a in sorted(PRIVATE) for k in sorted(HOSTILE)
                 # only these release two parts; with one, "missing" means no arrays
                 if k != "missing-part" or a in ("priv-altmin", "deep-private-fedrep")]


@pytest.mark.parametrize("algorithm,kind", HOSTILE_CASES)
def test_a_hostile_node_is_rejected_and_counted_and_the_run_goes_on(task_identity, algorithm,
                                                                    kind):
    config = make_config(algorithm)
    results = _strategy_run(config, LoopbackGrid(config, 4, _tamper_with(kind)))
    reason = HOSTILE[kind][1]
    releases = [r for r in results["rounds"] if r["step"] != "final"]
    assert all(r["rejected"] == {reason: 1} for r in releases), results["rounds"]
    assert results["rejections"] == {reason: len(releases)}
    if kind != "duplicate":  # the duplicate's first copy is used
        assert all(r["nodes_answered"] == 3 and r["nodes_failed"] == 1 for r in releases)
    assert results["metrics"] and all(np.isfinite(v) for v in results["metrics"].values())
    # the noise and the accounting are exactly those of an honest run: a hostile node cannot
    # make the server release more, or with less noise
    assert release_record(results) == release_record(_honest_run(algorithm))


@pytest.mark.parametrize("timing", [float("nan"), float("inf"), -5.0, 1e30])
def test_a_nodes_bogus_timing_is_ignored_by_the_profile_not_the_run(task_identity, timing):
    """Timings are the node's word, for the operator profile only: a hostile value counts as
    0 and changes nothing else (the update itself is honest, so it is used)."""
    config = make_config("private-fedrep")

    def tamper(request: Message, reply: Message) -> list[Message]:
        metrics = {**dict(reply.content[P.METRICS]), P.KEY_COMPUTE_S: timing}
        return [Message(c, reply_to=request) for c in _rebuilt(reply, metrics=metrics)]

    from strategies.private import PrivateStrategy

    grid = LoopbackGrid(config, 4, tamper)
    strategy = PrivateStrategy(config, {node: p for p, node in enumerate(grid.contexts)})
    strategy.server.log = lambda _: None
    results = strategy.run(grid)
    assert results["rejections"] == {}
    assert all(np.isfinite(s["nodes_compute_s"]) and 0 <= s["nodes_compute_s"] < 1e6
               for s in strategy.profile)
    assert release_record(results) == release_record(_honest_run("private-fedrep"))


@functools.lru_cache(maxsize=None)
def _honest_run(algorithm: str) -> dict:
    return quiet(make_config(algorithm), parts=4)


@pytest.mark.parametrize("algorithm", sorted(PRIVATE))
@pytest.mark.parametrize("final", sorted(HOSTILE_FINAL))
def test_a_hostile_final_evaluation_is_rejected_and_the_results_are_written(task_identity,
                                                                            algorithm, final):
    config = make_config(algorithm)
    results = _strategy_run(config, LoopbackGrid(config, 4, _tamper_with(None, final)))
    assert results["rounds"][-1]["rejected"] == {"metrics": 1}
    assert results["rejections"] == {"metrics": 1}
    assert results["metrics"] and all(np.isfinite(v) for v in results["metrics"].values())
    assert "bogus" not in results["metrics"]


@pytest.mark.parametrize("algorithm", sorted(PRIVATE))
def test_an_oversized_update_is_bounded_to_the_sensitivity_not_rejected(task_identity,
                                                                        algorithm):
    """A node's sum scaled by 1e6 (or, for scores, far outside [0, B]) is bounded to its users
    times the per-user bound, so one node cannot shift the release by more than it may."""
    config = make_config(algorithm)

    def blow_up(request, reply):
        if request.metadata.message_type == P.MSG_FINAL:
            return [reply]
        return [Message(c, reply_to=request) for c in _rebuilt(
            reply, {k: (v + 1.0) * 1e6 for k, v in _arrays(reply).items()})]

    results = _strategy_run(config, LoopbackGrid(config, 4, blow_up))
    releases = [r for r in results["rounds"] if r["step"] != "final"]
    assert all(r["nodes_bounded"] >= 1 and r["nodes_answered"] == 4 for r in releases)
    assert results["rejections"] == {}


def test_bounding_keeps_the_node_sum_within_users_times_clip():
    config = make_config("private-fedrep")
    server = PrivateServer(config, 2, log=lambda _: None)
    part = server.steps()[1].parts[0]
    from fedpriv.algorithms.base import UserContribution

    for value in (1e9, 1e200):  # 1e200: its plain norm overflows to inf
        huge = UserContribution({part.name: np.full(part.shape, value)}, 300)
        bounded = server._bounded_sum(part, [huge])
        assert np.linalg.norm(bounded) == pytest.approx(300 * part.clip_norm)


# ----- budget guard -----------------------------------------------------------------------------
def test_a_target_above_max_epsilon_is_refused_before_the_run():
    with pytest.raises(ConfigError, match="max-epsilon"):
        make_config("private-fedrep", epsilon=4.0, max_epsilon=2.0)


def test_a_plan_is_checked_against_the_ceiling_by_the_accountant():
    server = check_run(make_config("private-fedrep", max_epsilon=5.0))
    assert server.projected_epsilon == pytest.approx(4.0, rel=1e-5)
    assert server.projected_epsilon <= 4.0


def test_a_non_private_baseline_cannot_run_under_a_ceiling():
    config = parse_config({"algorithm": "fedrep", "num-users": 300, "dim": 8,
                                     "max-epsilon": 10.0})
    with pytest.raises(BudgetExceededError, match="without noise"):
        check_run(config)


@pytest.mark.parametrize("algorithm", ["private-fedrep", "meta-nsgd", "dp-ftmrl", "a-exp"])
def test_a_release_off_the_verified_plan_is_stopped_before_it_is_drawn(tmp_path, algorithm):
    """The per-release guard: a release whose noise is not what the start-up budget check
    composed (here the plan is tampered with after the check) stops the run before its noise
    is drawn, so nothing of it reaches the ledger, the checkpoint, the log or the nodes --
    also for Poisson-sampled releases, whose epsilon is not evaluated every round."""
    config = make_config(algorithm)
    path = tmp_path / "c"
    lines: list[str] = []
    server = PrivateServer(config, 2, log=lines.append, checkpoint_path=path)
    table = server.pure_epsilons if server.pure else server.multipliers
    last = server.steps()[-2].release  # the entry of the last release
    table[last] = table[last] * (2.0 if server.pure else 0.5)
    with pytest.raises(BudgetExceededError, match="not released"):
        for step in server.pending_steps():
            server.aggregate(step, _honest(server, step, 2), 0.0)
    refused = server.pending_steps()[0]
    assert refused.release == last
    assert all(e["release"] != refused.label for e in server.accountant.ledger)
    if path.exists():
        saved = checkpoint.load(path)
        assert saved["completed"] == server.completed
        assert saved["accountant"].ledger == server.accountant.ledger
    assert not any(line.startswith(f"[{server.completed + 1}/") for line in lines)
    server.close()


def _honest(server, step, parts):
    from fedpriv.algorithms.base import partition_users

    cls = type(server.algorithm)
    arrays = server.payload(step)
    return [NodeReply(p, cls.user_step(server.config, step, arrays, cls.participants(
        server.config, step, partition_users(server.config.num_users, p, parts))))
        for p in range(parts)]


# ----- checkpoint and resume --------------------------------------------------------------------
def _interrupted(config: RunConfig, path, stop_after: int, parts: int = 4):
    """Run until ``stop_after`` steps are done, then drop the server (a crash)."""
    server = PrivateServer(config, parts, log=lambda _: None, checkpoint_path=path)
    for _ in range(stop_after):  # the next step is asked for after each (adaptive clipping)
        step = server.next_step()
        server.aggregate(step, _honest(server, step, parts), 0.0)
    server.close()  # the process is gone: the OS would release its lock
    return server


def test_two_servers_cannot_run_one_checkpoint_at_once(tmp_path):
    """Two resumed servers of one run would publish its next releases twice."""
    path = tmp_path / "run.checkpoint"
    _interrupted(make_config("private-fedrep"), path, stop_after=2)
    first = PrivateServer(make_config("private-fedrep", resume=True), 4, log=lambda _: None,
                          checkpoint_path=path)
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
        PrivateServer(make_config("private-fedrep", resume=True), 4, log=lambda _: None,
                      checkpoint_path=path)
    first.close()  # released (as when the process ends): a resume may go on
    PrivateServer(make_config("private-fedrep", resume=True), 4, log=lambda _: None,
                  checkpoint_path=path).close()


@pytest.mark.parametrize("algorithm", sorted(PRIVATE))
def test_a_resumed_run_has_the_ledger_of_an_uninterrupted_run(tmp_path, algorithm):
    config = make_config(algorithm, results_path=str(tmp_path / "r.json"))
    path = tmp_path / "run.checkpoint"
    whole = quiet(config, parts=4)
    steps = len(whole["rounds"])
    _interrupted(config, path, stop_after=steps // 2)
    state = checkpoint.load(path)
    assert state["completed"] == steps // 2
    assert os.stat(path).st_mode & 0o777 == 0o600  # it may hold secret noise state
    resumed = quiet(make_config(algorithm, results_path=str(tmp_path / "r.json"), resume=True),
                    parts=4, checkpoint_path=path)
    assert resumed["resumed_from_step"] == steps // 2
    assert resumed["privacy"]["ledger"] == whole["privacy"]["ledger"]  # none twice, none lost
    assert resumed["metrics"] == pytest.approx(whole["metrics"], rel=1e-12)
    assert [r["step"] for r in resumed["rounds"]] == [r["step"] for r in whole["rounds"]]


def test_resume_refuses_another_runs_checkpoint_or_a_missing_one(tmp_path):
    path = tmp_path / "run.checkpoint"
    _interrupted(make_config("private-fedrep"), path, stop_after=2)
    with pytest.raises(CheckpointError, match="epsilon"):
        check_run(make_config("private-fedrep", epsilon=8.0, resume=True), path)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        check_run(make_config("private-fedrep", resume=True), tmp_path / "absent")
    path.write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="unreadable"):
        check_run(make_config("private-fedrep", resume=True), path)


def test_a_resumed_run_cannot_exceed_max_epsilon(tmp_path):
    path = tmp_path / "run.checkpoint"
    server = _interrupted(make_config("private-fedrep", max_epsilon=4.5), path, stop_after=2)
    spent = checkpoint.load(path)["epsilon_spent"]
    assert 0 < spent < 4.0
    # the ceiling may be lowered on resume, but not below what the rest of the plan needs
    assert check_run(make_config("private-fedrep", max_epsilon=4.0, resume=True),
                     path).projected_epsilon <= 4.0
    with pytest.raises(ConfigError, match="max-epsilon"):  # below the target: refused at parsing
        make_config("private-fedrep", max_epsilon=3.9, resume=True)
    # a checkpoint whose ledger already holds more than planned (say a release counted by an
    # earlier attempt) cannot be resumed past the ceiling: the accountant composes it all
    state = checkpoint.load(path)
    state["accountant"].record("round-1", server.multipliers["round"])
    checkpoint.save(path, state)
    with pytest.raises(BudgetExceededError, match="already spent"):
        check_run(make_config("private-fedrep", max_epsilon=4.0, resume=True), path)


def test_a_checkpoint_is_written_atomically(tmp_path, monkeypatch):
    """A crash while writing leaves the previous checkpoint intact."""
    path = tmp_path / "run.checkpoint"
    server = _interrupted(make_config("private-fedrep"), path, stop_after=2)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(pickle, "dump", crash)
    step = server.pending_steps()[0]
    with pytest.raises(OSError):
        server.aggregate(step, _honest(server, step, 4), 0.0)
    assert path.read_bytes() == before
    assert sorted(tmp_path.iterdir()) == [path, path.with_name(path.name + ".lock")]  # no tmp


def test_the_cli_refuses_to_silently_restart_an_interrupted_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["run", "--engine", "inprocess", "--out", str(out), "--set", "num-users=300",
            "--set", "dim=8"]
    _interrupted(parse_config({"num-users": 300, "dim": 8,
                                         "results-path": str(out)}),
                 tmp_path / "r.checkpoint", stop_after=2, parts=3)
    assert cli_main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli_main([*args, "--resume"]) == 0
    assert out.is_file() and not (tmp_path / "r.checkpoint").exists()
    assert "resumed from" in capsys.readouterr().out


def test_a_refused_resume_leaves_no_lock_file(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["run", "--engine", "inprocess", "--out", str(out), "--set", "num-users=300",
            "--set", "dim=8", "--resume"]
    assert cli_main(args) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither a checkpoint nor its lock


def test_a_lock_taken_on_a_file_its_holder_just_removed_is_taken_again(tmp_path, monkeypatch):
    """The previous holder removes the lock file (a run ended or was refused) between our
    open and our flock: a lock on the unlinked file would exclude no one, so ``lock`` takes
    the lock of the file now at the path, and a second server is refused."""
    import fcntl

    path = tmp_path / "r.checkpoint"
    lock_path = tmp_path / "r.checkpoint.lock"
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            lock_path.unlink()  # the holder's close(), just before our flock
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    fd = checkpoint.lock(path)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert len(calls) == 2  # tried again on the new file
    assert os.fstat(fd).st_ino == os.stat(lock_path).st_ino
    with pytest.raises(CheckpointError, match="another server"):
        checkpoint.lock(path)
    checkpoint.unlock(fd)


def test_a_data_error_found_during_an_in_process_run_stops_it_cleanly(tmp_path, capsys,
                                                                      monkeypatch):
    """An error that only reading the users' data reveals (the CLI checks what it can before
    the run) ends the command with status 2 and the message, not a traceback."""
    from fedpriv import engine
    from fedpriv.data.sources import DatasetError

    def failing(config, **kwargs):
        raise DatasetError("dataset: csv: rows of the train split were asked for that this "
                           "process did not load")
    monkeypatch.setattr(engine, "run_in_process", failing)
    args = ["run", "--engine", "inprocess", "--out", str(tmp_path / "r.json"), "--set",
            "num-users=300", "--set", "dim=8"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "fedpriv: the run stopped: dataset: csv: rows of the train split" in err
    assert "Traceback" not in err and not (tmp_path / "r.json").exists()


def test_a_run_that_no_node_answered_exits_non_zero_naming_why(tmp_path, capsys,
                                                                monkeypatch):
    """Every node failing every step (a node config, data file or model the nodes cannot
    use) still gives a private run, of noise alone: the CLI says so and exits 1."""
    from fedpriv import engine
    from fedpriv.server import silent_run

    config = parse_config({"num-users": 300, "dim": 8, "checkpoint": False,
                                     "results-path": str(tmp_path / "real.json")})
    results = run_in_process(config, log=lambda _: None)
    assert silent_run(results) is None
    for step in results["rounds"]:
        step["nodes_answered"] = 0
    silent = copy.deepcopy(results)
    silent["rejections"] = {"node-error": len(silent["rounds"])}
    monkeypatch.setattr(engine, "run_in_process", lambda *a, **k: silent)
    args = ["run", "--engine", "inprocess", "--out", str(tmp_path / "r.json"), "--set",
            "num-users=300", "--set", "dim=8"]
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert f"no node answered any of the run's {len(silent['rounds'])} steps" in err
    assert "'node-error'" in err and (tmp_path / "r.json").is_file()  # written all the same
    answered_once = copy.deepcopy(silent)
    answered_once["rounds"][-1]["nodes_answered"] = 1
    assert silent_run(answered_once) is None


# ----- secure noise -----------------------------------------------------------------------------
def test_secure_noise_refuses_a_fixed_noise_seed():
    with pytest.raises(ConfigError, match="noise-seed"):
        make_config("private-fedrep", secure_noise=True, noise_seed=7)


@pytest.mark.parametrize("algorithm", ["private-fedrep", "dp-ftmrl", "a-exp"])
def test_secure_noise_is_fresh_every_run_and_seeded_noise_repeats(algorithm):
    # a-exp at a small epsilon: the choice among 400 candidates is then nearly uniform
    low = {"epsilon": 0.05} if algorithm == "a-exp" else {}

    def released(**overrides):
        results = quiet(make_config(algorithm, **low, **overrides), parts=2)
        return repr(results["server_state"])

    assert released() == released()  # seeded: reproducible
    assert released(noise_seed=5) != released()  # the noise seed moves the noise only
    secure = {released(secure_noise=True, accountant="rdp") for _ in range(3)}
    assert len(secure) > 1  # three identical draws would be a 1-in-160,000 event for a-exp
    results = quiet(make_config(algorithm, secure_noise=True, accountant="rdp"), parts=2)
    assert results["privacy"]["noise"] == "os-entropy"
    assert results["privacy"]["epsilon"] <= 4.0


def test_secure_noise_takes_its_key_from_os_entropy(monkeypatch):
    """Each release's ChaCha20 stream is keyed by 256 bits from the OS (secrets), one key per
    release; never from the config."""
    import fedpriv.privacy.discrete as discrete
    calls = []
    real = discrete.secrets.randbits

    def spy(bits):
        calls.append(bits)
        return real(bits)
    monkeypatch.setattr(discrete.secrets, "randbits", spy)
    results = quiet(make_config("private-fedrep", secure_noise=True, accountant="rdp"), parts=2)
    releases = len(results["privacy"]["ledger"])
    assert calls == [256] * releases  # one OS-entropy key per release


def test_secure_noise_survives_a_resume_of_dp_ftmrl(tmp_path):
    """DP-FTMRL's tree noise is secret server state: with OS-entropy noise it cannot be
    redrawn, so the checkpoint carries it and the resumed run continues the same tree."""
    config = make_config("dp-ftmrl", secure_noise=True, accountant="rdp")
    path = tmp_path / "run.checkpoint"
    server = _interrupted(config, path, stop_after=3)
    saved_nodes = copy.deepcopy(server.algorithm.nodes)
    resumed = PrivateServer(make_config("dp-ftmrl", secure_noise=True, accountant="rdp",
                                        resume=True), 4,
                            log=lambda _: None, checkpoint_path=path)
    assert resumed.algorithm.nodes.keys() == saved_nodes.keys()
    assert all(np.array_equal(resumed.algorithm.nodes[k], v) for k, v in saved_nodes.items())
    resumed.close()
