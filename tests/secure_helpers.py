"""Instruments for the in-process tests of secure aggregation (tests/test_secure_aggregation.py):
a transcript of every message the server sends and receives, each node's unmasked vector as it
left its setup stage, each round's outcome, and the server object of a run; node noise fixed by
the node's own contribution (so a secure and a distributed run draw the same noise whatever the
order of the nodes' calls)."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import fedpriv.engine as engine
import fedpriv.nodes as nodes_module
from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.configure import parse_config
from fedpriv.privacy.discrete import CryptoRandom
from fedpriv.secagg import node as N
from fedpriv.secagg.crypto import Layout
from fedpriv.secagg.local import LocalNodes
from fedpriv.server.secagg import SecureOutcome, SecureRound

# 10 nodes of 100 users; init, one or two rounds, final
BASE = {"algorithm": "private-fedrep", "num-users": 1000, "users-per-node": 100, "dim": 10,
        "rounds": 1, "epsilon": 2.0, "accountant": "rdp", "aggregation": "secure",
        "test-samples-per-user": 5}


def make_config(**extra: Any) -> RunConfig:
    return parse_config({**BASE, **{k.replace("_", "-"): v for k, v in extra.items()}})


def quiet(config: RunConfig, **kwargs: Any) -> dict[str, Any]:
    return engine.run_in_process(config, log=lambda _: None, **kwargs)


@dataclass
class Exchange:
    """One stage of one round: what the server sent and what it got back (after any
    ``tamper``, i.e. exactly what the server read)."""

    round_id: bytes
    label: str
    stage: str
    messages: dict[int, Mapping[str, Any]]
    replies: dict[int, Any]


@dataclass
class Transcript:
    """Everything a secure run's server exchanged, plus what the nodes kept to themselves."""

    exchanges: list[Exchange] = field(default_factory=list)
    labels: dict[bytes, str] = field(default_factory=dict)  # round id: step label
    vectors: dict[tuple[bytes, int], np.ndarray] = field(default_factory=dict)
    layouts: dict[tuple[bytes, int], Layout] = field(default_factory=dict)
    contribs: dict[tuple[bytes, int], UserContribution] = field(default_factory=dict)
    outcomes: list[tuple[bytes, Step, SecureOutcome]] = field(default_factory=list)
    servers: list[Any] = field(default_factory=list)
    node_replies: list[Exchange] = field(default_factory=list)  # before any tamper

    def stage(self, label: str, stage: str) -> Exchange:
        (found,) = [e for e in self.exchanges if e.label == label and e.stage == stage]
        return found


Tamper = Callable[[str, str, dict[int, Mapping[str, Any]], Transcript],
                  dict[int, Mapping[str, Any]]]
Forge = Callable[[str, str, dict[int, Any], Transcript], dict[int, Any]]


def instrument(monkeypatch: Any, tamper: Tamper | None = None,
               forge: Forge | None = None) -> Transcript:
    """Record a run. ``tamper(label, stage, messages, transcript)`` may rewrite the server's
    messages before the nodes see them; ``forge(label, stage, replies, transcript)`` the nodes'
    replies before the server sees them (e.g. to lose one)."""
    record = Transcript()
    send, setup, run = LocalNodes.send, N.setup, SecureRound.run
    make_server = engine.PrivateServer

    def spy_send(self: LocalNodes, stage: str, messages: Mapping[int, Mapping[str, Any]]):
        messages = dict(messages)
        round_id = bytes(next(iter(messages.values()))["round"])
        if stage == "setup":
            record.labels[round_id] = Step.from_json(
                str(next(iter(messages.values()))["step"])).label
        label = record.labels[round_id]
        if tamper is not None:
            messages = tamper(label, stage, messages, record)
        replies = dict(send(self, stage, messages))
        record.node_replies.append(Exchange(round_id, label, stage, messages, dict(replies)))
        if forge is not None:
            replies = forge(label, stage, replies, record)
        record.exchanges.append(Exchange(round_id, label, stage, messages, replies))
        return replies

    def spy_setup(config, pid, nodes, state, msg, arrays, compute):
        key = (bytes(msg["round"]), pid)

        def keep(step: Step, arr: Mapping[str, np.ndarray]) -> UserContribution:
            record.contribs[key] = compute(step, arr)
            return record.contribs[key]

        reply = setup(config, pid, nodes, state, msg, arrays, keep)
        if "round/vector" in state:  # not a node that lost its advertised keys
            record.vectors[key] = np.array(state["round/vector"], dtype=np.uint64)
            record.layouts[key] = Layout.from_json(json.loads(state["round/layout"]))
        return reply

    def spy_run(self: SecureRound) -> SecureOutcome:
        outcome = run(self)
        record.outcomes.append((self.round_id, self.step, outcome))
        return outcome

    def keep_server(*args: Any, **kwargs: Any) -> Any:
        server = make_server(*args, **kwargs)
        record.servers.append(server)
        return server

    monkeypatch.setattr(LocalNodes, "send", spy_send)
    monkeypatch.setattr(N, "setup", spy_setup)
    monkeypatch.setattr(SecureRound, "run", spy_run)
    monkeypatch.setattr(engine, "PrivateServer", keep_server)
    return record


def ledger_of(record: Transcript) -> list[dict[str, Any]]:
    return copy.deepcopy(record.servers[-1].accountant.ledger)


def contribution_key(label: str, contrib: UserContribution) -> int:
    """A test-only noise key: the step label and a hash of the node's exact contribution
    (the same in both modes, whatever order the nodes are called in)."""
    h = hashlib.sha256(label.encode())
    for name in sorted(contrib.totals):
        h.update(name.encode())
        h.update(np.ascontiguousarray(contrib.totals[name], dtype=np.float64).tobytes())
    h.update(f"{contrib.num_users}/{contrib.num_clipped}".encode())
    return int.from_bytes(h.digest(), "little")  # < 2^256


def fix_node_noise(monkeypatch: Any) -> list[str]:
    """Every node's noise share from ``CryptoRandom(contribution_key)``; returns the labels of
    the encoded shares (one per call)."""
    calls: list[str] = []
    encode = nodes_module.encode_shares

    def fixed(seed: int, step: Step, contrib: UserContribution, params: np.ndarray,
              rng: CryptoRandom | None = None) -> UserContribution:
        calls.append(step.label)
        return encode(seed, step, contrib, params,
                      rng=CryptoRandom(contribution_key(step.label, contrib)))

    monkeypatch.setattr(nodes_module, "encode_shares", fixed)
    return calls


SHARED = frozenset({"dst", "ciphertexts", "seed-digest"})
REVEALED = frozenset({"seed-of", "seed-shares", "key-of", "key-shares"})
NEXT = frozenset({"next-c-pk", "next-s-pk"})
# a stage's possible replies: a setup with the key list (keys advertised a round ahead) is
# answered as stage 2; an unmask stage also asks for the next round's keys, of the nodes that
# are not survivors those alone
REPLY_KEYS = {"setup": [frozenset({"c-pk", "s-pk"}), SHARED, frozenset({"no-keys"})],
              "share-keys": [SHARED],
              "collect": [frozenset({"masked"})], "unmask": [REVEALED | NEXT, NEXT, REVEALED]}


def assert_nothing_in_plain(exchange: Exchange, record: Transcript, nodes: int) -> None:
    """No reply the server read carries a node's vector (whole or one segment), its counts
    or its metrics: only the stage's keys; integers only as node ids; no strings; bytes (keys,
    ciphertexts, shares, digests) holding no vector's bytes; arrays
    only masked vectors that agree with no node's vector but by chance."""
    secrets = [(v, record.layouts[(r, p)]) for (r, p), v in record.vectors.items()
               if r == exchange.round_id]
    for reply in exchange.replies.values():
        if isinstance(reply, N.Failure):  # the transport's word: a simulated fault
            assert reply.detail.startswith("simulated")
            continue
        assert set(reply) in REPLY_KEYS[exchange.stage], (exchange.stage, sorted(reply))
        for key, value in reply.items():
            for item in value if isinstance(value, list) else [value]:
                assert not isinstance(item, float)
                if isinstance(item, bool):  # a node that lost its advertised keys says so
                    assert key == "no-keys" and item
                elif isinstance(item, (int, np.integer)):
                    assert key in ("dst", "seed-of", "key-of") and 0 <= item < nodes
                elif isinstance(item, str):  # no metrics step: no names, no strings
                    raise AssertionError(f"{key}: a string {item!r} in a reply")
                elif isinstance(item, bytes):
                    for vector, layout in secrets:
                        assert vector.tobytes() not in item
                        for seg in layout.split(vector).values():
                            assert len(seg) < 2 or seg.tobytes() not in item
                else:
                    y = np.asarray(item)
                    assert key == "masked" and y.dtype == np.uint64
                    for vector, _ in secrets:
                        assert np.count_nonzero(y == vector) <= 1
