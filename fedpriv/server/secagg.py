"""The server's side of secure aggregation (``aggregation = "secure"``): it sees only the sum.

One round of SecAgg+ (Bell et al. 2020; SecAgg of Bonawitz et al. 2017 when the graph is
complete) for one step, on fedpriv's own messages, whatever carries them (``Send``: Flower's
Grid, or direct calls in process). Each node shares with its neighbours of the round's graph
(``fedpriv.secagg.graph``: all other nodes below 64 nodes):

1. **setup**: the step, its broadcast and share parameters, ``k`` and ``t``, the ledger so far.
   Each node checks the round against the run's plan, computes its noisy share and answers two
   fresh public keys (U1: the nodes that answered).
2. **share-keys**: U1 as a bitmap, the beacon nodes' keys and each node's neighbours' keys;
   each node recomputes its neighbours, Shamir-shares its mask seed and its mask key among
   itself and them (threshold ``t``), encrypted for each holder (U2: those that answered).
3. **collect**: each node gets the ciphertexts held for it and sends its vector masked (U3).
4. **unmask**: each node learns which of its neighbours are active (U3) and dropped (U2 minus
   U3) and the survivor count; it checks that no node is both, that at least ``t`` of its
   neighbourhood are active and the round above its minimum, then reveals its shares of the
   active nodes' seeds and of the dropped nodes' mask keys. With ``t`` shares of each the
   server removes the masks: the sum over U3 of the nodes' vectors, and nothing else.

**Keys ahead**: the unmask request also fixes the next round's id, and every node of the run
answers two fresh public keys for it (a node not in U3 is asked for those alone and reveals
nothing: ``keys-only``). The next round (``ahead``) then sends the setup with stage 2's key list
and each node answers stage 2 at once: three exchanges a round after the first.

Threat model: an honest-but-curious server (it follows the protocol and forwards messages
faithfully, but reads everything it receives), no Sybil nodes, and at most
``floor(collusion-threshold * K)`` nodes colluding with it (``check_threshold``: with the
complete graph ``t`` exceeds them; with neighbourhoods the failure bounds of the graph hold). A
round with fewer than its minimum left at any stage, or a secret with fewer than ``t`` shares,
cannot be unmasked: the run stops there (``SecureAggregationError``), its checkpoint intact for
``resume``.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.config import ConfigError, RunConfig
from fedpriv.secagg import crypto as C
from fedpriv.secagg import graph as G
from fedpriv.secagg import shamir
from fedpriv.secagg.node import COUNTS, Failure, own_layout, pair_sign, read_counts
from fedpriv.shares import DISTRIBUTED_KEY

STAGES = ("setup", "share-keys", "collect", "unmask")
EXCHANGES = 3  # a round's message exchanges from the run's second secure round on (keys ahead)


Reply = Mapping[str, Any] | Failure
# (stage, {node: message}) -> {node: reply}; a node missing from the result did not answer
Send = Callable[[str, Mapping[int, Mapping[str, Any]]], Mapping[int, Reply]]


class SecureAggregationError(RuntimeError):
    """Too few nodes were left to unmask a round: nothing of it was released."""


def check_threshold(config: RunConfig, nodes: int) -> G.GraphPlan:
    """The run's neighbourhoods and threshold, or a ``ConfigError`` naming the key, before
    round 1 (``fedpriv.secagg.graph.check``)."""
    if nodes < 2:
        raise ConfigError(f"aggregation: secure aggregation needs at least 2 nodes, the run has "
                          f"{nodes} (set users-per-node so that num-users makes several nodes)")
    return G.check(config, nodes)


@dataclass(frozen=True)
class KeysAhead:
    """The public keys nodes advertised for the next secure round (in this round's unmask
    stage), under the round id the server fixed before they were made."""

    round_id: bytes
    keys: dict[int, Mapping[str, Any]]  # node: {"c-pk", "s-pk"}


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
    ahead: KeysAhead | None = None  # the next secure round's keys (``SecureRound(ahead=)``)


def _unusable_keys(keys: dict[int, Mapping[str, Any]]) -> dict[int, str]:
    """Take out of ``keys`` the nodes whose public keys are unusable (not 32 bytes, or a point
    no agreement works with: their neighbours would fail on them); {node: why}."""
    probe = C.key_pair()[0]
    out: dict[int, str] = {}
    for n, reply in sorted(keys.items()):
        try:
            C.agree(probe, bytes(reply["c-pk"]), b"probe")
            C.agree(probe, bytes(reply["s-pk"]), b"probe")
        except Exception as err:  # noqa: BLE001
            out[n] = f"malformed keys: {err!r}"
            keys.pop(n)
    return out


def _has_keys(reply: Mapping[str, Any]) -> bool:
    """Whether an unmask reply carries two 32-byte public keys for the next round (a node that
    sends other values sits the next round out; ``_check_keys`` tests them as points)."""
    pair = (reply.get("next-c-pk"), reply.get("next-s-pk"))
    return all(isinstance(k, (bytes, bytearray)) and len(k) == C.KEY_BYTES for k in pair)


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
                 nodes: Sequence[int], plan: G.GraphPlan, history: Mapping[str, float],
                 log: Callable[[str], None] = print, count: int | None = None,
                 ahead: KeysAhead | None = None) -> None:
        """``count``: the run's node count (the node list's bitmap size; the nodes check it),
        by default the largest node id plus one. ``ahead``: the keys the nodes advertised in
        the last secure round (its outcome's ``ahead``): the setup then carries the key list
        and the round takes three exchanges; a node without keys there sits this round out."""
        self.send_fn, self.step, self.arrays = send, step, dict(arrays)
        self.nodes, self.history, self.log = list(nodes), dict(history), log
        self.count = count if count is not None else max(self.nodes) + 1
        self.plan, self.t = plan, plan.t
        self.ahead = ahead
        self.round_id = ahead.round_id if ahead is not None else secrets.token_bytes(16)
        self.failures: dict[int, tuple[str, str, str]] = {}
        self.sent = self.received = 0
        self.seconds: dict[str, float] = {}

    # ----- transport -------------------------------------------------------------------------
    def _send(self, stage: str, messages: Mapping[int, Mapping[str, Any]],
              aside: frozenset[int] = frozenset()) -> dict[int, Mapping[str, Any]]:
        """The replies of the nodes that answered; a failure of a node in ``aside`` (asked
        only for its next keys) is not this round's."""
        started = time.perf_counter()
        self.sent += sum(payload_bytes(m) for m in messages.values())
        replies = self.send_fn(stage, messages)
        self.seconds[stage] = time.perf_counter() - started
        good: dict[int, Mapping[str, Any]] = {}
        for node in messages:
            reply = replies.get(node, Failure("timeout", "no reply before the timeout"))
            if isinstance(reply, Failure):
                if node not in aside:
                    self.failures[node] = (stage, reply.kind, reply.detail)
            else:
                self.received += payload_bytes(reply)
                good[node] = reply
        return good

    def _drop(self, node: int, stage: str, detail: str) -> None:
        self.failures[node] = (stage, "malformed", detail[:300])

    def _enough(self, nodes: Sequence[int], stage: str) -> None:
        """Stop the round (nothing released) with too few nodes left after ``stage``: the
        ring's drawn floor after the setup, the round's minimum after the others."""
        floor = self.plan.drawn if stage == "setup" else self.plan.minimum
        if len(nodes) < floor:
            lost = {n: f"{k}: {d}" for n, (s, k, d) in self.failures.items() if s == stage}
            raise SecureAggregationError(
                f"secure-threshold: only {len(nodes)} nodes were left after the {stage} stage "
                f"of {self.step.label}, fewer than the round's minimum {floor}"
                + (" (the neighbourhoods are drawn over at least all but secure-dropout of "
                   "the nodes)" if floor > self.plan.minimum else "")
                + f"; nothing was released (lost there: {lost})")

    # ----- the protocol ----------------------------------------------------------------------
    def run(self) -> SecureOutcome:
        ahead_keys = self._keys_ahead()  # first: a full setup instead takes a fresh round id
        base = {"round": self.round_id}
        params = self.arrays.get(DISTRIBUTED_KEY)
        setup = {**base, "step": self.step.to_json(), "threshold": self.t,
                 "neighbours": self.plan.k, "history-labels": list(self.history),
                 "history-rho": [float(r) for r in self.history.values()], **self.arrays}
        keys = ahead_keys
        if keys is None:  # a full setup: fresh keys from every node
            keys = self._send("setup", {n: setup for n in self.nodes})
            self._check_keys(keys)
        layout = own_layout(self.step, params)
        u1 = sorted(keys)
        self._enough(u1, "setup")
        beacon = [bytes(keys[n]["c-pk"]) for n in u1[:G.BEACON]]
        order = G.ring(u1, G.graph_seed(self.round_id, u1, beacon))
        peers = G.all_neighbours(order, self.plan.k)
        self.peers = peers
        listed = G.bitmap(u1, self.count)
        share = {n: {**base, "nodes": listed, "beacon": beacon, "peers": peers[n],
                     "c-pks": [keys[v]["c-pk"] for v in peers[n]],
                     "s-pks": [keys[v]["s-pk"] for v in peers[n]],
                     "layout": json.dumps(layout.to_json())} for n in u1}
        if self.ahead is None:
            stage2 = "share-keys"
            shared = self._send(stage2, share)
        else:  # stages 1 and 2 in one message: the setup with the key list
            stage2 = "setup"
            shared = self._send(stage2, {n: {**setup, **share[n]} for n in u1})
        held: dict[int, dict[int, bytes]] = {n: {} for n in u1}  # holder: {owner: ciphertext}
        digests: dict[int, bytes] = {}
        for n, reply in sorted(shared.items()):
            if self.ahead is not None and reply.get("no-keys"):  # its state was lost
                self.failures[n] = ("setup", "unavailable", "no longer holds the keys it "
                                    "advertised (its state was not kept)")
                continue
            try:
                dst = [int(v) for v in reply["dst"]]
                texts = [bytes(c) for c in reply["ciphertexts"]]
                if dst != peers[n] or len(texts) != len(dst):
                    raise ValueError("shares not addressed to every neighbour")
                digests[n] = bytes(reply["seed-digest"])
            except Exception as err:  # noqa: BLE001 -- anything a broken node sends
                self._drop(n, stage2, f"malformed reply: {err!r}")
                continue
            for v, text in zip(dst, texts, strict=True):
                held[v][n] = text
        u2 = sorted(digests)
        # with keys ahead, a node lost at the setup is inside the ring: at most as many as a
        # full setup may lose before the ring is drawn (the setup's drawn floor), else no release
        self._enough(u2, stage2)
        in_u2 = set(u2)
        masked = self._send("collect", {n: {
            **base, "src": [v for v in peers[n] if v in in_u2],
            "ciphertexts": [held[n][v] for v in peers[n] if v in in_u2]} for n in u2})
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
        dropped = {n for n in u2 if n not in vectors}
        asked = {n: {"active": [v for v in sorted([n, *peers[n]]) if v in vectors],
                     "dropped": [v for v in peers[n] if v in dropped]} for n in u3}
        # every node of the run is asked for its keys of the next round (fixing its id now):
        # the survivors with their shares, the others alone (they reveal nothing)
        next_id = secrets.token_bytes(16)
        others = frozenset(n for n in self.nodes if n not in asked)
        unmasking = {n: {**base, **asked[n], "survivors": len(u3), "next-round": next_id}
                     for n in u3}
        unmasking.update({n: {**base, "keys-only": True, "next-round": next_id}
                          for n in sorted(others)})
        replies = self._send("unmask", unmasking, aside=others)
        revealed = {n: r for n, r in replies.items() if n in asked}
        total = self._unmask(layout, {n: bytes(keys[n]["s-pk"]) for n in u1}, u3,
                             sorted(dropped), vectors, asked, revealed, digests)
        ahead = KeysAhead(next_id, {n: {"c-pk": bytes(r["next-c-pk"]),
                                        "s-pk": bytes(r["next-s-pk"])}
                                    for n, r in replies.items() if _has_keys(r)})
        n_users, n_clipped = read_counts(layout.split(total)[COUNTS])
        totals = {k: v for k, v in layout.split(total).items() if k != COUNTS}
        contrib = UserContribution(totals, n_users, n_clipped)
        return SecureOutcome(contrib, u3, self.failures, self.sent, self.received,
                             self.seconds, ahead)

    def _keys_ahead(self) -> dict[int, Mapping[str, Any]] | None:
        """The usable keys the nodes advertised for this round, or None for a full setup:
        none given, or too few usable (fewer than the ring's drawn floor: a lost unmask
        stage must not stop a run whose nodes are there), then under a fresh round id."""
        if self.ahead is None:
            return None
        keys = {n: self.ahead.keys[n] for n in self.nodes if n in self.ahead.keys}
        unusable = _unusable_keys(keys)
        if len(keys) < self.plan.drawn:
            self.log(f"  {self.step.label}: {len(keys)} nodes advertised usable keys, fewer "
                     f"than {self.plan.drawn}: a full setup")
            self.ahead, self.round_id = None, secrets.token_bytes(16)
            return None
        for n, detail in unusable.items():
            self._drop(n, "setup", detail)
        for n in self.nodes:
            if n not in keys and n not in self.failures:
                self.failures[n] = ("setup", "timeout", "no usable keys advertised for this "
                                    "round (none in its answer to the last unmask stage)")
        return keys

    def _check_keys(self, keys: dict[int, Mapping[str, Any]]) -> None:
        """Leave out of the round a node whose setup reply holds unusable public keys."""
        for n, detail in _unusable_keys(keys).items():
            self._drop(n, "setup", detail)

    def _unmask(self, layout: C.Layout, s_pks: Mapping[int, bytes], u3: list[int],
                dropped: list[int], vectors: Mapping[int, np.ndarray],
                asked: Mapping[int, Mapping[str, list[int]]],
                revealed: Mapping[int, Mapping[str, Any]], digests: Mapping[int, bytes],
                ) -> np.ndarray:
        """The sum over ``u3`` without masks: each node's secret from the first ``t`` shares
        its neighbourhood revealed (Lagrange weights shared by every secret rebuilt from the
        same points)."""
        seed_shares: dict[int, list[bytes]] = {v: [] for v in u3}
        key_shares: dict[int, list[bytes]] = {v: [] for v in dropped}
        for n, reply in sorted(revealed.items()):
            asked_seed, asked_key = asked[n]["active"], asked[n]["dropped"]
            try:
                if [int(v) for v in reply["seed-of"]] != asked_seed or [
                        int(v) for v in reply["key-of"]] != asked_key:
                    raise ValueError("shares for other nodes than asked")
                seeds = [bytes(s) for s in reply["seed-shares"]]
                keys = [bytes(s) for s in reply["key-shares"]]
                if len(seeds) != len(asked_seed) or len(keys) != len(asked_key):
                    raise ValueError("shares for other nodes than asked")
            except Exception as err:  # noqa: BLE001
                self._drop(n, "unmask", f"malformed shares: {err!r}")
                continue
            for v, s in zip(asked_seed, seeds, strict=True):
                seed_shares[v].append(s)
            for v, s in zip(asked_key, keys, strict=True):
                key_shares[v].append(s)
        self._enough([n for n in revealed if n not in self.failures], "unmask")
        total = np.zeros(layout.size, dtype=np.uint64)  # wraps modulo 2^64: reduced at the end
        for n in u3:
            total += vectors[n]
        for v in u3:
            seed = self._rebuild(v, seed_shares[v], "mask seed")
            if C.digest(seed) != digests[v]:
                raise SecureAggregationError(f"{self.step.label}: node {v}'s mask seed did not "
                                             "reconstruct (inconsistent shares)")
            total -= C.mask(seed, layout)
        purpose = b"pair/" + self.round_id
        alive = set(u3)
        for v in dropped:
            sk_bytes, pk = C.key_pair_from_seed(self._rebuild(v, key_shares[v], "mask key"))
            if pk != s_pks[v]:
                raise SecureAggregationError(f"{self.step.label}: dropped node {v}'s mask key "
                                             "did not reconstruct (inconsistent shares)")
            sk = C.private_key(sk_bytes)
            for u in self.peers[v]:
                if u in alive:
                    pair = C.mask(C.agree(sk, s_pks[u], purpose), layout)
                    if pair_sign(u, v) > 0:
                        total -= pair
                    else:
                        total += pair
        reduced: np.ndarray = total & layout.moduli()
        return reduced

    def _rebuild(self, owner: int, shares: list[bytes], what: str) -> bytes:
        """A node's secret from the first ``t`` of its shares (by point)."""
        if len(shares) < self.t:
            raise SecureAggregationError(
                f"{self.step.label}: only {len(shares)} shares of node {owner}'s {what} were "
                f"revealed, fewer than the threshold {self.t}; nothing was released "
                "(secure-dropout: more of its neighbours dropped than the graph was sized for)")
        try:
            return shamir.combine(sorted(shares, key=shamir.point)[:self.t])
        except ValueError:
            raise SecureAggregationError(f"{self.step.label}: node {owner}'s {what} did not "
                                         "reconstruct (inconsistent shares)") from None
