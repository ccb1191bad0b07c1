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


# ----- the contract before typed keys, and what moved ------------------------------------------
def test_a_plugin_declaring_paramgroups_gets_a_real_config_class(monkeypatch):
    """A plug-in written before typed keys (``components = (ParamGroup, ...)``, as the toy
    package here) keeps working: its config class is made from its groups at run time, a
    dataclass extending its parent algorithm's config, its keys real fields (no __getattr__)."""
    import dataclasses

    from fedpriv import registry
    from fedpriv.algorithms.personalization.params import FedRepConfig
    from fedpriv.algorithms.personalization.private_fedrep import PrivateFedRep
    from fedpriv.configure import parse_config
    from fedpriv.params import Param, ParamGroup, positive

    registry.available()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # only for this test
    extra = ParamGroup("old style", (Param("old-style-scale", float, 2.0, "a key", positive,
                                           "a number > 0"),))

    class OldStyle(PrivateFedRep):
        name = "old-style-fedrep"
        components = (*PrivateFedRep.components, extra)

    registry.register(OldStyle)
    config = parse_config({"algorithm": "old-style-fedrep", "old-style-scale": 3.0,
                           "clip-norm": 0.25}, strict=True)
    assert isinstance(config, FedRepConfig) and dataclasses.is_dataclass(config)
    assert config.old_style_scale == 3.0 and config.clip_norm == 0.25  # type: ignore[attr-defined]
    assert "__getattr__" not in type(config).__dict__
    assert list(OldStyle.declared_params()) == [*PrivateFedRep.declared_params(),
                                                "old-style-scale"]


def test_declaring_keys_both_ways_is_refused_naming_the_change():
    from fedpriv.algorithms.base import Algorithm
    from fedpriv.algorithms.personalization.params import ProblemKeys
    from fedpriv.params import ParamGroup

    with pytest.raises(TypeError, match="set config_type .typed keys. or, as plug-ins did "
                                        "before typed keys, components"):
        type("Both", (Algorithm,), {"config_type": ProblemKeys,
                                    "components": (ParamGroup("g", ()),)})


def test_what_moved_fails_with_a_message_naming_its_new_home():
    import warnings

    from fedpriv import cohorts
    from fedpriv.config import RunConfig

    with pytest.raises(AttributeError, match="fedpriv.configure.parse_config"):
        RunConfig.from_mapping({"algorithm": "private-fedrep"})
    with pytest.raises(AttributeError, match="fedpriv.configure.config_defaults"):
        RunConfig().defaults()
    with pytest.raises(AttributeError, match=r"block_cache\(\)"):
        cohorts.CACHE  # noqa: B018
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from fedpriv.cohorts import node_step
    from fedpriv.nodes import node_step as moved

    assert node_step is moved
    assert any("moved to fedpriv.nodes.node_step" in str(w.message) for w in caught)


def test_a_plugin_config_made_from_paramgroups_pickles():
    """Checkpoints pickle what an algorithm keeps; a config class made at run time is found
    again by its place on the algorithm class."""
    import pickle

    from fedpriv.configure import parse_config

    sys.path.insert(0, str(Path(__file__).resolve().parent / "plugin_pkg"))
    try:
        from fedpriv_toy import ToyMean

        from fedpriv.registry import register

        register(ToyMean)
        config = parse_config({"algorithm": "toy-mean", "toy-scale": 2.5})
    finally:
        sys.path.pop(0)
    again = pickle.loads(pickle.dumps(config))
    assert again == config and type(again) is ToyMean.config_type
