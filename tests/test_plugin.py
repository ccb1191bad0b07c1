"""A plug-in algorithm from another package, with a run-config key of its own: installed from
``tests/plugin_pkg`` (a real package with a ``fedpriv.algorithms`` entry point) into a temporary
folder, then run through the CLI in-process and through the Flower simulation engine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site),
                    str(ROOT / "tests" / "plugin_pkg")], check=True, capture_output=True)
    return site


def _env(site: Path, base: dict | None = None) -> dict:
    env = dict(base or os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _fedpriv(args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "fedpriv.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_the_plugin_is_listed_with_its_own_key(plugin_site):
    done = _fedpriv(["algorithms"], _env(plugin_site))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    row = lines.index(next(line for line in lines if line.startswith("toy-mean")))
    assert "toy mean: toy-scale=1.0" in lines[row + 1]


def test_the_plugin_runs_in_process_with_its_key_and_refuses_a_typo(plugin_site, tmp_path):
    env = _env(plugin_site)
    out = tmp_path / "toy.json"
    done = _fedpriv(["run", "--engine", "inprocess", "--set", "algorithm=toy-mean",
                     "--set", "toy-scale=2.5", "--set", "num-users=400", "--set", "epsilon=8",
                     "--out", str(out)], env)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    metrics = results["metrics"]
    assert results["config"]["toy-scale"] == 2.5
    assert metrics["scale_seen_by_nodes"] == pytest.approx(2.5)
    assert metrics["estimate"] == pytest.approx(metrics["exact_mean"], abs=0.1)
    assert 0 < results["privacy"]["epsilon"] <= 8.0
    typo = _fedpriv(["run", "--engine", "inprocess", "--set", "algorithm=toy-mean",
                     "--set", "toy-scal=2.5", "--out", str(tmp_path / "typo.json")], env)
    assert typo.returncode == 2
    assert "toy-scal" in typo.stderr and "toy-scale" in typo.stderr  # names it and the keys
    bad = _fedpriv(["run", "--engine", "inprocess", "--set", "algorithm=toy-mean",
                    "--set", "toy-scale=-1", "--out", str(tmp_path / "bad.json")], env)
    assert bad.returncode == 2 and "toy-scale: -1.0 is not allowed" in bad.stderr


@pytest.mark.integration
def test_the_plugin_runs_through_the_flower_simulation(plugin_site, tmp_path, flower_env):
    env = _env(plugin_site, flower_env)
    settings = ["--set", "algorithm=toy-mean", "--set", "toy-scale=2.5", "--set",
                "num-users=400", "--set", "epsilon=8"]
    local, flower = tmp_path / "local.json", tmp_path / "flower.json"
    assert _fedpriv(["run", "--engine", "inprocess", *settings, "--out", str(local)],
                    env).returncode == 0
    done = _fedpriv(["run", *settings, "--out", str(flower)], env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    a, b = json.loads(local.read_text()), json.loads(flower.read_text())
    assert b["config"] == {**a["config"], "results-path": b["config"]["results-path"],
                           "checkpoint-path": b["config"]["checkpoint-path"]}
    assert b["config"]["toy-scale"] == 2.5 and b["num_nodes"] == a["num_nodes"]
    assert b["metrics"]["scale_seen_by_nodes"] == pytest.approx(2.5)
    assert b["privacy"]["ledger"] == a["privacy"]["ledger"]
    for key, value in a["metrics"].items():
        assert b["metrics"][key] == pytest.approx(value, rel=1e-9)
