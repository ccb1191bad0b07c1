"""SecAgg+'s neighbourhoods (Bell et al. 2020): who shares keys and masks with whom, and with
what threshold, so that a round is private and completes with a stated failure probability.

The graph is a ring of the round's nodes (those that answered the setup stage, U1) in a random
order, each node joined to the ``k / 2`` nodes on either side (the Harary graph of Flower's
``SecAggPlusWorkflow``). The order is not the server's choice alone: it is drawn from
the ChaCha20 keystream of a seed, a hash of the round id (the server's, sent before any node
answers), the node list and the fresh public keys of the first ``BEACON`` nodes of U1 (made by
those nodes after the round id was fixed). Every node computes its own neighbours; the server
forwards only their keys, so a node's messages grow with ``k``, not with the node count (the
node list travels as a bitmap, ``K / 8`` bytes).

A node's two secrets are Shamir-shared among itself and its ``k`` neighbours with threshold
``t``. With ``C`` colluding and ``D`` dropping nodes placed independently of the order, a round
fails (union bounds over the nodes, ``plan_failures``):

* privacy, if some node has ``t`` or more colluders among its neighbours (they would rebuild
  both its secrets), or if ``k / 2`` consecutive nodes of the ring are all colluding or
  dropped (only then can the honest survivors split into groups whose partial sums the server
  could unmask); target ``PRIVACY_FAILURE`` a round;
* to complete, if some node has more than ``k - t`` of its neighbours dropped (its secret
  could not be rebuilt); target ``COMPLETION_FAILURE`` a round.

``plan`` picks the smallest even ``k`` (and for it the smallest ``t``) meeting both; where that
is more than half of ``K - 1``, or for fewer than ``RING_FROM`` nodes, the complete graph with
the majority threshold (``complete_threshold``) is used instead: its guarantees
hold with certainty and it survives any minority of dropouts, whatever the declared fractions,
at a cost that is small at that size.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedpriv.config import ConfigError, RunConfig

PRIVACY_FAILURE = 2.0 ** -40
COMPLETION_FAILURE = 2.0 ** -20
BEACON = 8
RING_FROM = 64  # automatic neighbourhoods from this many nodes; the complete graph below


@dataclass(frozen=True)
class GraphPlan:
    """A round's neighbourhood size ``k`` (``nodes - 1``: the complete graph), the Shamir
    threshold ``t`` within a neighbourhood, the fewest survivors a round is unmasked with,
    the failure probabilities the choice was made for (0 for the complete graph) and the
    fewest nodes the graph is drawn over (a ring: all but the declared dropouts)."""

    k: int
    t: int
    minimum: int
    privacy_failure: float
    completion_failure: float
    drawn: int  # the fewest nodes the graph may be drawn over (U1)

    def complete(self, nodes: int) -> bool:
        return self.k >= nodes - 1


def _tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """P[X >= at_least] for X hypergeometric: ``draws`` of ``population``, ``marked`` marked."""
    if at_least <= 0:
        return 1.0
    top = min(marked, draws)
    if at_least > top:
        return 0.0
    hits = sum(math.comb(marked, i) * math.comb(population - marked, draws - i)
               for i in range(at_least, top + 1))
    return hits / math.comb(population, draws)


def plan_failures(nodes: int, colluders: int, dropouts: int, k: int, t: int
                  ) -> tuple[float, float]:
    """(privacy, completion) failure bounds of a round of ``nodes`` with neighbourhoods of
    ``k`` and threshold ``t``, ``colluders`` and ``dropouts`` placed independently of the
    ring's order, the ring drawn over at least ``nodes - dropouts`` of them (some may drop
    before it is drawn: colluders do not, so a node's neighbours are drawn from a pool of
    ``nodes - dropouts - 1`` in the worst case; a run of ``k / 2`` bad nodes is likeliest when
    none dropped before). The complete graph: 0 or 1 (the guarantees are deterministic)."""
    if k >= nodes - 1:
        private = colluders < t
        completes = nodes - dropouts >= t
        return (0.0 if private else 1.0), (0.0 if completes else 1.0)
    peers, half = nodes - 1, k // 2
    pool = max(nodes - dropouts - 1, k)
    leak = nodes * _tail(pool, min(colluders, pool), k, t)
    bad = min(colluders + dropouts, nodes)
    leak += nodes * math.comb(bad, half) / math.comb(nodes, half)
    stuck = nodes * _tail(peers, dropouts, k, k - t + 1)
    return min(leak, 1.0), min(stuck, 1.0)


@lru_cache(maxsize=256)
def _plan(nodes: int, colluders: int, dropouts: int, k: int, t: int, majority: int
          ) -> GraphPlan:
    """``majority``: the fewest survivors of a round (and the complete graph's threshold when
    ``t`` is 0); a ring is drawn over at least ``nodes - dropouts``."""
    drawn = max(nodes - dropouts, majority)
    if k == 0:  # automatic: the smallest even k that meets both targets, if it halves K - 1
        for k_try in range(2, (nodes - 1) // 2 + 1 if nodes >= RING_FROM else 2, 2):
            for t_try in range(2, k_try + 2):
                leak, stuck = plan_failures(nodes, colluders, dropouts, k_try, t_try)
                if leak <= PRIVACY_FAILURE:
                    if stuck <= COMPLETION_FAILURE:
                        return GraphPlan(k_try, t_try, majority, leak, stuck, drawn)
                    break  # a larger t only makes completion harder
        return GraphPlan(nodes - 1, majority, majority, 0.0, 0.0, majority)
    if k >= nodes - 1:
        return GraphPlan(nodes - 1, t or majority, t or majority, 0.0, 0.0, t or majority)
    if t == 0:
        t = next((t_try for t_try in range(2, k + 2) if plan_failures(
            nodes, colluders, dropouts, k, t_try)[0] <= PRIVACY_FAILURE), k + 1)
    leak, stuck = plan_failures(nodes, colluders, dropouts, k, t)
    return GraphPlan(k, t, majority, leak, stuck, drawn)


def majority(config: RunConfig, nodes: int) -> int:
    """A majority of the nodes, and always more than the nodes that may collude (at least 2)."""
    return max(nodes // 2 + 1, math.floor(config.collusion_threshold * nodes) + 1, 2)


def complete_threshold(config: RunConfig, nodes: int) -> int:
    """The Shamir threshold of the complete graph: ``secure-threshold``, or by default
    ``majority``."""
    return config.secure_threshold or majority(config, nodes)


def plan(config: RunConfig, nodes: int) -> GraphPlan:
    """The run's neighbourhoods for ``nodes`` nodes (``secure-neighbours``,
    ``secure-threshold``, ``collusion-threshold``, ``secure-dropout``); no check (``check``)."""
    colluders = math.floor(config.collusion_threshold * nodes)
    dropouts = math.floor(config.secure_dropout * nodes)
    k = config.secure_neighbours
    if k == 0 and config.secure_threshold:  # a threshold alone: the complete graph
        k = nodes - 1
    if k >= nodes - 1:
        return _plan(nodes, colluders, dropouts, k, 0, complete_threshold(config, nodes))
    return _plan(nodes, colluders, dropouts, k, config.secure_threshold,
                 majority(config, nodes))


def check(config: RunConfig, nodes: int) -> GraphPlan:
    """The plan, or a ``ConfigError`` naming the key (before round 1): a complete graph's
    threshold the nodes cannot meet or that colluders reach; neighbourhoods that miss the
    failure targets."""
    p = plan(config, nodes)
    if p.complete(nodes):
        colluders = math.floor(config.collusion_threshold * nodes)
        if p.t > nodes:
            raise ConfigError(f"secure-threshold: {p.t} exceeds the number of nodes ({nodes}): "
                              "no round could be unmasked")
        if p.t <= colluders or p.t < 2:
            raise ConfigError(f"secure-threshold: {p.t} must exceed the nodes that may collude "
                              f"with the server (floor(collusion-threshold * {nodes}) = "
                              f"{colluders}) and be at least 2, or they could unmask a single "
                              "node's vector")
        return p
    if p.k % 2 or p.k < 2:
        raise ConfigError(f"secure-neighbours: {p.k} must be an even number >= 2 (each node "
                          "takes k / 2 neighbours on either side of the ring)")
    if not 2 <= p.t <= p.k + 1:
        raise ConfigError(f"secure-threshold: {p.t} outside [2, {p.k + 1}] (a node's secrets "
                          f"are shared among itself and its {p.k} neighbours)")
    key = "secure-threshold" if config.secure_threshold else "secure-neighbours"
    if p.privacy_failure > PRIVACY_FAILURE:
        raise ConfigError(
            f"{key}: neighbourhoods of {p.k} with threshold {p.t} over {nodes} nodes leave a "
            f"privacy failure probability of {p.privacy_failure:.3g} a round (colluders: "
            f"collusion-threshold; target {PRIVACY_FAILURE:.3g}); raise secure-neighbours or "
            "secure-threshold, or set both to 0 (automatic)")
    if p.completion_failure > COMPLETION_FAILURE:
        raise ConfigError(
            f"{key}: neighbourhoods of {p.k} with threshold {p.t} over {nodes} nodes fail to "
            f"complete with probability {p.completion_failure:.3g} a round when "
            f"secure-dropout = {config.secure_dropout:g} of them drop (target "
            f"{COMPLETION_FAILURE:.3g}); raise secure-neighbours or lower secure-threshold")
    return p


# ----- the ring ------------------------------------------------------------------------------
def bitmap(members: Sequence[int], nodes: int) -> np.ndarray:
    """``members`` of ``range(nodes)`` as a packed bitmap (``nodes / 8`` bytes)."""
    bits = np.zeros(nodes, dtype=bool)
    bits[np.asarray(members, dtype=np.int64)] = True
    packed: np.ndarray = np.packbits(bits)
    return packed


def members(packed: np.ndarray, nodes: int) -> list[int]:
    """The node list of a bitmap (``ValueError`` if it is not one of ``range(nodes)``)."""
    raw = np.asarray(packed)
    if raw.dtype != np.uint8 or raw.shape != ((nodes + 7) // 8,):
        raise ValueError(f"a node bitmap of {nodes} nodes has {(nodes + 7) // 8} bytes")
    bits = np.unpackbits(raw)
    if bits[nodes:].any():
        raise ValueError("the node bitmap names nodes outside the run")
    return [int(v) for v in np.flatnonzero(bits[:nodes])]


def graph_seed(round_id: bytes, u1: Sequence[int], beacon: Sequence[bytes]) -> bytes:
    """The seed of the ring's order: the round id, the node list and the beacon nodes' keys."""
    h = hashlib.sha256(b"fedpriv-secagg/graph")
    for part in (round_id, np.asarray(u1, dtype="<i8").tobytes(), *beacon):
        h.update(len(part).to_bytes(8, "little") + bytes(part))
    return h.digest()


def ring(u1: Sequence[int], seed: bytes) -> list[int]:
    """The nodes of ``u1`` (ascending) in the ring's order: sorted by 64-bit keys from the
    ChaCha20 keystream of ``seed``, one a node."""
    ids = np.asarray(u1, dtype=np.int64)
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    keys = np.frombuffer(stream.update(bytes(8 * ids.size)), dtype="<u8")
    return [int(v) for v in ids[np.argsort(keys, kind="stable")]]


def _around(order: Sequence[int], at: int, k: int) -> list[int]:
    """The neighbours of the node at position ``at`` of the ring ``order``, in ascending id:
    ``k / 2`` on either side, or every other node when ``k >= len - 1``."""
    n = len(order)
    if k >= n - 1:
        return sorted(v for i, v in enumerate(order) if i != at)
    return sorted(order[(at + o) % n] for o in range(-(k // 2), k // 2 + 1) if o)


def neighbours(order: Sequence[int], k: int, node: int) -> list[int]:
    """``node``'s neighbours on the ring ``order``."""
    return _around(order, list(order).index(node), k)


def all_neighbours(order: Sequence[int], k: int) -> dict[int, list[int]]:
    """Every node's neighbours (the server's view of the whole graph)."""
    return {v: _around(order, i, k) for i, v in enumerate(order)}
