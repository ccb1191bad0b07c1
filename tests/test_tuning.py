"""Private tuning: the Papernot-Steinke bound against an independent implementation and against
dp-accounting, the composed baseline against dp-accounting's PLD, the calibration of a tuning,
its validation signal, its outputs, and its errors."""

import json
import math
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event, pld, rdp

from fedpriv.config import ConfigError
from fedpriv.configure import parse_config
from fedpriv.data.synthetic import SyntheticProblem, generate_users
from fedpriv.engine import run_in_process
from fedpriv.privacy.accounting import InfeasiblePlanError, composed_event
from fedpriv.privacy.selection import (
    ORDERS,
    Repetitions,
    plan_rdp,
    repeat_and_select_rdp,
    selection_epsilon,
    tnb_mean,
)
from fedpriv.tuning.budget import calibrate_tuning, total_epsilon
from fedpriv.tuning.run import draw_candidates, run_tuning, table_lines
from fedpriv.tuning.spec import load_tune


# ----- an independent implementation of Papernot & Steinke (ICLR 2022) ------------------------
def _tnb_pmf(eta, gamma, k):
    """Definition 1: P[K = k] of the truncated negative binomial."""
    if eta == 0:
        return (1 - gamma) ** k / (k * math.log(1 / gamma))
    prod = 1.0
    for ell in range(k):
        prod *= (ell + eta) / (ell + 1)
    return (1 - gamma) ** k / (gamma ** (-eta) - 1) * prod


def _gamma_for_mean(eta, mean):
    """gamma with E[K] = mean, by bisection on the mean summed from the pmf (each term from the
    previous one: P[k+1] / P[k] = (1 - gamma) (k + eta) / (k + 1))."""
    def mean_of(g):
        p, total = _tnb_pmf(eta, g, 1), 0.0
        for k in range(1, 20000):
            total += k * p
            p *= (1 - g) * (k + eta) / (k + 1)
        return total

    lo, hi = 1e-4, 1 - 1e-9
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_of(mid) > mean else (lo, mid)
    return hi


def _independent_epsilon(rdp_of, eta, mean, delta, orders):
    """Theorem 2 at every order lambda (lambda_hat over the same orders), monotone, then the
    RDP -> (epsilon, delta) conversion of Canonne, Kamath & Steinke (2020), Prop. 12."""
    gamma = _gamma_for_mean(eta, mean)
    hat = min((1 - 1 / lh) * rdp_of(lh) + math.log(1 / gamma) / lh for lh in orders)
    bound = {lam: rdp_of(lam) + (1 + eta) * hat + math.log(mean) / (lam - 1) for lam in orders}
    mono = {lam: min(bound[o] for o in orders if o >= lam) for lam in orders}
    return min(r + math.log1p(-1 / lam) - math.log(delta * lam) / (lam - 1)
               for lam, r in mono.items() if lam > 1.01)


def _gaussian_rdp(counts):
    """RDP of composed Gaussian releases (sensitivity 1, multiplier z): lambda sum n / (2 z^2)."""
    rho = sum(n / (2 * z * z) for (z, _), n in counts.items())
    return lambda lam: lam * rho


PLAN = {(2.0, 1.0): 5, (6.0, 1.0): 1}


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("mean", [3.0, 10.0])
def test_random_stopping_epsilon_matches_an_independent_papernot_steinke(eta, mean):
    ours, _ = selection_epsilon([plan_rdp(PLAN)], Repetitions(eta, mean), 1e-6)
    theirs = _independent_epsilon(_gaussian_rdp(PLAN), eta, mean, 1e-6, ORDERS)
    assert ours == pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("eta", [0.0, 1.0, 2.0, math.inf])
def test_random_stopping_matches_dp_accountings_repeat_and_select(eta):
    ours, _ = selection_epsilon([plan_rdp(PLAN)], Repetitions(eta, 8.0), 1e-5)
    acc = rdp.RdpAccountant(orders=list(ORDERS))
    acc.compose(dp_event.RepeatAndSelectDpEvent(composed_event(PLAN, "add-remove"), 8.0, eta))
    assert ours == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)


def test_the_selection_costs_more_than_one_candidate_and_less_than_composing_the_mean():
    one, _ = selection_epsilon([plan_rdp(PLAN)], Repetitions(0.0, 8.0), 1e-6)
    alone = rdp.compute_epsilon(list(ORDERS), list(plan_rdp(PLAN)), 1e-6)[0]
    eight = rdp.compute_epsilon(list(ORDERS), list(8 * plan_rdp(PLAN)), 1e-6)[0]
    assert alone < one < eight


def test_the_worst_plan_of_the_space_bounds_a_candidate():
    # a Poisson-sampled plan's curve is flat at low orders and steep at high ones; an unsampled
    # Gaussian's is linear: they cross, so neither alone bounds a mixture of the two
    sampled = plan_rdp({(2.0, 0.05): 100})
    linear = plan_rdp({(3.0, 1.0): 1})
    lam = np.asarray(ORDERS)
    assert np.any(sampled > linear) and np.any(sampled < linear)
    law = Repetitions(0.0, 5.0)
    worst = {o: max(a, b) for o, a, b in zip(ORDERS, sampled, linear, strict=True)}
    expected = _independent_epsilon(worst.__getitem__, 0.0, 5.0, 1e-6, ORDERS)
    for curves in ([sampled, linear], [linear, sampled]):
        assert selection_epsilon(curves, law, 1e-6)[0] == pytest.approx(expected, rel=1e-6)
    assert selection_epsilon([linear], law, 1e-6)[0] < expected
    assert selection_epsilon([sampled], law, 1e-6)[0] < expected
    curve = repeat_and_select_rdp(plan_rdp(PLAN), Repetitions(1.0, 5))
    assert np.all(np.diff(curve) >= -1e-12) and len(curve) == len(lam)  # monotone


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
def test_the_number_of_candidates_follows_its_law(eta):
    law = Repetitions(eta, 6.0)
    assert tnb_mean(eta, law.gamma) == pytest.approx(6.0, rel=1e-9)
    assert sum(law.pmf(k) for k in range(1, 5000)) == pytest.approx(1.0, abs=1e-9)
    assert sum(k * law.pmf(k) for k in range(1, 5000)) == pytest.approx(6.0, rel=1e-8)
    assert law.pmf(3) == pytest.approx(_tnb_pmf(eta, law.gamma, 3), rel=1e-9)
    draws = [law.sample(np.random.default_rng([7, i])) for i in range(4000)]
    sd = math.sqrt(sum((k - 6.0) ** 2 * law.pmf(k) for k in range(1, 5000)) / len(draws))
    assert min(draws) >= 1 and abs(np.mean(draws) - 6.0) < 4 * sd


def test_bad_laws_are_refused():
    with pytest.raises(InfeasiblePlanError, match="expected number"):
        Repetitions(0.0, 1.0)
    with pytest.raises(InfeasiblePlanError, match="eta"):
        Repetitions(-0.5, 4.0)
    with pytest.raises(InfeasiblePlanError, match="shape eta"):
        Repetitions.named("truncated-negative-binomial", 4.0)


# ----- a tuning file ---------------------------------------------------------------------------
BASE = """algorithm = "private-fedrep"
num-users = {n}
dim = 8
rank = 2
samples-per-user = 10
label-noise = 0.1
test-samples-per-user = 5
metric-clip = 0.5
metrics-budget-fraction = 0.1
"""

TUNE = """
[tune]
name = "tiny"
epsilon = {eps}
delta = 1e-5
{method}
seed = 3

[tune.space]
learning-rate = [0.5, 1.0]
rounds = [2, 3]
"""


def write(tmp_path, n=400, eps=4.0, method='expected-candidates = 3', extra=""):
    path = tmp_path / "tune.toml"
    path.write_text(BASE.format(n=n) + extra + TUNE.format(eps=eps, method=method))
    return path


def test_the_budget_meets_the_total_target_and_each_candidate_its_own(tmp_path):
    spec = load_tune(write(tmp_path, eps=2.0))
    budget = calibrate_tuning(spec)
    assert budget.total_epsilon <= 2.0 and budget.total_epsilon == pytest.approx(2.0, rel=1e-3)
    assert 0.3 < budget.candidate_epsilon < 2.0
    # rounds = 2 and rounds = 3 are two plans (other multipliers), each calibrated to the same
    # (eps_c, delta): unsampled Gaussian plans are mu-GDP, so both have the same RDP curve
    assert len({tuple(sorted(c.items())) for c in budget.counts.values()}) == 2
    rounds3 = next(i for i, p in enumerate(spec.points) if p["rounds"] == 3)
    rounds2 = next(i for i, p in enumerate(spec.points) if p["rounds"] == 2)
    law = spec.repetitions
    worst = _gaussian_rdp(budget.counts[rounds3])
    assert _gaussian_rdp(budget.counts[rounds2])(10.0) == pytest.approx(worst(10.0), rel=1e-6)
    assert budget.total_epsilon == pytest.approx(
        _independent_epsilon(worst, law.eta, law.mean, 1e-5, ORDERS), rel=1e-6)


def test_the_composed_baseline_matches_dp_accountings_pld(tmp_path):
    spec = load_tune(write(tmp_path, eps=2.0, method='method = "compose-all"\nsearch = "grid"'))
    points, _ = draw_candidates(spec)
    assert sorted(points) == list(range(4))  # every grid point once
    budget = calibrate_tuning(spec, points)
    acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    for i in points:
        for (z, _), n in budget.counts[i].items():
            acc.compose(dp_accounting.GaussianDpEvent(z), n)
    assert acc.get_epsilon(1e-5) == pytest.approx(budget.total_epsilon, rel=1e-4)
    assert budget.total_epsilon <= 2.0
    # random stopping over the same space lets each candidate spend more
    stopping = calibrate_tuning(load_tune(write(tmp_path, eps=2.0)))
    assert stopping.candidate_epsilon > budget.candidate_epsilon


def test_a_search_that_cannot_meet_its_target_is_refused_before_anything_runs(tmp_path):
    spec = load_tune(write(tmp_path, eps=0.02, method="expected-candidates = 10000"))
    with pytest.raises(InfeasiblePlanError, match="no tuning meets the total epsilon"):
        calibrate_tuning(spec)


@pytest.mark.parametrize("edit, match", [
    (("[tune]\n", "[tune]\nbogus = 1\n"), "unknown key"),
    (("learning-rate = [0.5, 1.0]", "epsilon = [1, 2]"), "set by the tuning"),
    (("learning-rate = [0.5, 1.0]", "learning-rate = [0.5, 0.5]"), "distinct values"),
    (("learning-rate = [0.5, 1.0]", "learning-rate = { low = 1, high = 0.5, num = 3 }"),
     "low < high"),
    (("learning-rate = [0.5, 1.0]", "learning-rate = [-1.0, 1.0]"), "learning-rate"),
    (("seed = 3", 'seed = 3\nscore = "test_mse"'), "not a private metric"),
    (("seed = 3", 'seed = 3\ndistribution = "uniform"'), "distribution"),
    (("seed = 3", "seed = 3\ncandidates = 4"), "random stopping draws"),
    (("metric-clip = 0.5\n", "metric-clip = 0.5\nepsilon = 3.0\n"), "set by the tuning"),
    (("seed = 3", "seed = 3\nmaximize = \"false\""), "maximize"),
    (("seed = 3", "seed = 3\nsearch = \"grid\""), "search"),
    (("seed = 3", "seed = 3\neta = 0.5"), "eta"),
    (('name = "tiny"', 'name = "../x"'), "name"),
    (("rounds = [2, 3]", "rounds = { low = 2, high = 2.4, num = 3 }"), "rounds to only"),
    (("rounds = [2, 3]", "rounds = { low = \"2\", high = 4, num = 3 }"), "needs numbers"),
    (("rounds = [2, 3]", "rounds = [2, 3]\nseed = [0, 1]"), "cannot vary"),
    (("rounds = [2, 3]", "rounds = [2, 3]\nneighbouring-relation = [\"add-remove\", "
      "\"replace-one\"]"), "cannot vary"),
    (("metric-clip = 0.5\n", "metric-clip = 0.5\nsecure-noise = true\n"), "seed: not allowed"),
    (("metric-clip = 0.5\n",
      'metric-clip = 0.5\naggregation = "distributed"\naccountant = "rdp"\n'),
     "aggregation: a private tuning runs central candidates only"),
])
def test_bad_tuning_files_fail_before_the_run_naming_the_key(tmp_path, edit, match):
    path = write(tmp_path)
    path.write_text(path.read_text().replace(*edit, 1))
    with pytest.raises(ConfigError, match=match):
        load_tune(path)


def test_set_reaches_the_base_the_tune_table_and_the_space_but_not_the_tunings_own_keys(
        tmp_path):
    path = write(tmp_path)
    spec = load_tune(path, ["dim=6", "tune.expected-candidates=4",
                            "tune.space.rounds=[2, 3, 4]"])
    assert spec.base["dim"] == 6 and spec.repetitions.mean == 4.0
    assert spec.space["rounds"] == (2, 3, 4) and len(spec.points) == 6
    for item in ("epsilon=50", "noise-seed=3", "delta=0.1"):
        with pytest.raises(ConfigError, match="set by the tuning"):
            load_tune(path, [item])


def test_a_file_without_a_tune_table_is_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(BASE.format(n=100))
    with pytest.raises(ConfigError, match=r"no \[tune\] table"):
        load_tune(path)


def test_ranges_are_discretized_and_integer_keys_rounded(tmp_path):
    path = write(tmp_path)
    path.write_text(path.read_text().replace(
        "rounds = [2, 3]", "rounds = { low = 2, high = 8, num = 3, log = true }")
        .replace("learning-rate = [0.5, 1.0]",
                 "learning-rate = { low = 0.5, high = 1.5, num = 3 }"))
    spec = load_tune(path)
    assert spec.space == {"learning-rate": (0.5, 1.0, 1.5), "rounds": (2, 4, 8)}
    assert len(spec.points) == 9


# ----- the validation signal -------------------------------------------------------------------
def test_validation_points_are_a_stream_of_their_own():
    problem = SyntheticProblem(50, 6, 2, 10, 0.1, seed=1)
    ids = np.arange(50)
    train = generate_users(problem, ids)
    test = generate_users(problem, ids, samples=10, fresh=True)
    val = generate_users(problem, ids, samples=10, purpose="validation")
    again = generate_users(problem, ids, samples=10, purpose="validation")
    assert np.array_equal(val.features, again.features)  # a pure function of (seed, user)
    for other in (train, test):
        assert not np.allclose(val.features, other.features)
    # the same users: the same true models
    assert np.array_equal(val.true_local_vectors, train.true_local_vectors)
    with pytest.raises(ValueError, match="purpose"):
        generate_users(problem, ids, purpose="holdout")


def test_the_validation_release_is_a_planned_noisy_release(tmp_path):
    values = {"num-users": 400, "dim": 8, "rank": 2, "epsilon": 2.0, "rounds": 2,
              "private-metrics": True, "metric-clip": 0.5}
    test = run_in_process(parse_config(values, strict=True), log=lambda _: None)
    val = run_in_process(parse_config({**values, "metrics-split": "validation"},
                                                strict=True), log=lambda _: None)
    assert set(val["private_metrics"]) == {"validation_mse"}
    assert set(test["private_metrics"]) == {"test_mse"}
    assert val["metrics"] == test["metrics"]  # the training and its test metrics are the same
    v, t = val["private_metrics"]["validation_mse"], test["private_metrics"]["test_mse"]
    assert v["exact_clipped"] != t["exact_clipped"]  # other points
    entry = next(e for e in val["privacy"]["ledger"] if e["release"] == "evaluate")
    # the noise is applied: std = multiplier x sensitivity (B / (2 n)), value != exact
    assert v["noise_std"] == pytest.approx(entry["noise_multiplier"] * 0.5 / (2 * 400))
    assert abs(v["value"] - v["exact_clipped"]) > 1e-4 * v["noise_std"]


def test_metrics_split_needs_private_metrics_and_validation_data():
    with pytest.raises(ConfigError, match="needs private-metrics"):
        parse_config({"metrics-split": "validation"}, strict=True)
    with pytest.raises(ConfigError, match="no held-back validation"):
        parse_config({"algorithm": "meta-nsgd", "feature-dist": "unit-ball",
                                "private-metrics": True, "metrics-split": "validation"},
                               strict=True)


# ----- a whole tuning ------------------------------------------------------------------------
def _leaves(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)


def test_a_tuning_selects_on_its_noisy_score_and_releases_the_winner_alone(tmp_path):
    spec = load_tune(write(tmp_path))
    out = tmp_path / "out"
    report = run_tuning(spec, out, log=lambda _: None)
    rows = report["candidates"]
    points, seeds = draw_candidates(spec)
    assert len(rows) == report["candidates_run"] == len(points) >= 1
    best = min(rows, key=lambda r: r["score"])
    assert report["winner"]["candidate"] == best["candidate"]
    assert all(r["score"] != r["exact_clipped_score"] for r in rows)  # noisy scores
    # the whole tuning's ledger: every candidate's releases and the selection
    assert report["ledger"][-1]["release"] == "selection"
    assert {e["candidate"] for e in report["ledger"][:-1]} == {r["candidate"] for r in rows}

    winner = json.loads((out / "winner.json").read_text())
    release = json.loads((out / "winner.release.json").read_text())
    tuning = winner["privacy"]["tuning"]
    assert tuning["included"] and "Papernot" in tuning["method"]
    assert winner["privacy"]["epsilon"] == tuning["epsilon"] <= 4.0
    assert release["privacy"]["tuning"] == tuning
    # the release names neither the other candidates nor their number
    keys = set(_leaves(release))
    assert not keys & {"candidates_run", "candidate", "exact_clipped", "seed", "noise-seed"}
    toml = (out / "winner.toml").read_text()
    assert "OPERATOR ONLY" in toml and f"candidate {best['candidate']}" not in toml

    # the rerun command reproduces the winner (same seeds, same noise)
    rerun = subprocess.run([sys.executable, "-m", "fedpriv.cli", "run",
                            str(out / "winner.toml"), "--engine", "inprocess"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    again = json.loads((out / "rerun.json").read_text())
    assert again["private_metrics"]["validation_mse"]["value"] == pytest.approx(
        best["score"], rel=1e-12)


def test_secure_noise_draws_k_and_the_candidates_from_os_entropy(tmp_path):
    path = write(tmp_path)
    path.write_text(path.read_text().replace("seed = 3\n", "").replace(
        "metric-clip = 0.5\n", 'metric-clip = 0.5\nsecure-noise = true\naccountant = "rdp"\n'))
    spec = load_tune(path)
    assert spec.seed is None and spec.secure
    first = [spec.draws().integers(2**62) for _ in range(2)]
    assert first[0] != first[1]  # not seeded: a fresh OS-entropy stream each time
    seeded = load_tune(write(tmp_path))
    assert seeded.draws().integers(2**62) == seeded.draws().integers(2**62)


def test_a_tuning_of_disjoint_user_groups_checks_each_users_releases(tmp_path):
    path = write(tmp_path, n=300, method='method = "compose-all"\nsearch = "grid"')
    text = path.read_text().replace('"private-fedrep"', '"priv-altmin"').replace(
        "rounds = [2, 3]", "rounds = [2, 4]").replace("learning-rate = [0.5, 1.0]\n", "")
    path.write_text(text.replace("metric-clip = 0.5\n", "metric-clip = 0.5\nuser-groups = 2\n"))
    report = run_tuning(load_tune(path), tmp_path / "out", log=lambda _: None)
    groups = {e.get("user_group") for e in report["ledger"][:-1]}
    assert {0, 1} <= groups and len(report["candidates"]) == 2


def test_nothing_runs_and_nothing_is_released_when_k_is_zero(tmp_path, monkeypatch):
    spec = load_tune(write(tmp_path, method='distribution = "poisson"\nexpected-candidates = 2'))
    out = tmp_path / "out"
    monkeypatch.setattr(Repetitions, "sample", lambda self, rng: 1)
    run_tuning(spec, out, log=lambda _: None)  # a first tuning leaves a winner
    assert (out / "winner.release.json").is_file()
    monkeypatch.setattr(Repetitions, "sample", lambda self, rng: 0)
    report = run_tuning(spec, out, log=lambda _: None)
    assert report["winner"] is None and report["candidates_run"] == 0
    assert not list(out.glob("winner*")) and not list((out / "candidates").glob("*.json"))


def test_maximize_selects_the_largest_noisy_score(tmp_path):
    from fedpriv.tuning.run import select

    rows = [{"candidate": 0, "score": 0.2}, {"candidate": 1, "score": 0.5},
            {"candidate": 2, "score": 0.1}]
    assert select(rows, True)["candidate"] == 1 and select(rows, False)["candidate"] == 2


def test_a_candidate_that_released_other_than_accounted_stops_the_tuning(tmp_path, monkeypatch):
    from fedpriv.tuning import run as tuning_run

    spec = load_tune(write(tmp_path))
    real = tuning_run._run

    def tampered(values, path, engine, session):
        results = real(values, path, engine, session)
        results["privacy"]["ledger"][0]["noise_multiplier"] *= 0.5
        return results

    monkeypatch.setattr(tuning_run, "_run", tampered)
    with pytest.raises(RuntimeError, match="differ from the plan"):
        run_tuning(spec, tmp_path / "out", log=lambda _: None)


def test_the_cli_reports_the_total_and_refuses_a_bad_file(tmp_path):
    path = write(tmp_path, n=300)
    ok = subprocess.run([sys.executable, "-m", "fedpriv.cli", "tune", str(path), "--out",
                         str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "the whole tuning spent (epsilon" in ok.stdout and "rerun the winner" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "fedpriv.cli", "tune", str(path), "--set",
                          "tune.expected-candidates=0.5"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "expected-candidates" in bad.stderr
    assert not (tmp_path / "results").exists()


def test_total_epsilon_grows_with_the_candidates_budget(tmp_path):
    spec = load_tune(write(tmp_path))
    assert total_epsilon(spec, 0.5)[0] < total_epsilon(spec, 1.0)[0]


# ----- deep models: validation rows held back from the users' training rows ----------------
def test_held_back_rows_are_a_seeded_per_user_split_of_the_training_rows():
    from fedpriv.algorithms.deep.problem import held_back
    from fedpriv.data.partition import Rows

    train = Rows.from_lists([np.arange(10, 16), np.arange(20, 23), np.arange(30, 40)])
    keys = np.array([4, 9, 2])  # the users' own randomness keys
    kept, held = held_back(train, 2, seed=4, keys=keys)
    # user 1 has 3 rows: it holds back 1 and keeps 2 to train on (two batches), by itself
    assert list(held.counts) == [2, 1, 2] and list(kept.counts) == [4, 2, 8]
    for u in range(3):
        mine = set(train.rows[train.offsets[u]:train.offsets[u + 1]].tolist())
        k = kept.rows[kept.offsets[u]:kept.offsets[u + 1]].tolist()
        h = set(held.rows[held.offsets[u]:held.offsets[u + 1]].tolist())
        assert set(k) | h == mine and not set(k) & h  # a split of the user's own rows
        assert k == sorted(k)  # the rows trained on keep their order
    again, other = held_back(train, 2, 4, keys), held_back(train, 2, 5, keys)
    assert np.array_equal(again[1].rows, held.rows)  # nodes agree
    assert not np.array_equal(other[1].rows, held.rows)


def test_a_deep_run_scores_its_held_back_rows_and_never_trains_on_them():
    from fedpriv.algorithms.deep.problem import problem_of, user_block

    keys = {"algorithm": "deep-private-fedrep", "num-users": 100, "rounds": 2,
            "checkpoint": False, "private-metrics": True, "validation-samples-per-user": 3}
    val = parse_config({**keys, "metrics-split": "validation"})
    test = parse_config(keys)
    full, held = problem_of(test), problem_of(val)
    assert held.validation is not None and full.validation is None
    assert np.array_equal(held.users.train.counts, full.users.train.counts - 3)
    assert np.array_equal(held.users.test.rows, full.users.test.rows)
    ids = np.arange(100)
    trained = user_block(held, ids).x
    scored = user_block(held, ids, "validation")
    assert scored.counts.tolist() == [3] * 100
    for u in range(0, 100, 17):  # held-back images are none of the user's training images
        rows = trained[u, :held.users.train.counts[u]].reshape(held.users.train.counts[u], -1)
        for image in scored.x[u].reshape(3, -1):
            assert not (rows == image).all(1).any()
    results = run_in_process(val, log=lambda _: None)
    assert set(results["private_metrics"]) == {"validation_error"}
    released = results["private_metrics"]["validation_error"]
    assert 0.0 <= released["exact_clipped"] <= 1.0
    # the release is noised as planned: its share f of the target in GDP units, mu from
    # (epsilon, delta) solved here independently, sensitivity 1 / (2 n) of the centred mean
    from scipy.optimize import brentq
    from scipy.stats import norm

    eps, delta = val.epsilon, val.delta
    mu = brentq(lambda m: norm.cdf(-eps / m + m / 2) - math.exp(eps) * norm.cdf(-eps / m - m / 2)
                - delta, 1e-3, 50.0)
    z = 1.0 / (math.sqrt(val.metrics_budget_fraction) * mu)
    assert released["noise_std"] == pytest.approx(z / (2 * 100), rel=1e-6)
    assert released["value"] != released["exact_clipped"]
    assert "accuracy" in results["metrics"]  # the reported metrics stay the test rows'
    # a user with fewer rows than the hold-back plus two batches' worth is not refused: it
    # holds back fewer (its own computation), the others are as they were
    smallest = int(full.users.train.counts.min())
    greedy = problem_of(parse_config({**keys, "metrics-split": "validation",
                                                "validation-samples-per-user": smallest - 1}))
    counts = full.users.train.counts
    assert np.array_equal(greedy.validation.counts, np.minimum(smallest - 1, counts - 2))
    assert int(greedy.users.train.counts.min()) == 2


def write_deep(tmp_path, extra=""):
    path = tmp_path / "tune.toml"
    path.write_text('algorithm = "deep-private-fedrep"\nnum-users = 100\nrounds = 2\n' + extra +
                    'validation-samples-per-user = 3\n\n[tune]\nname = "deep"\nepsilon = 2.0\n'
                    'delta = 1e-5\nmethod = "compose-all"\nsearch = "grid"\n'
                    'score = "validation_error"\nseed = 0\n\n[tune.space]\n'
                    'learning-rate = [0.25, 1.0]\n')
    return path


def test_a_deep_algorithm_is_tuned_on_its_held_back_rows(tmp_path):
    report = run_tuning(load_tune(write_deep(tmp_path)), tmp_path / "out", log=lambda _: None)
    scores = [c["score"] for c in report["candidates"]]
    assert len(scores) == 2 and report["winner"]["candidate"] == int(np.argmin(scores))
    winner = json.loads((tmp_path / "out" / "winner.json").read_text())
    assert winner["privacy"]["tuning"]["included"]
    assert winner["privacy"]["epsilon"] == pytest.approx(2.0, abs=1e-3)  # the whole tuning
    assert "private validation_error | accuracy (exact)" in "\n".join(
        table_lines(report, "validation_error"))


def test_a_key_the_algorithm_does_not_read_is_named_by_its_section(tmp_path):
    with pytest.raises(ConfigError, match=r"^base: key\(s\) \['learnig-rate'\] are not keys of "
                                          "private-fedrep"):
        load_tune(write(tmp_path, extra="learnig-rate = 0.5\n"))
    with pytest.raises(ConfigError, match=r"^\[tune.space\] head-steps: not a key of "
                                          "private-fedrep"):
        load_tune(write(tmp_path), ["tune.space.head-steps=[10, 20]"])
    with pytest.raises(ConfigError, match=r"^base: key\(s\) \['cross-fit'\]"):
        load_tune(write(tmp_path), ["cross-fit=2"])


@pytest.mark.integration
def test_a_flower_tuning_shares_one_superlink_and_holds_back_the_same_rows_on_every_node(
        tmp_path, flower_env, flower_sessions):
    """A tuning through Flower runs its candidates on one SuperLink and Ray head, stopped at
    its end, and leaves only the winner's release. The nodes compute a deep run's held-back
    rows themselves (a seeded choice per user): the Flower tuning's noisy scores and
    accuracies equal the in-process ones, and so does its winner. (One test for both: each
    tuning through Flower costs a SuperLink, a Ray head and a Flower run per candidate.)"""
    from fedpriv import launcher

    spec = load_tune(write_deep(tmp_path, "users-per-node = 50\n"))  # two SuperNodes
    flower = run_tuning(spec, tmp_path / "flower", engine="flower", log=lambda _: None)
    local = run_tuning(spec, tmp_path / "local", log=lambda _: None)
    assert len(flower_sessions) == 1 and flower_sessions[0]._head is None  # one, stopped
    assert not launcher._port_open(int(flower_env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]))
    assert [r["score"] for r in flower["candidates"]] == pytest.approx(
        [r["score"] for r in local["candidates"]], rel=1e-9)
    assert [r["accuracy"] for r in flower["candidates"]] == pytest.approx(
        [r["accuracy"] for r in local["candidates"]], rel=1e-9)
    winner = json.loads((tmp_path / "flower" / "winner.json").read_text())
    assert winner["num_nodes"] == 2 and winner["runtime"] == "flower"
    assert flower["winner"]["candidate"] == local["winner"]["candidate"]
    # a candidate's own release file is not left behind (only the winner's is written)
    assert not list((tmp_path / "flower" / "candidates").glob("*.release.json"))


def test_a_compose_all_tuning_of_secure_noise_candidates_is_refused(tmp_path):
    path = write(tmp_path, method='method = "compose-all"\nsearch = "grid"')
    path.write_text(path.read_text().replace("seed = 3\n", "").replace(
        "metric-clip = 0.5\n", 'metric-clip = 0.5\nsecure-noise = true\naccountant = "rdp"\n'))
    with pytest.raises(ConfigError, match="method: compose-all .* discrete Gaussian"):
        load_tune(path)
