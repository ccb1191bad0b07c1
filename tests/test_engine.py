"""End-to-end runs of the core in one process (no Flower)."""

import numpy as np
import pytest

from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.algorithms.shared_params import DIM
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.params import ParamGroup
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.registry import available, register
from tests.conftest import small_config


def test_private_fedrep_beats_local_training_and_stays_within_budget():
    results = run_in_process(small_config(), log=lambda _: None)
    m, p = results["metrics"], results["privacy"]
    assert m["population_mse"] < 0.2 * m["local_only_mse"]
    assert p["epsilon"] <= 4.0 and p["epsilon"] > 3.9
    assert [e["release"] for e in p["ledger"]] == ["init", "round-1", "round-2", "round-3",
                                                  "round-4"]
    eps = [r["epsilon_spent"] for r in results["rounds"] if "epsilon_spent" in r]
    assert eps == sorted(eps)


def test_same_seed_same_result_and_layout_does_not_matter():
    a = run_in_process(small_config(), num_partitions=3, log=lambda _: None)
    b = run_in_process(small_config(), num_partitions=5, log=lambda _: None)
    assert a["metrics"]["population_mse"] == pytest.approx(b["metrics"]["population_mse"],
                                                           rel=1e-9)
    c = run_in_process(small_config(seed=1), num_partitions=3, log=lambda _: None)
    assert c["metrics"]["population_mse"] != a["metrics"]["population_mse"]


def test_more_privacy_means_more_noise_and_worse_utility():
    tight = run_in_process(small_config(epsilon=0.05), log=lambda _: None)
    loose = run_in_process(small_config(epsilon=8.0), log=lambda _: None)
    assert tight["privacy"]["noise_multipliers"]["round"] > 10 * loose["privacy"][
        "noise_multipliers"]["round"]
    assert tight["metrics"]["subspace_distance"] > loose["metrics"]["subspace_distance"]


def test_users_per_node_one_is_the_faithful_layout():
    results = run_in_process(small_config(num_users=40, users_per_node=1, epsilon=8.0),
                             log=lambda _: None)
    assert results["num_nodes"] == 40 and results["rounds"][-1]["nodes_answered"] == 40


@register
class MeanEstimation(Algorithm):
    """A plug-in written against the public contract: private mean of users' feature means."""

    name = "test-private-mean"
    components = (ParamGroup("mean estimation", (DIM,)),)  # declares the keys it reads

    def privacy_plan(self):
        return [PlannedRelease("mean", 1.0)]

    def steps(self):
        return [Step("mean", 0, "mean", (Part("total", (self.config.dim,), 1.0),)),
                Step("final")]

    def broadcast(self, step):
        return {}

    def apply(self, step, noisy_means):
        self.estimate = noisy_means["total"]
        return {"norm": float(np.linalg.norm(self.estimate))}

    def finalize(self, sums, users):
        return {"population_mse": float(np.linalg.norm(self.estimate)), "users": users}

    @classmethod
    def user_step(cls, config, step, arrays, user_ids):
        if step.kind == "final":
            return UserContribution({}, len(user_ids), 0, {"one": float(len(user_ids))})
        return UserContribution({"total": np.full(config.dim, 0.01) * len(user_ids)},
                                len(user_ids))


def test_a_registered_plugin_runs_by_name():
    assert "test-private-mean" in available()
    config = parse_config({"algorithm": "test-private-mean", "num-users": 100,
                                     "dim": 4, "epsilon": 2.0})
    results = run_in_process(config, log=lambda _: None)
    assert results["privacy"]["epsilon"] <= 2.0
    assert results["metrics"]["users"] == 100
