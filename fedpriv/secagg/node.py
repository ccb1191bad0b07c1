"""A node's side of secure aggregation: check the round's plan, then the four SecAgg stages
(stages 1 and 2 in one message when the node advertised its keys in the last round's stage 4).

Each stage is a function of the node's state (kept between a round's messages: Flower's
``context.state`` on a SuperNode, a dict in process) and of the server's message; it returns
the reply. The node's contribution is computed in the setup stage (``compute``: the node's users'
step, ``fedpriv.nodes.node_step``, which quantizes it and adds the node's noise share), kept
on the node, and leaves it only masked: ``x + PRG(b_u) + sum_v +-PRG(s_uv)`` over its
neighbours ``v`` modulo each part's ``2^bits`` (Bonawitz et al. 2017; Bell et al. 2020: the
node computes its neighbours itself, ``fedpriv.secagg.graph``, and refuses another list).
The node's user count (the public one: ``fedpriv.nodes.public_reply``) travels in the same
masked vector (modulo ``2^62``), never in plain; a metrics step is never secure-aggregated
(its nodes send no exact metrics).

Before it contributes, the node checks the round against the run's declared plan
(``check_round``): the noise share, grid and modulus it recomputes from the run config and the
step; the budget: the epsilon of the releases so far (the server's ledger, which must agree
with what this node saw) and this one, which must stay within the ceiling. It refuses a round
that would lower its noise or exceed the budget, or whose neighbourhood size or threshold is
not the one the run config gives.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.privacy.accounting import DISCRETE_ACCOUNTANT, ZCDP, epsilon_of
from fedpriv.privacy.bounds import skellam_rho
from fedpriv.privacy.quantize import from_ring, padded_dim, to_ring
from fedpriv.secagg import crypto as C
from fedpriv.secagg import graph as G
from fedpriv.secagg import shamir
from fedpriv.shares import DISTRIBUTED_KEY

COUNT_BITS = 62  # the counts segment: modulo 2^62
COUNTS = "__counts__"


@dataclass(frozen=True)
class Failure:
    """What a transport got instead of a node's reply: the kind (one of the server's
    ``REJECTION_KINDS``) and why."""

    kind: str
    detail: str


class RoundRefused(ValueError):
    """The node will not take part in this round (a plan check or a protocol check failed)."""


# ----- the plan check ------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _multipliers(config_json: str) -> dict[str, float]:
    from fedpriv.configure import parse_config
    from fedpriv.evaluation import algorithm_for
    from fedpriv.server.release import calibrate

    config = parse_config(json.loads(config_json))
    plan = algorithm_for(config)(config).privacy_plan()
    return {r.name: z for r, z in zip(plan, calibrate(config, plan), strict=True)}


@lru_cache(maxsize=8)
def _groups(config_json: str) -> dict[str, tuple[int, ...] | None]:
    """{release label: the disjoint user groups it charges (None: every user)} of the run's
    steps, as the node computes them from the run config (the server's ``charge``)."""
    from fedpriv.configure import parse_config
    from fedpriv.evaluation import algorithm_for

    config = parse_config(json.loads(config_json))
    algorithm = algorithm_for(config)(config)
    out: dict[str, tuple[int, ...] | None] = {}
    for step in algorithm.steps():
        if step.release is not None:
            groups, _ = algorithm.charge(step)
            out[step.label] = None if groups is None else tuple(int(g) for g in groups)
    return out


def charged_epsilon(config: RunConfig, releases: Mapping[str, float]) -> float:
    """The epsilon of zCDP releases {label: rho}: each charged to the user groups the node's
    own step list gives it (a label it cannot place: to every user), the largest over groups."""
    from fedpriv.server.discrete import accounting_delta

    groups = _groups(json.dumps(config.to_mapping(), sort_keys=True, default=str))
    common: dict[tuple[float, float], int] = {}
    by_group: dict[int, dict[tuple[float, float], int]] = {}
    for label, rho in releases.items():
        key = (float(rho), ZCDP)
        charged = groups.get(label)
        if charged is None:
            common[key] = common.get(key, 0) + 1
        for g in charged or ():
            by_group.setdefault(g, {})[key] = by_group.setdefault(g, {}).get(key, 0) + 1
    delta, relation = accounting_delta(config), config.neighbouring_relation
    totals = [common] + [{k: common.get(k, 0) + by_group[g].get(k, 0)
                          for k in {*common, *by_group[g]}} for g in by_group]
    return max(epsilon_of(t, delta, DISCRETE_ACCOUNTANT, relation) for t in totals if t)


def planned_rho(config: RunConfig, nodes: int, step: Step, honest: int) -> float:
    """The zCDP rho of ``step`` when ``honest`` nodes' shares are in the sum, by the node's own
    calculation from the run config."""
    return float(sum(p.rho(honest) for p in expected_shares(config, nodes, step)))


def expected_shares(config: RunConfig, nodes: int, step: Step) -> list[Any]:
    """The share plans of ``step``'s parts as the node computes them (the server's
    ``share_plan`` from the config's calibrated multiplier)."""
    return _expected(json.dumps(config.to_mapping(), sort_keys=True, default=str), nodes,
                     step.to_json())


@lru_cache(maxsize=64)
def _expected(config_json: str, nodes: int, step_json: str) -> list[Any]:
    from fedpriv.configure import parse_config
    from fedpriv.server.discrete import share_plan

    config, step = parse_config(json.loads(config_json)), Step.from_json(step_json)
    if step.release is None:
        raise RoundRefused(f"{step.label} releases nothing with noise")
    z = _multipliers(config_json).get(step.release)
    if z is None:
        raise RoundRefused(f"{step.label}: release {step.release!r} is not in the run's plan")
    population = step.population or config.num_users
    return [share_plan(config, part, z / math.sqrt(part.share), population, nodes)
            for part in step.parts]


def check_round(config: RunConfig, nodes: int, step: Step, params: np.ndarray | None,
                history: Mapping[str, float], seen: Mapping[str, float]) -> float:
    """Refuse (``RoundRefused``) a round whose public parameters do not match the run's plan;
    returns the epsilon after it. ``params``: the server's share parameters (one row per part:
    granularity, node variance, bits). ``history``: the server's ledger so far {release label:
    rho}; ``seen``: the rounds this node took part in {label: rho by its own count}."""
    from fedpriv.server.discrete import honest_minimum

    if step.is_final:
        raise RoundRefused(f"{step.label}: a metrics step; this run's nodes send no exact "
                           "metrics")
    if params is None:
        raise RoundRefused(f"{step.label}: no noise-share parameters")
    expected = expected_shares(config, nodes, step)
    rows = np.asarray(params, dtype=np.float64)
    if rows.shape != (len(expected), 3):
        raise RoundRefused(f"{step.label}: {rows.shape[0] if rows.ndim else 0} share rows for "
                           f"{len(expected)} parts")
    for part, plan, (g, variance, bits) in zip(step.parts, expected, rows, strict=True):
        if g != plan.granularity or bits != plan.bits or not (
                variance >= plan.node_variance * (1.0 - 1e-12)):
            raise RoundRefused(
                f"{step.label}/{part.name}: the server asks for granularity {g:g}, share "
                f"variance {variance:.6g}, {bits:g} bits; the run's plan gives "
                f"{plan.granularity:g}, {plan.node_variance:.6g}, {plan.bits}")
    for label, rho in seen.items():
        if history.get(label, -1.0) < rho * (1.0 - 1e-9):
            raise RoundRefused(f"the server's ledger does not hold release {label} as this "
                               f"node saw it (rho {rho:.6g})")
    if step.label in history:
        raise RoundRefused(f"{step.label} was released already")
    this = planned_rho(config, nodes, step, honest_minimum(config, nodes))
    epsilon = charged_epsilon(config, {**history, step.label: this})
    if epsilon > config.ceiling * (1.0 + 1e-9):
        raise RoundRefused(f"{step.label} would bring epsilon to {epsilon:.6g}, above the "
                           f"run's ceiling {config.ceiling:g}")
    return epsilon


# ----- the stages ----------------------------------------------------------------------------
def counts_vector(contrib: UserContribution) -> np.ndarray:
    """The users and clipped users counts, modulo ``2^COUNT_BITS``."""
    ints = [int(contrib.num_users), int(contrib.num_clipped)]
    return to_ring(np.array(ints, dtype=np.int64), COUNT_BITS)


def read_counts(vector: np.ndarray) -> tuple[int, int]:
    """The summed counts back from the counts segment."""
    lifted = from_ring(np.asarray(vector, dtype=np.uint64), COUNT_BITS)
    return int(lifted[0]), int(lifted[1])


def own_layout(step: Step, params: np.ndarray | None) -> C.Layout:
    """The masked vector of ``step``: each noised part's ring vector, then the counts."""
    segments = []
    if params is not None:
        for part, row in zip(step.parts, np.asarray(params), strict=True):
            segments.append(C.Segment(part.name, padded_dim(int(np.prod(part.shape))),
                                      int(row[2])))
    segments.append(C.Segment(COUNTS, 2, COUNT_BITS))
    return C.Layout(tuple(segments))


def fresh_keys() -> dict[str, bytes]:
    """A round's two key pairs: ``c`` for the shares' encryption, ``s`` (from the seed
    ``s-seed``, which is what gets shared) for the pairwise masks."""
    c_sk, c_pk = C.key_pair()
    s_seed = secrets.token_bytes(C.SEED_BYTES)  # the mask key, shared as its seed
    s_sk, s_pk = C.key_pair_from_seed(s_seed)
    return {"c-sk": c_sk, "c-pk": c_pk, "s-sk": s_sk, "s-seed": s_seed, "s-pk": s_pk}


def advertise(state: dict[str, Any], next_round: bytes) -> dict[str, Any]:
    """Key pairs for the round ``next_round`` (its id fixed by the server before they exist,
    so it cannot pick the id after seeing them), kept for that round's setup alone; their
    public halves, for the server to forward then."""
    for key in [k for k in state if k.startswith("next/")]:
        del state[key]
    keys = fresh_keys()
    state.update({"next/id": bytes(next_round), **{f"next/{k}": v for k, v in keys.items()}})
    return {"next-c-pk": keys["c-pk"], "next-s-pk": keys["s-pk"]}


NO_KEYS = {"no-keys": True}
"""The reply to a key list when this node holds no advertised keys at all (its state was not
kept, e.g. a restarted SuperNode): lost like a node that did not answer, not refused."""


def _take_keys(state: dict[str, Any], msg: Mapping[str, Any]) -> dict[str, bytes] | None:
    """This round's key pairs: those advertised for it (a setup that brings the key list), or
    fresh ones; advertised keys serve one setup at most. None: no advertised keys held."""
    ahead = {k[len("next/"):]: state[k] for k in state if k.startswith("next/")}
    for key in [k for k in state if k.startswith("next/")]:
        del state[key]
    if "nodes" not in msg:
        return fresh_keys()
    if not ahead:
        return None
    if ahead.get("id") != bytes(msg["round"]):
        raise RoundRefused("the server sent the key list of a round this node advertised no "
                           "keys for")
    return {k: v for k, v in ahead.items() if k != "id"}


def setup(config: RunConfig, pid: int, nodes: int, state: dict[str, Any],
          msg: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
          compute: Callable[[Step, Mapping[str, np.ndarray]], UserContribution],
          ) -> dict[str, Any]:
    """Stage 1: check the round, compute the contribution, make this round's key pairs;
    reply the public keys. A metrics step is refused: its nodes send no exact metrics.
    With the keys this node advertised in the last round's unmask stage, the server sends the
    key list too (stage 2's message): the node then takes those keys and goes on with stage 2
    in the same reply (``share_keys``): three exchanges a round instead of four."""
    step = Step.from_json(str(msg["step"]))
    params = arrays.get(DISTRIBUTED_KEY)
    history = dict(zip(msg["history-labels"], msg["history-rho"], strict=True))
    seen = dict(zip(state.get("seen-labels", []), state.get("seen-rho", []), strict=True))
    graph = G.plan(config, nodes)
    t, k = int(msg["threshold"]), int(msg["neighbours"])
    if (t, k) != (graph.t, graph.k) or not 2 <= t <= min(k + 1, nodes):
        raise RoundRefused(f"threshold {t} with {k} neighbours is not the run's ({graph.t} "
                           f"with {graph.k} of {nodes} nodes)")
    for key in [k for k in state if k.startswith("round/")]:
        del state[key]  # a new round forgets the last one's secrets
    keys = _take_keys(state, msg)
    if keys is None:
        return dict(NO_KEYS)
    check_round(config, nodes, step, params, history, seen)
    plans = [[p.l2, p.l1, p.node_variance] for p in expected_shares(config, nodes, step)]
    contrib = compute(step, arrays)
    values = {COUNTS: counts_vector(contrib)}
    values.update({k: np.asarray(v).astype(np.uint64) for k, v in contrib.totals.items()})
    layout = own_layout(step, params)
    state.update({"round/id": bytes(msg["round"]), "round/step": str(msg["step"]),
                  "round/threshold": t, "round/k": k, "round/minimum": graph.minimum,
                  "round/drawn": graph.drawn, "round/layout": json.dumps(layout.to_json()),
                  **{f"round/{name}": value for name, value in keys.items()},
                  "round/vector": layout.join(values), "round/plans": json.dumps(plans)})
    if "nodes" in msg:
        return share_keys(pid, nodes, state, msg)
    return {"c-pk": keys["c-pk"], "s-pk": keys["s-pk"]}


def _check_round_id(state: Mapping[str, Any], msg: Mapping[str, Any]) -> None:
    if "round/id" not in state or bytes(msg["round"]) != state["round/id"]:
        raise RoundRefused("a message for a round this node has not set up")


def share_keys(pid: int, nodes: int, state: dict[str, Any], msg: Mapping[str, Any]
               ) -> dict[str, Any]:
    """Stage 2: the server names the nodes that answered stage 1 (U1, a bitmap), the beacon
    nodes' keys and this node's neighbours' keys; the node computes its neighbours itself
    (``fedpriv.secagg.graph``), refuses another list, and shares its mask seed ``b_u`` and its
    mask key ``s_sk`` among itself and them (Shamir, threshold t; a share's point is its
    holder's index in U1 plus one), each share encrypted for its holder. Once a round: shared
    again among other holders, its mask key could reach more colluders than the threshold."""
    _check_round_id(state, msg)
    if "round/peers" in state:  # set below, once a round
        raise RoundRefused("this node shared its keys for this round already")
    t, k = int(state["round/threshold"]), int(state["round/k"])
    if json.loads(str(msg["layout"])) != json.loads(state["round/layout"]):
        raise RoundRefused("the server's vector layout is not this node's")
    try:
        u1 = G.members(np.asarray(msg["nodes"]), nodes)
    except ValueError as err:
        raise RoundRefused(str(err)) from None
    if pid not in u1 or len(u1) < int(state["round/drawn"]):
        raise RoundRefused(f"the key list has {len(u1)} nodes (at least "
                           f"{state['round/drawn']} needed) or not this node")
    beacon = [bytes(b) for b in msg["beacon"]]
    if len(beacon) != min(G.BEACON, len(u1)) or (
            pid in u1[:G.BEACON] and beacon[u1.index(pid)] != state["round/c-pk"]):
        raise RoundRefused("the server forwarded other beacon keys than the nodes made")
    mine = G.neighbours(G.ring(u1, G.graph_seed(state["round/id"], u1, beacon)), k, pid)
    if [int(v) for v in msg["peers"]] != mine:
        raise RoundRefused("the server's neighbour list is not this round's graph")
    if len(mine) + 1 < t:
        raise RoundRefused(f"{len(mine)} neighbours cannot hold {t} shares")
    c_pks, s_pks = [bytes(b) for b in msg["c-pks"]], [bytes(b) for b in msg["s-pks"]]
    if len(c_pks) != len(mine) or len(s_pks) != len(mine):
        raise RoundRefused("a key missing for a neighbour")
    for v, c_pk in zip(mine, c_pks, strict=True):  # a beacon node that is also a neighbour
        if v in u1[:G.BEACON] and c_pk != beacon[u1.index(v)]:
            raise RoundRefused(f"the server forwarded two keys for node {v}")
    holders = sorted([pid, *mine])
    index = {v: i for i, v in enumerate(u1)}
    points = [index[h] + 1 for h in holders]
    seed = secrets.token_bytes(C.SEED_BYTES)
    seed_shares = shamir.split(seed, t, points)
    key_shares = shamir.split(state["round/s-seed"], t, points)
    out, cipher_keys = [], []
    c_sk = C.private_key(state["round/c-sk"])
    at = {v: i for i, v in enumerate(holders)}
    for v, c_pk in zip(mine, c_pks, strict=True):
        cipher_keys.append(C.cipher_key(c_sk, c_pk))
        out.append(C.encrypt(cipher_keys[-1], C.pack_share(pid, v, seed_shares[at[v]],
                                                           key_shares[at[v]])))
    me = holders.index(pid)
    state.update({"round/peers": mine, "round/s-pks": s_pks, "round/seed": seed,
                  "round/own-seed-share": seed_shares[me],
                  "round/own-key-share": key_shares[me], "round/cipher-keys": cipher_keys})
    return {"dst": mine, "ciphertexts": out, "seed-digest": C.digest(seed)}


def pair_sign(u: int, v: int) -> int:
    """``u`` adds the pair's mask if ``u < v`` and subtracts it otherwise."""
    return 1 if u < v else -1


def collect(pid: int, state: dict[str, Any], msg: Mapping[str, Any]) -> dict[str, Any]:
    """Stage 3: decrypt the shares held for the others (from the nodes of U2, who answered
    stage 2), then send the contribution masked: ``x + PRG(b_u) + sum_v +-PRG(s_uv)``."""
    _check_round_id(state, msg)
    peers = [int(v) for v in state["round/peers"]]
    src = [int(v) for v in msg["src"]]
    if len(set(src)) != len(src) or not set(src) <= set(peers):
        raise RoundRefused("the shares come from nodes that are not this node's neighbours, "
                           "or repeated")
    u2 = sorted([*src, pid])
    if len(u2) < int(state["round/threshold"]):
        raise RoundRefused(f"only {len(u2)} nodes of this neighbourhood shared keys "
                           f"(threshold {state['round/threshold']})")
    seeds, keys = [], []
    slot = {v: i for i, v in enumerate(peers)}
    for v, ciphertext in zip(src, msg["ciphertexts"], strict=True):
        plain = C.decrypt(state["round/cipher-keys"][slot[v]], bytes(ciphertext))
        seed_share, key_share = C.unpack_share(plain, v, pid)
        seeds.append(seed_share)
        keys.append(key_share)
    layout = C.Layout.from_json(json.loads(state["round/layout"]))
    total = np.array(state["round/vector"], dtype=np.uint64)
    total += C.mask(state["round/seed"], layout)  # uint64 wraps modulo 2^64: reduced below
    purpose = b"pair/" + state["round/id"]
    s_sk = C.private_key(state["round/s-sk"])
    for v in src:
        pair = C.mask(C.agree(s_sk, state["round/s-pks"][slot[v]], purpose), layout)
        if pair_sign(pid, v) > 0:
            total += pair
        else:
            total -= pair
    masked = total & layout.moduli()
    state.update({"round/u2": u2, "round/held-from": src, "round/held-seed": seeds,
                  "round/held-key": keys})
    del state["round/vector"]  # the exact contribution is not kept past this stage
    return {"masked": masked}


def unmask(config: RunConfig, pid: int, nodes: int, state: dict[str, Any],
           msg: Mapping[str, Any]) -> dict[str, Any]:
    """Stage 4: the consistency check on this node's neighbourhood (no node both active and
    dropped, every neighbour of U2 one or the other, at least the threshold active, this node
    among them; the round's survivors at least its minimum), then the shares of the active
    nodes' mask seeds and of the dropped nodes' mask keys, never both for one node."""
    if msg.get("keys-only"):  # not among this round's survivors: it reveals nothing
        for key in [k for k in state if k.startswith("round/")]:
            del state[key]
        return advertise(state, bytes(msg["next-round"]))
    _check_round_id(state, msg)
    active = [int(v) for v in msg["active"]]
    dropped = [int(v) for v in msg["dropped"]]
    u2 = set(state["round/u2"])
    t = int(state["round/threshold"])
    if set(active) & set(dropped):
        raise RoundRefused(f"nodes {sorted(set(active) & set(dropped))} are reported both "
                           "active and dropped: refusing to reveal both of their shares")
    survivors = int(msg["survivors"])
    if (len(set(active)) != len(active) or len(set(dropped)) != len(dropped)
            or set(active) | set(dropped) != u2 or pid not in active or len(active) < t
            or not max(len(active), int(state["round/minimum"])) <= survivors <= nodes):
        raise RoundRefused(f"inconsistent unmask request: {len(active)} active, "
                           f"{len(dropped)} dropped, {len(u2)} nodes of this neighbourhood "
                           f"sent masked keys, threshold {t}, {survivors} survivors")
    held_at = {v: i for i, v in enumerate(state["round/held-from"])}
    seed_of, seed_shares, key_of, key_shares = [], [], [], []
    for v in active:
        seed_of.append(v)
        seed_shares.append(state["round/own-seed-share"] if v == pid
                           else state["round/held-seed"][held_at[v]])
    for v in dropped:
        key_of.append(v)
        key_shares.append(state["round/held-key"][held_at[v]])
    step = Step.from_json(state["round/step"])
    from fedpriv.server.discrete import honest_count  # remember what this round cost

    honest = max(honest_count(config, nodes, survivors), 1)
    rho = float(sum(skellam_rho(l2, l1, variance * honest)
                    for l2, l1, variance in json.loads(state["round/plans"])))
    state["seen-labels"] = [*state.get("seen-labels", []), step.label]
    state["seen-rho"] = [*state.get("seen-rho", []), rho]
    for key in [k for k in state if k.startswith("round/")]:
        del state[key]
    reply: dict[str, Any] = {"seed-of": seed_of, "seed-shares": seed_shares, "key-of": key_of,
                             "key-shares": key_shares}
    if "next-round" in msg:
        reply.update(advertise(state, bytes(msg["next-round"])))
    return reply
