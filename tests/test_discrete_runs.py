"""Publishable (secure-noise) and distributed runs end to end: the grid, the CSPRNG, the
accounting against an independent computation, the per-user bound from the outside, the node's
quantized norm bound, dropouts, and bad input refused before round 1."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedpriv.algorithms.base import Part, Step, UserContribution
from fedpriv.config import ConfigError
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.outputs import publishable, release_document
from fedpriv.privacy.discrete import CryptoRandom
from fedpriv.privacy.grid import FLOAT_SLACK
from fedpriv.privacy.quantize import conditional_bound, from_ring, padded_dim, rotation_signs
from fedpriv.server import PrivateServer
from fedpriv.server.discrete import DELTA_RESERVE, share_plan
from fedpriv.shares import BETA, decode_sum, encode_part, quantize_part

FEDREP = {"algorithm": "private-fedrep", "num-users": 600, "dim": 10, "rounds": 3,
          "epsilon": 2.0, "accountant": "rdp", "test-samples-per-user": 5}


def config(**extra):
    return parse_config({**FEDREP, **{k.replace("_", "-"): v for k, v in extra.items()}})


def quiet(cfg, parts=4):
    return run_in_process(cfg, num_partitions=parts, log=lambda _: None)


def rdp_epsilon(rdp_of, delta: float) -> float:
    """Independent RDP -> (epsilon, delta) conversion (Canonne, Kamath & Steinke 2020, Prop.
    12; the form dp-accounting uses) over every integer order 2..1024."""
    best = math.inf
    for a in range(2, 1025):
        eps = rdp_of(a) + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        best = min(best, eps)
    return max(best, 0.0)


def skellam_rdp(a: int, l2: float, l1: float, mu: float) -> float:
    """Agarwal, Kairouz & Liu (2021): the Skellam mechanism's RDP at integer order a, with the
    minimum of their two second terms (the run's accountant uses the first, a bound)."""
    return a * l2 ** 2 / (2 * mu) + min(((2 * a - 1) * l2 ** 2 + 6 * l1) / (4 * mu ** 2),
                                        3 * l1 / (2 * mu))


def independent_distributed_epsilon(results) -> float:
    parts = [p for e in results["privacy"]["ledger"] for p in e["parts"]]
    delta = results["config"]["delta"] * (1 - DELTA_RESERVE)
    return rdp_epsilon(lambda a: sum(skellam_rdp(a, p["l2_sensitivity_grid"],
                                                 p["l1_sensitivity_grid"],
                                                 p["skellam_variance"]) for p in parts), delta)


# ----- publishable central noise -------------------------------------------------------------
def test_secure_noise_sums_lie_on_the_power_of_two_grid_with_the_slack_in_the_noise():
    cfg = config(secure_noise=True)
    server = PrivateServer(cfg, 4, log=lambda _: None)
    try:
        step = server.next_step()
        while step is not None and step.release is None:
            server.aggregate(step, [], 0.0)
            step = server.next_step()
        from fedpriv.nodes import node_step
        from fedpriv.server import NodeReply
        cls = type(server.algorithm)
        replies = [NodeReply(p, node_step(cls, cfg, step, server.payload(step),
                                          cls.hosted_users(cfg, p, 4))) for p in range(4)]
        server.aggregate(step, replies, 0.0)
        entry = server.accountant.ledger[-1]
        parts = entry.get("parts") or [entry]
        for p in parts:
            g = p["granularity"]
            assert math.frexp(g)[0] == 0.5  # a power of two
            units = server.release.last_grid_sums[p.get("name", step.parts[0].name)] / g
            np.testing.assert_array_equal(units, np.rint(units))  # exactly on the grid
            assert p["mechanism"] == "discrete gaussian"
            # the rounded sum's sensitivity is the clip plus the grid's slack g sqrt(d), and
            # the noise covers it: sigma >= z (Delta + g sqrt(d)) / g
            part = next(q for q in step.parts if q.name == p.get("name", q.name))
            population = step.population or cfg.num_users
            slack = g * math.sqrt(int(np.prod(part.shape)))
            assert p["l2_sensitivity"] * population == pytest.approx(
                part.clip_norm * (1 + FLOAT_SLACK) + slack, rel=1e-12)
            assert slack <= part.clip_norm / 1024
            assert p["sigma_grid"] >= p["noise_multiplier"] * (part.clip_norm + slack) / g
            assert p["sigma_grid"] >= p["noise_multiplier"] * p["l2_sensitivity"] * population / g
    finally:
        server.close()


def test_secure_noise_epsilon_is_the_zcdp_bound_of_the_discrete_gaussian():
    results = quiet(config(secure_noise=True))
    ledger = results["privacy"]["ledger"]
    rho = sum(1 / (2 * e["noise_multiplier"] ** 2) for e in ledger)  # rho-zCDP per release
    delta = results["config"]["delta"]
    assert results["privacy"]["epsilon"] == pytest.approx(
        rdp_epsilon(lambda a: a * rho, delta), rel=1e-9)
    assert results["privacy"]["epsilon"] <= FEDREP["epsilon"] * (1 + 1e-9)
    assert results["privacy"]["trust"]["trusted"].startswith("the server")
    assert publishable(results) == (True, "")


@pytest.mark.parametrize("mode", [{"secure_noise": True}, {"aggregation": "distributed"}])
def test_the_run_seeds_do_not_determine_the_noise(mode):
    a, b = (quiet(config(**mode))["server_state"] for _ in range(2))
    assert repr(a) != repr(b)  # same seeds, same users: only the CSPRNG noise differs


def test_secure_noise_exponential_mechanism_is_exact_and_accounted_as_before():
    values = {"algorithm": "a-exp", "num-users": 600, "dim": 6, "rank": 1,
              "samples-per-user": 6, "label-noise": 0.1, "candidates": 50, "epsilon": 1.0,
              "accountant": "rdp", "secure-noise": True, "test-samples-per-user": 5}
    results = quiet(parse_config(values))
    assert results["privacy"]["epsilon"] == pytest.approx(1.0)
    assert all(e["mechanism"] == "exponential" for e in results["privacy"]["ledger"])


# ----- distributed noise ---------------------------------------------------------------------
def test_distributed_epsilon_equals_an_independent_skellam_computation():
    results = quiet(config(aggregation="distributed"))
    reported = results["privacy"]["epsilon"]
    independent = independent_distributed_epsilon(results)
    assert reported >= independent * (1 - 1e-9)  # the accountant's bound is never smaller
    assert reported == pytest.approx(independent, rel=1e-6)
    assert reported <= FEDREP["epsilon"] * (1 + 1e-9)
    entry = results["privacy"]["ledger"][-1]
    assert entry["mechanism"] == "distributed skellam" and entry["honest_nodes"] == 4
    release = release_document(results)
    assert release["privacy"]["trust"]["aggregation"] == "distributed"
    assert release["privacy"]["ledger"][-1]["honest_nodes"] == 4


def test_the_nodes_shares_carry_the_planned_noise():
    """Zero sums from 5 nodes: the decoded release is the shares' noise alone, with the std of
    the planned Skellam variance (the central Gaussian's z Delta, plus the grid's slack)."""
    cfg = config(aggregation="distributed", collusion_threshold=0.2)
    plan = share_plan(cfg, PART, 3.0, 100, 5)
    assert plan.node_variance == pytest.approx(plan.variance / 4)  # 4 honest nodes guaranteed
    signs = rotation_signs(0, STEP.label, PART.name, plan.dim)
    draws = np.concatenate([decode_sum(
        [encode_part(np.zeros(35), 10, PART.clip_norm, signs, plan.granularity,
                     plan.node_variance, plan.bits, CryptoRandom())[0] for _ in range(5)],
        plan.granularity, plan.bits, 0, STEP.label, PART.name, 35) for _ in range(60)])
    expected = math.sqrt(5 * plan.node_variance) * plan.granularity
    assert draws.std() == pytest.approx(expected, rel=0.06)  # 2,100 draws
    central = 3.0 * PART.clip_norm  # z Delta of the central Gaussian
    assert central <= math.sqrt(plan.variance) * plan.granularity <= central * 1.01


def test_dropouts_within_the_threshold_keep_the_plan_and_beyond_it_the_ledger_says_so():
    # 10 nodes, threshold 0.1: one node may drop (or collude) without the noise falling
    within = run_in_process(config(aggregation="distributed", node_fault_rate=0.1),
                            num_partitions=10, log=lambda _: None)
    assert {e["honest_nodes"] for e in within["privacy"]["ledger"]} == {9}
    assert within["privacy"]["epsilon"] <= FEDREP["epsilon"] * (1 + 1e-9)
    logs: list[str] = []
    beyond = run_in_process(config(aggregation="distributed", node_fault_rate=0.2,
                                   max_epsilon=4.0), num_partitions=10, log=logs.append)
    assert {e["honest_nodes"] for e in beyond["privacy"]["ledger"]} == {8}
    assert beyond["privacy"]["epsilon"] > FEDREP["epsilon"]  # less noise than planned
    assert beyond["privacy"]["epsilon"] == pytest.approx(
        independent_distributed_epsilon(beyond), rel=1e-6)
    assert any("honest nodes' noise shares" in line for line in logs)


def test_the_budget_guard_stops_a_run_that_lost_more_nodes_than_declared():
    from fedpriv.server import BudgetExceededError
    with pytest.raises(BudgetExceededError):
        run_in_process(config(aggregation="distributed", node_fault_rate=0.5),
                       num_partitions=10, log=lambda _: None)


PART = Part("g", (5, 7), 0.5)
STEP = Step("round", 1, "round", (PART,), population=100)


def _plan(nodes=3):
    return share_plan(config(aggregation="distributed"), PART, 3.0, 100, nodes)


def test_neighbouring_nodes_with_the_same_randomness_differ_by_at_most_the_stated_bound():
    """One user added to a node's sum (any direction, at the clip), the node's randomness
    fixed: the integer vectors differ by at most the ledger's l2 and l1 sensitivities."""
    plan = _plan()
    signs = rotation_signs(0, STEP.label, PART.name, plan.dim)
    gen = np.random.default_rng(7)
    for trial in range(60):
        base = gen.normal(size=35) * gen.uniform(0, 3)
        user = gen.normal(size=35) if trial % 3 else np.eye(35)[trial % 35]
        user *= PART.clip_norm / np.linalg.norm(user)  # at the clip
        vectors = []
        for users, total in ((10, base), (11, base + user)):
            total = total * min(1.0, 10 * PART.clip_norm / np.linalg.norm(total))
            vec, tries = encode_part(total, users, PART.clip_norm, signs, plan.granularity,
                                     plan.node_variance, plan.bits, CryptoRandom(trial))
            assert tries == 1
            vectors.append(from_ring(vec.astype(np.uint64), plan.bits))
        diff = vectors[1] - vectors[0]
        assert np.linalg.norm(diff) <= plan.l2 and np.abs(diff).sum() <= plan.l1
        released = [decode_sum([v], plan.granularity, plan.bits, 0, STEP.label, PART.name, 35)
                    for v in (vectors[0] % 2 ** plan.bits, vectors[1] % 2 ** plan.bits)]
        assert np.linalg.norm(released[1] - released[0]) <= plan.l2 * plan.granularity


@pytest.mark.parametrize("kind", ["spike", "flat", "random", "huge", "nan"])
def test_the_quantized_norm_bound_holds_on_every_node_for_adversarial_sums(kind):
    plan, users = _plan(), 12
    signs = rotation_signs(3, STEP.label, PART.name, plan.dim)
    at_clip = users * PART.clip_norm
    total = {"spike": np.eye(35)[0] * at_clip, "flat": np.full(35, at_clip / math.sqrt(35)),
             "random": np.random.default_rng(1).normal(size=35),
             "huge": np.full(35, 1e30), "nan": np.full(35, np.nan)}[kind]
    if kind == "random":
        total *= at_clip / np.linalg.norm(total)
    limit = conditional_bound(at_clip / plan.granularity, padded_dim(35), BETA)
    for seed in range(20):
        q, bound, _ = quantize_part(total, users, PART.clip_norm, signs, plan.granularity,
                                    CryptoRandom(seed))
        assert bound == limit and np.linalg.norm(q) <= limit


def test_the_modular_sum_decodes_to_the_exact_sum_within_the_rounding():
    plan = share_plan(config(aggregation="distributed"), PART, 3.0, 100, 3)
    gen = np.random.default_rng(2)
    totals = [gen.normal(size=(5, 7)) * 0.1 for _ in range(3)]
    signs = rotation_signs(0, STEP.label, PART.name, plan.dim)
    vectors = [encode_part(t, 10, PART.clip_norm, signs, plan.granularity, 1e-12, plan.bits,
                           CryptoRandom(i))[0] for i, t in enumerate(totals)]
    decoded = decode_sum(vectors, plan.granularity, plan.bits, 0, STEP.label, PART.name, 35)
    exact = sum(totals).reshape(-1)
    # each node rounds by less than one grid unit per rotated coordinate
    assert np.linalg.norm(decoded - exact) <= 3 * math.sqrt(plan.dim) * plan.granularity
    assert np.linalg.norm(decoded - exact) > 0  # it did round


def test_a_node_encodes_its_share_in_a_real_step():
    cfg = config(aggregation="distributed")
    server = PrivateServer(cfg, 2, log=lambda _: None)
    try:
        step = next(s for s in server.steps() if s.release is not None)
        arrays = server.payload(step)
        from fedpriv.nodes import node_step
        cls = type(server.algorithm)
        contrib = node_step(cls, cfg, step, arrays, cls.hosted_users(cfg, 0, 2))
        for part, plan in zip(step.parts, server.share_plans(step), strict=True):
            value = contrib.totals[part.name]
            assert value.dtype == np.int64 and value.shape == (plan.dim,)
            assert value.min() >= 0 and value.max() < 2 ** plan.bits
        assert isinstance(contrib, UserContribution) and contrib.num_users > 0
    finally:
        server.close()


# ----- bad input, before round 1 -------------------------------------------------------------
@pytest.mark.parametrize("values,key", [
    ({"aggregation": "distributed", "modulus-bits": 4}, "modulus-bits"),
    ({"aggregation": "distributed", "collusion-threshold": 1.0}, "collusion-threshold"),
    ({"aggregation": "distributed", "accountant": "pld"}, "accountant"),
    ({"secure-noise": True, "accountant": "pld"}, "accountant"),
    ({"aggregation": "distributed", "algorithm": "a-exp", "candidates": 20, "rank": 1},
     "aggregation"),
    ({"aggregation": "distributed", "algorithm": "dp-ftmrl", "feature-dist": "unit-ball"},
     "aggregation"),
    ({"aggregation": "distributed", "algorithm": "meta-nsgd", "feature-dist": "unit-ball"},
     "tasks-per-round"),
    ({"aggregation": "distributed", "algorithm": "deep-dp-fedavg", "dataset": "digits",
      "num-users": 60, "hidden-sizes": "16", "users-per-round": 20}, "users-per-round"),
    ({"secure-noise": True, "algorithm": "deep-dp-fedavg", "dataset": "digits",
      "num-users": 60, "hidden-sizes": "16", "users-per-round": 20}, "users-per-round"),
    ({"aggregation": "distributed", "algorithm": "fedrep"}, "aggregation"),  # no noise at all
    ({"modulus-bits": 30}, "modulus-bits"),  # central: unused
    # every step is sized before round 1 (priv-altmin's later steps release other parts)
    ({"aggregation": "distributed", "algorithm": "priv-altmin", "user-groups": 2, "rounds": 2,
      "modulus-bits": 24}, "modulus-bits"),
])
def test_bad_discrete_settings_fail_before_round_1_naming_the_key(values, key):
    merged = {**FEDREP, **values}
    if merged["algorithm"] != "private-fedrep":
        merged.pop("dim", None)
    if merged["algorithm"].startswith("deep-"):
        merged.pop("test-samples-per-user")
    with pytest.raises(ConfigError, match=f"^{key}"):
        server = PrivateServer(parse_config(merged), 4, log=lambda _: None)
        server.close()


@pytest.mark.parametrize("mode", [{"secure_noise": True}, {"aggregation": "distributed"}])
def test_private_metrics_are_released_with_discrete_noise(mode):
    results = quiet(config(private_metrics=True, **mode))
    metric = results["private_metrics"]["test_mse"]
    entry = results["privacy"]["ledger"][-1]
    assert entry["release"] == "evaluate" and np.isfinite(metric["value"])
    assert metric["noise_std"] > 0 and metric["users"] == FEDREP["num-users"]
    # the server of a distributed run never sees the exact mean; a central one reports it
    assert (metric["exact_clipped"] is None) is ("aggregation" in mode)
    assert results["privacy"]["epsilon"] <= FEDREP["epsilon"] * (1 + 1e-9)


@pytest.mark.parametrize("mode", [{"secure_noise": True}, {"aggregation": "distributed"}])
def test_a_resumed_discrete_run_keeps_its_ledger(tmp_path, mode):
    from fedpriv.engine import run_in_process as run
    path = tmp_path / "run.checkpoint"
    whole = quiet(config(**mode))
    server = PrivateServer(config(**mode), 4, log=lambda _: None, checkpoint_path=path)
    from fedpriv.nodes import node_step
    from fedpriv.server import NodeReply
    cls = type(server.algorithm)
    for _ in range(2):  # init and round 1, then the process is gone
        step = server.next_step()
        arrays = server.payload(step)
        server.aggregate(step, [NodeReply(p, node_step(cls, server.config, step, arrays,
                                                       cls.hosted_users(server.config, p, 4)))
                                for p in range(4)], 0.0)
    server.close()
    resumed = run(config(resume=True, **mode), num_partitions=4, log=lambda _: None,
                  checkpoint_path=path)
    assert resumed["resumed_from_step"] == 2
    assert [e["release"] for e in resumed["privacy"]["ledger"]] == [
        e["release"] for e in whole["privacy"]["ledger"]]
    assert resumed["privacy"]["epsilon"] == pytest.approx(whole["privacy"]["epsilon"],
                                                          rel=1e-9)


def test_the_meta_sampling_refusal_says_how_to_run_every_task():
    values = {"algorithm": "meta-nsgd", "feature-dist": "unit-ball", "num-users": 300,
              "epsilon": 2.0, "accountant": "rdp", "aggregation": "distributed"}
    with pytest.raises(ConfigError, match="set tasks-per-round = 300"):
        PrivateServer(parse_config(values), 2, log=lambda _: None)
    values["tasks-per-round"] = 300  # every task every round: accepted
    PrivateServer(parse_config(values), 2, log=lambda _: None).close()


def test_a_node_sends_no_exact_sums_in_a_distributed_step_without_share_parameters():
    from fedpriv.nodes import node_step
    cfg = config(aggregation="distributed")
    server = PrivateServer(cfg, 2, log=lambda _: None)
    try:
        step = next(s for s in server.steps() if s.release is not None)
        cls = type(server.algorithm)
        arrays = server.payload(step)
        stripped = {k: v for k, v in arrays.items() if not k.startswith("__fedpriv")}
        with pytest.raises(ValueError, match="no noise-share parameters"):
            node_step(cls, cfg, step, stripped, cls.hosted_users(cfg, 0, 2))
        bad = {**arrays, **{k: v * np.array([1.0, 0.0, 1.0]) for k, v in arrays.items()
                            if k.startswith("__fedpriv")}}  # a zero share
        with pytest.raises(ValueError, match="refusing noise-share parameters"):
            node_step(cls, cfg, step, bad, cls.hosted_users(cfg, 0, 2))
        plans = server.share_plans(step)
        assert all(0 <= p.wrap_probability <= 1e-9 for p in plans)
    finally:
        server.close()


def test_a_distributed_run_whose_rounding_slack_would_exceed_the_delta_reserve_is_refused():
    # (1 + e^60) x releases x nodes x 2^-128 is above 1e-6 of delta: refused, naming delta
    with pytest.raises(ConfigError, match="^delta: .* conditional rounding"):
        PrivateServer(config(aggregation="distributed", epsilon=60.0), 10, log=lambda _: None)
    PrivateServer(config(aggregation="distributed", epsilon=20.0), 10,
                  log=lambda _: None).close()  # e^20: far inside the reserve
