"""What leaves the server: the release (public config, ledger, released model, noisy private
metrics) kept apart from the operator report (exact metrics, counts, seeds)."""

import json
import subprocess
import sys

import pytest

from fedpriv.algorithms.catalogue import BUILTIN
from fedpriv.config import ConfigError
from fedpriv.configure import parse_config, select_keys
from fedpriv.engine import run_in_process
from fedpriv.evaluation import algorithm_for
from fedpriv.outputs import public_config, publishable, release_document, write_outputs
from tests.test_accounting import analytic_gaussian_epsilon

TINY = {"num-users": 300, "rounds": 2, "epsilon": 4.0, "test-samples-per-user": 3, "dim": 6,
        "candidates": 20, "jl-dim": 2, "cover-radius": 0.5}
PRIVATE = [cls.name for cls in BUILTIN if cls.private]


def tiny_config(name, **extra):
    family = {"rank": 1} if name.startswith("jl-exp") else {}
    if name.startswith(("meta", "private-meta", "dp-ftmrl", "jl")):
        family["feature-dist"] = "unit-ball"
    if name.startswith("deep"):  # real data: digits holds 1,437 training images
        family.update({"num-users": 60, "hidden-sizes": "16"})
    if name.startswith("fewshot"):  # few-shot tasks of digits' images
        family.update({"num-users": 60, "hidden-sizes": "16", "queries": 3,
                       "tasks-per-round": 20})
    values = select_keys({**TINY, **family, "algorithm": name})
    return parse_config({**values, **{k.replace("_", "-"): v
                                                for k, v in extra.items()}}, strict=True)


def _walk(value, path=""):
    """Every (path, leaf) of a JSON value, and every key as a leaf named 'key:...'."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}/key:{k}", k
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, value


def _exact_statistics(report):
    """Numbers computed from the users' data that only the operator report may hold."""
    numbers = {v for v in report["metrics"].values() if isinstance(v, float)}
    for r in report["rounds"]:  # private_* are the noisy (released) evaluation values
        numbers.update(v for k, v in r.items() if isinstance(v, (int, float))
                       and k not in ("step", "epsilon_spent", "seconds")
                       and not k.startswith("private_"))
    for m in report["private_metrics"].values():
        numbers.add(m["exact_clipped"])
    return {n for n in numbers if n not in (0, 1)}


LEDGER_KEYS = {"release", "mechanism", "noise_multiplier", "user_group", "user_groups",
               "epsilon_spent", "l2_sensitivity", "noise_std", "parts", "sampling_rate",
               "candidates", "score_sensitivity", "chosen", "name", "epsilon", "delta"}
SEED, NOISE_SEED = 424242, 31337  # distinctive, so a leak is visible wherever it hides


@pytest.mark.parametrize("name", [*PRIVATE, "deep-private-fedrep:adaptive"])
def test_every_field_of_a_release_is_public_config_the_ledger_or_a_post_processing(name):
    name, _, variant = name.partition(":")
    extra = {} if name in ("a-exp", "jl-exp") else {"private_metrics": True}
    if variant == "adaptive":  # the released clip follows the noisy counts
        extra["clip_quantile"] = 0.5
    report = run_in_process(tiny_config(name, seed=SEED, noise_seed=NOISE_SEED, **extra),
                            log=lambda _: None)
    release = release_document(report)
    assert set(release) == {"document", "publishable", "not_publishable_because", "algorithm",
                            "num_users", "config", "privacy", "released", "private_metrics",
                            "steps"}
    # public config: the run's config less seeds and paths
    assert release["config"] == public_config(report["config"])
    assert not {"seed", "noise-seed", "results-path", "checkpoint-path"} & set(release["config"])
    assert release["privacy"] == report["privacy"]  # the ledger and (epsilon, delta)
    for entry in release["privacy"]["ledger"]:  # only plan-derived fields (and the chosen index)
        parts = entry.get("parts", [entry])
        assert set(entry) <= LEDGER_KEYS and all(set(p) <= LEDGER_KEYS for p in parts)
        for p in parts:
            if entry["mechanism"] == "gaussian":
                assert p["noise_std"] == pytest.approx(p["noise_multiplier"]
                                                       * p["l2_sensitivity"])
    assert release["released"] == report["server_state"]  # the released model(s)
    assert all(set(s) == {"step", "epsilon_spent"} for s in release["steps"])
    noisy = {k: m["value"] for k, m in report["private_metrics"].items()}
    assert {k: m["value"] for k, m in release["private_metrics"].items()} == noisy
    assert bool(noisy) == bool(extra)
    # no seed anywhere, and no exact statistic of the users' data anywhere
    keys = {leaf for path, leaf in _walk(release) if "/key:" in path.rsplit("/", 1)[-1:][0]}
    assert not keys & {"seed", "noise-seed", "noise_seed", "exact_clipped", "users_clipped",
                       "users_contributing"}
    leaves = [leaf for _, leaf in _walk(release)]
    assert SEED not in leaves and NOISE_SEED not in leaves
    assert not any(str(SEED) in leaf or str(NOISE_SEED) in leaf
                   for leaf in leaves if isinstance(leaf, str))
    # config and privacy equal the operator's public entries (above); what else carries
    # numbers is the released model and the private metrics: none may be an exact statistic
    carried = [release["released"], release["private_metrics"]]
    leaked = _exact_statistics(report) & {leaf for _, leaf in _walk(carried)
                                          if isinstance(leaf, float) and "/key:" not in _}
    assert not leaked, f"exact statistics in the release: {leaked}"
    if variant == "adaptive":
        clips = [r["clip_norm"] for r in report["rounds"] if "clip_norm" in r]
        assert release["released"]["clip_norm"] not in clips  # the clip after the last round


@pytest.mark.parametrize("name", PRIVATE)
def test_a_secure_noise_release_is_publishable_and_a_sampled_one_is_refused(name):
    config = tiny_config(name, secure_noise=True, accountant="rdp")
    sampled = any(r.sampling_rate < 1 for r in algorithm_for(config)(config).privacy_plan())
    if sampled:  # the discrete Gaussian is accounted without amplification: refused up front
        with pytest.raises(ConfigError, match="(users|tasks)-per-round: secure-noise"):
            run_in_process(config, log=lambda _: None)
        return
    report = run_in_process(config, log=lambda _: None)
    assert publishable(report) == (True, "")


def test_a_seeded_release_is_not_publishable_and_a_secure_noise_release_is(tmp_path):
    seeded = run_in_process(tiny_config("private-fedrep"), log=lambda _: None)
    ok, why = publishable(seeded)
    assert not ok and "seeded" in why and "secure-noise = true" in why
    report_path, release_path = write_outputs(seeded, tmp_path / "run.json")
    assert release_path.name == "run.release.json"
    assert release_path.read_text().splitlines()[0].startswith('{"document": "fedpriv RELEASE')
    assert report_path.read_text().splitlines()[0].startswith(
        '{"document": "fedpriv OPERATOR REPORT')
    release = json.loads(release_path.read_text())
    assert release["publishable"] is False and "seeded" in release["not_publishable_because"]
    secure = run_in_process(tiny_config("private-fedrep", secure_noise=True, accountant="rdp"),
                            log=lambda _: None)
    assert publishable(secure) == (True, "")
    nothing = run_in_process(tiny_config("local-only"), log=lambda _: None)
    assert publishable(nothing)[0]  # nothing released from user data
    baseline = run_in_process(parse_config({**select_keys(TINY | {
        "algorithm": "fedrep"})}), log=lambda _: None)
    assert publishable(baseline) == (False, publishable(baseline)[1])
    assert "without noise" in publishable(baseline)[1]


def test_private_metrics_are_one_more_accounted_release_within_their_stated_noise():
    config = parse_config({"num-users": 20000, "dim": 10, "rounds": 3,
                                     "private-metrics": True, "metric-clip": 0.05,
                                     "metrics-budget-fraction": 0.2})
    plain = run_in_process(parse_config({**config.to_mapping(),
                                                   "private-metrics": False}),
                           log=lambda _: None)
    report = run_in_process(config, log=lambda _: None)
    ledger = report["privacy"]["ledger"]
    assert [e["release"] for e in ledger] == ["init", "round-1", "round-2", "round-3",
                                              "evaluate"]
    assert report["privacy"]["epsilon"] == ledger[-1]["epsilon_spent"] <= config.epsilon
    # the whole plan, evaluation included, is one composition of Gaussians at the target
    zs = [e["noise_multiplier"] for e in ledger]
    assert analytic_gaussian_epsilon(zs, config.delta) == pytest.approx(config.epsilon,
                                                                        rel=1e-3)
    # the evaluation's share: 1/z^2 of it is 20% of the total; the rest kept its proportions
    mu2 = sum(1 / z**2 for z in zs)
    assert 1 / zs[-1] ** 2 / mu2 == pytest.approx(0.2, rel=1e-5)
    assert report["privacy"]["noise_multipliers"]["round"] > plain["privacy"][
        "noise_multipliers"]["round"]
    m = report["private_metrics"]["test_mse"]
    assert m["noise_std"] == pytest.approx(zs[-1] * 0.05 / 2 / 20000)  # centred: B/(2n)
    assert m["value"] != m["exact_clipped"]  # noise was applied
    assert abs(m["value"] - m["exact_clipped"]) < 4 * m["noise_std"]
    # the exact clipped mean is the exact test MSE where no user hit the clip
    assert m["exact_clipped"] <= report["metrics"]["test_mse"] + 1e-12


@pytest.mark.parametrize("name,why", [("fedrep", "non-private"), ("a-exp", "pure epsilon-DP")])
def test_private_metrics_are_refused_where_they_cannot_be_released(name, why):
    with pytest.raises(ConfigError, match=f"private-metrics: .*{why}"):
        tiny_config(name, private_metrics=True)


@pytest.mark.integration
def test_the_flower_app_writes_a_publishable_release_with_private_metrics(tmp_path,
                                                                           shared_flower_env):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "fedpriv.cli", "run", "--out", str(out),
                           "--set", "num-users=600", "--set", "rounds=2", "--set",
                           "secure-noise=true", "--set", "accountant=rdp", "--set",
                           "private-metrics=true"],
                          env=shared_flower_env, capture_output=True, text=True, timeout=480,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    release = json.loads((tmp_path / "results.release.json").read_text())
    report = json.loads(out.read_text())
    assert release["publishable"] is True and report["runtime"] == "flower"
    assert release["privacy"]["ledger"][-1]["release"] == "evaluate"
    assert release["private_metrics"]["test_mse"]["value"] == report["private_metrics"][
        "test_mse"]["value"]
    assert "operator report (exact, not private; do not publish)" in proc.stdout
    assert "release (public config, ledger, model; publishable)" in proc.stdout


def test_a_sampled_plan_gives_the_evaluation_its_share_in_gdp_units_not_most_of_the_budget():
    from fedpriv.privacy.accounting import gdp_mu

    config = tiny_config("meta-nsgd", private_metrics=True, num_users=2000, rounds=10,
                         epsilon=1.0, metrics_budget_fraction=0.1)
    report = run_in_process(config, log=lambda _: None)
    ledger = report["privacy"]["ledger"]
    assert ledger[-1]["release"] == "evaluate" and ledger[0]["sampling_rate"] < 1
    assert report["privacy"]["epsilon"] <= 1.0
    z_eval = ledger[-1]["noise_multiplier"]
    assert 1 / z_eval == pytest.approx(0.1**0.5 * gdp_mu(1.0, config.delta))
    # alone, the evaluation spends a small part of the target; the rounds keep most of it
    assert analytic_gaussian_epsilon([z_eval], config.delta) < 0.35
    without = run_in_process(tiny_config("meta-nsgd", num_users=2000, rounds=10, epsilon=1.0),
                             log=lambda _: None)
    ratio = (report["privacy"]["noise_multipliers"]["round"]
             / without["privacy"]["noise_multipliers"]["round"])
    assert 1.0 < ratio < 1.5


def test_the_private_metric_survives_failing_nodes_and_states_the_rescaled_noise():
    config = parse_config({"num-users": 20000, "dim": 10, "rounds": 2,
                                     "private-metrics": True, "metric-clip": 0.05,
                                     "node-fault-rate": 0.3, "users-per-node": 2000,
                                     # every user's MSE below the metric clip (with the final
                                     # choice a few users' mixes exceed it: the clip binds)
                                     "final-choice": "off"})
    report = run_in_process(config, log=lambda _: None)
    m = report["private_metrics"]["test_mse"]
    evaluate = next(r for r in report["rounds"] if r["step"] == "evaluate")
    assert evaluate["nodes_failed"] == 3
    assert evaluate["evaluation_scale"] == pytest.approx(10 / 7)
    ledger_std = report["privacy"]["ledger"][-1]["noise_std"]
    assert m["noise_std"] == pytest.approx(ledger_std * 10 / 7)
    assert abs(m["value"] - m["exact_clipped"]) < 4 * m["noise_std"]
    assert m["exact_clipped"] == pytest.approx(report["metrics"]["test_mse"], rel=0.2)
