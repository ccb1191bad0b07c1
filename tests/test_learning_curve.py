"""Learning curves of deep runs (``eval-every``): exact evaluation steps between rounds score
the model of their round, change nothing the run computes or releases, and are drawn beside the
operator report."""

import json

import pytest

from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.learning_curve import curve_path, curve_points
from fedpriv.outputs import output_lines, write_outputs
from fedpriv.params import ConfigError

SMALL = {"dataset": "digits", "num-users": 60, "hidden-sizes": "16", "checkpoint": False,
         "epsilon": 2.0, "delta": 1e-5}
METRICS = ("accuracy", "accuracy_p10", "test_loss", "users_evaluated")


def run(algorithm, **keys):
    mapping = {"algorithm": algorithm, **SMALL, **{k.replace("_", "-"): v for k, v in keys.items()}}
    return run_in_process(parse_config(mapping, strict=True), num_partitions=2,
                          log=lambda _: None)


def test_an_eval_step_scores_the_model_of_its_round():
    """Non-private FedRep (no noise, so the rounds' models do not depend on how many rounds
    the budget is split over): the evaluation after round 2 of a 4-round run equals the final
    metrics of a 2-round run."""
    four = run("deep-fedrep", rounds=4, eval_every=2)
    assert [r["step"] for r in four["rounds"]] == ["eval-0", "round-1", "round-2", "eval-2",
                                                   "round-3", "round-4", "final"]
    two = run("deep-fedrep", rounds=2)
    after_two = four["rounds"][3]
    assert after_two["after_round"] == 2 and after_two["users_evaluated"] == 60
    for key in METRICS:
        assert after_two[key] == two["metrics"][key]
    assert four["metrics"] != two["metrics"]  # the curve moved: a check that can fail
    assert four["rounds"][0]["after_round"] == 0
    # training helped the shared model (what the users keep starts at their own models)
    assert four["rounds"][0]["accuracy_shared"] < after_two["accuracy_shared"]


@pytest.mark.parametrize("algorithm", ["deep-private-fedrep", "deep-dp-fedavg-ft"])
def test_eval_steps_change_nothing_the_run_computes_or_releases(algorithm):
    """With Poisson cohorts, adaptive clipping and the private evaluation: the same model,
    ledger, epsilon, private metric and final metrics with and without the eval steps (they
    draw no noise, move no sample and spend no epsilon)."""
    keys = dict(rounds=3, users_per_round=30, clip_quantile=0.5, private_metrics=True)
    plain, curved = run(algorithm, **keys), run(algorithm, eval_every=1, **keys)
    assert [r["step"] for r in curved["rounds"]] == [
        "eval-0", "round-1", "eval-1", "round-2", "eval-2", "round-3", "evaluate", "final"]
    assert curved["server_state"] == plain["server_state"]
    assert curved["privacy"] == plain["privacy"]
    assert curved["private_metrics"] == plain["private_metrics"]
    assert curved["metrics"] == plain["metrics"]
    evals = [r for r in curved["rounds"] if r["step"].startswith("eval-")]
    assert all("epsilon_spent" not in r and r["users_evaluated"] == 60 for r in evals)
    rounds = [r for r in curved["rounds"] if r["step"].startswith("round-")]
    assert [r["users_contributing"] for r in rounds] == [
        r["users_contributing"] for r in plain["rounds"] if r["step"].startswith("round-")]


def test_the_curve_is_drawn_beside_the_operator_report_and_never_released(tmp_path):
    results = run("deep-private-fedrep", rounds=4, eval_every=2)
    report, release = write_outputs(results, tmp_path / "r.json")
    png = curve_path(report)
    assert png == tmp_path / "r.curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = curve_points(results)
    by_step = {r["step"]: r for r in results["rounds"]}
    assert [p["round"] for p in points] == [0, 2, 4]
    assert [p["epsilon_spent"] for p in points] == [0.0, by_step["round-2"]["epsilon_spent"],
                                                    by_step["round-4"]["epsilon_spent"]]
    assert points[1]["accuracy"] == by_step["eval-2"]["accuracy"]
    assert points[2]["accuracy"] == results["metrics"]["accuracy"]
    assert any(str(png) in line for line in output_lines(report, release, results))
    released = json.loads(release.read_text())
    assert "accuracy" not in json.dumps(released)  # exact metrics stay with the operator
    assert [s["step"] for s in released["steps"]] == [f"round-{t}" for t in range(1, 5)]
    # a run without eval steps: no curve (an older run's at its path is removed), no line
    plain = run("deep-private-fedrep", rounds=2)
    write_outputs(results, tmp_path / "plain.json")
    assert curve_path(tmp_path / "plain.json").exists()
    report, release = write_outputs(plain, tmp_path / "plain.json")
    assert not curve_path(report).exists() and curve_points(plain) == []
    assert not any("learning curve" in line for line in output_lines(report, release, plain))


def test_a_poisson_runs_curve_shows_only_the_epsilons_the_accountant_gave(tmp_path):
    """With Poisson cohorts the accountant is evaluated at some rounds only (1, 2, 4 and the
    last here): a point after another round carries no epsilon (not an older, smaller one),
    and the plot then leaves the epsilon axis out."""
    results = run("deep-private-fedrep", rounds=5, users_per_round=30, eval_every=1)
    by_step = {r["step"]: r for r in results["rounds"]}
    assert "epsilon_spent" not in by_step["round-3"]
    points = curve_points(results)
    assert [p["round"] for p in points] == [0, 1, 2, 3, 4, 5]
    assert [p["epsilon_spent"] for p in points] == [
        0.0, *(by_step[f"round-{t}"].get("epsilon_spent") for t in range(1, 6))]
    assert points[3]["epsilon_spent"] is None and points[5]["epsilon_spent"] <= 2.0
    report, _ = write_outputs(results, tmp_path / "r.json")
    assert curve_path(report).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_eval_every_fails_before_the_run_naming_the_key():
    with pytest.raises(ConfigError, match="eval-every"):
        parse_config({"algorithm": "deep-private-fedrep", **SMALL, "eval-every": -1},
                               strict=True)
    with pytest.raises(ConfigError, match="eval-every"):  # nothing shared, no rounds to score
        parse_config({"algorithm": "deep-local-only", **SMALL, "eval-every": 2},
                               strict=True)


SWEEP = """
[sweep]
name = "curves"
title = "tiny curves"
epsilons = [2, 8]
seeds = [0, 1]
metric = "accuracy"

[base]
dataset = "digits"
num-users = 60
hidden-sizes = "16"
delta = 1e-5
rounds = 2
eval-every = 1

[[series]]
label = "Private FedRep"
algorithm = "deep-private-fedrep"

[[series]]
label = "FedRep"
algorithm = "deep-fedrep"
set = { clipping = false }

[[series]]
label = "Local only"
algorithm = "deep-local-only"
"""


def test_a_sweep_draws_its_runs_learning_curves_one_panel_per_epsilon(tmp_path, capsys):
    from fedpriv.cli import main
    from fedpriv.sweep import load_sweep
    from fedpriv.sweep_figure import curve_table

    path = tmp_path / "curves.toml"
    path.write_text(SWEEP)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--jobs", "1",
                 "--plot", str(tmp_path / "fig.png")]) == 0
    printed = capsys.readouterr().out
    assert f"learning curves (the runs' eval steps; exact, operator only) {out / 'curves.png'}" in (
        printed)
    for png in (out / "curves.png", tmp_path / "fig_curves.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = curve_table(load_sweep(path), out / "runs")
    runs = {p.name: json.loads(p.read_text()) for p in (out / "runs").glob("*.json")
            if ".release." not in p.name}
    for label, slug, eps in (("Private FedRep", "private-fedrep", 2.0),
                             ("Private FedRep", "private-fedrep", 8.0),
                             ("FedRep", "fedrep", None)):
        cell = table[(label, eps)]
        assert sorted(cell) == [0, 1, 2]  # the initial model, eval-1, the final step
        tag = "none" if eps is None else f"{eps:g}"
        seeds = [runs[f"{slug}__eps-{tag}__seed-{s}.json"] for s in (0, 1)]
        assert cell[2] == [r["metrics"]["accuracy"] for r in seeds]
        assert cell[1] == [next(s["accuracy"] for s in r["rounds"] if s["step"] == "eval-1")
                           for r in seeds]
    local = [runs[f"local-only__eps-none__seed-{s}.json"] for s in (0, 1)]
    assert table[("Local only", None)] == {None: [r["metrics"]["accuracy"] for r in local]}
    # the same sweep without eval steps: no curves, and the old figure is not left behind
    path.write_text(SWEEP.replace("eval-every = 1\n", ""))
    assert main(["sweep", str(path), "--out", str(out), "--jobs", "1"]) == 0
    assert "learning curves" not in capsys.readouterr().out
    assert not (out / "curves.png").exists()
    # the runs of the earlier config are moved aside, not overwritten
    aside = sorted(p.name for p in (out / "runs" / "replaced").glob("*.json"))
    assert "private-fedrep__eps-2__seed-0-1.json" in aside
    assert "private-fedrep__eps-2__seed-0-1.release.json" in aside
