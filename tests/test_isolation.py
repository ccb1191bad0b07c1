"""Per-user isolation and public shared settings, unit by unit: what one user's data can do
stays inside that user's own contribution (fedpriv.neighbours tests the whole path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.deep_algorithm import accuracy_sums, disjoint_batches
from fedpriv.algorithms.deep.ghost_clipping import ghost_clipped_sum
from fedpriv.algorithms.deep.problem import (
    capped,
    held_back,
    hosted_positions,
    node_of,
    problem_of,
    user_block,
)
from fedpriv.config import RunConfig
from fedpriv.configure import parse_config
from fedpriv.data.partition import Rows, user_keys
from fedpriv.privacy.mechanisms import (
    clip_by_norm,
    clipped_outer_sum,
    clipped_sum,
    factors_from_norms,
    norms,
    score_sum,
)
from fedpriv.server import NodeReply, PrivateServer


# ----- the mechanisms: non-finite and overflowing users give zero ------------------------------
def test_a_non_finite_norm_gives_factor_zero_not_one():
    factors = factors_from_norms(np.array([0.0, 0.5, 2.0, np.nan, np.inf]), 1.0)
    assert factors.tolist() == [1.0, 1.0, 0.5, 0.0, 0.0]


def test_a_user_with_nan_or_inf_adds_nothing_and_counts_as_clipped():
    values = np.array([[3.0, 4.0], [np.nan, 1.0], [np.inf, 0.0], [0.3, 0.4]])
    total, clipped = clipped_sum(values, 1.0)
    np.testing.assert_allclose(total, [0.6 + 0.3, 0.8 + 0.4])
    assert clipped == 3  # the first scaled down, the two non-finite dropped
    assert np.isfinite(clip_by_norm(values, 1.0)).all()


@pytest.mark.parametrize("scale", [1e-200, 1e-160, 1e160, 1e300])
def test_norms_are_exact_for_huge_and_tiny_entries(scale):
    """Squares of 1e-200 underflow to 0 and of 1e300 overflow: measured scaled instead. (An
    update of 1e200 times one of 1e-200 looked like norm 0, unclipped: a harness finding.)"""
    row = np.array([[3.0, 4.0]]) * scale
    assert norms(row)[0] == pytest.approx(5.0 * scale, rel=1e-15)
    total, clipped = clipped_outer_sum(np.array([[3e200, 4e200]]), np.array([[1e-200, 0.0]]),
                                       1.0)
    assert np.linalg.norm(total) == pytest.approx(1.0, rel=1e-12) and clipped == 1


def test_exponential_mechanism_scores_of_a_broken_user_are_zero():
    scores = np.array([[0.2, np.nan, 0.5], [0.9, 0.1, 7.0]])  # (candidates, users)
    total, dropped = score_sum(scores, 1.0)
    np.testing.assert_allclose(total, [0.2 + 0.5, 0.9 + 1.0])
    assert dropped == 1


# ----- the deep paths --------------------------------------------------------------------------
def deep_config(**keys) -> RunConfig:
    return parse_config({"algorithm": "deep-dp-fedavg", "dataset": "digits",
                                   "num-users": 60, "hidden-sizes": "16", **keys})


@pytest.mark.parametrize("poison", [np.nan, 1e37, 1e38])
def test_ghost_clipping_leaves_the_other_users_sum_as_it_was(poison):
    """One user's rows nan, or huge: its factor is 0 where its norm is not finite (its rows
    zeroed before the products), else it is clipped; either way the chunk's sum is the other
    users' sum (each alone) plus at most the clip, and it counts as clipped."""
    config = deep_config()
    problem = problem_of(config)
    spec = problem.spec
    model = torch.from_numpy(spec.initial(0))
    block = user_block(problem, np.arange(8))
    x = block.x.clone()
    x[3] = x[3] * poison
    clean, _ = ghost_clipped_sum(spec, model, None, block.x, block.y, block.mask, 0.1, 0.5)
    others = np.array([i for i in range(8) if i != 3])
    alone, _ = ghost_clipped_sum(spec, model, None, block.x[others], block.y[others],
                                 block.mask[others], 0.1, 0.5)
    poisoned, clipped = ghost_clipped_sum(spec, model, None, x, block.y, block.mask, 0.1, 0.5)
    assert np.isfinite(poisoned).all() and clipped >= 1
    assert np.linalg.norm(poisoned - alone) <= 0.5 * (1 + 1e-5)
    if np.isnan(poison):
        np.testing.assert_allclose(poisoned, alone, rtol=1e-5, atol=1e-9)
    assert not np.allclose(poisoned, clean)


def test_the_per_user_path_drops_a_non_finite_update():
    updates = torch.tensor([[0.3, 0.4], [float("nan"), 0.0], [3.0, 4.0]])
    total, clipped = dm.clipped_sum(updates, 1.0)
    np.testing.assert_allclose(total, [0.9, 1.2], rtol=1e-6)
    assert clipped == 2


def test_metrics_leave_out_a_user_whose_scores_are_not_finite():
    sums = accuracy_sums(np.array([1.0, 0.5, 0.2]), np.array([0.1, np.nan, 0.3]),
                         np.array([4, 4, 0]))
    assert sums["acc_users"] == 1 and sums["acc_sum"] == 1.0 and sums["acc_unscored"] == 1


def test_a_user_with_fewer_rows_than_two_batches_uses_half_its_rows_alone():
    """b = 4; user 1 has 5 rows: batches of 2 each, disjoint, within its rows; the other
    users' batches are what they are without it (a function of their own key and count)."""
    counts = np.array([12, 5, 1, 0, 12])
    keys = np.array([10, 11, 12, 13, 14])
    first, second, mask = disjoint_batches(7, 3, keys, counts, 12, 4)
    assert mask.sum(1).tolist() == [4, 2, 0, 0, 4]
    assert set(first[1, :2]).isdisjoint(second[1, :2]) and max(first[1, :2]) < 5
    alone = disjoint_batches(7, 3, keys[[0, 4]], counts[[0, 4]], 12, 4)
    assert np.array_equal(first[[0, 4]], alone[0]) and np.array_equal(second[[0, 4]],
                                                                      alone[1])


# ----- a user's randomness is its own --------------------------------------------------------
def rows_of(counts) -> Rows:
    counts = np.asarray(counts)
    return Rows(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                np.arange(int(np.sum(counts)), dtype=np.int64) * 3)


def test_held_back_and_capped_rows_depend_on_the_users_own_key_only():
    keys = np.array([500, 7, 42])
    rows = rows_of([30, 8, 3])
    train, held = held_back(rows, 4, seed=1, keys=keys)
    assert held.counts.tolist() == [4, 4, 1] and train.counts.tolist() == [26, 4, 2]
    # user 42 alone, or next to other users: the same rows held back
    _, alone = held_back(rows_of([3]), 4, seed=1, keys=np.array([42]))
    assert np.array_equal(alone.rows // 3, held.rows[held.offsets[2]:] // 3 - 38)
    cut = capped(rows, 10, keys, seed=1)
    assert cut.counts.tolist() == [10, 8, 3]
    mine = cut.rows[:10]
    assert np.all(np.diff(mine) > 0) and set(mine) <= set(rows.rows[:30])
    other = capped(rows_of([30]), 10, np.array([500]), seed=1)
    assert np.array_equal(other.rows, mine)


def test_natural_users_are_hosted_by_their_own_id():
    keys = user_keys(np.array([3, 17, 99, 1000, 5]))
    nodes = node_of(keys, 4)
    assert np.array_equal(node_of(keys[[2]], 4), nodes[[2]])  # no other user moves it
    hosted = np.concatenate([hosted_positions("natural", keys, 5, p, 4) for p in range(4)])
    assert sorted(hosted.tolist()) == [0, 1, 2, 3, 4]
    text = user_keys(np.array(["alice", "bob"]))
    assert np.array_equal(text, user_keys(np.array(["alice", "bob"])))
    assert text[0] != text[1]


# ----- the missing-node rescale: only for nodes no user's data can have lost -----------------
def test_the_rescale_ignores_errors_and_bad_sums_and_counts_lost_nodes():
    """A node that answers with an error or a non-finite sum (which a bug meeting one user's
    data could cause) counts as present with zero: the release is not scaled up. A node that
    timed out or was lost by the transport is missing and rescaled for."""
    config = parse_config({"algorithm": "private-fedrep", "num-users": 400,
                                     "dim": 10, "epsilon": 4.0, "rounds": 2})

    def scale_for(failure: NodeReply) -> float | None:
        server = PrivateServer(config, 4, log=lambda _: None)
        step = server.next_step()
        zero = {part.name: np.zeros(part.shape) for part in step.parts}
        replies = [NodeReply(p, UserContribution(zero, server.expected_users(step)[p]))
                   for p in range(3)] + [failure]
        report = server.aggregate(step, replies, 0.0)
        server.close()
        return report.get("missing_node_rescale")

    nan = UserContribution({"total": np.full((10, 10), np.nan)}, 100)
    assert scale_for(NodeReply(3, error="ValueError: boom")) is None
    assert scale_for(NodeReply(3, nan)) is None
    assert scale_for(NodeReply(3, error="no reply", failure="timeout")) == pytest.approx(4 / 3)
    assert scale_for(NodeReply(3, error="5: node", failure="unavailable")) == pytest.approx(
        4 / 3)


# ----- the server reads no user data --------------------------------------------------------
def test_the_server_of_a_data_file_run_reads_no_row(tmp_path, monkeypatch):
    """Building and checking the server of a csv run calls none of the readers of rows: it
    builds the model from the header and the declared classes."""
    from fedpriv.data import sources, tables

    path = tmp_path / "d.csv"
    path.write_text("user,split,label,a,b,c\n" + "".join(
        f"{u},{s},{u % 3},{u},{u / 2},1\n" for u in range(40) for s in ("train", "test")))
    config = parse_config({"algorithm": "deep-private-fedrep", "dataset": "csv",
                                     "data-file": str(path), "partition": "natural",
                                     "num-classes": 3, "num-users": 40, "hidden-sizes": "8"})

    def forbidden(*_args, **_kwargs):
        raise AssertionError("the server read the users' rows")

    for module, name in ((tables, "table_columns"), (tables, "table_rows"),
                         (sources, "load_source"), (sources, "_load")):
        monkeypatch.setattr(module, name, forbidden)
    import fedpriv.algorithms.deep.problem as problem_module

    monkeypatch.setattr(problem_module, "load_source", forbidden)
    server = PrivateServer(config, 3, log=lambda _: None)
    step = server.next_step()
    assert server.expected_users(step) == {0: None, 1: None, 2: None}
    assert server.payload(step)["model"].shape == (server.algorithm.model.size,)
    server.close()


def test_a_natural_run_divides_by_the_public_population_and_hosts_every_user(tmp_path):
    from fedpriv.engine import run_in_process

    path = tmp_path / "d.csv"
    rng = np.random.default_rng(0)
    lines = ["user,split,label,a,b"]
    for u in range(25):
        for s in ("train",) * 6 + ("test",) * 2:
            lines.append(f"id{u},{s},{rng.integers(2)},{rng.normal():.4f},{rng.normal():.4f}")
    path.write_text("\n".join(lines) + "\n")
    config = parse_config({"algorithm": "deep-private-fedrep", "dataset": "csv",
                                     "data-file": str(path), "partition": "natural",
                                     "num-classes": 2, "num-users": 30, "hidden-sizes": "4",
                                     "rounds": 1, "epsilon": 2.0, "delta": 1e-5,
                                     "clip-quantile": 0.0, "checkpoint": False})
    cls = PrivateServer(config, 1, log=lambda _: None).algorithm.__class__
    (note,) = cls.input_notes(config)  # fedpriv run prints it: 25 users, n = 30
    assert "(25 users); the releases divide by num-users = 30" in note
    assert cls.input_notes(parse_config({**config.to_mapping(), "num-users": 25}))\
        == []
    results = run_in_process(config, num_partitions=3, log=lambda _: None)
    (entry,) = results["privacy"]["ledger"]
    assert entry["l2_sensitivity"] == pytest.approx(config.clip_norm / 30)
    (round_1,) = [r for r in results["rounds"] if r["step"] == "round-1"]
    assert round_1["users_contributing"] == 25 and round_1["nodes_answered"] == 3
    assert results["metrics"]["users_evaluated"] == 25


def test_a_step_of_the_final_kind_still_answers_for_an_empty_cohort():
    config = deep_config()
    cls = type(PrivateServer(config, 1, log=lambda _: None).algorithm)
    contrib = cls.user_step(config, Step("final"), {"model": problem_of(config).spec.initial(0)},
                            np.zeros(0, dtype=np.int64))
    assert contrib.metrics["acc_unscored"] == 0
