"""What the server receives (docs/concepts/trust.md, "What the server receives"): in distributed
and secure runs nothing exact about the users leaves a node (public counts, no clipped count, no
metrics step sent); a user's failure on a node costs only that user; how far a hostile node can
move a distributed release (the ledger's ``hostile_node_l2_bound``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from secure_helpers import fix_node_noise, make_config, quiet

import fedpriv.nodes as nodes_module
from fedpriv.algorithms.base import UserContribution
from fedpriv.evaluation import algorithm_for
from fedpriv.nodes import node_step
from fedpriv.server import PrivateServer
from fedpriv.server.discrete import SERVER_VIEW


def _received(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[Any]]]:
    """Every (step label, node replies) the server of the next runs aggregates."""
    seen: list[tuple[str, list[Any]]] = []
    aggregate = PrivateServer.aggregate

    def spy(self: PrivateServer, step: Any, replies: Any, started: float) -> Any:
        seen.append((step.label, list(replies)))
        return aggregate(self, step, replies, started)

    monkeypatch.setattr(PrivateServer, "aggregate", spy)
    return seen


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_a_distributed_server_receives_public_counts_and_no_metrics(monkeypatch, mode):
    """Clip small enough that users are clipped: a central server sees the clipped counts and
    the exact final metrics; a distributed one sees only the public counts, and is never sent
    the final step."""
    seen = _received(monkeypatch)
    results = quiet(make_config(aggregation=mode, clip_norm=0.05))
    labels = [label for label, _ in seen]
    replies = [r for _, rs in seen for r in rs]
    assert all(r.contribution is not None for r in replies)
    if mode == "central":
        assert labels == ["init", "round-1", "final"]
        assert sum(r.contribution.num_clipped for r in replies) > 0  # the check can fail
        assert results["metrics"] and "simulation_metrics" not in results
        assert results["privacy"]["trust"]["server_receives"] == SERVER_VIEW["central"]
        return
    assert labels == ["init", "round-1"]  # the final step is recorded, not sent
    for r in replies:
        assert r.contribution.num_users == 100  # the public count of each node's users
        assert r.contribution.num_clipped == 0 and r.contribution.metrics is None
    assert results["metrics"] == {}
    final = results["rounds"][-1]
    assert final["step"] == "final" and final["note"].startswith("not sent")
    assert results["rounds"][0]["users_clipped"] is None
    assert set(results["simulation_metrics"]) >= {"population_mse", "local_only_mse"}
    trust = results["privacy"]["trust"]
    assert trust["server_receives"] == SERVER_VIEW["distributed"]
    assert "not bounded" in trust["hostile_node"]


def test_a_node_refuses_to_send_a_metrics_step_of_a_distributed_run():
    config = make_config(aggregation="distributed")
    server = PrivateServer(config, 10, log=lambda _: None)
    final = server.steps()[-1]
    assert final.is_final and not server.sends(final)
    cls = type(server.algorithm)
    with pytest.raises(ValueError, match="no exact metrics"):
        node_step(cls, config, final, {}, cls.hosted_users(config, 0, 10))
    server.close()


# ----- a user's failure costs only that user --------------------------------------------------
def _failing_user(monkeypatch: pytest.MonkeyPatch, cls: type, bad: set[int]) -> None:
    """``cls.user_step`` raises whenever a user of ``bad`` is among its users (as a torch
    IndexError on a label outside the classes would)."""
    step_of = cls.user_step

    def user_step(config: Any, step: Any, arrays: Any, user_ids: np.ndarray) -> Any:
        if bad & {int(u) for u in user_ids}:
            raise IndexError("target 11 is out of bounds")
        return step_of(config, step, arrays, user_ids)

    monkeypatch.setattr(cls, "user_step", staticmethod(user_step))


@pytest.mark.parametrize("block", [1000, 7])
def test_a_user_whose_step_raises_takes_part_with_zero_and_the_others_are_kept(
        monkeypatch, block):
    monkeypatch.setenv("FEDPRIV_BLOCK_USERS", str(block))
    config = make_config(aggregation="central")
    cls = algorithm_for(config)
    server = PrivateServer(config, 10, log=lambda _: None)
    step = server.steps()[0]  # init
    arrays = server.payload(step)
    server.close()
    hosted = cls.hosted_users(config, 0, 10)
    without = node_step(cls, config, step, arrays, np.setdiff1d(hosted, [hosted[5]]))
    _failing_user(monkeypatch, cls, {int(hosted[5])})
    got = node_step(cls, config, step, arrays, hosted)
    assert got.num_users == len(hosted)  # the failed user still takes part (with zero)
    for name, total in without.totals.items():
        np.testing.assert_allclose(got.totals[name], total, rtol=1e-12, atol=1e-12)


def test_a_node_whose_every_user_and_empty_step_fail_raises_the_error(monkeypatch):
    config = make_config(aggregation="central")
    cls = algorithm_for(config)
    server = PrivateServer(config, 10, log=lambda _: None)
    step = server.steps()[0]
    arrays = server.payload(step)
    server.close()

    def broken(config: Any, step: Any, arrays: Any, user_ids: np.ndarray) -> Any:
        raise RuntimeError("the broadcast is broken")

    monkeypatch.setattr(cls, "user_step", staticmethod(broken))
    with pytest.raises(RuntimeError, match="broadcast is broken"):
        node_step(cls, config, step, arrays, cls.hosted_users(config, 0, 10))


def test_a_failing_user_changes_nothing_the_distributed_server_receives_but_the_noisy_sum(
        monkeypatch):
    """D' = D with one user whose step raises: every count, error and rejection the server
    receives is the same; the released model moves by at most the stated sensitivity."""
    fix_node_noise(monkeypatch)
    seen = _received(monkeypatch)
    config = make_config(aggregation="distributed")
    d = quiet(config)
    cls = algorithm_for(config)
    _failing_user(monkeypatch, cls, {42})
    d2 = quiet(config)
    half = len(seen) // 2
    for (label, ours), (label2, theirs) in zip(seen[:half], seen[half:], strict=True):
        assert label == label2
        assert [(r.partition_id, r.error, r.contribution.num_users,
                 r.contribution.num_clipped, r.contribution.metrics) for r in ours] == [
            (r.partition_id, r.error, r.contribution.num_users, r.contribution.num_clipped,
             r.contribution.metrics) for r in theirs]
    assert d["rejections"] == d2["rejections"] == {}
    assert d["privacy"]["ledger"] == d2["privacy"]["ledger"]
    assert [r["nodes_answered"] for r in d["rounds"]] == [r["nodes_answered"]
                                                         for r in d2["rounds"]]


# ----- hostile nodes -------------------------------------------------------------------------
def test_a_hostile_distributed_node_moves_the_release_within_the_stated_bound(monkeypatch):
    """A node adds 2^(bits-2) to one coordinate of its ring vector: nothing is rejected, the
    init release moves far beyond what its users could (the central bound), and within the
    ledger's hostile_node_l2_bound."""
    fix_node_noise(monkeypatch)
    config = make_config(aggregation="distributed", rounds=1)
    released: list[dict[str, np.ndarray]] = []
    apply = type(PrivateServer(config, 10, log=lambda _: None).algorithm).apply

    def keep(self: Any, step: Any, noisy: Any) -> Any:
        if step.label == "init":
            released.append({k: np.array(v, dtype=np.float64) for k, v in noisy.items()})
        return apply(self, step, noisy)

    monkeypatch.setattr(type(PrivateServer(config, 10, log=lambda _: None).algorithm),
                        "apply", keep)
    honest = quiet(config)
    encode = nodes_module.public_reply

    def hostile(cls: Any, config: Any, step: Any, hosted: np.ndarray,
                contrib: UserContribution) -> UserContribution:
        reply = encode(cls, config, step, hosted, contrib)
        if int(hosted[0]) == 0 and step.label == "init":  # partition 0
            bits = next(e for e in honest["privacy"]["ledger"]
                        if e["release"] == "init")["parts"][0]["modulus_bits"]
            name = step.parts[0].name
            vector = np.array(reply.totals[name], dtype=np.int64)
            vector[0] = (vector[0] + 2 ** (bits - 2)) % 2 ** bits
            reply = UserContribution({**reply.totals, name: vector}, reply.num_users, 0, None)
        return reply

    monkeypatch.setattr(nodes_module, "public_reply", hostile)
    attacked = quiet(config)
    assert attacked["rejections"] == {}  # the server cannot tell
    part = next(e for e in honest["privacy"]["ledger"] if e["release"] == "init")["parts"][0]
    (name, a), = released[0].items()
    moved = float(np.linalg.norm(released[1][name] - a))
    users_bound = 2 * 100 * config.clip_norm / config.num_users  # what its 100 users could
    assert moved > 2 * users_bound > 100 * part["l2_sensitivity"]
    assert moved <= part["hostile_node_l2_bound"]


def test_a_user_whose_final_metric_overflows_costs_only_that_user(monkeypatch):
    """A loss that overflows for one user (huge features): the node's metric sums are those of
    its other users, and the server accepts the node's reply."""
    config = make_config(aggregation="central")
    cls = algorithm_for(config)
    sent: dict[str, Any] = {}
    payload = PrivateServer.payload

    def spy(self: PrivateServer, step: Any) -> Any:
        sent[step.label] = (step, payload(self, step))
        return sent[step.label][1]

    monkeypatch.setattr(PrivateServer, "payload", spy)
    quiet(config)  # the final step's broadcast after the run's own releases
    final, arrays = sent["final"]
    hosted = cls.hosted_users(config, 0, 10)
    step_of = cls.user_step
    without = node_step(cls, config, final, arrays, np.setdiff1d(hosted, [hosted[3]]))

    def user_step(config: Any, step: Any, arrays: Any, user_ids: np.ndarray) -> Any:
        contrib = step_of(config, step, arrays, user_ids)
        if int(hosted[3]) in {int(u) for u in user_ids}:
            metrics = dict.fromkeys(contrib.metrics, float("inf"))
            return UserContribution(contrib.totals, contrib.num_users, 0, metrics)
        return contrib

    monkeypatch.setattr(cls, "user_step", staticmethod(user_step))
    got = node_step(cls, config, final, arrays, hosted)
    assert got.num_users == len(hosted)
    assert got.metrics.keys() == without.metrics.keys()
    for name, value in without.metrics.items():
        assert got.metrics[name] == pytest.approx(value, rel=1e-12, abs=1e-12)


def test_a_learning_curve_is_refused_where_nodes_send_no_exact_metrics():
    from fedpriv.config import ConfigError
    from fedpriv.configure import parse_config

    with pytest.raises(ConfigError, match="^eval-every: distributed nodes send no exact"):
        parse_config({"algorithm": "deep-private-fedrep", "eval-every": 2,
                      "aggregation": "distributed", "accountant": "rdp"})


def test_a_distributed_flower_node_replies_with_its_share_and_public_values_only(monkeypatch):
    """The real PrivateStrategy and ClientApp handlers (loopback grid, no runtime): every
    reply of a distributed run holds the ring vectors, the public user count, a zero clipped
    count and the partition, no timing and no metric; no metrics step is sent."""
    from flwr.supercore.task_identity import TaskIdentity
    from test_reliability import LoopbackGrid

    import fedpriv.protocol as P
    from strategies.private import PrivateStrategy

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    config = make_config(aggregation="distributed", num_users=400)
    grid = LoopbackGrid(config, 4)
    replies: list[Any] = []
    send = grid.send_and_receive

    def spy(messages: Any, timeout: Any = None) -> Any:
        out = send(messages, timeout)
        replies.extend((m.metadata.message_type, dict(r.content[P.METRICS]))
                       for m, r in zip(messages, out, strict=True))
        return out

    grid.send_and_receive = spy  # type: ignore[method-assign]
    strategy = PrivateStrategy(config, {node: p for p, node in enumerate(grid.contexts)})
    strategy.server.log = lambda _: None
    results = strategy.run(grid)
    assert {kind for kind, _ in replies} == {P.MSG_STEP}  # no final (metrics) message
    assert len(replies) == 4 * 2  # init and round-1, four nodes
    for _, metrics in replies:
        assert set(metrics) == {P.KEY_NUM_USERS, P.KEY_NUM_CLIPPED, P.KEY_PARTITION}
        assert metrics[P.KEY_NUM_USERS] == 100 and metrics[P.KEY_NUM_CLIPPED] == 0
    assert results["metrics"] == {} and results["rejections"] == {}
