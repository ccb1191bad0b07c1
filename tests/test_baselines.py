"""Each baseline on a small problem."""

import numpy as np
import pytest

from fedpriv.algorithms.personalization.problem import local_models, problem_of
from fedpriv.config import ConfigError
from fedpriv.data.synthetic import generate_users, ground_truth_embedding
from fedpriv.engine import run_in_process
from tests.conftest import small_config

QUIET = {"log": lambda _: None}


def test_local_only_is_minimum_norm_least_squares_and_releases_nothing():
    config = small_config(algorithm="local-only", num_users=200, dim=12, samples_per_user=6)
    results = run_in_process(config, **QUIET)
    m, p = results["metrics"], results["privacy"]
    assert m["population_mse"] == pytest.approx(m["local_only_mse"])
    assert p["epsilon"] == 0.0 and p["ledger"] == []
    assert [r["step"] for r in results["rounds"]] == ["final"]
    problem = problem_of(config)
    data = generate_users(problem, np.arange(5))
    for i in range(5):  # m = 6 < d = 12: the minimum-norm solution
        expected = np.linalg.lstsq(data.features[i], data.labels[i], rcond=None)[0]
        np.testing.assert_allclose(local_models(problem, np.array([i]))[0], expected,
                                   atol=1e-10)
    assert m["population_mse"] > 0.3  # m < d: users alone cannot learn


def test_known_embedding_is_the_floor_of_the_final_fit():
    config = small_config(algorithm="known-embedding", num_users=400)
    known = run_in_process(config, **QUIET)["metrics"]
    problem = problem_of(config)
    data = generate_users(problem, np.arange(400))
    _, (x1, y1) = data.split_halves()
    u = ground_truth_embedding(problem)
    w = np.stack([u @ np.linalg.lstsq(x1[i] @ u, y1[i], rcond=None)[0] for i in range(400)])
    w_star = data.true_local_vectors @ u.T
    expected = config.label_noise**2 + ((w - w_star) ** 2).sum(axis=1).mean()
    assert known["population_mse"] == pytest.approx(expected, rel=1e-9)
    assert known["subspace_distance"] == 0.0
    learned = run_in_process(small_config(num_users=400, epsilon=8.0), **QUIET)["metrics"]
    assert known["population_mse"] <= learned["population_mse"]


@pytest.mark.parametrize("algorithm", ["fedrep", "altmin"])
def test_non_private_baselines_add_no_noise_with_or_without_clipping(algorithm):
    clipped = run_in_process(small_config(algorithm=algorithm, num_users=1000), **QUIET)
    unclipped = run_in_process(small_config(algorithm=algorithm, num_users=1000,
                                            clipping=False), **QUIET)
    for results in (clipped, unclipped):
        p = results["privacy"]
        assert p["epsilon"] is None and p["private"] is False and p["ledger"] == []
        assert "epsilon_spent" not in results["rounds"][1]
    assert clipped["rounds"][1]["users_clipped"] > 0
    assert unclipped["rounds"][1]["users_clipped"] == 0
    assert clipped["metrics"]["population_mse"] != unclipped["metrics"]["population_mse"]
    # the same seed twice gives the same numbers: no hidden noise
    again = run_in_process(small_config(algorithm=algorithm, num_users=1000), **QUIET)
    assert again["metrics"] == clipped["metrics"]
    best = min(clipped["metrics"]["population_mse"], unclipped["metrics"]["population_mse"])
    assert best < 0.1 * clipped["metrics"]["local_only_mse"]


def test_dp_global_model_is_private_and_cannot_personalize():
    config = small_config(algorithm="dp-global-model", num_users=1000, epsilon=2.0, rounds=3)
    results = run_in_process(config, **QUIET)
    p, m = results["privacy"], results["metrics"]
    assert 1.98 < p["epsilon"] <= 2.0
    assert [e["release"] for e in p["ledger"]] == ["round-1", "round-2", "round-3"]
    assert p["ledger"][0]["l2_sensitivity"] == pytest.approx(config.clip_norm / 1000)
    # one vector for users whose models w*_i = U* v*_i, v*_i ~ N(0, I_k): the best single
    # model is near 0, with population MSE about R^2 + E||w*||^2 = R^2 + k
    assert 1.5 < m["population_mse"] < 3.0
    w = np.array(results["server_state"]["model"])
    assert np.linalg.norm(w) < 1.0


@pytest.mark.parametrize("algorithm", ["private-fedrep", "priv-altmin", "dp-global-model"])
def test_private_algorithms_refuse_to_run_without_clipping(algorithm):
    with pytest.raises(ConfigError, match="clipping"):
        small_config(algorithm=algorithm, clipping=False)


@pytest.mark.parametrize("algorithm", ["local-only", "known-embedding", "fedrep",
                                       "private-fedrep", "dp-global-model"])
def test_algorithms_without_user_groups_refuse_them(algorithm):
    with pytest.raises(ConfigError, match="user-groups"):
        small_config(algorithm=algorithm, user_groups=2)
