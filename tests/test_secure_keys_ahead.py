"""Keys ahead: from the second secure round on, the nodes' keys come with the last round's
unmask replies, and a round takes three exchanges (fedpriv.server.secagg, fedpriv.secagg.node).

In process, instrumented as tests/test_secure_aggregation.py is (tests/secure_helpers.py)."""

from __future__ import annotations

import pytest
from secure_helpers import (
    assert_nothing_in_plain,
    fix_node_noise,
    instrument,
    make_config,
    quiet,
)

from fedpriv.faults import failing_partitions
from fedpriv.secagg import node as N


def _stages(record, label):
    return [e.stage for e in record.exchanges if e.label == label]


def test_the_first_secure_round_takes_four_exchanges_and_the_next_three(monkeypatch):
    record = instrument(monkeypatch)
    quiet(make_config(rounds=3))
    labels = [step.label for _, step, _ in record.outcomes]
    assert labels == ["init", "round-1", "round-2", "round-3"]
    assert _stages(record, "init") == ["setup", "share-keys", "collect", "unmask"]
    for label in labels[1:]:
        assert _stages(record, label) == ["setup", "collect", "unmask"]
        setup = record.stage(label, "setup")
        # the setup carries stage 2's key list, and every reply is stage 2's
        assert all({"nodes", "peers", "c-pks", "s-pks", "step"} <= set(m)
                   for m in setup.messages.values())
        assert all(set(r) == {"dst", "ciphertexts", "seed-digest"}
                   for r in setup.replies.values())
    for previous, (round_id, _step, _outcome) in zip(record.outcomes, record.outcomes[1:],
                                                   strict=False):
        # the id of a round was fixed in the last round's unmask request, before the keys
        unmask = record.stage(previous[1].label, "unmask")
        assert {bytes(m["next-round"]) for m in unmask.messages.values()} == {round_id}
        keys = previous[2].ahead
        assert keys is not None and keys.round_id == round_id
        assert sorted(keys.keys) == sorted(unmask.replies)
    for exchange in record.exchanges:
        assert_nothing_in_plain(exchange, record, nodes=10)


def test_keys_ahead_release_what_full_setups_release(monkeypatch):
    """The same run with every round set up in full (the server keeps no keys ahead) releases
    the same, with the same ledger and the same survivors: the masks cancel either way."""
    import fedpriv.server.secagg as S

    fix_node_noise(monkeypatch)
    runs, stages = {}, {}
    for mode in ("ahead", "full"):
        if mode == "full":
            real = S.SecureOutcome.__init__

            def forget(self, *args, _real=real, **kwargs):
                _real(self, *args, **kwargs)
                self.ahead = None

            monkeypatch.setattr(S.SecureOutcome, "__init__", forget)
        record = instrument(monkeypatch)
        runs[mode] = quiet(make_config(rounds=2, node_fault_rate=0.1))
        stages[mode] = _stages(record, "round-2")
    assert stages == {"ahead": ["setup", "collect", "unmask"],
                      "full": ["setup", "share-keys", "collect", "unmask"]}
    ahead, full = runs["ahead"], runs["full"]
    assert ahead["server_state"] == full["server_state"]
    assert ahead["privacy"]["ledger"] == full["privacy"]["ledger"]
    assert ahead["rejections"] == full["rejections"]
    for a, b in zip(ahead["rounds"], full["rounds"], strict=True):
        drop = ("seconds", "note", "secure_bytes_to_nodes", "secure_bytes_from_nodes")
        assert {k: v for k, v in a.items() if k not in drop} == {
            k: v for k, v in b.items() if k not in drop}


def test_a_node_that_failed_a_round_is_asked_for_keys_and_takes_part_in_the_next(
        monkeypatch):
    """10 nodes, 10% crashing in each step's collect stage (after sharing keys): each round
    loses only that step's crashing node, not also the last step's."""
    record = instrument(monkeypatch)
    config = make_config(rounds=2, node_fault_rate=0.1)
    quiet(config)
    for _, step, outcome in record.outcomes:
        failing = failing_partitions(config.seed, step.label, 10, config.node_fault_rate)
        assert failing and sorted(outcome.survivors) == sorted(set(range(10)) - failing)
        unmask = record.stage(step.label, "unmask")
        only = {n for n, m in unmask.messages.items() if m.get("keys-only")}
        assert only == failing  # asked for keys alone: they reveal nothing
        assert all(set(unmask.replies[n]) == {"next-c-pk", "next-s-pk"} for n in only)


def test_a_node_without_keys_ahead_sits_the_round_out(monkeypatch):
    """A node whose unmask reply is lost is not in the next round's key list (counted failed
    at its setup); the round goes on with the others."""
    def lose_node_3(label, stage, replies, record):
        if label == "round-1" and stage == "unmask":
            replies = {n: r for n, r in replies.items() if n != 3}
        return replies

    record = instrument(monkeypatch, forge=lose_node_3)
    result = quiet(make_config(rounds=2))
    setup = record.stage("round-2", "setup")
    assert 3 not in setup.messages and len(setup.messages) == 9
    outcome = record.outcomes[-1][2]
    assert 3 not in outcome.survivors and outcome.failures[3][0] == "setup"
    assert result["rounds"][2]["nodes_failed"] == 1


# ----- the node's checks -------------------------------------------------------------------
def _node_after_unmask(next_round: bytes) -> dict:
    state: dict = {}
    reply = N.unmask(make_config(), 0, 10, state, {"round": b"r" * 16, "keys-only": True,
                                                   "next-round": next_round})
    assert set(reply) == {"next-c-pk", "next-s-pk"} and state["next/id"] == next_round
    assert state["next/c-pk"] == reply["next-c-pk"] and state["next/s-pk"] == reply["next-s-pk"]
    return state


def _setup_message(config, round_id: bytes) -> dict:
    from fedpriv.algorithms.base import Step
    from fedpriv.secagg.graph import plan

    graph = plan(config, 10)
    return {"round": round_id, "step": Step("round", 1, release="round").to_json(),
            "threshold": graph.t, "neighbours": graph.k, "history-labels": [],
            "history-rho": [], "nodes": b""}


def test_keys_only_reveals_nothing_and_forgets_the_round():
    state = {"round/id": b"r" * 16, "round/vector": [1, 2], "round/held-seed": [b"x"]}
    reply = N.unmask(make_config(), 0, 10, state, {"round": b"r" * 16, "keys-only": True,
                                                   "next-round": b"n" * 16})
    assert set(reply) == {"next-c-pk", "next-s-pk"}
    assert not any(k.startswith("round/") for k in state)


@pytest.mark.parametrize("round_id", [b"n" * 16, b"o" * 16])
def test_a_key_list_for_a_round_the_node_made_no_keys_for_is_refused(round_id):
    """Advertised for round n: a key list for round o is refused; for round n the keys serve
    one setup at most (here a refused one): then the node holds none and says so."""
    config = make_config()
    state = _node_after_unmask(b"n" * 16)
    computed = []
    with pytest.raises(N.RoundRefused):
        N.setup(config, 0, 10, state, _setup_message(config, round_id), {},
                lambda step, arrays: computed.append(step))
    assert not any(k.startswith("next/") for k in state) and computed == []
    again = N.setup(config, 0, 10, state, _setup_message(config, b"n" * 16), {},
                    lambda step, arrays: computed.append(step))
    assert again == {"no-keys": True} and computed == []


def test_a_full_setup_forgets_keys_advertised_for_another_round():
    state = _node_after_unmask(b"n" * 16)
    config = make_config()
    message = {k: v for k, v in _setup_message(config, b"f" * 16).items() if k != "nodes"}
    with pytest.raises(N.RoundRefused):  # no share parameters: refused after the keys
        N.setup(config, 0, 10, state, message, {}, lambda step, arrays: None)
    assert not any(k.startswith("next/") for k in state)


# ----- what a round keeps from its keys ahead ------------------------------------------------
RING = {"num_users": 350, "users_per_node": 5, "dim": 6}  # 70 nodes: k = 32, drawn 63, min 36


def _lose(label, stage, nodes):
    def forge(at, where, replies, record):
        if (at, where) == (label, stage):
            for pid in nodes:
                replies[pid] = N.Failure("timeout", "lost in transit")
        return replies
    return forge


def test_a_keys_ahead_setup_loses_no_more_nodes_than_a_full_one_may(monkeypatch):
    """Nodes lost at a setup with keys ahead are inside the ring: the round stops past the
    ring's drawn floor (all but secure-dropout's 7 of 70), as a full setup's does."""
    from fedpriv.server.secagg import SecureAggregationError

    instrument(monkeypatch, forge=_lose("round-1", "setup", range(7)))
    result = quiet(make_config(**RING))
    assert result["rounds"][1]["nodes_failed"] == 7
    instrument(monkeypatch, forge=_lose("round-1", "setup", range(8)))
    with pytest.raises(SecureAggregationError, match="only 62 nodes .* setup stage of round-1, "
                       "fewer than the round's minimum 63"):
        quiet(make_config(**RING))


def test_too_few_keys_ahead_make_a_full_setup_not_a_stopped_run(monkeypatch):
    """8 of 70 unmask replies lost in init (the round needs only a majority there): round-1
    has 62 nodes' keys, under its drawn floor, so it sets up in full under a fresh round id
    and every node takes part."""
    record = instrument(monkeypatch, forge=_lose("init", "unmask", range(8)))
    result = quiet(make_config(**RING))
    assert _stages(record, "round-1") == ["setup", "share-keys", "collect", "unmask"]
    ids = {e.round_id for e in record.exchanges if e.label == "round-1"}
    unmask = record.stage("init", "unmask")
    assert len(ids) == 1 and ids != {bytes(next(iter(unmask.messages.values()))["next-round"])}
    assert result["rounds"][1]["nodes_failed"] == 0


def test_a_node_that_lost_its_keys_is_lost_not_refused(monkeypatch):
    """A node whose state lost its advertised keys (a restarted SuperNode) answers the key list
    with ``no-keys``: counted as unavailable (no user's data did it), the round goes on."""
    record = instrument(monkeypatch)
    setup = N.setup

    def forgetful(config, pid, nodes, state, msg, arrays, compute):
        if pid == 4 and "nodes" in msg and '"index": 1' in str(msg["step"]):  # round-1
            for key in [k for k in state if k.startswith("next/")]:
                del state[key]
        return setup(config, pid, nodes, state, msg, arrays, compute)

    monkeypatch.setattr(N, "setup", forgetful)
    result = quiet(make_config(rounds=2))
    assert record.stage("round-1", "setup").replies[4] == {"no-keys": True}
    failures = {step.label: outcome.failures for _, step, outcome in record.outcomes}
    assert failures["round-1"][4][:2] == ("setup", "unavailable") and failures["init"] == {}
    assert 4 in record.outcomes[-1][2].survivors  # asked for keys again: back in round-2
    assert result["rounds"][1]["nodes_failed"] == 1


def test_a_lost_keys_only_reply_keeps_the_nodes_own_failure(monkeypatch):
    """Node 2's masked vector lost in init, then its keys-only reply too: its failure stays
    the collect stage's, and round-1 has no keys of it (failed at its setup, not asked)."""
    def lose_node_2(label, stage, replies, record):
        if label == "init" and stage in ("collect", "unmask") and 2 in replies:
            replies[2] = N.Failure("timeout", "lost in transit")
        return replies

    record = instrument(monkeypatch, forge=lose_node_2)
    quiet(make_config())
    unmask = record.stage("init", "unmask")
    assert unmask.messages[2].get("keys-only")
    outcomes = {step.label: outcome for _, step, outcome in record.outcomes}
    assert {n: f[0] for n, f in outcomes["init"].failures.items()} == {2: "collect"}
    assert outcomes["round-1"].failures[2][:2] == ("setup", "timeout")
    assert 2 not in record.stage("round-1", "setup").messages


def test_a_node_shares_its_keys_once_a_round(monkeypatch):
    """A second key list in the same round (other holders) is refused: shared twice, its mask
    key could reach more colluders than the threshold."""
    from fedpriv.secagg.local import LocalNodes

    refused = []
    send = LocalNodes.send

    def again(self, stage, messages):
        replies = send(self, stage, messages)
        if stage == "share-keys":
            with pytest.raises(N.RoundRefused, match="shared its keys for this round already"):
                N.share_keys(3, self.nodes, self.states[3], messages[3])
            refused.append(True)
        return replies

    monkeypatch.setattr(LocalNodes, "send", again)
    quiet(make_config())
    assert refused == [True]  # init: the run's one full setup
