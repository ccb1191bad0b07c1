"""``fedpriv sweep``: validation before running, the table, the figure, reuse."""

import json
import subprocess
import sys
import textwrap

import pytest

from fedpriv.cli import main
from fedpriv.config import ConfigError
from fedpriv.sweep import load_sweep, run_sweep, summarize

SWEEP = """
[sweep]
name = "tiny"
title = "a tiny sweep"
epsilons = [2, 8]
seeds = [0, 1]

[base]
num-users = 600
dim = 16
rounds = 2
test-samples-per-user = 3

[[series]]
label = "Private FedRep"
algorithm = "private-fedrep"

[[series]]
label = "Local only"
algorithm = "local-only"

[[series]]
label = "FedRep (non-private, no clipping)"
algorithm = "fedrep"
set = { clipping = false }
"""


def write(tmp_path, text, name="sweep.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_sweep_writes_table_and_figure_and_reuses_finished_runs(tmp_path, capsys):
    path = write(tmp_path, SWEEP)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--jobs", "1",
                 "--plot", str(tmp_path / "fig.png")]) == 0
    printed = capsys.readouterr().out
    assert "[1/8]" in printed and "[8/8]" in printed and "ETA" in printed
    rows = json.loads((out / "table.json").read_text())
    assert [(r["series"], r["epsilon"]) for r in rows] == [
        ("Private FedRep", 2.0), ("Private FedRep", 8.0), ("Local only", None),
        ("FedRep (non-private, no clipping)", None)]
    runs = sorted(p for p in (out / "runs").glob("*.json") if ".release." not in p.name)
    assert len(runs) == 8  # 2 epsilons x 2 seeds + 2 epsilon-free series x 2 seeds
    for run in runs:  # every run's release beside its operator report, as Flower's
        release = json.loads(run.with_name(run.stem + ".release.json").read_text())
        assert "ledger" in release["privacy"] and "server_state" not in release
        assert json.loads(run.read_text())["document"].startswith("fedpriv OPERATOR REPORT")
    fedrep_2 = [json.loads(p.read_text()) for p in runs if "private-fedrep__eps-2__" in p.name]
    values = [r["metrics"]["population_mse"] for r in fedrep_2]
    assert rows[0]["population_mse_mean"] == pytest.approx(sum(values) / 2)
    assert rows[0]["population_mse_min"] == min(values)
    assert rows[0]["epsilon_spent_max"] <= 2.0
    assert rows[3]["epsilon_spent_max"] is None  # released without noise
    assert rows[2]["epsilon_spent_max"] == 0.0  # released nothing
    assert rows[1]["population_mse_mean"] < rows[2]["population_mse_mean"]
    header = (out / "table.csv").read_text().splitlines()[0]
    assert header.startswith("series,algorithm,epsilon,seeds,population_mse_mean")
    for png in (out / "figure.png", tmp_path / "fig.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # a second invocation reuses every finished run
    spec = load_sweep(path)
    messages = []
    rows_again = run_sweep(spec, out, log=messages.append)
    assert "8 reused, 0 to run" in messages[0]
    assert rows_again == rows


@pytest.mark.parametrize("change,message", [
    (("epsilons = [2, 8]", "epsilons = [2, -1]"), "epsilons"),
    (("seeds = [0, 1]", "seeds = [0, 0]"), "duplicate seeds"),
    (('name = "tiny"', 'name = "tiny"\nrepeats = 3'), "unknown key"),
    (('algorithm = "local-only"', 'algorithm = "no-such-thing"'), "unknown algorithm"),
    (("dim = 16", "dim = 16\nepsilon = 3"), "set by the sweep"),
    (("dim = 16", "dim = -8"), "dim"),
    (("set = { clipping = false }", "set = { clipping = false, rounds = -1 }"), "rounds"),
    (("[base]", "[base]\nclipping = false"), "clipping"),
])
def test_bad_sweeps_fail_before_any_run_naming_the_problem(tmp_path, change, message, capsys):
    path = write(tmp_path, SWEEP.replace(*change))
    with pytest.raises(ConfigError, match=message):
        load_sweep(path)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    assert message.split()[0] in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("item,message", [
    ("epsilon=3", "--set epsilon: set by the sweep itself"),
    ("seed=4", "--set seed: set by the sweep itself"),
    ("head-step=3", r"--set: key\(s\) \['head-step'\] are read by none"),
])
def test_a_bad_set_item_is_named_as_one(tmp_path, item, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(write(tmp_path, SWEEP), {item.split("=")[0]: int(item.split("=")[1])})


def test_a_metric_the_runs_do_not_report_stops_the_sweep_at_the_first_run(tmp_path, capsys):
    path = write(tmp_path, SWEEP.replace('title = "a tiny sweep"',
                                         'title = "a tiny sweep"\nmetric = "populaton_mse"'))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--jobs", "1"]) == 2
    captured = capsys.readouterr()
    assert "[1/8]" in captured.out and "[2/8]" not in captured.out
    assert "sweep stopped: [sweep] metric: 'populaton_mse' is not reported by" in captured.err
    assert "'population_mse'" in captured.err and "Traceback" not in captured.err
    assert len(list((out / "runs").glob("*.release.json"))) == 1  # kept, for reuse


def test_labels_that_name_the_same_files_are_refused_saying_so(tmp_path):
    text = SWEEP.replace('label = "Local only"', 'label = "Private-FedRep"')
    with pytest.raises(ConfigError, match="label 'Private-FedRep' names the same run files as "
                                          "'Private FedRep'"):
        load_sweep(write(tmp_path, text))


def test_an_accuracy_axis_is_linear_unless_the_file_says_otherwise(tmp_path):
    assert load_sweep(write(tmp_path, SWEEP)).log_y  # an MSE: log scale
    text = SWEEP.replace('title = "a tiny sweep"', 'title = "t"\nmetric = "accuracy"')
    assert not load_sweep(write(tmp_path, text, "acc.toml")).log_y
    forced = text.replace('metric = "accuracy"', 'metric = "accuracy"\nlog-y = true')
    assert load_sweep(write(tmp_path, forced, "forced.toml")).log_y


def test_summary_statistics_over_seeds():
    from fedpriv.sweep import Run, SweepSpec

    runs = {Run("A", "x", 1.0, s, {}): {"metrics": {"population_mse": v, "test_mse": v},
                                          "privacy": {"epsilon": 0.9}, "wall_time_s": 1.0}
            for s, v in enumerate([1.0, 2.0, 4.0])}
    spec = SweepSpec("s", "t", [1.0], [0, 1, 2], {}, [{"label": "A", "algorithm": "x"}], [],
                     None)
    (row,) = summarize(spec, runs)
    assert row["population_mse_mean"] == pytest.approx(7 / 3)
    assert row["population_mse_std"] == pytest.approx(1.5275252, rel=1e-6)
    assert (row["population_mse_min"], row["population_mse_max"]) == (1.0, 4.0)


def test_an_x_key_that_a_reference_series_does_not_read_gives_it_a_flat_line(tmp_path):
    path = write(tmp_path, """
        [sweep]
        x = "clip-norm"
        x-values = [0.25, 1.0]
        epsilons = [4]

        [base]
        num-users = 300
        dim = 8

        [[series]]
        algorithm = "private-fedrep"

        [[series]]
        algorithm = "local-only"
    """)
    spec = load_sweep(path)
    fedrep = [r for r in spec.runs if r.algorithm == "private-fedrep"]
    local = [r for r in spec.runs if r.algorithm == "local-only"]
    assert sorted(r.values["clip-norm"] for r in fedrep) == [0.25, 1.0]
    assert [r.x for r in local] == [0.25, 1.0] and all("clip-norm" not in r.values
                                                       for r in local)


FLOWER_SWEEP = """
[sweep]
name = "flower"
epsilons = [4]
seeds = [0]

[base]
num-users = 300
dim = 8
rounds = 1

[[series]]
algorithm = "private-fedrep"

[[series]]
algorithm = "local-only"
"""


def _ray_sessions(root) -> list:
    from pathlib import Path

    return list(Path(root).rglob("session_2*"))


def test_a_ray_head_that_exits_at_start_up_is_retried_once_then_its_log_is_quoted(
        monkeypatch):
    """The error names why (the head's log is removed with its folder, so the error quotes
    it), after one retry with fresh ports."""
    from fedpriv import launcher

    starts, real_popen = [], subprocess.Popen

    def failing_head(args, **kwargs):
        starts.append(args)
        return real_popen([sys.executable, "-c", "print('gcs: port 6379 is already in use')"],
                          stdout=kwargs["stdout"], stderr=kwargs["stderr"])

    monkeypatch.setattr(launcher, "_port_open", lambda port: False)  # no SuperLink running
    monkeypatch.setattr(launcher, "stop_local_superlink", lambda port: None)
    monkeypatch.setattr(launcher.subprocess, "Popen", failing_head)
    session = launcher.FlowerSession(num_cpus=1)
    with pytest.raises(RuntimeError, match="did not start(.|\n)*port 6379 is already in use"):
        session.__enter__()
    assert len(starts) == 2 and starts[0][:3] == ["ray", "start", "--head"]
    assert session._head is None and session._tmp is None  # nothing left behind


@pytest.mark.integration
def test_a_sessions_superlink_port_taken_meanwhile_is_chosen_again(flower_env, monkeypatch,
                                                                   deadline):
    """The session chooses its SuperLink's ports when entered and starts Ray's head (which
    opens many ports) before the SuperLink: a port taken in between is chosen again, not an
    error (it failed five tests of one clean run)."""
    import socket

    from fedpriv import launcher

    monkeypatch.delenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", raising=False)
    with deadline(300), launcher.FlowerSession(num_cpus=1) as session, socket.socket() as taker:
        taken = session.link.port
        taker.bind(("127.0.0.1", taken))
        taker.listen()
        session.start_superlink()
        assert session.link.port != taken and session.link.running()
        assert not session.link.named


@pytest.mark.integration
def test_a_flower_sweep_shares_one_superlink_and_one_ray_head_and_stops_them(
        tmp_path, flower_env, flower_sessions, monkeypatch, deadline):
    from fedpriv import launcher, sweep

    # no SuperLink named: the session starts its own (free ports, a private FLWR_HOME)
    monkeypatch.delenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT")
    # a new user's environment: without Ray's loopback setting, the runs' drivers left
    # 127.0.0.1 for the machine's IP and hung (fixed in launcher.run_flower)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    heads = flower_sessions
    spec = load_sweep(write(tmp_path, FLOWER_SWEEP))
    with deadline(300):
        rows = run_sweep(spec, tmp_path / "out", engine="flower", log=lambda _: None)
    assert [r["series"] for r in rows] == ["private-fedrep", "local-only"]
    (session,) = heads
    port = session.link.port
    assert not session.link.named and session.link.home is not None
    # every simulation ran on the session's Ray head: none started a Ray instance of its own
    assert session.ray_address and not _ray_sessions(flower_env["RAY_TMPDIR"])
    # ... and both are stopped at the end
    assert session._head is None and not launcher._port_open(port)

    # an error in the middle of a sweep stops them too
    def boom(values, path, session=None):
        raise RuntimeError("a run failed")

    monkeypatch.setattr(sweep, "_run_flower", boom)
    with pytest.raises(RuntimeError, match="a run failed"):
        run_sweep(load_sweep(write(tmp_path, FLOWER_SWEEP.replace('"flower"', '"again"'))),
                  tmp_path / "again", engine="flower", log=lambda _: None)
    assert heads[-1]._head is None and not launcher._port_open(heads[-1].link.port)


def _stored_sweeps() -> list:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return [path for path in sorted((root / "configs").glob("*.toml"))
            if "[sweep]" in path.read_text()]


def test_figure_configs_set_the_hyperparameters_that_defaults_may_change():
    """A stored figure never depends on a tuned default: every run of an algorithm with
    defaults of its own (and of the deep cross-fitting, head steps and final choice) names
    those keys in its sweep file, so a change of a default changes no figure. (Every run's
    config and size are checked; the privacy plans are calibrated in the slow tier's test
    below.)"""
    from fedpriv.registry import get_algorithm

    checked = 0
    for path in _stored_sweeps():
        for run in load_sweep(path, plans=False).runs:
            cls = get_algorithm(run.algorithm)
            tuned = set(cls.defaults) | ({"cross-fit", "head-steps", "final-choice",
                                          "body-steps", "local-lr"}  # also where they fall back
                                         & set(cls.declared_params()))
            if run.values.get("final-choice", "best") == "best":  # the choice's own rule
                tuned |= {"choice-std-errors"} & set(cls.declared_params())
            missing = sorted(tuned - set(run.values))
            assert not missing, f"{path.name}, {run.series}: set {missing} in the file"
            checked += bool(tuned)
    assert checked > 100  # the deep figures' runs


@pytest.mark.slow
def test_every_stored_sweep_meets_its_privacy_plans():
    """Every figure's sweep file loads as `fedpriv sweep` loads it: each run's privacy plan
    calibrated (188 plans, about a minute on 2 cores)."""
    runs = [run for path in _stored_sweeps() for run in load_sweep(path).runs]
    assert len(runs) > 100


DISTRIBUTED_SWEEP = """
[sweep]
name = "shares"
title = "distributed noise"
epsilons = [2]
seeds = [0]

[base]
num-users = 400
users-per-node = 100
dim = 8
rounds = 1
accountant = "rdp"
aggregation = "distributed"
test-samples-per-user = 3

[[series]]
label = "Private FedRep"
algorithm = "private-fedrep"
"""


def test_a_distributed_sweep_reads_the_simulators_metrics_and_refuses_flower(tmp_path):
    """The server of a distributed run receives no exact metrics: an in-process sweep tables
    the simulator's measurement on the nodes; a Flower one is refused before any run."""
    spec = load_sweep(write(tmp_path, DISTRIBUTED_SWEEP))
    with pytest.raises(ConfigError, match=r"^\[sweep\] engine: series \['Private FedRep'\]"):
        run_sweep(spec, tmp_path / "flower", engine="flower", log=lambda _: None)
    assert not list((tmp_path / "flower" / "runs").glob("*.json"))
    rows = run_sweep(spec, tmp_path / "out", log=lambda _: None)
    (run,) = [json.loads(p.read_text()) for p in (tmp_path / "out" / "runs").glob("*.json")
              if ".release." not in p.name]
    assert run["metrics"] == {}
    assert rows[0]["population_mse_mean"] == run["simulation_metrics"]["population_mse"]
