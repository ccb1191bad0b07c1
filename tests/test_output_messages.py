"""Quiet, clear output: a typo gets a suggestion, a TOML error names its file, line and column,
no printed line is empty of values, the release line is short, and a result worse than each
user alone says so."""

import json

import pytest

from fedpriv import cli
from fedpriv.config import ConfigError
from fedpriv.config_files import load_run_config, read_config_file
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.outputs import output_lines, write_outputs
from fedpriv.registry import get_algorithm
from fedpriv.server import plan_lines
from fedpriv.server.report import quality_line, results_dict, summary_lines
from fedpriv.sweep import load_sweep
from tests.conftest import small_config

BAD_TOML = 'algorithm = "local-only"\nnum-users = 10\nepsilon = = 2\n'


# ----- 1. did you mean ---------------------------------------------------------------------------
def test_an_unknown_algorithm_suggests_the_closest_registered_name(capsys):
    with pytest.raises(KeyError, match="unknown algorithm 'priv-altmn'; did you mean "
                                       "'priv-altmin'\\?"):
        get_algorithm("priv-altmn")
    with pytest.raises(ConfigError, match="algorithm: .*did you mean 'priv-altmin'\\?"):
        parse_config({"algorithm": "priv-altmn"}, strict=True)
    with pytest.raises(KeyError) as far:  # nothing close: no guess, the registered names
        get_algorithm("zzzzzz")
    assert "did you mean" not in str(far.value) and "private-fedrep" in str(far.value)
    # what `fedpriv run --set algorithm=priv-altmn` prints (it fails before any run)
    assert cli.main(["run", "--engine", "inprocess", "--set", "algorithm=priv-altmn"]) == 2
    assert "did you mean 'priv-altmin'?" in capsys.readouterr().err


def test_an_unknown_key_suggests_the_closest_key():  # already there: kept
    with pytest.raises(ConfigError, match="did you mean 'num-users' for 'num-user'\\?"):
        parse_config({"num-user": 10}, strict=True)


# ----- 2. TOML errors name file:line:column -------------------------------------------------------
def test_a_toml_syntax_error_names_the_file_line_and_column(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text(BAD_TOML)
    expected = "bad.toml:3:11: not valid TOML: Invalid value"
    with pytest.raises(ConfigError) as err:
        read_config_file("bad.toml")
    assert str(err.value) == expected
    with pytest.raises(ConfigError, match=expected):
        load_run_config("bad.toml", [])
    with pytest.raises(ConfigError, match=expected):
        load_sweep("bad.toml")
    assert cli.main(["run", "--engine", "inprocess", "bad.toml"]) == 2
    assert expected in capsys.readouterr().err
    (tmp_path / "open.toml").write_text("seeds = [1, 2\n")  # at the end: tomllib says so
    with pytest.raises(ConfigError, match="open.toml: not valid TOML: .*end of document"):
        read_config_file("open.toml")


# ----- 3. no line without values -----------------------------------------------------------------
def test_a_run_without_noise_prints_no_empty_plan_line():
    assert plan_lines({}, {}) == []  # non-private: nothing, not "noise multipliers " alone
    assert plan_lines({"init": 3.15437, "round": 7.0}, {}) == [
        "fedpriv: noise multipliers init=3.154, round=7"]
    assert plan_lines({}, {"select": 0.5}) == [
        "fedpriv: epsilon per release (exponential mechanism) select=0.5"]


@pytest.mark.parametrize("name", ["fedrep", "local-only", "meta-sgd"])
def test_the_summary_of_a_non_private_run_has_no_empty_line(name):
    values = {"algorithm": name, "num-users": 300, "rounds": 2}
    if name == "meta-sgd":
        values["feature-dist"] = "unit-ball"
    results = run_in_process(parse_config(values), log=lambda _: None)
    text = "\n".join(summary_lines(results))
    for line in text.splitlines():
        assert line.strip() and not line.rstrip().endswith((":", "=")), line
        assert "nan" not in line, line


def test_a_quality_line_shows_only_the_figures_a_run_has():
    assert quality_line({"population_mse": 0.5}) == "  population MSE 0.5"
    assert quality_line({"my_score": 0.25}) == "  my_score 0.25"  # a plug-in's own metric


# ----- 4. the release line ------------------------------------------------------------------------
def test_a_seeded_release_prints_one_short_line_and_keeps_the_reason_in_the_file(tmp_path):
    report = run_in_process(small_config(num_users=300, rounds=2), log=lambda _: None)
    report_path, release = write_outputs(report, tmp_path / "run.json")
    lines = output_lines(report_path, release, report)
    line = next(x for x in lines if x.startswith("fedpriv: release"))
    assert line == ("fedpriv: release (public config, ledger, model; NOT publishable: seeded "
                    f"noise — rerun with secure-noise = true to publish): {release}")
    why = json.loads(release.read_text())["not_publishable_because"]
    assert why.startswith("seeded noise") and "regenerate the noise" in why and len(why) > 150
    baseline = run_in_process(parse_config({"algorithm": "fedrep", "num-users": 300,
                                            "rounds": 2}), log=lambda _: None)
    assert "NOT publishable: non-private baseline): " in output_lines(report_path, release,
                                                                       baseline)[1]


# ----- 5. worse than each user alone ------------------------------------------------------------
def _results(metrics, epsilon=2.0, ledger=({"release": "init"},)):
    config = small_config(epsilon=2.0, num_users=2000)
    return results_dict(
        config, num_nodes=3, runtime="test", private=epsilon is not None, epsilon=epsilon,
        pure=False, multipliers={"init": 2.0}, ledger=list(ledger), metrics=metrics,
        rounds=[], rejections={}, bounded=0, resumed_from=None, server_state={},
        wall_time_s=1.0)


def test_a_result_worse_than_each_user_alone_gets_a_one_line_hint():
    lines = summary_lines(_results({"population_mse": 2.468, "local_only_mse": 0.9915,
                                    "test_mse": 2.5}))
    quality, note = lines[1].splitlines()  # one entry: the privacy line stays lines[2]
    assert "population MSE 2.468" in quality and "privacy:" in lines[2]
    assert note == ("  note: worse than each user training alone (local-only MSE 0.9915 vs "
                    "2.468): at epsilon = 2 the noise dominates at 2000 users; raise num-users "
                    "(or epsilon; see docs/results.md)")
    better = summary_lines(_results({"population_mse": 0.1, "local_only_mse": 0.9915}))
    assert "note:" not in "\n".join(better)
    accuracy = {"test_accuracy": 0.7, "local_only_accuracy": 0.8,
                "known_embedding_accuracy": 0.9}
    assert "local-only test accuracy 0.8 vs 0.7" in summary_lines(_results(accuracy))[1]
    meta = {"transfer_risk": 9.0, "local_risk": 8.0, "fresh_tasks": 10}
    assert "local-only transfer risk 8 vs 9" in summary_lines(_results(meta))[1]
    plain = summary_lines(_results({"population_mse": 2.0, "local_only_mse": 1.0},
                                   epsilon=None, ledger=()))[1]
    assert "non-private baseline" in plain and "noise dominates" not in plain
    deep = {"accuracy": 0.5, "accuracy_p10": 0.2, "test_loss": 1.0}  # no local-only figure
    assert "note:" not in summary_lines(_results(deep))[1]


def test_the_summary_says_what_the_users_chose():
    deep = {"accuracy": 0.715, "accuracy_p10": 0.4, "test_loss": 0.78,
            "accuracy_shared": 0.7088, "accuracy_local": 0.6943, "chose_shared": 0.3433,
            "chose_mix": 0.4607, "chose_local": 0.196}
    quality, choice = summary_lines(_results(deep))[1].splitlines()
    assert "accuracy 0.7150" in quality
    assert choice == ("  each user's final choice (on its own training rows): shared model 34%, "
                      "a mix 46%, its own 20%; without the choice 0.7088, each user's linear "
                      "model alone 0.6943")
    linear = {"population_mse": 1.15, "local_only_mse": 0.99, "population_mse_shared": 3.2,
              "chose_shared": 0.07, "chose_mix": 0.34, "chose_local": 0.59}
    lines = summary_lines(_results(linear))[1].splitlines()
    assert lines[1].endswith("its own 59%; population MSE without the choice 3.2")
    assert lines[2].startswith("  note: worse than each user training alone")


def test_the_quick_starts_priv_altmin_run_says_it_is_worse_than_local_only():
    """README's second command (priv-altmin, epsilon 2; fewer users): the noise dominates."""
    config = parse_config({"algorithm": "priv-altmin", "epsilon": 2, "seed": 1,
                           "num-users": 500})
    results = run_in_process(config, log=lambda _: None)
    assert results["metrics"]["population_mse"] > results["metrics"]["local_only_mse"]
    assert "note: worse than each user training alone" in summary_lines(results)[1]


def test_the_flower_server_app_prints_no_empty_noise_multipliers_line(tmp_path, monkeypatch,
                                                                      capsys):
    """The ServerApp's plan line, for a non-private run (the Flower runtime stubbed out: the
    real one is exercised by the integration tests)."""
    from types import SimpleNamespace

    import strategies.server_app as server_app

    values = {"algorithm": "fedrep", "num-users": 300, "rounds": 2,
              "results-path": str(tmp_path / "run.json"), "checkpoint": False}
    results = run_in_process(parse_config(values), log=lambda _: None)

    class Strategy:
        def __init__(self, config, partitions, checkpoint_path=None):
            self.server = SimpleNamespace(multipliers={}, pure_epsilons={},
                                          discard_checkpoint=lambda: None)
            self.profile = []

        def run(self, grid):
            return dict(results)

    monkeypatch.setattr(server_app, "discover_partitions", lambda grid, timeout: [])
    monkeypatch.setattr(server_app, "PrivateStrategy", Strategy)
    server_app.main(None, SimpleNamespace(run_config=values))
    out = capsys.readouterr().out
    assert "noise multipliers" not in out and "fedpriv: fedrep on 300 users" in out
    assert all(line.strip() and not line.rstrip().endswith((":", "="))
               for line in out.splitlines()), out
