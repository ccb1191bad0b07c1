"""Secure aggregation in process (aggregation = "secure"): the server reads only masked vectors
and their sum, which is exactly the modular sum of the surviving nodes' vectors (dropped nodes'
masks reconstructed); a server that reports a node both active and dropped gets nothing; the
results are those of a distributed run with the same node noise; bad input fails before round 1
naming the key; the node's plan check; the cryptographic units; resume."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from secure_helpers import (
    BASE,
    assert_nothing_in_plain,
    fix_node_noise,
    instrument,
    ledger_of,
    make_config,
    quiet,
)

from fedpriv import checkpoint
from fedpriv.config import ConfigError
from fedpriv.configure import parse_config
from fedpriv.faults import failing_partitions
from fedpriv.privacy.quantize import ring_sum
from fedpriv.secagg import crypto as C
from fedpriv.secagg import shamir
from fedpriv.secagg.node import (
    COUNT_BITS,
    COUNTS,
    Failure,
    RoundRefused,
    check_round,
)
from fedpriv.secagg.node import setup as node_setup
from fedpriv.server import PrivateServer
from fedpriv.server.discrete import honest_minimum, payload
from fedpriv.server.secagg import SecureAggregationError
from fedpriv.shares import DISTRIBUTED_KEY

K = 10  # nodes of make_config()


def _drop_node_3_reply(label, stage, replies, record):
    """The server never gets node 3's masked vector (lost in transit)."""
    return {p: r for p, r in replies.items() if not (stage == "collect" and p == 3)}


# ----- 1. the server sees only masked vectors, and their exact sum -----------------------------
@pytest.mark.parametrize("faults", ["none", "crash", "lost-reply"])
def test_the_server_reads_only_masked_vectors_and_unmasks_exactly_the_survivors_sum(
        monkeypatch, faults):
    extra = {"node_fault_rate": 0.1} if faults == "crash" else {}
    record = instrument(monkeypatch, forge=_drop_node_3_reply if faults == "lost-reply"
                        else None)
    cfg = make_config(**extra)
    results = quiet(cfg)
    # the final (metrics) step is never sent: the nodes send nothing exact about their users
    assert [label for label in record.labels.values()] == ["init", "round-1"]
    assert len(record.outcomes) == 2
    assert results["metrics"] == {} and results["rounds"][-1]["nodes_answered"] == 0
    for exchange in record.exchanges:
        assert_nothing_in_plain(exchange, record, K)
    for round_id, step, outcome in record.outcomes:
        label = step.label
        expected_lost = {"none": set(), "lost-reply": {3},
                         "crash": set(failing_partitions(cfg.seed, label, K, 0.1))}[faults]
        assert len(expected_lost) == (0 if faults == "none" else 1)
        assert outcome.survivors == sorted(set(range(K)) - expected_lost)
        assert {n: s for n, (s, _, _) in outcome.failures.items()} == dict.fromkeys(
            expected_lost, "collect")
        vectors = {p: v for (r, p), v in record.vectors.items() if r == round_id}
        assert set(vectors) == set(range(K))  # every node set up, the lost ones too
        layout = record.layouts[(round_id, 0)]
        # each masked vector differs from its node's vector in (almost) every coordinate
        collect = record.stage(label, "collect")
        answered = {p: r for p, r in collect.replies.items() if not isinstance(r, Failure)}
        assert set(answered) == set(outcome.survivors)
        for pid, reply in answered.items():
            assert np.count_nonzero(reply["masked"] == vectors[pid]) <= 1
            assert np.all(reply["masked"] <= layout.moduli())
        # the dropped nodes' masks were reconstructed from their key shares, theirs only
        # (the lost nodes are asked only for their keys of the next round: they reveal nothing)
        unmask = record.stage(label, "unmask")
        only = {n for n, m in unmask.messages.items() if m.get("keys-only")}
        assert only == expected_lost
        for n, message in unmask.messages.items():
            if n in only:
                assert set(message) == {"round", "keys-only", "next-round"}
                assert set(unmask.replies[n]) == {"next-c-pk", "next-s-pk"}
                continue
            assert message["active"] == outcome.survivors
            assert message["dropped"] == sorted(expected_lost)
        for reply in (r for n, r in unmask.replies.items() if n not in only):
            assert reply["key-of"] == sorted(expected_lost)
            assert len(reply["key-shares"]) == len(expected_lost)
            assert reply["seed-of"] == outcome.survivors
        # the unmasked total is the ring sum of the survivors' vectors, part by part
        params = record.stage(label, "setup").messages[0].get(DISTRIBUTED_KEY)
        parts = [s for s in layout.segments if s.name != COUNTS]
        assert [s.name for s in parts] == [p.name for p in step.parts]
        if params is not None:
            assert [s.bits for s in parts] == [int(row[2]) for row in params]
        for seg in parts:
            pieces = [layout.split(vectors[p])[seg.name] for p in outcome.survivors]
            exact = ring_sum(pieces, seg.bits)
            np.testing.assert_array_equal(outcome.total.totals[seg.name], exact)
            if expected_lost:  # the lost nodes' vectors are not in it
                every = ring_sum([layout.split(v)[seg.name] for v in vectors.values()],
                                 seg.bits)
                assert not np.array_equal(exact, every)
        assert set(outcome.total.totals) == {s.name for s in parts}
        contribs = [record.contribs[(round_id, p)] for p in outcome.survivors]
        # the counts in the masked sum are the public ones; no clipped count, no metrics
        assert [c.num_users for c in contribs] == [100] * len(contribs)
        assert outcome.total.num_users == 100 * len(contribs)
        assert outcome.total.num_clipped == 0 and outcome.total.metrics is None
    users = sum(r["users_contributing"] for r in results["rounds"][:2])
    assert users == 2 * (K - (0 if faults == "none" else 1)) * 100


# ----- 2. a server that reports a node both active and dropped gets nothing ------------------
def _both(msg, t):
    return {**msg, "dropped": [*msg["dropped"], msg["active"][0]]}


def _omitted(msg, t):
    return {**msg, "active": msg["active"][1:]}


def _below_threshold(msg, t):
    return {**msg, "active": msg["active"][:t - 1], "dropped": msg["active"][t - 1:]}


@pytest.mark.parametrize("lie,why", [(_both, "both active and dropped"),
                                     (_omitted, "inconsistent unmask request"),
                                     (_below_threshold, "inconsistent unmask request")])
def test_an_inconsistent_unmask_request_stops_the_round_and_releases_nothing(
        monkeypatch, lie, why):
    before = {}

    def tamper(label, stage, messages, record):
        if label == "round-1" and stage == "unmask":
            before["ledger"] = ledger_of(record)
            before["rounds"] = len(record.servers[-1].rounds)
            t = record.servers[-1].graph.t
            return {p: lie(m, t) for p, m in messages.items()}
        return messages

    record = instrument(monkeypatch, tamper=tamper)
    with pytest.raises(SecureAggregationError, match="^secure-threshold: only 0 nodes .* unmask"):
        quiet(make_config())
    refused = [e for e in record.node_replies if e.stage == "unmask" and e.label == "round-1"]
    assert len(refused) == 1 and len(refused[0].replies) == K
    for reply in refused[0].replies.values():  # every node refused, revealing no share
        assert not isinstance(reply, dict)
        assert reply.kind == "node-error" and reply.detail.startswith("RoundRefused")
        assert why in reply.detail
    server = record.servers[-1]
    assert [e["release"] for e in before["ledger"]] == ["init"]
    assert server.accountant.ledger == before["ledger"]  # round-1 was not released
    assert len(server.rounds) == before["rounds"] == 1


def test_a_node_refuses_a_threshold_outside_2_to_the_nodes():
    cfg = make_config()
    server = PrivateServer(cfg, K, log=lambda _: None)
    step = server.next_step()
    msg = {"round": b"r" * 16, "step": step.to_json(), "history-labels": [],
           "history-rho": []}
    arrays = server.payload(step)
    server.close()
    for t in (1, K + 1):
        with pytest.raises(RoundRefused, match="threshold"):
            node_setup(cfg, 0, K, {}, {**msg, "threshold": t, "neighbours": K - 1}, arrays,
                       lambda *_: pytest.fail("computed before the check"))
    with pytest.raises(RoundRefused, match="with 4 neighbours is not the run's"):  # not a ring
        node_setup(cfg, 0, K, {}, {**msg, "threshold": 6, "neighbours": 4}, arrays,
                   lambda *_: pytest.fail("computed before the check"))


def test_a_node_refuses_a_threshold_the_colluders_reach():
    """A threshold at or below the colluders would let them and the server unmask one node's
    vector: the node compares it with the run's own."""
    cfg = make_config(collusion_threshold=0.3)  # 3 of 10 nodes may collude
    server = PrivateServer(cfg, K, log=lambda _: None)
    step = server.next_step()
    arrays = server.payload(step)
    server.close()
    msg = {"round": b"r" * 16, "step": step.to_json(), "history-labels": [],
           "history-rho": [], "threshold": 3, "neighbours": K - 1}
    with pytest.raises(RoundRefused, match="threshold 3 with 9 neighbours is not the run's"):
        node_setup(cfg, 0, K, {}, msg, arrays, lambda *_: pytest.fail("computed"))


# ----- 3. the same results as a distributed run with the same node noise ---------------------
@pytest.mark.parametrize("dropouts", [0.0, 0.1])
def test_secure_results_equal_the_distributed_runs_with_the_same_node_noise(
        monkeypatch, dropouts):
    calls = fix_node_noise(monkeypatch)
    runs = {}
    for mode in ("distributed", "secure"):
        cfg = make_config(aggregation=mode, rounds=2, node_fault_rate=dropouts)
        runs[mode] = quiet(cfg)
    dist, sec = runs["distributed"], runs["secure"]
    # secure: every node encodes (the crashing one too, before it crashes mid-protocol)
    assert len(calls) == (3 * K - round(3 * K * dropouts)) + 3 * K
    if dropouts:
        for label in ("init", "round-1", "round-2"):
            assert len(failing_partitions(cfg.seed, label, K, dropouts)) >= 1
        assert all(r["nodes_failed"] >= 1 for r in sec["rounds"][:-1])
        assert {e["honest_nodes"] for e in sec["privacy"]["ledger"]} == {9}
    assert sec["privacy"]["ledger"] == dist["privacy"]["ledger"]  # rho, honest_nodes, parts
    assert sec["privacy"]["epsilon"] == dist["privacy"]["epsilon"]
    assert sec["server_state"] == dist["server_state"]
    assert sec["rejections"] == dist["rejections"]
    assert sec["privacy"]["trust"]["aggregation"] == "secure"
    for a, b in zip(dist["rounds"], sec["rounds"], strict=True):
        assert {k for k in b if k not in a} <= {"secure_bytes_to_nodes",
                                                "secure_bytes_from_nodes"}
        exact = {k: v for k, v in a.items() if k not in ("seconds", "note")}
        assert {k: b[k] for k in exact} == exact  # the releases, counts, epsilon
    # neither server received exact metrics; the in-process simulator measured the same ones
    assert sec["metrics"] == dist["metrics"] == {}
    assert sec["simulation_metrics"] == dist["simulation_metrics"]
    assert set(sec["simulation_metrics"]) >= {"population_mse", "local_only_mse"}


# ----- 4. bad input fails before round 1, naming the key --------------------------------------
@pytest.mark.parametrize("values,key", [
    ({"secure-threshold": 11}, "secure-threshold"),  # more than the 10 nodes
    ({"secure-threshold": 3, "collusion-threshold": 0.3}, "secure-threshold"),  # 3 colluders
    ({"secure-threshold": 1, "collusion-threshold": 0.0}, "secure-threshold"),
    ({"num-users": 100}, "aggregation"),  # one node
    ({"algorithm": "fedrep"}, "aggregation"),  # no noise plan: nothing to protect
    ({"algorithm": "a-exp", "candidates": 20, "rank": 1, "dim": None}, "aggregation"),
    ({"algorithm": "dp-ftmrl", "feature-dist": "unit-ball", "dim": None}, "aggregation"),
    ({"modulus-bits": 4}, "modulus-bits"),
])
def test_bad_secure_settings_fail_before_round_1_naming_the_key(monkeypatch, values, key):
    record = instrument(monkeypatch)
    merged = {k: v for k, v in {**BASE, **values}.items() if v is not None}
    with pytest.raises(ConfigError, match=f"^{key}"):
        quiet(parse_config(merged))
    assert record.exchanges == []


@pytest.mark.parametrize("values,key", [
    ({"secure-threshold": 6, "aggregation": "central"}, "secure-threshold"),
    ({"secure-threshold": 6, "aggregation": "distributed"}, "secure-threshold"),
    ({"accountant": "pld"}, "accountant"),
])
def test_bad_secure_keys_are_refused_by_the_config(values, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        make_config(**{k.replace("-", "_"): v for k, v in values.items()})


@pytest.mark.parametrize("extra", [{"node_fault_rate": 0.5},
                                   {"node_fault_rate": 0.5, "node_fault_kind": "timeout"},
                                   {"node_fault_rate": 0.1, "secure_threshold": 10}])
def test_fewer_nodes_than_the_threshold_stop_the_run_with_nothing_released(monkeypatch, extra):
    record = instrument(monkeypatch)
    with pytest.raises(SecureAggregationError, match="^secure-threshold: .* collect stage of "
                       "init.* nothing was released"):
        quiet(make_config(**extra))
    assert record.servers[-1].accountant.ledger == [] and record.servers[-1].rounds == []
    assert [e.stage for e in record.exchanges] == ["setup", "share-keys", "collect"]


# ----- 5. the node's plan check --------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_world():
    cfg = make_config(rounds=2)
    server = PrivateServer(cfg, K, log=lambda _: None)
    init, round1 = server.steps()[:2]
    params = {s.label: payload(server.share_plans(s)) for s in (init, round1)}
    server.close()
    from fedpriv.secagg.node import planned_rho
    rho = planned_rho(cfg, K, init, honest_minimum(cfg, K))
    return cfg, init, round1, params, rho


def test_the_node_accepts_the_servers_honest_parameters(plan_world):
    cfg, init, round1, params, rho = plan_world
    first = check_round(cfg, K, init, params["init"], {}, {})
    second = check_round(cfg, K, round1, params["round-1"], {"init": rho}, {"init": rho})
    assert 0 < first < second <= cfg.ceiling * (1 + 1e-9)
    more_noise = params["round-1"] * np.array([1.0, 2.0, 1.0])
    assert check_round(cfg, K, round1, more_noise, {"init": rho}, {}) == second
    # a metrics step is never secure-aggregated: a node refuses it (it sends no exact metrics)
    with pytest.raises(RoundRefused, match="a metrics step"):
        check_round(cfg, K, dataclasses.replace(round1, parts=()), None, {}, {})


@pytest.mark.parametrize("change,why", [
    (lambda p: p * np.array([1.0, 0.5, 1.0]), "share variance"),
    (lambda p: p * np.array([1.0, 1.0 - 1e-9, 1.0]), "share variance"),
    (lambda p: p * np.array([2.0, 1.0, 1.0]), "granularity"),
    (lambda p: p * np.array([0.5, 1.0, 1.0]), "granularity"),
    (lambda p: p + np.array([0.0, 0.0, 1.0]), "bits"),
    (lambda p: p - np.array([0.0, 0.0, 1.0]), "bits"),
    (lambda p: np.vstack([p, p]), "share rows"),
    (lambda p: None, "no noise-share parameters"),
])
def test_the_node_refuses_other_share_parameters(plan_world, change, why):
    cfg, _, round1, params, rho = plan_world
    with pytest.raises(RoundRefused, match=why):
        check_round(cfg, K, round1, change(params["round-1"]), {"init": rho}, {"init": rho})


def test_the_node_refuses_a_ledger_that_is_not_what_it_saw_or_spends_too_much(plan_world):
    cfg, init, round1, params, rho = plan_world
    p = params["round-1"]
    with pytest.raises(RoundRefused, match="round-1 was released already"):
        check_round(cfg, K, round1, p, {"init": rho, "round-1": rho}, {"init": rho})
    for history in ({}, {"init": rho / 2}, {"other": rho}):
        with pytest.raises(RoundRefused, match="does not hold release init"):
            check_round(cfg, K, round1, p, history, {"init": rho})
    with pytest.raises(RoundRefused, match="above the run's ceiling"):
        check_round(cfg, K, round1, p, {"init": rho, "x": 1.0, "y": 1.0}, {"init": rho})
    with pytest.raises(RoundRefused, match="not in the run's plan"):
        check_round(cfg, K, dataclasses.replace(round1, release="bogus"), p, {}, {})
    with pytest.raises(RoundRefused, match="releases nothing with noise"):
        check_round(cfg, K, dataclasses.replace(round1, release=None), p, {}, {})
    # a server that inflates its ledger is refused only where it passes the ceiling
    assert check_round(cfg, K, round1, p, {"init": 1.05 * rho}, {"init": rho}) > check_round(
        cfg, K, round1, p, {"init": rho}, {"init": rho})


# ----- 6. the cryptographic units ------------------------------------------------------------
LAYOUT = C.Layout((C.Segment("a", 40, 7), C.Segment("b", 30, 25), C.Segment("c", 3, 62)))


def test_pairwise_masks_cancel_in_every_segment():
    keys = [C.key_pair() for _ in range(4)]
    purpose = b"pair/test"
    gen = np.random.default_rng(5)
    vectors = [LAYOUT.join({s.name: gen.integers(0, 2 ** s.bits, s.length, dtype=np.uint64)
                            for s in LAYOUT.segments}) for _ in keys]
    masked = []
    for u, (sk, _) in enumerate(keys):
        y = vectors[u]
        for v, (_, pk) in enumerate(keys):
            if v != u:
                seed = C.agree(sk, pk, purpose)
                assert seed == C.agree(keys[v][0], keys[u][1], purpose)  # both ends agree
                y = C.add(y, C.mask(seed, LAYOUT), LAYOUT, 1 if u < v else -1)
        # chance agreements only: 40 coordinates mod 2^7 agree ~0.3 times (Poisson); 8 or more
        # has probability < 1e-9
        assert np.count_nonzero(y == vectors[u]) < 8
        masked.append(y)
    total = np.zeros(LAYOUT.size, dtype=np.uint64)
    for y in masked:
        total = C.add(total, y, LAYOUT)
    for name, seg in zip("abc", LAYOUT.segments, strict=True):
        bits = seg.bits
        np.testing.assert_array_equal(LAYOUT.split(total)[name], ring_sum(
            [LAYOUT.split(x)[name] for x in vectors], bits))
    assert C.agree(keys[0][0], keys[1][1], b"pair/other") != C.agree(keys[0][0], keys[1][1],
                                                                      purpose)


def test_masks_are_in_range_roughly_uniform_and_differ_by_seed():
    big = C.Layout((C.Segment("a", 64_000, 7), C.Segment("b", 20_000, 25),
                    C.Segment("c", 20_000, 62)))
    seed = bytes(range(32))
    m = C.mask(seed, big)
    np.testing.assert_array_equal(m, C.mask(seed, big))  # a function of the seed
    parts = big.split(m)
    counts = np.bincount(parts["a"].astype(np.int64), minlength=128)
    assert counts.size == 128  # nothing at or above 2^7
    chi2 = ((counts - 500.0) ** 2 / 500.0).sum()  # 127 degrees of freedom: mean 127, sd 16
    assert chi2 < 127 + 6 * 16
    for name, bits in (("b", 25), ("c", 62)):
        values = parts[name].astype(np.float64) / 2.0 ** bits
        assert values.max() < 1.0 and values.max() > 0.999
        assert abs(values.mean() - 0.5) < 6 * math.sqrt(1 / 12 / values.size)
    other = C.mask(bytes([1]) + seed[1:], big)
    assert np.count_nonzero(other == m) < 64_000 / 128 * 1.5  # only chance agreements
    with pytest.raises(ValueError, match="32 bytes"):
        C.mask(seed[:16], big)


def test_share_plaintexts_name_their_pair():
    plain = C.pack_share(3, 7, b"seed-share", b"key-share-bytes")
    assert C.unpack_share(plain, 3, 7) == (b"seed-share", b"key-share-bytes")
    for src, dst in ((7, 3), (3, 8), (4, 7)):
        with pytest.raises(ValueError, match="not"):
            C.unpack_share(plain, src, dst)
    for broken in (plain[:10], plain[:-1], plain + b"x"):
        with pytest.raises(ValueError):
            C.unpack_share(broken, 3, 7)
    a, b, c = (C.key_pair() for _ in range(3))
    text = C.encrypt(C.cipher_key(a[0], b[1]), plain)
    assert C.decrypt(C.cipher_key(b[0], a[1]), text) == plain
    with pytest.raises(Exception):  # noqa: B017 -- the AEAD's InvalidTag
        C.decrypt(C.cipher_key(c[0], a[1]), text)


def _solve_mod(rows, rhs, p):
    """Gaussian elimination modulo the prime ``p`` (an independent check of the sharing)."""
    n = len(rows)
    a = [list(r) + [b] for r, b in zip(rows, rhs, strict=True)]
    for c in range(n):
        pivot = next(r for r in range(c, n) if a[r][c] % p)
        a[c], a[pivot] = a[pivot], a[c]
        inv = pow(a[c][c], p - 2, p)
        a[c] = [x * inv % p for x in a[c]]
        for r in range(n):
            if r != c and a[r][c]:
                f = a[r][c]
                a[r] = [(x - f * y) % p for x, y in zip(a[r], a[c], strict=True)]
    return [row[-1] for row in a]


def test_shamir_shares_need_the_threshold():
    secret = bytes(range(32))
    points = [3, 9, 10, 17, 40]
    shares = shamir.split(secret, 3, points)
    assert [shamir.point(s) for s in shares] == points
    assert shamir.combine(shares[:3]) == secret
    assert shamir.combine([shares[4], shares[1], shares[2]]) == secret
    assert shamir.combine(shares) == secret  # more than the threshold: the same secret
    # independently: the shares are a degree-2 polynomial whose constant term is 0x01||secret
    values = [int.from_bytes(s[4:], "little") for s in shares[:3]]
    coeffs = _solve_mod([[1, x, x * x] for x in points[:3]], values, shamir.PRIME)
    assert coeffs[0] == int.from_bytes(b"\x01" + secret, "big")
    fourth = sum(c * points[3] ** i for i, c in enumerate(coeffs)) % shamir.PRIME
    assert fourth == int.from_bytes(shares[3][4:], "little")
    try:  # two shares determine nothing: garbage, or a refusal
        assert shamir.combine(shares[:2]) != secret
    except ValueError:
        pass
    assert shamir.combine(shamir.split(b"\x00\x00ab", 2, [1, 2])) == b"\x00\x00ab"
    for bad in (lambda: shamir.split(bytes(65), 2, [1, 2]), lambda: shamir.split(secret, 3, [1, 2]),
                lambda: shamir.split(secret, 2, [1, 1]), lambda: shamir.combine([b"x"]),
                lambda: shamir.combine([shares[0], shares[0]])):
        with pytest.raises(ValueError):
            bad()



def test_layout_join_split_round_trip_and_range():
    gen = np.random.default_rng(3)
    values = {s.name: gen.integers(0, 2 ** s.bits, s.length, dtype=np.uint64)
              for s in LAYOUT.segments}
    joined = LAYOUT.join(values)
    assert joined.dtype == np.uint64 and joined.shape == (LAYOUT.size,) == (73,)
    back = LAYOUT.split(joined)
    assert list(back) == ["a", "b", "c"]
    for name, value in values.items():
        np.testing.assert_array_equal(back[name], value)
    assert C.Layout.from_json(LAYOUT.to_json()) == LAYOUT
    moduli = LAYOUT.moduli()
    assert set(moduli[:40]) == {127} and set(moduli[40:70]) == {2 ** 25 - 1}
    with pytest.raises(ValueError, match="outside"):
        LAYOUT.join({**values, "a": np.full(40, 128, dtype=np.uint64)})
    with pytest.raises(ValueError, match="expected 30"):
        LAYOUT.join({**values, "b": np.zeros(29, dtype=np.uint64)})
    top = LAYOUT.join({**values, "c": np.full(3, 2 ** 62 - 1, dtype=np.uint64)})
    assert LAYOUT.split(C.add(top, top, LAYOUT))["c"].max() < 2 ** COUNT_BITS


# ----- 7. resume -----------------------------------------------------------------------------
class Killed(BaseException):
    """The server process died."""


def _kill_at_round_2(label, stage, messages, record):
    if label == "round-2" and stage == "setup":
        raise Killed
    return messages


def _refuse_round_2(label, stage, messages, record):
    if label == "round-2" and stage == "unmask":
        return {p: _both(m, 0) for p, m in messages.items()}
    return messages


@pytest.fixture(scope="module")
def whole_run():
    return quiet(make_config(rounds=2))


@pytest.mark.parametrize("stop,error", [(_kill_at_round_2, Killed),
                                        (_refuse_round_2, SecureAggregationError)])
def test_a_stopped_secure_run_resumes_with_the_uninterrupted_runs_ledger(
        monkeypatch, tmp_path, whole_run, stop, error):
    whole = whole_run
    path = tmp_path / "run.checkpoint"
    instrument(monkeypatch, tamper=stop)
    with pytest.raises(error):
        quiet(make_config(rounds=2), checkpoint_path=path)
    assert checkpoint.load(path)["completed"] == 2  # init and round-1
    monkeypatch.undo()
    record = instrument(monkeypatch)
    resumed = quiet(make_config(rounds=2, resume=True), checkpoint_path=path)
    assert resumed["resumed_from_step"] == 2
    assert list(record.labels.values()) == ["round-2"]  # the final step is not sent
    # the resumed server holds no keys ahead: a full setup, four exchanges
    assert [e.stage for e in record.exchanges] == ["setup", "share-keys", "collect", "unmask"]
    setup = record.stage("round-2", "setup").messages[0]
    assert setup["history-labels"] == ["init", "round-1"]  # the checkpointed ledger
    ledgers = [r["privacy"]["ledger"] for r in (whole, resumed)]
    assert [[e["release"] for e in ledger] for ledger in ledgers] == [
        ["init", "round-1", "round-2"]] * 2
    assert [[(e["honest_nodes"], e["rho"]) for e in ledger] for ledger in ledgers][0] == [
        (e["honest_nodes"], e["rho"]) for e in ledgers[1]]
    assert setup["history-rho"] == [e["rho"] for e in ledgers[0][:2]]
    assert resumed["privacy"]["epsilon"] == pytest.approx(whole["privacy"]["epsilon"],
                                                          rel=1e-12)
    assert [r["step"] for r in resumed["rounds"]] == [r["step"] for r in whole["rounds"]]
    assert resumed["metrics"] == whole["metrics"] == {}
    assert resumed["simulation_metrics"].keys() == whole["simulation_metrics"].keys()


def test_disjoint_user_groups_are_charged_their_own_releases_by_server_and_nodes():
    """priv-altmin's rounds each use one group of users: the server's ledger charges each
    group its own releases, and the nodes' budget check agrees (it refused round-2 when it
    charged every release to every user)."""
    settings = dict(algorithm="priv-altmin", num_users=600, users_per_node=100, rounds=3,
                    user_groups=3)
    runs = {mode: quiet(make_config(aggregation=mode, **settings))
            for mode in ("distributed", "secure")}
    for results in runs.values():
        ledger = results["privacy"]["ledger"]
        assert [e["user_group"] for e in ledger] == [None, 0, 1, 2]
        assert results["rejections"] == {}
        assert results["privacy"]["epsilon"] <= 2.0 * (1 + 1e-9)
    assert runs["secure"]["privacy"]["epsilon"] == runs["distributed"]["privacy"]["epsilon"]

