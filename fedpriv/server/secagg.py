"""The server's side of secure aggregation (``aggregation = "secure"``): it sees only the sum.

One round of SecAgg (Bonawitz et al. 2017; Flower's SecAgg+ stages over the complete graph)
for one step, on fedpriv's own messages, whatever carries them (``Send``: Flower's Grid, or
direct calls in process):

1. **setup**: the step, its broadcast and share parameters, the threshold ``t``, the ledger
   so far. Each node checks the round against the run's plan, computes its noisy share and
   answers two fresh public keys (U1: the nodes that answered).
2. **share-keys**: the server forwards U1's keys; each node Shamir-shares its mask seed and its
   mask key (threshold ``t``), encrypted for each other node (U2: those that answered).
3. **collect**: each node gets the ciphertexts held for it and sends its vector masked (U3).
4. **unmask**: the server names the active (U3) and dropped (U2 minus U3) nodes; each node
   checks that no node is both and that at least ``t`` are active, then reveals its shares of
   the active nodes' seeds and of the dropped nodes' mask keys. With ``t`` answers the server
   removes the masks: the sum over U3 of the nodes' vectors, and nothing else.

Threat model: an honest-but-curious server (it follows the protocol and forwards messages
faithfully, but reads everything it receives), no Sybil nodes, and at most
``floor(collusion-threshold * K)`` nodes colluding with it; ``t`` must exceed that number
(``check_threshold``). A round with fewer than ``t`` nodes left at any stage cannot be unmasked:
the run stops there (``SecureAggregationError``), its checkpoint intact for ``resume``.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.config import ConfigError, RunConfig
from fedpriv.secagg import crypto as C
from fedpriv.secagg.node import COUNTS, Failure, own_layout, pair_sign, read_counts
from fedpriv.server.discrete import threshold
from fedpriv.shares import DISTRIBUTED_KEY

STAGES = ("setup", "share-keys", "collect", "unmask")


Reply = Mapping[str, Any] | Failure
# (stage, {node: message}) -> {node: reply}; a node missing from the result did not answer
Send = Callable[[str, Mapping[int, Mapping[str, Any]]], Mapping[int, Reply]]


class SecureAggregationError(RuntimeError):
    """Too few nodes were left to unmask a round: nothing of it was released."""


def check_threshold(config: RunConfig, nodes: int) -> int:
    """Refuse, before round 1, a threshold the layout cannot meet or that colluders reach."""
    t = threshold(config, nodes)
    colluders = math.floor(config.collusion_threshold * nodes)
    if nodes < 2:
        raise ConfigError(f"aggregation: secure aggregation needs at least 2 nodes, the run has "
                          f"{nodes} (set users-per-node so that num-users makes several nodes)")
    if t > nodes:
        raise ConfigError(f"secure-threshold: {t} exceeds the number of nodes ({nodes}): no "
                          "round could be unmasked")
    if t <= colluders or t < 2:
        raise ConfigError(f"secure-threshold: {t} must exceed the nodes that may collude with "
                          f"the server (floor(collusion-threshold * {nodes}) = {colluders}) and "
                          "be at least 2, or they could unmask a single node's vector")
    return t


@dataclass
class SecureOutcome:
    """A secure round: the sum over the surviving nodes (ring vectors per part; the public
    counts), who survived, who was lost where, and what the round cost."""

    total: UserContribution
    survivors: list[int]
    failures: dict[int, tuple[str, str, str]]  # node: (stage, kind, detail)
    bytes_to_nodes: int = 0
    bytes_from_nodes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def payload_bytes(message: Mapping[str, Any]) -> int:
    """The payload of a message: bytes, arrays and strings at their size, numbers at 8."""
    size = 0
    for value in message.values():
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, (bytes, bytearray)):
                size += len(item)
            elif isinstance(item, np.ndarray):
                size += item.nbytes
            elif isinstance(item, str):
                size += len(item.encode())
            else:
                size += 8
    return size


class SecureRound:
    """One step's secure aggregation over the nodes ``nodes`` with threshold ``t``."""

    def __init__(self, send: Send, step: Step, arrays: Mapping[str, np.ndarray],
                 nodes: Sequence[int], t: int, history: Mapping[str, float],
                 log: Callable[[str], None] = print) -> None:
        self.send_fn, self.step, self.arrays = send, step, dict(arrays)
        self.nodes, self.t, self.history, self.log = list(nodes), t, dict(history), log
        self.round_id = secrets.token_bytes(16)
        self.failures: dict[int, tuple[str, str, str]] = {}
        self.sent = self.received = 0
        self.seconds: dict[str, float] = {}

    # ----- transport -------------------------------------------------------------------------
    def _send(self, stage: str, messages: Mapping[int, Mapping[str, Any]]
              ) -> dict[int, Mapping[str, Any]]:
        started = time.perf_counter()
        self.sent += sum(payload_bytes(m) for m in messages.values())
        replies = self.send_fn(stage, messages)
        self.seconds[stage] = time.perf_counter() - started
        good: dict[int, Mapping[str, Any]] = {}
        for node in messages:
            reply = replies.get(node, Failure("timeout", "no reply before the timeout"))
            if isinstance(reply, Failure):
                self.failures[node] = (stage, reply.kind, reply.detail)
            else:
                self.received += payload_bytes(reply)
                good[node] = reply
        return good

    def _drop(self, node: int, stage: str, detail: str) -> None:
        self.failures[node] = (stage, "malformed", detail[:300])

    def _enough(self, nodes: Sequence[int], stage: str) -> None:
        if len(nodes) < self.t:
            lost = {n: f"{k}: {d}" for n, (s, k, d) in self.failures.items() if s == stage}
            raise SecureAggregationError(
                f"secure-threshold: only {len(nodes)} nodes were left after the {stage} stage "
                f"of {self.step.label}, fewer than the threshold {self.t}; nothing was released "
                f"(lost there: {lost})")

    # ----- the protocol ----------------------------------------------------------------------
    def run(self) -> SecureOutcome:
        base = {"round": self.round_id}
        params = self.arrays.get(DISTRIBUTED_KEY)
        setup = {**base, "step": self.step.to_json(), "threshold": self.t,
                 "history-labels": list(self.history), "history-rho": [
                     float(r) for r in self.history.values()], **self.arrays}
        keys = self._send("setup", {n: setup for n in self.nodes})
        self._check_keys(keys)
        layout = own_layout(self.step, params)
        u1 = sorted(keys)
        self._enough(u1, "setup")
        c_pks, s_pks = [keys[n]["c-pk"] for n in u1], [keys[n]["s-pk"] for n in u1]
        shared = self._send("share-keys", {n: {
            **base, "nodes": u1, "c-pks": c_pks, "s-pks": s_pks,
            "layout": json.dumps(layout.to_json())} for n in u1})
        held: dict[int, dict[int, bytes]] = {n: {} for n in u1}  # holder: {owner: ciphertext}
        digests: dict[int, bytes] = {}
        for n, reply in sorted(shared.items()):
            try:
                dst = [int(v) for v in reply["dst"]]
                texts = [bytes(c) for c in reply["ciphertexts"]]
                if sorted(dst) != [v for v in u1 if v != n] or len(texts) != len(dst):
                    raise ValueError("shares not addressed to every other node")
                digests[n] = bytes(reply["seed-digest"])
            except Exception as err:  # noqa: BLE001 -- anything a broken node sends
                self._drop(n, "share-keys", f"malformed reply: {err!r}")
                continue
            for v, text in zip(dst, texts, strict=True):
                held[v][n] = text
        u2 = sorted(digests)
        self._enough(u2, "share-keys")
        masked = self._send("collect", {n: {
            **base, "src": [v for v in u2 if v != n],
            "ciphertexts": [held[n][v] for v in u2 if v != n]} for n in u2})
        moduli = layout.moduli()
        vectors: dict[int, np.ndarray] = {}
        for n, reply in sorted(masked.items()):
            y = np.asarray(reply.get("masked", np.zeros(0)))
            if y.dtype != np.uint64 or y.shape != (layout.size,) or np.any(y > moduli):
                self._drop(n, "collect", f"masked vector {y.dtype} {y.shape} is not the layout's")
                continue
            vectors[n] = y
        u3 = sorted(vectors)
        self._enough(u3, "collect")
        dropped = [n for n in u2 if n not in vectors]
        revealed = self._send("unmask", {n: {**base, "active": u3, "dropped": dropped}
                                         for n in u3})
        total = self._unmask(layout, u1, s_pks, u3, dropped, vectors, revealed, digests)
        n_users, n_clipped = read_counts(layout.split(total)[COUNTS])
        totals = {k: v for k, v in layout.split(total).items() if k != COUNTS}
        contrib = UserContribution(totals, n_users, n_clipped)
        return SecureOutcome(contrib, u3, self.failures, self.sent, self.received,
                             self.seconds)

    def _check_keys(self, keys: dict[int, Mapping[str, Any]]) -> None:
        """Leave out of the round a node whose setup reply holds unusable public keys."""
        for n, reply in sorted(keys.items()):
            try:
                C.public_key(bytes(reply["c-pk"]))
                C.public_key(bytes(reply["s-pk"]))
            except Exception as err:  # noqa: BLE001
                self._drop(n, "setup", f"malformed keys: {err!r}")
                keys.pop(n)

    def _unmask(self, layout: C.Layout, u1: list[int], s_pks: list[bytes], u3: list[int],
                dropped: list[int], vectors: Mapping[int, np.ndarray],
                revealed: Mapping[int, Mapping[str, Any]], digests: Mapping[int, bytes],
                ) -> np.ndarray:
        """The sum over ``u3`` without masks, from ``t`` nodes' revealed shares."""
        seed_shares: dict[int, list[bytes]] = {v: [] for v in u3}
        key_shares: dict[int, list[bytes]] = {v: [] for v in dropped}
        for n, reply in sorted(revealed.items()):
            try:
                if [int(v) for v in reply["seed-of"]] != u3 or [
                        int(v) for v in reply["key-of"]] != dropped:
                    raise ValueError("shares for other nodes than asked")
                seeds = [bytes(s) for s in reply["seed-shares"]]
                keys = [bytes(s) for s in reply["key-shares"]]
            except Exception as err:  # noqa: BLE001
                self._drop(n, "unmask", f"malformed shares: {err!r}")
                continue
            if len(seeds) != len(u3) or len(keys) != len(dropped):
                self._drop(n, "unmask", "shares for other nodes than asked")
                continue
            for v, s in zip(u3, seeds, strict=True):
                seed_shares[v].append(s)
            for v, s in zip(dropped, keys, strict=True):
                key_shares[v].append(s)
        self._enough([n for n in revealed if n not in self.failures], "unmask")
        total = np.zeros(layout.size, dtype=np.uint64)
        for n in u3:
            total = C.add(total, vectors[n], layout)
        for v in u3:
            seed = C.combine_shares(seed_shares[v][:self.t])
            if C.digest(seed) != digests[v]:
                raise SecureAggregationError(f"{self.step.label}: node {v}'s mask seed did not "
                                             "reconstruct (inconsistent shares)")
            total = C.add(total, C.mask(seed, layout), layout, -1)
        purpose = b"pair/" + self.round_id
        for v in dropped:
            sk_bytes, pk = C.key_pair_from_seed(C.combine_shares(key_shares[v][:self.t]))
            sk = C.private_key(sk_bytes)
            if pk != s_pks[u1.index(v)]:
                raise SecureAggregationError(f"{self.step.label}: dropped node {v}'s mask key "
                                             "did not reconstruct (inconsistent shares)")
            for u in u3:
                pair = C.mask(C.agree(sk, s_pks[u1.index(u)], purpose), layout)
                total = C.add(total, pair, layout, -pair_sign(u, v))
        return total
