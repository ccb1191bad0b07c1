"""Never worse than training alone: each user's final choice between its local model, the
method's personal model and their mixes, made by cross-validation on its own training rows
(``fedpriv.algorithms.deep.choice``): what it reads, what it leaves unchanged (the release),
and what it reports."""

import math

import numpy as np
import pytest
import torch

from fedpriv.algorithms.deep import choice
from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.problem import UserBlock, model_of, problem_of, user_block
from fedpriv.params import ConfigError
from fedpriv.registry import get_algorithm
from tests.test_deep import config, run

ROUNDS = ("deep-private-fedrep", "deep-dp-fedavg", "deep-dp-fedavg-ft")


def test_ties_go_to_the_shared_model_and_a_user_without_rows_keeps_it():
    y = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1.0, 1, 1, 1], [0.0, 0, 0, 0]])
    right = torch.nn.functional.one_hot(y, 2).float() * 0.8 + 0.1
    wrong = 1.0 - right
    barely = torch.nn.functional.one_hot(y, 2).float() * 0.1 + 0.45
    # user 0: both models right everywhere (a tie: the shared model); user 1: the local model
    # barely right on every row, the shared one sure and wrong (only the local model alone is
    # right); user 2: no rows
    shared = torch.stack([right[0], wrong[1], wrong[2]])
    local = torch.stack([right[0], barely[1], right[2]])
    weights = choice.chosen_weights(shared, local, y, mask, 0.0)
    assert weights.tolist() == [1.0, 0.0, 1.0]


def test_a_mix_is_chosen_where_it_is_right_on_more_rows_than_either_model():
    # two rows: the shared model barely wrong on row 0 and sure and right on row 1; the local
    # model the reverse. Each alone is right on one row; only a mix gets both right.
    y = torch.tensor([[0, 1]])
    mask = torch.ones(1, 2)
    shared = torch.tensor([[[0.45, 0.55], [0.1, 0.9]]])
    local = torch.tensor([[[0.9, 0.1], [0.55, 0.45]]])
    (w,) = choice.chosen_weights(shared, local, y, mask, 0.0).tolist()
    assert 0.0 < w < 1.0
    mix = torch.softmax(w * shared.log() + (1 - w) * local.log(), -1)  # the log-linear pool
    assert torch.allclose(choice.mixed(torch.tensor([w]), shared, local), mix)
    assert mix.argmax(-1).tolist() == [[0, 1]]


def _problem(**keys):
    cfg = config("deep-private-fedrep", **keys)
    return cfg, problem_of(cfg)


def test_each_held_back_fold_is_scored_by_models_that_never_saw_its_labels():
    cfg, problem = _problem()
    ids = np.arange(6)
    train = user_block(problem, ids, "train")
    test = user_block(problem, ids, "test")
    held, _ = choice.local_predictions(cfg, problem, train, test)
    fold = choice.row_folds(train.y.shape[1], cfg.choice_folds, train.y.device)
    flipped = UserBlock(train.user_ids, train.keys, train.x,
                        torch.where(fold[None, :] == 0, (train.y + 1) % 10, train.y),
                        train.mask, train.counts)
    held_flipped, _ = choice.local_predictions(cfg, problem, flipped, test)
    inside = (fold == 0)[None, :] & (train.mask > 0)
    assert torch.equal(held[inside], held_flipped[inside])  # fold 0 never saw its labels
    assert not torch.allclose(held[~inside & (train.mask > 0)],
                              held_flipped[~inside & (train.mask > 0)])


def test_the_choice_never_reads_the_test_rows():
    cfg, problem = _problem()
    model = torch.from_numpy(model_of(cfg).initial(cfg.seed))
    ids = np.arange(8)
    before = choice.choice_scores(cfg, problem, model, ids, "zero")
    y, x = problem.source.y_test, problem.source.x_test
    rows = problem.users.test.rows
    saved_y, saved_x = y[rows].copy(), x[rows].copy()
    try:
        y[rows] = (saved_y + 3) % 10  # every test label of the problem changed
        x[rows] = np.nan  # and every test feature
        after = choice.choice_scores(cfg, problem, model, ids, "zero")
    finally:
        y[rows], x[rows] = saved_y, saved_x
    assert np.array_equal(before["weight"], after["weight"])
    assert not np.allclose(before["acc"], after["acc"])


@pytest.mark.parametrize("head_from", choice.HEAD_FROM)
def test_a_users_choice_is_its_own_whatever_the_other_users_rows_hold(head_from):
    """Users 1-7's training labels changed and user 3's features made non-finite: user 0's
    weight, scores and kept model are the same to the last bit, whatever the final head."""
    cfg, problem = _problem()
    model = torch.from_numpy(model_of(cfg).initial(cfg.seed))
    ids = np.arange(8)
    before = choice.choice_scores(cfg, problem, model, ids, head_from)
    y, x, off = problem.source.y_train, problem.source.x_train, problem.users.train.offsets
    mine = problem.users.train.rows[off[1]:off[8]]
    theirs = problem.users.train.rows[off[3]:off[4]]
    saved_y, saved_x = y[mine].copy(), x[theirs].copy()
    try:
        y[mine] = (saved_y + 1) % 10
        x[theirs] = np.nan
        after = choice.choice_scores(cfg, problem, model, ids, head_from)
    finally:
        y[mine], x[theirs] = saved_y, saved_x
    for key in ("weight", "acc", "loss", "shared", "local"):
        assert before[key][0] == after[key][0], key
    # the broken user keeps the shared model: the global model as it is scores its (finite)
    # test rows; a head fitted on its rows is not finite, and the user is left out of the sums
    assert after["weight"][3] == 1.0
    sums = choice.choice_sums(after)
    assert np.isfinite(sums["acc_sum"]) and np.isfinite(sums["local_acc_sum"])
    assert sums["acc_users"] == (8 if head_from == "none" else 7)


def test_an_empty_node_sends_the_same_metric_keys_as_its_peers():
    cfg, problem = _problem()
    cls = get_algorithm("deep-private-fedrep")
    model = torch.from_numpy(model_of(cfg).initial(cfg.seed))
    full = cls.final_sums(cfg, problem, model, np.arange(4))
    assert set(cls.empty_sums(cfg)) == set(full)
    off = config("deep-private-fedrep", final_choice="off")
    assert set(cls.empty_sums(off)) == set(cls.final_sums(off, problem, model, np.arange(4)))


@pytest.mark.parametrize("algorithm", ROUNDS)
def test_the_release_is_the_same_and_the_shared_accuracy_is_the_run_without_the_choice(
        tmp_path, algorithm):
    on = run(tmp_path / "on", algorithm)
    off = run(tmp_path / "off", algorithm, final_choice="off")
    assert on["server_state"] == off["server_state"]
    assert on["privacy"] == off["privacy"]
    untimed = [[{k: v for k, v in r.items() if k != "seconds"} for r in result["rounds"]
                if r["step"] != "final"] for result in (on, off)]  # the final step's metrics
    assert len(untimed[0]) == 2
    assert untimed[0] == untimed[1]
    m = on["metrics"]
    assert m["accuracy_shared"] == pytest.approx(off["metrics"]["accuracy"], abs=1e-9)
    assert math.isclose(m["chose_shared"] + m["chose_mix"] + m["chose_local"], 1.0)
    assert m["below_local"] <= m["below_local_without_choice"]
    assert "chose_local" not in off["metrics"]


def test_a_user_never_keeps_a_shared_model_that_its_own_rows_reject(tmp_path):
    """DP-FedAvg after two rounds is near chance on these users; their own linear models are
    far better, and the choice keeps those (or a mix) for nearly everyone."""
    m = run(tmp_path, "deep-dp-fedavg")["metrics"]
    assert m["accuracy_shared"] < 0.5 < m["accuracy_local"]
    assert m["accuracy"] >= m["accuracy_local"] - 0.02
    assert m["chose_shared"] < 0.1
    assert m["below_local"] < m["below_local_without_choice"]


def test_private_metrics_score_what_the_users_keep():
    cfg = config("deep-dp-fedavg-ft")
    cls = get_algorithm("deep-dp-fedavg-ft")
    problem = problem_of(cfg)
    model = cls(cfg).model
    ids = np.arange(10)
    errors = cls.evaluation_values(cfg, {"model": model}, ids)["test_error"]
    kept = choice.choice_scores(cfg, problem, torch.from_numpy(model), ids, "global")
    assert np.allclose(errors, 1.0 - kept["acc"])
    off = config("deep-dp-fedavg-ft", final_choice="off")
    shared = cls.evaluation_values(off, {"model": model}, ids)["test_error"]
    assert np.allclose(shared, 1.0 - kept["shared"]) and not np.allclose(shared, errors)


def test_bad_choice_keys_fail_before_the_run():
    with pytest.raises(ConfigError, match="final-choice"):
        config(final_choice="always")
    with pytest.raises(ConfigError, match="choice-folds"):
        config(choice_folds=1)


def test_head_steps_follow_the_public_batch_size_unless_given():
    from fedpriv.algorithms.deep.params import auto_head_steps
    from fedpriv.algorithms.deep.problem import public_batch_size

    assert auto_head_steps(3) == 24 and auto_head_steps(13) == 100
    cfg = config(head_steps=-1)
    assert cfg.head_steps == auto_head_steps(public_batch_size(cfg))
    assert config(head_steps=-1, num_users=200).head_steps < cfg.head_steps  # fewer rows
    assert config(head_steps=7).head_steps == 7
    with pytest.raises(ConfigError, match="head-steps"):
        config(head_steps=-2)


def test_the_results_config_holds_the_head_steps_that_ran(tmp_path):
    from fedpriv.algorithms.deep.params import auto_head_steps
    from fedpriv.algorithms.deep.problem import public_batch_size

    results = run(tmp_path, "deep-private-fedrep", head_steps=-1)
    b = public_batch_size(config())
    assert results["config"]["head-steps"] == auto_head_steps(b) == 8 * b
    rows = tmp_path / "rows.csv"  # a data file: b = 32 without reading a row, so 100 steps
    rows.write_text("user,split,label,f0\n0,train,0,1.0\n")
    from fedpriv.configure import parse_config

    table = parse_config({"algorithm": "deep-private-fedrep", "dataset": "csv",
                          "data-file": str(rows), "num-classes": 2, "num-users": 1})
    assert table.head_steps == 100


# ----- the linear family -------------------------------------------------------------------
def _linear(tmp_path, algorithm, **keys):
    from fedpriv.configure import parse_config
    from fedpriv.engine import run_in_process

    cfg = parse_config({"algorithm": algorithm, "num-users": 500, "checkpoint": False,
                        "results-path": str(tmp_path / "r.json"), **keys})
    return run_in_process(cfg, num_partitions=2, log=lambda _: None)


@pytest.mark.parametrize("algorithm", ["private-fedrep", "priv-altmin"])
def test_linear_release_is_the_same_and_the_shared_mse_is_the_run_without_the_choice(
        tmp_path, algorithm):
    on = _linear(tmp_path / "on", algorithm)
    off = _linear(tmp_path / "off", algorithm, **{"final-choice": "off"})
    assert on["server_state"] == off["server_state"] and on["privacy"] == off["privacy"]
    m = on["metrics"]
    assert m["population_mse_shared"] == pytest.approx(off["metrics"]["population_mse"],
                                                       rel=1e-12)
    assert math.isclose(m["chose_shared"] + m["chose_mix"] + m["chose_local"], 1.0)


def test_a_linear_user_with_a_poor_embedding_keeps_its_own_least_squares(tmp_path):
    """Priv-AltMin's embedding at this size is far from the truth (population MSE ~3 against
    ~1 alone): the users choose their own vectors or mixes, and end near training alone."""
    m = _linear(tmp_path, "priv-altmin")["metrics"]
    assert m["population_mse_shared"] > 2 * m["local_only_mse"]
    assert m["population_mse"] < 1.3 * m["local_only_mse"]
    assert m["chose_shared"] < 0.2


def test_a_linear_users_choice_reads_only_its_own_samples():
    from fedpriv.algorithms.personalization import choice as linear
    from fedpriv.data.synthetic import UserData

    rng = np.random.default_rng(0)
    n, m, d = 6, 10, 8
    x, y = rng.standard_normal((n, m, d)), rng.standard_normal((n, m))
    embedding = np.linalg.qr(rng.standard_normal((d, 2)))[0]
    data = UserData(np.arange(n), x, y, np.zeros((n, 2)))
    kept, shared, weight = linear.chosen_models(embedding, data, 5)
    y2 = y.copy()
    y2[3] = 1e6  # one user's labels: huge
    y2[4, :5] = np.nan  # another's: not finite
    kept2, _, weight2 = linear.chosen_models(embedding, UserData(np.arange(n), x, y2,
                                                                  np.zeros((n, 2))), 5)
    others = [0, 1, 2, 5]
    assert np.array_equal(weight[others], weight2[others])
    assert np.array_equal(kept[others], kept2[others])
    # the shared vector is fitted on S1 as without the choice
    s1 = np.linalg.lstsq(x[0, 5:] @ embedding, y[0, 5:], rcond=None)[0]
    assert np.allclose(shared[0], embedding @ s1)


def test_the_benchmark_prints_the_choice_table():
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run(
        [sys.executable, "benchmarks/bench_final_choice.py", "--seeds", "0", "--settings",
         "n2000", "--set", "dataset=digits", "--set", "num-users=60", "--set", "rounds=2"],
        capture_output=True, text=True, timeout=300, check=True,
        cwd=Path(__file__).resolve().parents[1]).stdout
    rows = [line.split("|") for line in out.splitlines()[2:]]
    assert [r[2].strip() for r in rows] == ["deep-private-fedrep", "deep-dp-fedavg-ft"]
    for row in rows:
        shared, kept, local = (float(v) for v in row[3:6])
        assert 0 < shared <= 1 and 0 < kept <= 1 and 0 < local <= 1
        assert abs(sum(float(v) for v in row[6:9]) - 1.0) < 1e-9  # the shares of the choice
    linear = subprocess.run(
        [sys.executable, "benchmarks/bench_final_choice.py", "--family", "linear", "--seeds",
         "0", "--settings", "eps1.0", "--methods", "private-fedrep", "--set", "num-users=300"],
        capture_output=True, text=True, timeout=300, check=True,
        cwd=Path(__file__).resolve().parents[1]).stdout
    assert "| eps1.0 | private-fedrep |" in linear


def _nesterov_reference(x: torch.Tensor, y: torch.Tensor, classes: int, steps: int,
                        rate: float) -> torch.Tensor:
    """One user's softmax regression by Nesterov's method on (W, b) directly, in float64."""
    w = torch.zeros(classes, x.shape[1], dtype=torch.float64)
    b = torch.zeros(classes, dtype=torch.float64)
    last_w, last_b = w, b
    onehot = torch.nn.functional.one_hot(y, classes).double()
    for t in range(steps):
        m = t / (t + 3)
        aw, ab = w + m * (w - last_w), b + m * (b - last_b)
        g = (torch.softmax(x @ aw.T + ab, -1) - onehot) / len(y)
        last_w, last_b = w, b
        w, b = aw - rate * g.T @ x, ab - rate * g.sum(0)
    return torch.cat([w.reshape(-1), b])


@pytest.mark.parametrize("rows", [6, 40])  # fewer rows than inputs (the Gram path), and more
def test_the_local_models_accelerated_fit_is_nesterovs_method(rows):
    from fedpriv.algorithms.deep.head_fit import fit_heads, head_step_sizes

    g = torch.Generator().manual_seed(3)
    x = torch.rand(1, rows, 12, generator=g, dtype=torch.float64)  # positive, like pixels
    y = torch.randint(0, 3, (1, rows), generator=g)
    mask = torch.ones(1, rows, dtype=torch.float64)
    got = fit_heads(x, y, mask, 3, 25, 1.0, accelerated=True)
    rate = float(head_step_sizes(x, mask, 1.0)[0])
    assert torch.allclose(got[0], _nesterov_reference(x[0], y[0], 3, 25, rate), atol=1e-10)
    plain = fit_heads(x, y, mask, 3, 25, 1.0)
    assert not torch.allclose(got, plain)


def test_accelerated_steps_fit_ill_conditioned_pixels_further_than_plain_ones():
    """Raw pixels share a large mean: plain steps of 1/L crawl along every other direction."""
    g = torch.Generator().manual_seed(4)
    x = 0.8 + 0.1 * torch.randn(2, 30, 100, generator=g)  # a common mean, small variations
    y = torch.randint(0, 4, (2, 30), generator=g)
    mask = torch.ones(2, 30)

    def loss(heads: torch.Tensor) -> torch.Tensor:
        logits = dm.head_logits(x, heads, 4)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 4), y.reshape(-1))

    plain = loss(dm.fit_heads(x, y, mask, 4, 300, 1.0))
    fast = loss(dm.fit_heads(x, y, mask, 4, 100, 1.0, accelerated=True))
    assert fast < 0.75 * plain  # 100 accelerated steps beyond 300 plain ones


@pytest.mark.parametrize("rows", [6, 12, 40])  # the Gram path, rows = features, the direct path
@pytest.mark.parametrize("start", [False, True])
@pytest.mark.parametrize("accelerated", [False, True])
def test_heads_on_several_row_sets_at_once_are_each_sets_own_fit(rows, start, accelerated):
    """``fit_head_sets``: F row sets a user (n, F, r) fitted in one pass (the choice's folds and
    the full fit): each is the head that set's (n, r) mask gives alone (float64: to rounding;
    float32: to 1e-5 relative), an empty set and a user without rows included."""
    from fedpriv.algorithms.deep.head_fit import cross_validated_heads, fit_head_sets, fit_heads

    g = torch.Generator().manual_seed(5)
    x = torch.rand(3, rows, 12, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (3, rows), generator=g)
    mask = (torch.rand(3, rows, generator=g) > 0.2).double()
    mask[2] = 0.0  # a user without a valid row
    init = torch.randn(3, 4 * 12 + 4, generator=g, dtype=torch.float64) if start else None
    sets = torch.stack([mask, mask * (torch.arange(rows) % 2), torch.zeros_like(mask)], 1)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        xs, ss = x.to(dtype), sets.to(dtype)
        first = None if init is None else init.to(dtype)
        for bias in (True, False):
            together = fit_head_sets(xs, y, ss, 4, 20, 1.0, first, bias, accelerated)
            assert together.shape == (3, 3, 4 * 12 + (4 if bias else 0))
            for j in range(3):
                alone = fit_heads(xs, y, ss[:, j], 4, 20, 1.0, first, bias, accelerated)
                assert torch.allclose(together[:, j], alone, rtol=tol, atol=tol), (dtype, bias, j)
    # cross-validation: fold j's rows scored by the head fitted without them; the full fit
    held, full = cross_validated_heads(x, y, mask, 4, 20, 1.0, 3, init, True, accelerated)
    assert torch.allclose(full, fit_heads(x, y, mask, 4, 20, 1.0, init, True, accelerated),
                          atol=1e-12)
    fold = torch.arange(rows) % 3
    for j in range(3):
        head = fit_heads(x, y, mask * (fold != j), 4, 20, 1.0, init, True, accelerated)
        probs = torch.softmax(dm.head_logits(x, head, 4), -1)
        assert torch.allclose(held[:, fold == j], probs[:, fold == j], atol=1e-12)
