"""A node computes its users in blocks, and the data cache is bounded: same results, bounded
memory (``fedpriv.cohorts``)."""

import tracemalloc

import numpy as np
import pytest

from fedpriv import cohorts
from fedpriv.algorithms.catalogue import BUILTIN
from fedpriv.cohorts import CACHE, node_step, partition_users
from fedpriv.config import RunConfig, select_keys
from fedpriv.engine import run_in_process
from fedpriv.registry import get_algorithm

TINY = {"num-users": 300, "rounds": 2, "epsilon": 4.0, "test-samples-per-user": 3, "dim": 6,
        "candidates": 20, "jl-dim": 2, "cover-radius": 0.5, "users-per-node": 150}


def tiny(name):
    family = {"rank": 1} if name.startswith("jl-exp") else {}
    if name.startswith(("meta", "private-meta", "dp-ftmrl", "ftmrl", "jl")):
        family["feature-dist"] = "unit-ball"
    return RunConfig.from_mapping(select_keys({**TINY, **family, "algorithm": name}))


@pytest.mark.parametrize("name", [cls.name for cls in BUILTIN])
def test_blocks_of_users_give_the_results_of_the_whole_cohort(name, monkeypatch):
    config = tiny(name)
    whole = run_in_process(config, log=lambda _: None)
    monkeypatch.setenv(cohorts.BLOCK_USERS_ENV, "37")  # blocks cut across partitions
    blocked = run_in_process(config, log=lambda _: None)
    assert blocked["privacy"] == whole["privacy"]
    assert blocked["metrics"].keys() == whole["metrics"].keys()
    for key, value in whole["metrics"].items():
        assert blocked["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert np.allclose(np.asarray(blocked["server_state"].get("embedding", 0.0), float),
                       np.asarray(whole["server_state"].get("embedding", 0.0), float))


def test_the_cache_never_holds_more_than_its_limit(monkeypatch):
    config = RunConfig.from_mapping({"num-users": 3000, "dim": 10, "rounds": 2})
    one_block = 500 * 10 * (10 * 8 + 8) + 500 * (8 + 2 * 8)  # ids, features, labels, v*
    monkeypatch.setenv(cohorts.BLOCK_USERS_ENV, "500")
    monkeypatch.setattr(CACHE, "capacity", 3 * one_block)
    CACHE.clear()
    CACHE.peak = 0
    run_in_process(config, log=lambda _: None)
    assert 0 < CACHE.peak <= CACHE.capacity and CACHE.nbytes <= CACHE.capacity


def test_a_nodes_memory_for_a_step_is_bounded_by_the_block():
    config = RunConfig.from_mapping({"num-users": 20000, "dim": 20, "rounds": 2})
    algorithm = get_algorithm("private-fedrep")
    server_init = algorithm(config)
    step = server_init.steps()[1]  # round 1
    arrays = {"embedding": np.linalg.qr(np.random.default_rng(0).standard_normal((20, 2)))[0]}
    hosted = partition_users(config.num_users, 0, 1)

    def peak(block: int) -> int:
        CACHE.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cohorts.BLOCK_USERS_ENV, str(block))
            mp.setattr(CACHE, "capacity", 0)  # nothing kept: the working set alone
            tracemalloc.start()
            node_step(algorithm, config, step, arrays, hosted)
            _, top = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        return top

    assert peak(1000) < 0.15 * peak(20000)


@pytest.mark.parametrize("family", ["gaussian", "mixed"])
def test_user_data_is_the_seeded_per_user_draw_it_always_was(family):
    """Generation got faster (one generator per user and data set, v* drawn once per process);
    every user's data must stay the same function of (seed, user id), drawn here as the
    original code drew it."""
    from fedpriv.data.synthetic import SyntheticProblem, generate_users, ground_truth_embedding

    problem = SyntheticProblem(500, 6, 2, 8, 0.1, family, seed=3)
    ids = np.array([0, 499, 17, 250])
    data = generate_users(problem, ids)
    u_star = ground_truth_embedding(problem)
    for row, uid in enumerate(ids):
        kind = problem.feature_dist
        if kind == "mixed":
            pick = np.random.default_rng([3, 0, 2, int(uid)]).integers(0, 3)
            kind = ("gaussian", "rademacher", "uniform")[int(pick)]
        rng = np.random.default_rng([3, 1, int(uid)])
        if kind == "gaussian":
            x = rng.standard_normal((8, 6))
        elif kind == "rademacher":
            x = rng.integers(0, 2, size=(8, 6)) * 2.0 - 1.0
        else:
            x = rng.uniform(-np.sqrt(3.0), np.sqrt(3.0), size=(8, 6))
        noise = rng.standard_normal(8) * 0.1
        v = np.random.default_rng([3, 0, 1, int(uid)]).standard_normal(2)
        assert np.array_equal(data.features[row], x)
        assert np.array_equal(data.true_local_vectors[row], v)
        assert np.allclose(data.labels[row], x @ (u_star @ v) + noise, rtol=0, atol=1e-12)
