"""A node computes its users in blocks, and the data cache is bounded: same results, bounded
memory (``fedpriv.nodes``, ``fedpriv.data.cache``)."""

import tracemalloc

import numpy as np
import pytest

from fedpriv.algorithms.base import partition_users
from fedpriv.algorithms.catalogue import BUILTIN
from fedpriv.configure import parse_config, select_keys
from fedpriv.data import cache as cohorts
from fedpriv.data.cache import block_cache
from fedpriv.engine import run_in_process
from fedpriv.nodes import node_step
from fedpriv.registry import get_algorithm

TINY = {"num-users": 300, "rounds": 2, "epsilon": 4.0, "test-samples-per-user": 3, "dim": 6,
        "candidates": 20, "jl-dim": 2, "cover-radius": 0.5, "users-per-node": 150}


def tiny(name):
    family = {"rank": 1} if name.startswith("jl-exp") else {}
    if name.startswith(("meta", "private-meta", "dp-ftmrl", "ftmrl", "jl")):
        family["feature-dist"] = "unit-ball"
    if name.startswith("deep"):  # real data: digits holds 1,437 training images
        family.update({"num-users": 60, "users-per-node": 30, "hidden-sizes": "16"})
    if name.startswith("fewshot"):  # few-shot tasks of digits' images
        family.update({"num-users": 60, "users-per-node": 30, "hidden-sizes": "16",
                       "queries": 3, "tasks-per-round": 20})
    return parse_config(select_keys({**TINY, **family, "algorithm": name}))


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
    config = parse_config({"num-users": 3000, "dim": 10, "rounds": 2})
    one_block = 500 * 10 * (10 * 8 + 8) + 500 * (8 + 2 * 8)  # ids, features, labels, v*
    monkeypatch.setenv(cohorts.BLOCK_USERS_ENV, "500")
    monkeypatch.setattr(block_cache(), "capacity", 3 * one_block)
    block_cache().clear()
    block_cache().peak = 0
    run_in_process(config, log=lambda _: None)
    cache = block_cache()
    assert 0 < cache.peak <= cache.capacity and cache.nbytes <= cache.capacity


def test_a_nodes_memory_for_a_step_is_bounded_by_the_block():
    config = parse_config({"num-users": 20000, "dim": 20, "rounds": 2})
    algorithm = get_algorithm("private-fedrep")
    server_init = algorithm(config)
    step = server_init.steps()[1]  # round 1
    arrays = {"embedding": np.linalg.qr(np.random.default_rng(0).standard_normal((20, 2)))[0]}
    hosted = partition_users(config.num_users, 0, 1)

    def peak(block: int) -> int:
        block_cache().clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cohorts.BLOCK_USERS_ENV, str(block))
            mp.setattr(block_cache(), "capacity", 0)  # nothing kept: the working set alone
            tracemalloc.start()
            node_step(algorithm, config, step, arrays, hosted)
            _, top = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        return top

    assert peak(1000) < 0.15 * peak(20000)


def test_s0_part_is_the_first_half_of_the_users_points():
    from fedpriv.data.cache import cohort_data
    from fedpriv.data.synthetic import SyntheticProblem

    problem = SyntheticProblem(900, 7, 2, 10, 0.1, seed=4)
    block_cache().clear()
    ids = np.arange(100, 700)
    full = cohort_data(problem, ids)
    s0 = cohort_data(problem, ids, part="s0")
    (x0, y0), _ = full.split_halves()
    assert np.array_equal(s0.features, x0) and np.array_equal(s0.labels, y0)
    assert np.array_equal(s0.user_ids, ids)
    with pytest.raises(ValueError, match="part"):
        cohort_data(problem, ids, part="s1")


def test_float32_data_is_the_float64_data_rounded_and_moves_metrics_by_rounding_only():
    from fedpriv.data.cache import cohort_data
    from fedpriv.data.synthetic import SyntheticProblem

    problem = SyntheticProblem(500, 8, 2, 10, 0.1, seed=5)
    rounded = SyntheticProblem(500, 8, 2, 10, 0.1, seed=5, dtype="float32")
    block_cache().clear()
    ids = np.arange(500)
    exact, small = cohort_data(problem, ids), cohort_data(rounded, ids)
    assert small.features.dtype == np.float64  # computed on in float64
    assert np.array_equal(small.features, exact.features.astype(np.float32))
    assert np.array_equal(small.labels, exact.labels.astype(np.float32))
    cached = {k[-1]: b for k, b in block_cache()._blocks.items() if k[0] == rounded}
    assert cached["all"].features.dtype == np.float32  # kept in float32: half the bytes
    base = {"num-users": 2000, "dim": 30, "rounds": 3}  # m < d: well-posed local fits
    r64 = run_in_process(parse_config(base), log=lambda _: None)
    r32 = run_in_process(parse_config({**base, "data-dtype": "float32"}),
                         log=lambda _: None)
    assert r32["privacy"] == r64["privacy"]
    for key in ("population_mse", "test_mse", "local_only_mse"):
        assert r32["metrics"][key] == pytest.approx(r64["metrics"][key], rel=1e-5), key
        assert r32["metrics"][key] != r64["metrics"][key], key  # the rounding is real
    with pytest.raises(ValueError, match="data-dtype"):
        parse_config({**base, "data-dtype": "float16"})


def test_flower_actors_get_a_share_of_the_default_cache_unless_one_is_set():
    from fedpriv.launcher import with_cache_share

    assert with_cache_share({}, 2) == {cohorts.CACHE_MB_ENV: str(cohorts.DEFAULT_CACHE_MB // 2)}
    assert with_cache_share({}, 1000)[cohorts.CACHE_MB_ENV] == "64"
    assert with_cache_share({cohorts.CACHE_MB_ENV: "300"}, 2) == {cohorts.CACHE_MB_ENV: "300"}


def test_processes_that_start_actors_get_no_prestarted_ray_workers_unless_asked():
    from fedpriv.launcher import RAY_PRESTART_ENV, actor_env

    env = actor_env({}, 2)
    assert env[RAY_PRESTART_ENV] == "0" and cohorts.CACHE_MB_ENV in env
    assert actor_env({RAY_PRESTART_ENV: "1"}, 2)[RAY_PRESTART_ENV] == "1"  # the user's wins
