"""Priv-AltMin (Jain et al. 2021): statistics, noise, groups and the accounting of parallel
composition."""

import math

import numpy as np
import pytest

from fedpriv.algorithms.base import UserContribution, partition_users
from fedpriv.algorithms.personalization import altmin_math as altmin
from fedpriv.algorithms.personalization import init_math as private_init
from fedpriv.algorithms.personalization.linear_math import (
    local_vectors,
    orthonormalize,
    subspace_distance,
)
from fedpriv.algorithms.personalization.priv_altmin import PrivAltMin
from fedpriv.data.synthetic import SyntheticProblem, generate_users, ground_truth_embedding
from fedpriv.engine import run_in_process
from fedpriv.privacy.accounting import mean_sensitivity
from fedpriv.randomness import user_groups
from fedpriv.server import NodeReply, PrivateServer
from tests.conftest import small_config
from tests.test_accounting import analytic_gaussian_epsilon

INF = float("inf")


def altmin_config(**overrides):
    values = {"algorithm": "priv-altmin", "num_users": 800, "rounds": 2, "epsilon": 8.0}
    return small_config(**{**values, **overrides})


def test_noiseless_statistics_solve_is_the_direct_least_squares_solution(rng):
    n, m0, d, k = 40, 5, 6, 2
    x = rng.standard_normal((n, m0, d))
    y = rng.standard_normal((n, m0))
    u = orthonormalize(rng.standard_normal((d, k)))
    cov, corr, clipped = altmin.sufficient_statistics(u, x, y, INF, INF)
    assert clipped == 0
    # brute force: one design row vec(x v^T) per statistic sample, v solved on the first part
    a = altmin.sample_split(m0)
    v = local_vectors(u, x[:, :a], y[:, :a])
    rows, targets = [], []
    for i in range(n):
        for j in range(a, m0):
            rows.append(np.outer(x[i, j], v[i]).reshape(-1))
            targets.append(y[i, j])
    design, targets = np.array(rows), np.array(targets)
    np.testing.assert_allclose(cov, design.T @ design, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(corr, design.T @ targets, rtol=1e-10, atol=1e-10)
    direct = np.linalg.lstsq(design, targets, rcond=None)[0].reshape(d, k)
    # scaling both statistics (a mean instead of a sum) does not change the solution
    solved = altmin.solve_embedding(cov / n, corr / n, d, k)
    np.testing.assert_allclose(solved, orthonormalize(direct), atol=1e-8)
    # the prediction <x, U v> is linear in vec(U) with exactly these rows
    np.testing.assert_allclose(design @ direct.reshape(-1),
                               np.einsum("nmd,dk,nk->nm", x[:, a:], direct, v).reshape(-1))


def test_each_users_statistics_stay_within_the_stated_bounds(rng):
    n, m0, d, k, eta, zeta = 30, 5, 8, 2, 1.5, 0.7
    x = rng.standard_t(2, size=(n, m0, d)) * 3  # heavy tails: clipping must act
    y = rng.standard_t(2, size=(n, m0)) * 3
    u = orthonormalize(rng.standard_normal((d, k)))
    s = m0 - altmin.sample_split(m0)
    cov_bound, corr_bound = altmin.statistic_bounds(s, eta, zeta)
    assert (cov_bound, corr_bound) == (s * eta**2, s * zeta * eta)
    clipped_any = 0
    for i in range(n):
        cov, corr, clipped = altmin.sufficient_statistics(u, x[i:i + 1], y[i:i + 1], eta, zeta)
        assert np.linalg.norm(cov) <= cov_bound * (1 + 1e-12)
        assert np.linalg.norm(corr) <= corr_bound * (1 + 1e-12)
        clipped_any += clipped
    assert clipped_any > n // 2


def test_pair_initialization_is_bounded_symmetric_and_finds_the_subspace():
    problem = SyntheticProblem(20000, 10, 2, 10, 0.01, seed=3)
    data = generate_users(problem, np.arange(problem.num_users))
    (x0, y0), _ = data.split_halves()
    zeta = 2.0
    per_user = private_init.pair_statistics(x0[:50], y0[:50], zeta)
    assert np.allclose(per_user, per_user.transpose(0, 2, 1))
    bound = private_init.pair_bound(x0.shape[1], zeta)
    assert bound == 2 * zeta**2  # 5 samples -> 2 disjoint pairs
    assert np.all(np.linalg.norm(per_user, axis=(1, 2)) <= bound * (1 + 1e-12))
    total, _ = private_init.clipped_pair_sum(x0, y0, zeta)
    init = private_init.server_init(total / problem.num_users, problem.rank)
    assert subspace_distance(init, ground_truth_embedding(problem)) < 0.25


def test_round_noise_is_symmetric_on_the_covariance_with_the_planned_stds():
    config = altmin_config(rounds=1, feature_clip=2.0, response_clip=0.5, cov_budget_share=0.8)
    server = PrivateServer(config, 1, log=lambda _: None)
    init, round_1, _ = server.steps()
    server.aggregate(init, [NodeReply(0, UserContribution({"total": np.zeros((10, 10))},
                                                          800))], 0.0)
    captured = {}
    original = server.algorithm.apply
    server.algorithm.apply = lambda step, means: (captured.update(means),
                                                  original(step, means))[1]
    zero = UserContribution({"cov": np.zeros((20, 20)), "corr": np.zeros(20)}, 800)
    server.aggregate(round_1, [NodeReply(0, zero)], 0.0)
    s = 5 - altmin.sample_split(5)
    z = server.multipliers["round"]
    expected_cov = z / math.sqrt(0.8) * mean_sensitivity(s * 2.0**2, 800, "add-remove")
    expected_corr = z / math.sqrt(0.2) * mean_sensitivity(s * 0.5 * 2.0, 800, "add-remove")
    cov = captured["cov"]
    assert np.array_equal(cov, cov.T)
    assert cov[np.triu_indices(20)].std() == pytest.approx(expected_cov, rel=0.15)
    assert captured["corr"].std() == pytest.approx(expected_corr, rel=0.4)
    entry = server.accountant.ledger[-1]
    assert [p["name"] for p in entry["parts"]] == ["cov", "corr"]
    assert [p["noise_std"] for p in entry["parts"]] == pytest.approx([expected_cov,
                                                                      expected_corr])
    # the two parts are one Gaussian mechanism with multiplier z: 1/z^2 = sum 1/z_part^2
    assert sum(p["noise_multiplier"] ** -2 for p in entry["parts"]) == pytest.approx(z**-2)


def test_user_groups_partition_the_users_and_nodes_report_only_their_group():
    config = altmin_config(rounds=4, user_groups=4, num_users=803)
    groups = user_groups(config.seed, config.num_users, 4)
    sizes = np.bincount(groups)
    assert sizes.sum() == 803 and sizes.max() - sizes.min() <= 1
    server = PrivateServer(config, 3, log=lambda _: None)
    rounds = [s for s in server.steps() if s.kind == "round"]
    assert [s.group for s in rounds] == [0, 1, 2, 3]
    assert [s.population for s in rounds] == list(sizes)
    seen = np.zeros(803, dtype=int)
    for step in rounds:
        for p in range(3):
            ids = PrivAltMin.participants(config, step, partition_users(803, p, 3))
            assert np.all(groups[ids] == step.group)
            seen[ids] += 1
        assert sum(server.expected_users(step).values()) == sizes[step.group]
    assert np.all(seen == 1)  # each user takes part in exactly rounds / groups = 1 round
    # a node claiming all its users in a group round is rejected; the round goes on
    step = rounds[0]
    server.aggregate(server.steps()[0], [
        NodeReply(p, PrivAltMin.user_step(config, server.steps()[0], {},
                                          partition_users(803, p, 3))) for p in range(3)], 0.0)
    replies = [NodeReply(p, PrivAltMin.user_step(
        config, step, server.payload(step),
        PrivAltMin.participants(config, step, partition_users(803, p, 3)))) for p in range(3)]
    cheat = PrivAltMin.user_step(config, step, server.payload(step), partition_users(803, 1, 3))
    replies[1] = NodeReply(1, cheat)
    report = server.aggregate(step, replies, 0.0)
    assert report["nodes_answered"] == 2 and report["rejected"] == {"user-count": 1}


@pytest.mark.parametrize("groups,rounds", [(4, 4), (1, 4), (2, 4)])
def test_reported_epsilon_matches_an_independent_computation_with_parallel_composition(
        groups, rounds):
    config = altmin_config(rounds=rounds, user_groups=groups, epsilon=2.0, num_users=400)
    results = run_in_process(config, log=lambda _: None)
    privacy = results["privacy"]
    z = privacy["noise_multipliers"]
    per_user = [z["init"]] + [z["round"]] * (rounds // groups)
    # independent: the exact GDP conversion of what one user takes part in
    assert privacy["epsilon"] == pytest.approx(analytic_gaussian_epsilon(per_user, 1e-6),
                                               rel=0.01)
    assert 1.97 < privacy["epsilon"] <= 2.0
    ledger = privacy["ledger"]
    assert [e["release"] for e in ledger] == ["init"] + [f"round-{t}"
                                                        for t in range(1, rounds + 1)]
    if groups > 1:
        assert [e["user_group"] for e in ledger[1:]] == [t % groups for t in range(rounds)]
        # charged sequentially, the same releases would cost more
        sequential = [z["init"]] + [z["round"]] * rounds
        assert analytic_gaussian_epsilon(sequential, 1e-6) > 1.2 * privacy["epsilon"]
    epsilons = [e["epsilon_spent"] for e in ledger]
    assert epsilons == sorted(epsilons)


def test_priv_altmin_learns_and_noiseless_unclipped_altmin_converges():
    private = run_in_process(altmin_config(epsilon=8.0, num_users=3000, rounds=1,
                                           feature_clip=1e-4, response_clip=1e-4,
                                           init="u-statistic"), log=lambda _: None)
    m = private["metrics"]
    assert m["population_mse"] < 0.1 * m["local_only_mse"]
    exact = run_in_process(altmin_config(algorithm="altmin", clipping=False, num_users=3000,
                                         rounds=5), log=lambda _: None)
    assert exact["privacy"]["epsilon"] is None and exact["privacy"]["private"] is False
    assert exact["metrics"]["subspace_distance"] < 0.05
    assert exact["metrics"]["population_mse"] < 0.01 * exact["metrics"]["local_only_mse"]


@pytest.mark.parametrize("init", ["u-statistic", "pairs", "random"])
def test_either_initialization_combines_with_either_algorithm(init):
    for algorithm in ("priv-altmin", "private-fedrep"):
        config = altmin_config(algorithm=algorithm, init=init, rounds=2)
        results = run_in_process(config, log=lambda _: None)
        assert results["server_state"]["init"] == init
        steps = [r["step"] for r in results["rounds"]]
        assert steps[0] == ("round-1" if init == "random" else "init")
        names = [e["release"] for e in results["privacy"]["ledger"]]
        assert ("init" in names) == (init != "random")
        assert results["privacy"]["epsilon"] <= 8.0
