"""Deep personalization's privacy machinery: ghost clipping against the per-user updates,
adaptive clipping (the clip's path, the noisy count, its accounting against an independent
computation), and the audit of a deep release."""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from fedpriv.algorithms.base import Part, Step
from fedpriv.algorithms.deep import deep_algorithm as da
from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep import ghost_clipping as gc
from fedpriv.algorithms.deep.deep_algorithm import adapted_clip, disjoint_batches
from fedpriv.algorithms.deep.ghost_clipping import ghost_clipped_sum
from fedpriv.algorithms.deep.problem import problem_of, user_block
from fedpriv.audit import run_audit
from fedpriv.params import ConfigError
from fedpriv.registry import get_algorithm
from tests.test_deep import config, run


def _fedrep_and_fedavg_inputs(cfg, users=10):
    problem = problem_of(cfg)
    spec = problem.spec
    flat = torch.from_numpy(spec.initial(0))
    body = flat[:spec.body_size]
    block = user_block(problem, np.arange(users))
    n, r = block.y.shape
    feats = dm.features(spec, body, block.x.reshape(n * r, *spec.input_shape)).reshape(n, r, -1)
    heads = dm.fit_heads(feats, block.y, block.mask, spec.num_classes, 10, 1.0,
                         bias=spec.head_bias)
    return spec, block, ((body, heads), (flat, None))


# ----- ghost clipping ---------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["mlp", "tests.test_deep_privacy:no_bias_tanh", "cnn",
                                   "tests.test_deep_privacy:strided_conv"])
@pytest.mark.parametrize("clip_at", [0.0, 0.5, 1e9])
def test_ghost_clipping_equals_clipping_the_per_user_updates(model, clip_at):
    """FedRep's body update and FedAvg's whole-model update with every user clipped, half of
    them (the clip at the median norm), or none; convolutions (per-user gradients from
    unfolded patches, with and without bias, stride and dilation) beside linear layers."""
    spec, block, cases = _fedrep_and_fedavg_inputs(config(model=model, hidden_sizes="32,16"))
    for start, heads in cases:
        with torch.enable_grad():
            updates = dm.local_updates(spec, start, heads, block.x, block.y, block.mask, 1, 0.1)
        norms = torch.linalg.vector_norm(updates, dim=1).numpy()
        clip = {0.0: 0.01 * norms.min(), 0.5: float(np.median(norms))}.get(clip_at, clip_at)
        ghost = ghost_clipped_sum(spec, start, heads, block.x, block.y, block.mask, 0.1, clip)
        total, clipped = dm.clipped_sum(updates, clip)
        assert ghost is not None
        assert ghost[1] == clipped == {0.0: 10, 0.5: 5}.get(clip_at, 0)
        assert np.abs(total).max() > 1e-4
        assert np.allclose(ghost[0], total, rtol=1e-5, atol=1e-7 * np.abs(total).max())


@pytest.mark.parametrize("block_bytes", [1, 3 * 8 * (64 + 32) * 30])
def test_ghost_clipping_block_by_block_equals_the_per_user_updates(monkeypatch, block_bytes):
    """The Grams and the clipped sum computed a few users at a time (one user a block; three,
    the last block short), a user with nan rows among them: the same sum as the per-user
    updates with that user dropped."""
    monkeypatch.setattr(gc, "BLOCK_BYTES", block_bytes)
    spec, block, ((body, heads), _) = _fedrep_and_fedavg_inputs(
        config(model="mlp", hidden_sizes="32,16"))
    x = block.x.clone()
    x[4] = float("nan")
    with torch.enable_grad():
        updates = dm.local_updates(spec, body, heads, x, block.y, block.mask, 1, 0.1)
    # a clip off every user's norm: one at the median's own norm is clipped or not by the
    # last bit of each path's float64 sum of squares
    clip = float(np.nanmedian(torch.linalg.vector_norm(updates, dim=1).numpy())) * 1.0001
    total, clipped = dm.clipped_sum(updates, clip)
    ghost = ghost_clipped_sum(spec, body, heads, x, block.y, block.mask, 0.1, clip)
    assert ghost is not None and ghost[1] == clipped >= 4
    assert np.isfinite(ghost[0]).all() and np.abs(total).max() > 1e-4
    assert np.allclose(ghost[0], total, rtol=1e-5, atol=1e-7 * np.abs(total).max())


def no_bias_tanh(shape, classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 24, bias=False),
                               torch.nn.Tanh(), torch.nn.Linear(24, classes))


def strided_conv(shape, classes):
    return torch.nn.Sequential(
        torch.nn.Conv2d(shape[0], 3, 3, stride=2, padding=1, bias=False), torch.nn.Tanh(),
        torch.nn.Conv2d(3, 4, 2, dilation=2), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, classes))


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_ghost_clipping_never_lets_a_user_past_the_clip(model):
    spec, block, cases = _fedrep_and_fedavg_inputs(config(model=model, hidden_sizes="32"),
                                                   users=1)
    for start, heads in cases:
        for scale in (1.0, 1e3, 1e6):
            total, clipped = ghost_clipped_sum(spec, start, heads, block.x * scale, block.y,
                                               block.mask, 10.0, 0.5)
            assert clipped == 1 and np.linalg.norm(total) <= 0.5 * (1 + 1e-9)


def test_ghost_norms_bound_the_exact_norm_under_heavy_cancellation():
    """Users whose two rows nearly cancel (g_2 = -g_1 (1 + tiny), same input): the Gram sum
    loses the exact norm to rounding, below it about half the time, and the slack lifts every
    norm to at least the exact one (computed in rational arithmetic from the same floats)."""
    from fractions import Fraction

    from fedpriv.algorithms.deep.ghost_clipping import bounded_norms, layer_norm_terms

    rng = np.random.default_rng(0)
    n, d_a, d_g = 400, 5, 3
    a = torch.from_numpy(np.repeat(rng.normal(size=(n, 1, d_a)), 2, axis=1))
    g1 = rng.normal(size=(n, 1, d_g))
    g = torch.from_numpy(np.concatenate([g1, -g1 * (1 + 1e-12 * rng.normal(size=(n, 1, 1)))], 1))
    for bias in (False, True):
        sq, slack = layer_norm_terms(a, g, bias)
        bounded = bounded_norms(sq, slack).numpy()
        below = 0
        for i in range(n):
            ga = [[sum(Fraction(float(g[i, r, o])) * Fraction(float(a[i, r, j])) for r in (0, 1))
                   for j in range(d_a)] for o in range(d_g)]
            exact = sum(v * v for row in ga for v in row)
            if bias:
                exact += sum(sum(Fraction(float(g[i, r, o])) for r in (0, 1)) ** 2
                             for o in range(d_g))
            below += Fraction(float(sq[i])) < exact
            assert Fraction(float(bounded[i])) ** 2 >= exact, (i, bias)
        assert below > n // 10  # the slack is what keeps these users from being under-clipped


@pytest.mark.parametrize(("algorithm", "model", "cross_fit"),
                         [("deep-private-fedrep", "cnn", 0), ("deep-dp-fedavg", "cnn", 0),
                          ("deep-private-fedrep", "cnn", 2),
                          ("deep-private-fedrep", "mlp", 3)])
def test_a_round_in_the_nodes_chunks_equals_clipping_each_users_update(algorithm, model,
                                                                       cross_fit):
    """A round as a node computes it (ghost clipping, in the several calls that
    ``round_chunk`` gives a small ``chunk-mb``) against every user's update from the per-user
    path, half of them clipped, summed; cross-fit = k: k heads a user, head j on fold j of its
    rows."""
    cfg = config(algorithm, model=model, chunk_mb=0.05 if model == "cnn" else 0.002,
                 cross_fit=cross_fit, body_steps=1)  # one step: the ghost path (DP-FedAvg: 5)
    cls, problem = get_algorithm(algorithm), problem_of(cfg)
    ids = np.arange(12)
    assert cls.round_chunk(cfg, problem) < len(ids) // 2  # at least three calls
    spec, b = problem.spec, problem.batch_size
    model = torch.from_numpy(spec.initial(0))
    block = user_block(problem, ids)
    first, second, mask = disjoint_batches(cfg.seed, 1, ids, block.counts, block.y.shape[1], b)
    updates = cls.local_work(cfg, problem, model, block, first, second, mask)  # vmap, per user
    norms = torch.linalg.vector_norm(updates, dim=1).sort().values
    clip = float(norms[5:7].mean())  # between two users' norms: half of them clipped
    expected, clipped = dm.clipped_sum(updates, clip)
    step = Step("round", 1, "round", (Part("update", expected.shape, clip),))
    got = cls.user_step(cfg, step, {"model": model.numpy()}, ids)
    assert got.num_users == 12 and got.num_clipped == clipped == 6
    assert np.abs(expected).max() > 1e-4
    # float32 convolutions: 1e-4 of an entry (kernels differ between CPUs: 2.5e-8 on an entry
    # of 2.9e-4 on one machine), where a 0.1% error fails it
    assert np.allclose(got.totals["update"], expected, rtol=1e-4,
                       atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize(("algorithm", "steps", "ghost_declines"),
                         [("deep-dp-fedavg", 3, False), ("deep-private-fedrep", 2, False),
                          ("deep-dp-fedavg", 1, True)])
def test_the_per_user_path_in_parts_of_its_cap_sums_every_users_clipped_update(
        monkeypatch, algorithm, steps, ghost_declines):
    """Several local steps (or a model that ghost clipping turns down at run time, in a chunk
    sized for ghost clipping): ``clipped_work`` computes the per-user updates in parts of at
    most ``per_user_cap`` users; the sum and the count are those of every user's update at
    once. The cap is two users here (six parts of 11 users, the last short)."""
    cfg = config(algorithm, body_steps=steps)
    cls, problem = get_algorithm(algorithm), problem_of(cfg)
    own = cls.released_size(problem.spec)
    monkeypatch.setattr(da, "PER_USER_FLOATS", 3 * own - 1)  # two users a part
    assert da.per_user_cap(problem, own) == 2
    if ghost_declines:
        monkeypatch.setattr(da, "ghost_clipped_sum", lambda *args: None)
    ids = np.arange(11)
    model = torch.from_numpy(problem.spec.initial(0))
    block = user_block(problem, ids)
    first, second, mask = disjoint_batches(cfg.seed, 1, ids, block.counts, block.y.shape[1],
                                           problem.batch_size)
    updates = cls.local_work(cfg, problem, model, block, first, second, mask)  # all at once
    clip = float(torch.linalg.vector_norm(updates, dim=1).median()) * 1.0001
    expected, clipped = dm.clipped_sum(updates, clip)
    got, got_clipped = cls.clipped_work(cfg, problem, model, block, first, second, mask, clip)
    assert got_clipped == clipped and 0 < clipped < len(ids)
    assert np.abs(expected).max() > 1e-4
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7 * np.abs(expected).max())


def same_padded_conv(shape, classes):
    return torch.nn.Sequential(torch.nn.Conv2d(shape[0], 2, 3, padding="same"),
                               torch.nn.Flatten(), torch.nn.Linear(2 * 8 * 8, classes))


def grouped_conv(shape, classes):
    return torch.nn.Sequential(torch.nn.Conv2d(shape[0], 2, 3), torch.nn.ReLU(),
                               torch.nn.Conv2d(2, 4, 3, groups=2), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 4 * 4, 8), torch.nn.Linear(8, classes))


@pytest.mark.parametrize("model", ["same_padded_conv", "grouped_conv"])
def test_other_convolutions_fall_back_to_the_per_user_path(model):
    """Convolutions that the unfolded-patch gradients do not cover ("same" padding, groups):
    ghost clipping answers None and the round takes the vmap path, which still clips them."""
    cfg = config(model=f"tests.test_deep_privacy:{model}")
    spec, block, cases = _fedrep_and_fedavg_inputs(cfg, users=2)
    for start, heads in cases:
        assert ghost_clipped_sum(spec, start, heads, block.x, block.y, block.mask, 0.1,
                                 1.0) is None


# ----- adaptive clipping ------------------------------------------------------------------------
def test_the_clip_steps_geometrically_towards_the_quantile():
    assert adapted_clip(1.0, 0.5, 0.5, 0.2) == 1.0
    assert adapted_clip(1.0, 1.0, 0.5, 0.2) == pytest.approx(math.exp(-0.1))  # all unclipped
    assert adapted_clip(1.0, 0.0, 0.5, 0.2) == pytest.approx(math.exp(0.1))  # all clipped


def _released(results):
    return [r for r in results["rounds"] if r["step"].startswith("round")]


def test_adaptive_clipping_follows_the_update_norms_from_either_side(tmp_path):
    """Started far below every user's update norm the clip grows each round; far above, it
    shrinks; each round's released update uses the clip the round started with."""
    keys = dict(rounds=6, epsilon=50.0, clip_quantile=0.5, clip_lr=0.5)
    low = _released(run(tmp_path, clip_norm=1e-4, **keys))
    high = _released(run(tmp_path, clip_norm=1e3, **keys))
    assert low[0]["users_clipped"] == 60 and high[0]["users_clipped"] == 0
    assert all(b["clip_norm"] > a["clip_norm"] for a, b in zip(low, low[1:], strict=False))
    assert all(b["clip_norm"] < a["clip_norm"] for a, b in zip(high, high[1:], strict=False))
    for r in low:  # the next clip is the step the noisy count asked for
        assert r["clip_norm"] > 0


def test_the_unclipped_count_is_released_with_its_planned_noise(tmp_path):
    """The released fraction minus the exact one (from the operator's clipped count) is the
    noise of the count part, with the ledger's std."""
    results = run(tmp_path, rounds=40, epsilon=8.0, clip_quantile=0.5, hidden_sizes="8",
                  clip_count_share=0.5)
    rounds = _released(results)
    exact = np.array([1 - r["users_clipped"] / 60 for r in rounds])
    noisy = np.array([r["unclipped_fraction"] for r in rounds])
    stds = [next(p["noise_std"] for p in e["parts"] if p["name"] == "unclipped")
            for e in results["privacy"]["ledger"]]
    assert len(set(stds)) == 1 and stds[0] == pytest.approx(
        0.5 / 60 * results["privacy"]["ledger"][0]["parts"][1]["noise_multiplier"])
    z = (noisy - exact) / stds[0]
    assert 0.6 < z.std() < 1.5 and abs(z.mean()) < 4 / np.sqrt(len(z))


def _gdp_epsilon(mu: float, delta: float) -> float:
    """Dong, Roth & Su (2019), Cor. 2.13: the epsilon at delta of mu-GDP."""
    def excess(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta
    return brentq(excess, 0.0, 100.0)


def _round_multipliers(results):
    """Each round's effective multiplier rebuilt from the ledger's parts alone (std and stated
    sensitivity): composed Gaussians add in 1 / z^2."""
    return [sum((p["l2_sensitivity"] / p["noise_std"]) ** 2 for p in e["parts"]) ** -0.5
            for e in results["privacy"]["ledger"]]


def test_adaptive_clipping_is_accounted_as_one_gaussian_per_round(tmp_path):
    """Independent of dp-accounting: T Gaussians of multiplier z are sqrt(T)/z-GDP, and the
    (epsilon, delta) of GDP is in closed form. The update's sensitivity follows the clip."""
    results = run(tmp_path, rounds=5, epsilon=2.0, clip_quantile=0.5, clip_norm=0.01)
    entries = results["privacy"]["ledger"]
    clips = [r["clip_norm"] for r in _released(results)]
    assert len(set(clips)) == 5
    for entry, clip in zip(entries, clips, strict=True):
        assert entry["parts"][0]["l2_sensitivity"] == pytest.approx(clip / 60)
    z = _round_multipliers(results)
    assert z == pytest.approx([results["privacy"]["noise_multipliers"]["round"]] * 5)
    mu = math.sqrt(sum(1 / zi ** 2 for zi in z))
    assert results["privacy"]["epsilon"] == pytest.approx(_gdp_epsilon(mu, 1e-5), rel=2e-3)
    assert results["privacy"]["epsilon"] <= 2.0 + 1e-9


def test_adaptive_clipping_with_poisson_cohorts_matches_a_sampled_gaussian_accountant(tmp_path):
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    results = run(tmp_path, rounds=4, users_per_round=20, clip_quantile=0.5, clip_norm=0.01)
    accountant = pld_privacy_accountant.PLDAccountant()
    for z in _round_multipliers(results):
        accountant.compose(dp_accounting.PoissonSampledDpEvent(
            20 / 60, dp_accounting.GaussianDpEvent(z)))
    assert results["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5),
                                                          rel=1e-3)
    assert results["privacy"]["epsilon"] <= 2.0 + 1e-9


def test_adaptive_clipping_keys_are_checked_before_the_run():
    with pytest.raises(ConfigError, match="clip-quantile"):
        config(clip_quantile=1.0)
    with pytest.raises(ConfigError, match="clip-quantile: adaptive clipping needs clipping"):
        config("deep-fedrep", clip_quantile=0.5, clipping=False)
    with pytest.raises(ConfigError, match="clip-count-share"):
        config(clip_quantile=0.5, clip_count_share=1.0)


# ----- audit ------------------------------------------------------------------------------------
def test_a_deep_release_is_audited():
    cfg = config(epsilon=1.0, num_users=100, rounds=3)
    result = run_audit(cfg, trials=4000)
    assert result.release == "round-1" and not result.violation
    cut = run_audit(cfg, trials=4000, noise_scale=0.05)
    assert cut.violation
