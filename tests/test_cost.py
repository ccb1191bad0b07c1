"""The size guard (``fedpriv.cost``): absurd runs are refused before anything is allocated,
naming the key and the estimate; ``size-check = false`` lets a run through; the estimate grows
with the run and is within a factor of 4 of the peak memory of real in-process runs."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tracemalloc
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedpriv import cost
from fedpriv.config import ConfigError
from fedpriv.configure import parse_config
from fedpriv.server import check_run

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "private_fedrep.toml"
AS_LIMIT = 2 * 2**30  # the refusal's address space: a run of 10^9 users needs 8 GB of ids alone


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _fedpriv_run(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run(
        [sys.executable, "-m", "fedpriv.cli", "run", str(CONFIG), "--engine", "inprocess",
         "--out", str(tmp_path / "r.json"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, preexec_fn=_limited)


@pytest.mark.parametrize(("key", "value"), [("num-users", 10**9), ("rounds", 10**9),
                                            ("num-users", 10**10)])
def test_an_absurd_run_is_refused_without_allocating_it(tmp_path, key, value):
    """In a process limited to 2 GB of address space: the run exits 2 with a message naming
    the key, its value and the estimate, not with a MemoryError or a kill."""
    done = _fedpriv_run(tmp_path, f"{key}={value}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{key} = {value}:" in done.stderr
    assert "size-check = false" in done.stderr
    assert "MemoryError" not in done.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_refusal_says_why():
    huge = parse_config({"algorithm": "private-fedrep", "num-users": 10**10}, strict=True)
    with pytest.raises(ConfigError) as err:
        cost.check_size(huge)
    assert "would take about" in str(err.value) and "12.0 h a run may take" in str(err.value)
    many = parse_config({"algorithm": "dp-global-model", "rounds": 10**8}, strict=True)
    with pytest.raises(ConfigError, match=r"rounds = 100000000: 100,000,001 steps, above"):
        cost.check_size(many)


def test_memory_beyond_the_machine_is_refused_and_the_override_lets_it_through(monkeypatch):
    monkeypatch.setattr(cost, "available_memory", lambda: 50 * 2**20)  # a 50 MB machine
    values = {"algorithm": "private-fedrep", "num-users": 20_000, "checkpoint": False}
    with pytest.raises(ConfigError) as err:
        check_run(parse_config(values, strict=True))
    text = str(err.value)
    assert text.startswith("num-users = 20000") and "of memory (estimate" in text
    assert "this machine has 52 MB available" in text
    # the override: the same run passes the check (and the rest of check_run: plan, budget)
    assert check_run(parse_config({**values, "size-check": False}, strict=True))
    assert cost.check_size(parse_config({**values, "size-check": False}, strict=True)) is None
    # a deployment submitted from here runs elsewhere: its memory is not this machine's
    assert check_run(parse_config(values, strict=True), here=False)


def test_the_refusal_comes_before_the_privacy_plan(monkeypatch):
    import fedpriv.server.core as core

    def no_plan(*args, **kwargs):
        raise AssertionError("the plan was calibrated before the size check")

    monkeypatch.setattr(core, "calibrate", no_plan)
    with pytest.raises(ConfigError, match="rounds = 1000000000"):
        check_run(parse_config({"algorithm": "private-fedrep", "rounds": 10**9}, strict=True))


def test_estimating_allocates_nothing_of_the_run():
    config = parse_config({"algorithm": "priv-altmin", "num-users": 10**12, "user-groups": 4,
                           "rounds": 8 * 10**8}, strict=True)
    tracemalloc.start()
    try:
        est = cost.estimate(config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20  # the probe's steps, never 10^12 ids or 8e8 steps
    assert est.memory_bytes > 10**13 and est.steps == pytest.approx(8 * 10**8 + 2, rel=1e-6)


@pytest.mark.parametrize("algorithm", ["private-fedrep", "dp-global-model", "priv-altmin",
                                       "meta-nsgd", "dp-ftmrl", "a-exp"])
def test_the_estimate_grows_with_num_users_and_rounds(algorithm):
    def est(**values: int) -> cost.Estimate:
        keys = {k.replace("_", "-"): v for k, v in values.items()}
        return cost.estimate(parse_config({"algorithm": algorithm, **keys}, strict=True))

    most = 10**5 if algorithm == "a-exp" else 10**8  # a-exp's own guard: 2e8 user scores
    users = [est(num_users=n, rounds=4) for n in (1_000, 3_000, 10_000, most // 3, most)]
    rounds = ([] if algorithm == "a-exp"  # one selection, whatever the rounds
              else [est(num_users=10**5, rounds=r) for r in (4, 40, 400, 4_000, 40_000)])
    for series in (users, rounds):
        assert all(a.memory_bytes < b.memory_bytes for a, b in pairwise(series))
        assert all(a.seconds < b.seconds for a, b in pairwise(series))


def test_many_rounds_are_extrapolated_from_a_probe():
    exact = cost.estimate(parse_config({"rounds": cost.PROBE_ROUNDS}, strict=True))
    above = cost.estimate(parse_config({"rounds": 4 * cost.PROBE_ROUNDS}, strict=True))
    assert exact.steps == cost.PROBE_ROUNDS + 2  # init, the rounds, final
    assert above.steps == pytest.approx(4 * cost.PROBE_ROUNDS + 2)


def test_a_long_run_gets_one_line_and_a_short_one_none():
    long = parse_config({"algorithm": "private-fedrep", "num-users": 10**6}, strict=True)
    line = cost.estimate_line(long)
    assert line is not None and line.startswith("fedpriv: estimated ~")
    assert "GB peak (from num-users = 1000000" in line
    assert cost.estimate_line(parse_config({"num-users": 2000}, strict=True)) is None


def test_the_machine_memory_is_read_or_none(monkeypatch):
    found = cost.available_memory()
    assert found is None or found > 0
    monkeypatch.setattr(cost, "available_memory", lambda: None)  # no /proc: memory unchecked
    big = parse_config({"num-users": 3 * 10**6, "dim": 200}, strict=True)
    assert cost.check_size(big) is not None


def test_the_flower_server_app_checks_before_discovering_nodes(monkeypatch):
    import strategies.server_app as server_app

    def discover(grid, timeout):
        raise AssertionError("nodes discovered before the size check")

    monkeypatch.setattr(server_app, "discover_partitions", discover)
    with pytest.raises(ConfigError, match="num-users = 1000000000"):
        server_app.main(None, SimpleNamespace(run_config={"num-users": 10**9}))


def test_sweeps_and_tuning_check_every_run_before_any(tmp_path):
    from fedpriv.sweep import load_sweep
    from fedpriv.tuning.spec import load_tune

    with pytest.raises(ConfigError, match=r"num-users = 1000000000: this run"):
        load_sweep(ROOT / "configs" / "quick_sweep.toml", {"num-users": 10**9})
    with pytest.raises(ConfigError, match=r"candidate .*num-users = 1000000000: this run"):
        load_tune(ROOT / "configs" / "tune_private_fedrep.toml", ["num-users=1000000000"])


# The run's own peak: VmHWM, the high-water RSS of this process's memory since its exec.
# getrusage's ru_maxrss is not: Linux keeps it across fork and exec, so a child of a large
# pytest worker (after the deep tests) reported the worker's 1.86 GB as its own peak.
MEASURE = """
import json, re, sys
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
run_in_process(parse_config(json.loads(sys.argv[1]), strict=True), log=lambda _: None)
status = open("/proc/self/status").read()
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024)
"""


@pytest.mark.parametrize("values", [
    {"algorithm": "private-fedrep", "num-users": 2_000},  # small: the imports dominate
    {"algorithm": "private-fedrep", "num-users": 100_000},  # medium: the data cache dominates
], ids=["small", "medium"])
def test_the_estimate_is_within_4x_of_a_measured_peak(values, tmp_path):
    values = {**values, "checkpoint": False, "results-path": str(tmp_path / "r.json")}
    done = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(values)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    measured = int(done.stdout.split()[-1])
    estimated = cost.estimate(parse_config(values, strict=True)).memory_bytes
    assert measured / 4 < estimated < 4 * measured, (estimated, measured)


def test_a_deep_run_on_a_built_in_dataset_is_refused_before_its_partition_is_cut():
    """The deep family cuts a built-in dataset's partition while its config is parsed: the
    size check comes first, so 10^9 users are refused, not partitioned."""
    from fedpriv.configure import parse_config

    with pytest.raises(ConfigError, match="num-users = 1000000000"):
        parse_config({"algorithm": "deep-private-fedrep", "dataset": "digits",
                      "num-users": 1_000_000_000})


def test_the_estimate_reads_no_users_data_file(tmp_path):
    """A data file's size is a function of its users' rows: the server's size check does not
    read it (two files of different sizes, the same estimate)."""
    import dataclasses

    from fedpriv import cost
    from fedpriv.configure import parse_config

    base = parse_config({"algorithm": "deep-private-fedrep", "dataset": "digits",
                         "num-users": 60})
    small, big = tmp_path / "small.npz", tmp_path / "big.npz"
    small.write_bytes(b"x" * 10)
    big.write_bytes(b"x" * 10_000_000)
    estimates = [cost.estimate(dataclasses.replace(base, dataset="npz", data_file=str(f)))
                 for f in (small, big)]
    assert estimates[0].memory_bytes == estimates[1].memory_bytes
    assert estimates[0].seconds == estimates[1].seconds


def test_a_deep_runs_time_counts_its_local_steps():
    """One local step is ghost clipping; several are per-user updates, each user-step costing
    2 + body-steps one-step user-steps (measured: docs/defaults.md), named in the breakdown."""
    from fedpriv import cost
    from fedpriv.configure import parse_config

    keys = {"algorithm": "deep-dp-fedavg-ft", "dataset": "fashion-mnist", "num-users": 2000}
    default = cost.estimate(parse_config(keys))  # DP-FedAvg's default: 5 local steps
    one = cost.estimate(parse_config({**keys, "body-steps": 1, "local-lr": 0.1}))
    many, single = (next(t for t in est.time if t.name == "user work") for est in (default, one))
    assert many.value == pytest.approx(7 * single.value)
    assert "body-steps" in many.keys and "body-steps" not in single.keys
    assert default.seconds > 200 > one.seconds
