"""The record-level DP meta-learning baseline (``fewshot-dp-reptile``): each task's clipped
record-gradient sums (MLP path, ``torch.func`` path, a one-record-at-a-time loop agree), one
record's change bounded by the clip whatever it holds, the noise really applied from each
task's own stream, the record-level plan against an independent dp-accounting computation,
and a run that reports record-level privacy and no task-level guarantee."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpriv.algorithms.deep.models import model_spec
from fedpriv.algorithms.fewshot import record_dp as rd
from fedpriv.algorithms.fewshot import reptile as rp
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.outputs import publishable
from fedpriv.params import ConfigError
from fedpriv.server.report import privacy_line

WAYS, ROWS = 3, 7
TINY = {"algorithm": "fewshot-dp-reptile", "num-users": 60, "hidden-sizes": "16", "queries": 3,
        "rounds": 3, "tasks-per-round": 30, "epsilon": 2.0, "delta": 1e-5, "seed": 5}


def tasks(n: int, shape=(1, 8, 8), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, WAYS, (n, ROWS), generator=g)
    x = torch.randn(n, ROWS, *shape, generator=g) + y[..., None, None, None]
    return x, y


def per_task_params(spec, n: int, seed: int = 0) -> torch.Tensor:
    """n different networks (a task's iterate after its first step differs from the others')."""
    base = torch.from_numpy(spec.initial(seed)).float()
    g = torch.Generator().manual_seed(seed + 1)
    return base + 0.3 * torch.randn(n, spec.size, generator=g)


def loop_sums(spec, params, x, y, clip):
    """The independent reference: each record's gradient by autograd alone, scaled to clip."""
    sums = torch.zeros(params.shape, dtype=torch.float64)
    for i in range(len(params)):
        for j in range(y.shape[1]):
            leaf = params[i].detach().clone().requires_grad_(True)
            out = torch.func.functional_call(spec.module, spec.unflatten(leaf), (x[i, j][None],))
            (g,) = torch.autograd.grad(F.cross_entropy(out, y[i, j][None]), leaf)
            norm = float(g.double().norm())
            if math.isfinite(norm):
                sums[i] += g.double() * min(1.0, clip / max(norm, 1e-300))
    return sums


@pytest.mark.parametrize("model,hidden", [("mlp", "16,8"), ("cnn", "")])
def test_clipped_record_sums_match_a_record_by_record_loop(model, hidden):
    spec = model_spec(model, hidden, (1, 8, 8), WAYS)
    x, y = tasks(3)
    params = per_task_params(spec, 3)
    expected = loop_sums(spec, params, x, y, 0.5)
    assert (rd.mlp_layers(spec) is not None) == (model == "mlp")
    sums, factors = rd.clipped_record_sums(spec, params, x, y, 0.5)
    assert factors.shape == (3, ROWS) and bool((factors < 1).any())  # the clip binds
    assert torch.allclose(sums.double(), expected, rtol=1e-4, atol=1e-5)
    if model == "mlp":  # the torch.func path gives the same sums and factors
        again, f2 = rd.clipped_record_sums(spec, params, x, y, 0.5, per_record=True)
        assert torch.allclose(again.double(), expected, rtol=1e-4, atol=1e-5)
        assert torch.allclose(f2, factors, rtol=1e-5)


@pytest.mark.parametrize("clip", [0.7, 1e-5])
@pytest.mark.parametrize("per_record", [False, True])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30, 1e38, -1e4])
def test_one_record_moves_only_its_tasks_sum_and_by_at_most_twice_the_clip(value, per_record,
                                                                           clip):
    spec = model_spec("mlp", "16", (1, 8, 8), WAYS)
    x, y = tasks(4)
    params = per_task_params(spec, 4)
    before, _ = rd.clipped_record_sums(spec, params, x, y, clip, per_record)
    changed, label = x.clone(), y.clone()
    changed[2, 4] = value  # replace one record of task 2: any pixels, another label
    label[2, 4] = (y[2, 4] + 1) % WAYS
    after, factors = rd.clipped_record_sums(spec, params, changed, label, clip, per_record)
    assert torch.isfinite(after).all()
    moved = (after.double() - before.double()).norm(dim=1)
    # a non-finite record is dropped (a removal: one clip); a finite one replaced: two
    bound = clip if not math.isfinite(value) else 2 * clip
    assert float(moved[2]) <= bound * (1 + 1e-5)
    assert float(moved[[0, 1, 3]].max()) == 0.0  # other tasks untouched
    if not math.isfinite(value):
        assert float(factors[2, 4]) == 0.0  # a non-finite record adds nothing


def test_a_dp_sgd_step_adds_each_tasks_own_noise_and_one_record_moves_it_by_the_clip():
    c = parse_config(TINY)
    spec = model_spec("mlp", "16", (1, 8, 8), WAYS)
    x, y = tasks(3)
    start = torch.from_numpy(spec.initial(0)).float()
    ids = np.array([4, 1, 7])
    lr, clip, std = 0.5, 1.0, 3.0
    noisy = rd.dp_sgd_updates(spec, start, x, y, 1, lr, clip, std,
                                 rp.task_generators(c, 2, ids))
    exact = rd.dp_sgd_updates(spec, start, x, y, 1, lr, clip, 0.0,
                                 rp.task_generators(c, 2, ids))
    noise = (noisy - exact) * ROWS / lr  # the step subtracts lr (sum + noise) / r
    assert abs(float(noise.std()) / std - 1) < 0.02  # ~1,000 draws a task
    # each task's noise is its own stream: task 1's the same when drawn alone
    drawn = torch.randn(spec.size, generator=rp.task_generators(c, 2, ids[1:2])[0])
    assert torch.allclose(noise[1].float(), drawn * std, atol=1e-3)
    # other rounds, other streams
    other = torch.randn(spec.size, generator=rp.task_generators(c, 3, ids[1:2])[0])
    assert not torch.allclose(other, drawn)
    # the same noise on a dataset with one record of task 0 replaced: its update moves by at
    # most lr * 2 clip / r, whatever the record holds
    x2, y2 = x.clone(), y.clone()
    x2[0, 0], y2[0, 0] = 1e30, (y[0, 0] + 1) % WAYS
    other_data = rd.dp_sgd_updates(spec, start, x2, y2, 1, lr, clip, std,
                                      rp.task_generators(c, 2, ids))
    gap = (other_data - noisy).norm(dim=1)
    assert float(gap[0]) <= lr * 2 * clip / ROWS * (1 + 1e-4)
    assert float(gap[1:].max()) == 0.0


def test_each_tasks_noise_stream_is_a_function_of_seed_round_and_task():
    c = parse_config(TINY)
    a, b = (torch.randn(50, generator=g) for g in rp.task_generators(c, 1, np.array([3, 3])))
    assert torch.equal(a, b)  # whatever node hosts it, whatever else is in its chunk
    other = parse_config({**TINY, "noise-seed": 9})
    (c2,) = (torch.randn(50, generator=g) for g in rp.task_generators(other, 1, np.array([3])))
    assert not torch.allclose(a, c2)  # noise-seed, when set, seeds it


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_the_record_level_noise_meets_the_target_by_an_independent_composition(relation):
    """Conditioned on the k rounds its task is sampled in, a record goes through k * s
    Gaussian steps of multiplier std / Delta; the coins have the same law on both datasets,
    so delta(eps) is at most the binomial mixture of the k-fold compositions' deltas (each
    from dp-accounting's own PLD here, not from the closed form the code uses)."""
    from scipy.stats import binom

    c = parse_config({**TINY, "inner-steps": 2, "rounds": 4, "neighbouring-relation": relation})
    q = rp.FewShotDPReptile.sampling_rate(c)
    assert q == 0.5  # 30 of 60 tasks a round
    sensitivity = (1.0 if relation == "add-remove" else 2.0) * c.clip_norm
    z_step = rp.step_noise_std(c) / sensitivity

    def delta_at(eps: float) -> float:
        total = 0.0
        for k in range(1, c.rounds + 1):
            acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
            acc.compose(dp_accounting.GaussianDpEvent(z_step), k * c.inner_steps)
            total += binom.pmf(k, c.rounds, q) * acc.get_delta(eps)
        return total

    assert delta_at(c.epsilon) == pytest.approx(c.delta, rel=0.02)  # the target is met, tightly
    # the sampling does NOT amplify: charging every round as if q were tiny would be wrong,
    # and the noise is what all rounds at their binomial weights need, more than one round
    lone = dp_accounting.pld.PLDAccountant()
    lone.compose(dp_accounting.GaussianDpEvent(z_step), c.inner_steps)
    assert lone.get_delta(c.epsilon) < c.delta
    # the run's own epsilon after its rounds: the accountant's, and the target
    config = parse_config({**TINY, "inner-steps": 2, "rounds": 4,
                           "neighbouring-relation": relation})
    algo = rp.FewShotDPReptile(config)
    algo.iterates = config.rounds
    spent = algo.record_level_privacy()["epsilon"]
    assert spent == pytest.approx(config.epsilon, rel=1e-6) and spent <= config.epsilon
    algo.iterates = 1  # fewer rounds run, less spent
    assert algo.record_level_privacy()["epsilon"] < config.epsilon


def test_the_figures_record_level_plan_meets_its_target_by_dp_accounting():
    """The figure's regime (T = 40 rounds, q = 0.05, 3 steps): the per-k PLDs of dp-accounting
    mixed with the binomial weights (k past 15 weighs under 1e-11: at most that is left out)
    meet delta at the calibrated noise; the run's reported epsilon never exceeds the target."""
    from scipy.stats import binom

    c = parse_config({**TINY, "num-users": 10000, "tasks-per-round": 500, "rounds": 40,
                      "epsilon": 1.0})
    z_step = rp.step_multiplier(c)
    total = 0.0
    for k in range(1, 16):
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        acc.compose(dp_accounting.GaussianDpEvent(z_step), 3 * k)
        total += binom.pmf(k, 40, 0.05) * acc.get_delta(1.0)
    assert total == pytest.approx(1e-5, rel=0.02)
    algo = rp.FewShotDPReptile(c)
    algo.iterates = 40
    assert algo.record_level_privacy()["epsilon"] <= 1.0


def test_the_participation_profile_is_the_gdp_one_when_every_round_takes_part():
    from fedpriv.privacy import participation as pp
    from fedpriv.privacy.bounds import gdp_mu

    mu = pp.participation_mu(1.0, 1e-5, 9, 1.0)
    assert mu * 3 == pytest.approx(gdp_mu(1.0, 1e-5), rel=1e-6)  # 9 rounds: sqrt(9) mu
    # fewer expected rounds allow more per round, but never more than one round alone
    sampled = pp.participation_mu(1.0, 1e-5, 9, 0.2)
    assert mu < sampled < gdp_mu(1.0, 1e-5)
    assert pp.participation_epsilon(sampled, 9, 0.2, 1e-5) == pytest.approx(1.0, rel=1e-6)
    assert pp.participation_delta(sampled, 9, 0.2, 1.0) <= 1e-5


def test_user_step_noises_with_the_calibrated_std(monkeypatch):
    """One inner step: a node's sum minus the same sum without noise is lr / r times the
    tasks' noise, whose spread is the calibrated std (with the relation's sensitivity)."""
    from fedpriv.algorithms.base import Step

    config = parse_config({**TINY, "inner-steps": 1, "neighbouring-relation": "replace-one",
                           "hidden-sizes": "64"})  # 4,500 parameters: the spread within 1%
    algo = rp.FewShotDPReptile(config)
    step = algo.steps()[0]
    assert isinstance(step, Step) and step.parts[0].clip_norm == math.inf
    arrays = algo.broadcast(step)
    ids = np.arange(20)
    contribution = rp.FewShotDPReptile.user_step(config, step, arrays, ids)
    assert contribution.num_clipped == 0  # a count of records' values is never sent
    noisy = contribution.totals["grads"]
    std = rp.step_noise_std(config)
    assert std == pytest.approx(2 * config.clip_norm * rp.step_multiplier(config))
    monkeypatch.setattr(rp, "step_noise_std", lambda _config: 0.0)
    exact = rp.FewShotDPReptile.user_step(config, step, arrays, ids).totals["grads"]
    rows = config.ways * (config.shots + config.queries)
    spread = float(np.std(noisy - exact)) / (config.inner_lr / rows * math.sqrt(len(ids)))
    assert abs(spread / std - 1) < 0.05


def test_bad_record_level_settings_fail_before_the_run():
    for eps in (float("inf"), 1e4):
        with pytest.raises(ConfigError, match="epsilon"):
            rp.FewShotDPReptile.validate(parse_config({**TINY, "epsilon": eps}))
    with pytest.raises(ConfigError, match="clipping"):
        parse_config({**TINY, "clipping": False})
    with pytest.raises(ConfigError, match="secure-noise"):
        parse_config({**TINY, "secure-noise": True, "accountant": "rdp"})
    for key, value in (("inner-steps", 0), ("inner-lr", -1.0)):
        with pytest.raises(ConfigError, match=key):
            parse_config({**TINY, key: value})


def test_a_run_reports_record_level_privacy_and_no_task_level_guarantee(tmp_path):
    config = parse_config({**TINY, "results-path": str(tmp_path / "r.json")})
    results = run_in_process(config, log=lambda _: None)
    p = results["privacy"]
    assert p["epsilon"] is None and p["ledger"] == []  # no user (task) level release
    record = p["record_level"]
    assert record["level"] == "record" and record["rounds_accounted"] == 3
    assert 0.97 * 2.0 <= record["epsilon"] <= 2.0
    assert record["accountant"].startswith("gdp binomial mixture")
    assert p["level"] == "record" and "unbounded" in p["trust"]["hostile nodes"]
    assert "record-level only" in privacy_line(p) and "NO task-level" in privacy_line(p)
    ok, why = publishable(results)
    assert not ok and why.startswith("record-level DP only")
    # the released network is the whole model; it moved from its start and still embeds
    state = results["server_state"]
    spec = model_spec("mlp", "16", (1, 8, 8), 5)
    assert len(state["meta_models"][0]) == spec.size
    assert state["network_parameters"] == list(spec.names)
    start = rp.FewShotDPReptile.starting_models(config)[0]
    assert np.linalg.norm(np.asarray(state["meta_models"][0]) - start) > 0
    assert 0.2 < results["metrics"]["transfer_accuracy"] <= 1.0
    json.dumps(results)  # the results file can be written


def test_the_release_does_not_depend_on_how_tasks_are_spread_over_nodes(tmp_path):
    """Each task's record-level noise is its own stream: one node or three, the same network
    (the Flower transport carries the same node sums: tests/test_flower_integration.py)."""
    config = parse_config({**TINY, "results-path": str(tmp_path / "r.json")})
    one = run_in_process(config, num_partitions=1, log=lambda _: None)
    three = run_in_process(config, num_partitions=3, log=lambda _: None)
    assert np.allclose(one["server_state"]["meta_models"], three["server_state"]["meta_models"],
                       atol=1e-5)
    assert one["metrics"]["transfer_accuracy"] == pytest.approx(
        three["metrics"]["transfer_accuracy"], abs=1e-9)


def test_a_sweep_runs_the_record_level_baseline_at_every_epsilon(tmp_path):
    """Its noise is calibrated to epsilon (per record): not an epsilon-free line."""
    from fedpriv.sweep import load_sweep

    path = tmp_path / "s.toml"
    path.write_text('[sweep]\nname = "s"\nepsilons = [1, 4]\nseeds = [0]\n[base]\n'
                    'num-users = 60\nhidden-sizes = "16"\nqueries = 3\ntasks-per-round = 30\n'
                    '[[series]]\nlabel = "record"\nalgorithm = "fewshot-dp-reptile"\n'
                    '[[series]]\nlabel = "alone"\nalgorithm = "fewshot-local"\n')
    runs = load_sweep(path).runs
    assert sorted(r.epsilon for r in runs if r.series == "record") == [1.0, 4.0]
    assert [r.epsilon for r in runs if r.series == "alone"] == [None]
