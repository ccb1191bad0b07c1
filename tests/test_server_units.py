"""The server's units, each alone: reply checks and node bounds, release, checkpoint store,
report. (``tests/test_server.py`` drives them together through ``PrivateServer``.)"""

import os
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.checkpoint import CheckpointError
from fedpriv.privacy.accounting import InfeasiblePlanError, PlannedRelease
from fedpriv.privacy.mechanisms import exponential_mechanism
from fedpriv.randomness import server_generator
from fedpriv.server import NodeReply, PrivateServer
from fedpriv.server.release import BudgetExceededError, Releaser, calibrate, missing_node_scale
from fedpriv.server.replies import REJECTION_KINDS, ReplyChecker, bound_node_sum
from fedpriv.server.report import progress_line, results_dict, step_report, summary_lines
from fedpriv.server.store import CheckpointStore
from tests.conftest import small_config

GRAD = Part("grad", (6, 2), clip_norm=1.0, share=0.5)
BIAS = Part("bias", (3,), clip_norm=2.0, share=0.5)
ROUND = Step("round", 1, "round", (GRAD, BIAS), population=600)
FINAL = Step("final")
EXPECTED = {0: 100, 1: 200}  # partition: users taking part


def contribution(users=100, **totals) -> UserContribution:
    arrays = {"grad": np.zeros(GRAD.shape), "bias": np.zeros(BIAS.shape)}
    arrays.update(totals)
    return UserContribution({k: v for k, v in arrays.items() if v is not None}, users)


# ----- replies: checks and node bounds ----------------------------------------------------------
def test_the_checker_rejects_a_nan_sum_and_a_wrong_shape_and_counts_them():
    checker = ReplyChecker()
    replies = [NodeReply(0, contribution(grad=np.full(GRAD.shape, np.nan))),
               NodeReply(1, contribution(200, bias=np.zeros(4)))]

    checked = checker.check(ROUND, replies, EXPECTED)

    assert checked.accepted == [] and checked.answered == set()
    assert [(r.partition_id, r.kind) for r in checked.rejected] == [(0, "non-finite"),
                                                                    (1, "shape")]
    assert checker.rejections == {"non-finite": 1, "shape": 1}


HOSTILE = {  # kind: (step, reply) that must be rejected as that kind
    "node-error": (ROUND, NodeReply(0, error="crashed")),
    "timeout": (ROUND, NodeReply(0, error="no reply", failure="timeout")),
    "unavailable": (ROUND, NodeReply(0, error="5: node unavailable", failure="unavailable")),
    "malformed": (ROUND, NodeReply(0, UserContribution(contribution().totals, 100, 101))),
    "unknown-partition": (ROUND, NodeReply(7, contribution())),
    "duplicate": (ROUND, NodeReply(1, contribution(200))),  # after an honest partition 1
    "user-count": (ROUND, NodeReply(0, contribution(99))),
    "missing-part": (ROUND, NodeReply(0, contribution(bias=None))),
    "unexpected-part": (ROUND, NodeReply(0, contribution(extra=np.zeros(2)))),
    "dtype": (ROUND, NodeReply(0, contribution(grad=np.zeros(GRAD.shape, dtype=np.int32)))),
    "shape": (ROUND, NodeReply(0, contribution(grad=np.zeros((2, 6))))),
    "non-finite": (ROUND, NodeReply(0, contribution(bias=np.array([0.0, np.inf, 0.0])))),
    "metrics": (FINAL, NodeReply(0, UserContribution({}, 100, 0, {"mse": np.nan}))),
    # a distributed step: vectors mod 2^8 of the padded dimensions
    "range": (ROUND, NodeReply(0, UserContribution({"grad": np.full(16, 256, dtype=np.int64),
                                                    "bias": np.zeros(4, dtype=np.int64)}, 100)),
              {"grad": (16, 8), "bias": (4, 8)}),
}


@pytest.mark.parametrize("kind", REJECTION_KINDS)
def test_every_rejection_kind_is_counted_under_its_name(kind):
    step, hostile, *ring = HOSTILE[kind]
    honest = NodeReply(1, UserContribution({}, 200, 0, {"mse": 1.0}) if step.is_final
                       else contribution(200))
    if ring:  # distributed: the honest node sends int64 vectors in [0, 2^8)
        honest = NodeReply(1, UserContribution({"grad": np.full(16, 255, dtype=np.int64),
                                                "bias": np.zeros(4, dtype=np.int64)}, 200))
    checker = ReplyChecker()

    checked = checker.check(step, [honest, hostile], EXPECTED, *ring)

    assert checked.answered == {1} and checked.accepted == [honest.contribution]
    assert [(r.partition_id, r.kind) for r in checked.rejected] == [(hostile.partition_id,
                                                                    kind)]
    assert checker.rejections == {kind: 1}


def test_an_oversized_node_sum_is_bounded_to_its_users_times_clip_and_counted():
    checker = ReplyChecker()
    huge = contribution(grad=np.full(GRAD.shape, 1e200))  # its plain norm overflows
    honest = contribution(200, grad=np.full(GRAD.shape, 0.5))

    total = checker.bounded_sum(GRAD, [huge, honest])

    expected = np.full(GRAD.shape, 100 * GRAD.clip_norm / np.sqrt(12)) + 0.5
    np.testing.assert_allclose(total, expected, rtol=1e-12)
    assert checker.bounded == 1


def test_scores_are_clamped_entrywise_to_users_times_bound():
    scores = Part("scores", (4,), clip_norm=1.0, mechanism="exponential")

    clamped, bounded = bound_node_sum(scores, np.array([-5.0, 3.0, 50.0, 10.0]), 10)

    np.testing.assert_array_equal(clamped, [0.0, 3.0, 10.0, 10.0])
    assert bounded


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e300, 1e300), min_size=12, max_size=12),
       st.integers(0, 1000))
def test_node_bounding_never_exceeds_the_bound_nor_grows_a_norm(values, users):
    total = np.array(values).reshape(GRAD.shape)

    bounded, _ = bound_node_sum(GRAD, total, users)

    norm = np.linalg.norm(bounded)
    assert norm <= users * GRAD.clip_norm * (1 + 1e-9)
    assert np.all(np.abs(bounded) <= np.abs(total))


# ----- release: noise, accountant, budget guard -------------------------------------------------
class Recorder(Algorithm):
    """An algorithm that only records what it is handed (the base class's noise)."""

    name = "recorder"

    def __init__(self, config):
        super().__init__(config)
        self.applied = []

    def apply(self, step, noisy_means):
        self.applied.append(dict(noisy_means))
        return {"applied": 1.0}


PLAN = [PlannedRelease("round", 1.0, count=3)]


def releaser(**overrides) -> tuple[Releaser, Recorder]:
    config = small_config(**overrides)
    algorithm = Recorder(config)
    release = Releaser(config, algorithm, PLAN, calibrate(config, PLAN), "round-3")
    release.check_budget([ROUND], [ROUND] * 3)
    return release, algorithm


def zero_means() -> dict[str, np.ndarray]:
    return {"grad": np.zeros(GRAD.shape), "bias": np.zeros(BIAS.shape)}


def test_the_release_adds_exactly_the_calibrated_noise_and_records_it():
    release, algorithm = releaser()
    z = release.multipliers["round"]

    report = release.gaussian(ROUND, zero_means(), 600)

    # a direct computation: std = z / sqrt(share) * clip / population, stream (seed, release i)
    for index, part in enumerate((GRAD, BIAS)):
        std = z / np.sqrt(part.share) * part.clip_norm / 600
        direct = server_generator(0, index).standard_normal(part.shape) * std
        np.testing.assert_allclose(algorithm.applied[0][part.name], direct, rtol=1e-12)
    (entry,) = release.accountant.ledger
    assert entry["release"] == "round-1" and entry["noise_multiplier"] == z
    assert [p["noise_std"] for p in entry["parts"]] == pytest.approx(
        [z / np.sqrt(0.5) * 1.0 / 600, z / np.sqrt(0.5) * 2.0 / 600])
    assert report["epsilon_spent"] == entry["epsilon_spent"] > 0
    assert release.releases == 2 and release.epsilon() == entry["epsilon_spent"]


def test_the_noise_std_is_the_planned_one_over_many_draws():
    release, algorithm = releaser(neighbouring_relation="replace-one")
    big = Step("round", 1, "round", (Part("g", (200, 200), 1.0),), population=600)

    release.gaussian(big, {"g": np.zeros((200, 200))}, 600)

    planned = release.multipliers["round"] * 2 * 1.0 / 600  # replace-one: twice the sensitivity
    assert algorithm.applied[0]["g"].std() == pytest.approx(planned, rel=0.01)
    assert release.accountant.ledger[0]["noise_std"] == pytest.approx(planned, rel=1e-12)


def test_a_release_off_the_verified_plan_is_refused_before_its_noise_is_drawn():
    release, algorithm = releaser()
    release.multipliers["round"] *= 0.5  # half the noise: more epsilon than was checked

    with pytest.raises(BudgetExceededError, match="not released"):
        release.gaussian(ROUND, zero_means(), 600)

    assert release.releases == 0 and algorithm.applied == [] and release.accountant.ledger == []


def test_a_plan_over_the_ceiling_is_refused_and_so_is_a_spent_epsilon_above_it():
    release, _ = releaser()
    release.accountant.record("earlier", release.multipliers["round"])  # one release too many

    with pytest.raises(BudgetExceededError, match="already spent"):
        release.check_budget([ROUND], [ROUND] * 3)
    with pytest.raises(BudgetExceededError, match="exceed the ceiling"):
        release.guard(4.0 * 1.001)


def test_the_exponential_mechanism_draws_from_its_stream_and_records_only_the_index():
    config = small_config()
    plan = [PlannedRelease("select", 1.0, mechanism="exponential")]
    step = Step("select", 0, "select", (Part("scores", (5,), 1.0, mechanism="exponential"),),
                population=600)
    algorithm = Recorder(config)
    release = Releaser(config, algorithm, plan, calibrate(config, plan), "select")
    release.check_budget([step], [step])
    scores = np.array([0.5, 0.1, 0.9, 0.2, 0.4])

    report = release.select(step, scores, 600)

    chosen = exponential_mechanism(scores, 4.0, 1.0 / 600, server_generator(0, 0))
    assert int(algorithm.applied[0]["choice"]) == chosen
    (entry,) = release.accountant.ledger
    assert entry["chosen"] == chosen and entry["epsilon"] == 4.0 and entry["delta"] == 0.0
    assert report["epsilon_spent"] == pytest.approx(4.0) and release.pure


def test_the_missing_node_rescale_uses_public_counts_and_can_be_off():
    assert missing_node_scale({0: 100, 1: 100, 2: 200}, {0, 2}) == pytest.approx(400 / 300)
    assert missing_node_scale({0: 100}, set()) == 1.0
    on, _ = releaser()
    assert on.rescale(ROUND, {0}, {0: 1, 1: 3}, {0: 1, 1: 1}) == 2.0  # by participants
    off, _ = releaser(rescale_missing_nodes=False)
    assert off.rescale(ROUND, {0}, {0: 1, 1: 1}, {0: 1, 1: 1}) == 1.0
    # a release without noise is not rescaled (and so does not report a rescale)
    assert on.rescale(Step("round", 1, None, (GRAD,)), {0}, {0: 1, 1: 1}, {0: 1, 1: 1}) == 1.0


def test_an_infeasible_plan_is_refused_at_calibration():
    config = small_config()

    with pytest.raises(InfeasiblePlanError, match="refusing to start: release 'round' needs"):
        calibrate(config, [PlannedRelease("round", weight=0.0)])


# ----- checkpoint store -------------------------------------------------------------------------
def test_the_store_round_trips_the_state_and_refuses_another_runs(tmp_path):
    path = tmp_path / "run.checkpoint"
    config = small_config().to_mapping()
    state = {"config": config, "completed": 2, "multipliers": {"round": 3.0},
             "pure_epsilons": {}, "rounds": [{"step": "init"}]}
    store = CheckpointStore(path)

    store.save(state)
    loaded = store.load(config, {"round": 3.0}, {})

    assert loaded == {"format": 1, **state, "pid": os.getpid()}
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(CheckpointError, match="seed = 0 there, 1 now"):
        store.load({**config, "seed": 1}, {"round": 3.0}, {})
    with pytest.raises(CheckpointError, match="privacy plan"):
        store.load(config, {"round": 2.0}, {})
    store.close()


def test_the_store_refuses_a_second_holder_of_the_lock(tmp_path):
    path = tmp_path / "run.checkpoint"
    first = CheckpointStore(path)

    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
        CheckpointStore(path)

    first.close()
    CheckpointStore(path).close()  # released: another server may take it


def test_the_store_refuses_to_overwrite_and_discards_file_and_lock(tmp_path):
    path = tmp_path / "run.checkpoint"
    store = CheckpointStore(path)
    store.save({"completed": 1, "total_steps": 3, "epsilon_spent": 0.5})

    with pytest.raises(CheckpointError, match="1 of 3 steps done"):
        store.refuse_overwrite()
    store.discard()

    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="needs a checkpoint path"):
        CheckpointStore(None).load({}, {}, {})


def test_a_server_checkpoint_keeps_the_format_1_keys(tmp_path):
    path = tmp_path / "run.checkpoint"
    server = PrivateServer(small_config(), 1, log=lambda _: None, checkpoint_path=path)
    zero = UserContribution({"total": np.zeros((10, 10))}, 600)

    server.aggregate(server.steps()[0], [NodeReply(0, zero)], 0.0)
    server.close()

    state = pickle.loads(path.read_bytes())
    assert set(state) == {"format", "config", "completed", "total_steps", "multipliers",
                          "pure_epsilons", "algorithm", "accountant", "rejections", "bounded",
                          "rounds", "metrics", "releases", "unnoised", "epsilon_spent", "pid"}


# ----- report -----------------------------------------------------------------------------------
def test_the_results_dict_is_built_from_its_inputs():
    config = small_config()
    ledger = [{"release": "init", "epsilon_spent": 1.5}]

    results = results_dict(
        config, num_nodes=3, runtime="test", private=True, epsilon=1.5, pure=False,
        multipliers={"init": 2.0}, ledger=ledger, metrics={"population_mse": 0.1},
        rounds=[{"step": "init"}], rejections={"timeout": 2}, bounded=1, resumed_from=None,
        server_state={"embedding": [1.0]}, wall_time_s=4.0)

    assert list(results) == ["algorithm", "num_users", "runtime", "num_nodes", "config",
                             "privacy", "metrics", "private_metrics", "rounds", "rejections",
                             "norm_bounded_nodes", "node_faults", "resumed_from_step",
                             "server_state", "wall_time_s"]
    assert results["privacy"]["epsilon"] == 1.5 and results["privacy"]["ledger"] is ledger
    assert results["privacy"]["delta"] == config.delta and results["norm_bounded_nodes"] == 1
    assert results["privacy"]["noise"] == "seeded" and results["privacy"]["max_epsilon"] == 4.0
    lines = summary_lines(results)
    assert "epsilon spent 1.5000" in lines[2] and "{'timeout': 2}" in lines[-1]
    results["privacy"]["epsilon"] = None
    assert "non-private" in summary_lines(results)[2]
    results["metrics"] = {}  # no node answered the final step: no quality figures of nan
    assert "no metrics: no node answered" in summary_lines(results)[1]


def test_a_step_report_and_its_progress_line():
    step = Step("round", 2, "round", (GRAD,), group=1)

    report = step_report(step, 3, 4, 450, {"timeout": 1})
    report.update({"epsilon_spent": 1.25, "population_mse": 0.5, "seconds": 0.125})

    assert report["nodes_failed"] == 1 and report["user_group"] == 1
    assert progress_line(report, 5, 3) == (
        "[3/5] round-2    epsilon_spent=1.2500  population_mse=0.5  users=450  nodes=3  "
        "failed=1  rejected=timeout:1  0.12s")
