import numpy as np
import pytest

from fedpriv.algorithms.personalization import fedrep_math as fedrep
from fedpriv.algorithms.personalization import init_math as private_init
from fedpriv.algorithms.personalization.linear_math import (
    least_squares,
    orthonormalize,
    subspace_distance,
)
from fedpriv.data import SyntheticProblem, generate_users, ground_truth_embedding
from fedpriv.privacy.mechanisms import clipped_sum
from fedpriv.randomness import user_uniforms


def test_orthonormalize_gives_orthonormal_columns_spanning_the_input(rng):
    m = rng.standard_normal((8, 3))
    q = orthonormalize(m)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-12)
    assert subspace_distance(q, m) < 1e-12


def test_subspace_distance_extremes_and_invariance(rng):
    e = np.eye(5)
    assert subspace_distance(e[:, :2], e[:, :2]) < 1e-12
    assert subspace_distance(e[:, :2], e[:, 2:4]) == pytest.approx(1.0)
    u = orthonormalize(rng.standard_normal((5, 2)))
    rotation = orthonormalize(rng.standard_normal((2, 2)))
    assert subspace_distance(u @ rotation, u) < 1e-12
    # one principal angle theta: distance sin(theta)
    theta = 0.3
    v = np.stack([np.cos(theta) * e[:, 0] + np.sin(theta) * e[:, 2], e[:, 1]], axis=1)
    assert subspace_distance(v, e[:, :2]) == pytest.approx(np.sin(theta))


def test_least_squares_exact_and_minimum_norm(rng):
    design = rng.standard_normal((4, 6, 2))
    v = rng.standard_normal((4, 2))
    np.testing.assert_allclose(least_squares(design, np.einsum("nbk,nk->nb", design, v)), v)
    under = rng.standard_normal((3, 1, 2))  # b = 1 < k = 2
    y = rng.standard_normal((3, 1))
    sol = least_squares(under, y)
    np.testing.assert_allclose(np.einsum("nbk,nk->nb", under, sol), y, atol=1e-12)
    # minimum norm: the solution lies in the row space of the design
    expected = under[:, 0, :] * (y[:, 0] / (under[:, 0, :] ** 2).sum(1))[:, None]
    np.testing.assert_allclose(sol, expected)


def test_u_statistic_matches_brute_force_and_is_unbiased():
    problem = SyntheticProblem(4000, 4, 1, 6, 0.1, "rademacher", seed=3)
    data = generate_users(problem, np.arange(4000))
    z = private_init.u_statistics(data.features, data.labels)
    x, y = data.features[0], data.labels[0]
    brute = sum(y[a] * y[b] * np.outer(x[a], x[b]) for a in range(6) for b in range(6) if a != b)
    np.testing.assert_allclose(z[0], brute / 30)
    w = data.true_local_vectors @ ground_truth_embedding(problem).T
    expected = np.einsum("ni,nj->ij", w, w) / 4000
    # E[Z_i] = w_i w_i^T: the population average agrees up to Monte Carlo error
    assert np.abs(z.mean(0) - expected).max() < 0.1 * np.abs(expected).max() + 0.05


def test_disjoint_batches_are_disjoint_deterministic_and_layout_independent():
    ids = np.arange(50, 80)
    first, second = fedrep.disjoint_batches(7, 2, ids, 5, 2)
    for a, b in zip(first, second, strict=True):
        assert not set(a) & set(b) and len(set(a)) == 2
    again_first, _ = fedrep.disjoint_batches(7, 2, ids[10:], 5, 2)
    np.testing.assert_array_equal(first[10:], again_first)  # same user, same draw
    other_round, _ = fedrep.disjoint_batches(7, 3, ids, 5, 2)
    assert not np.array_equal(first, other_round)
    u = user_uniforms(1, 1, 0, np.arange(20000), 4)
    assert abs(u.mean() - 0.5) < 0.01 and 0 <= u.min() and u.max() < 1


def test_embedding_gradient_matches_finite_differences_and_uses_the_other_batch(rng):
    d, k, b = 6, 2, 4
    u = orthonormalize(rng.standard_normal((d, k)))
    xs, ys = rng.standard_normal((1, b, d)), rng.standard_normal((1, b))
    xg, yg = rng.standard_normal((1, b, d)), rng.standard_normal((1, b))
    grad = fedrep.embedding_gradients(u, xs, ys, xg, yg)[0]
    v = least_squares(xs @ u, ys)[0]  # v fixed: solved on the first batch only

    def loss(mat):
        return np.mean((yg[0] - xg[0] @ mat @ v) ** 2)

    numeric = np.zeros_like(u)
    for i in range(d):
        for j in range(k):
            e = np.zeros_like(u)
            e[i, j] = 1e-6
            numeric[i, j] = (loss(u + e) - loss(u - e)) / 2e-6
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)


def test_batch_size_policies():
    assert fedrep.resolve_batch_size("max", 10, 5, 2) == 2
    assert fedrep.resolve_batch_size("paper", 10, 5, 2) == 1  # b = m/(2T) = 1 < k
    assert fedrep.resolve_batch_size("paper", 10, 20, 2) == 1  # m/(2T) = 0 -> 1
    with pytest.raises(ValueError, match="two disjoint batches"):
        fedrep.resolve_batch_size(3, 10, 5, 2)


def test_noiseless_fedrep_rounds_recover_the_embedding():
    problem = SyntheticProblem(3000, 10, 2, 20, 0.01, "gaussian", seed=1)
    data = generate_users(problem, np.arange(3000))
    truth = ground_truth_embedding(problem)
    (x0, y0), _ = data.split_halves()
    stats, _ = private_init.clipped_u_statistic_sum(x0, y0, 1e9)
    u = private_init.server_init(stats / 3000, 2)
    start = subspace_distance(u, truth)
    for t in range(10):
        g, v = fedrep.gradient_factors(u, x0, y0, data.user_ids, 0, t, 5)
        grads = g[:, :, None] * v[:, None, :]
        u = fedrep.server_update(u, grads.mean(0), 0.5)
    assert subspace_distance(u, truth) < min(0.05, start)


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_factored_gradients_are_the_gradients_on_the_gathered_batches(rng, batch_size):
    """``gradient_factors`` works on X U and a residual weight matrix instead of copying the
    batches; the gradients and their clipped sum must be those of the direct formula."""
    from fedpriv.privacy.mechanisms import clipped_outer_sum, clipped_sum
    from fedpriv.randomness import user_permutations

    problem = SyntheticProblem(400, 8, 2, 20, 0.1, "gaussian", seed=2)
    data = generate_users(problem, np.arange(400))
    (x0, y0), _ = data.split_halves()
    u = orthonormalize(rng.standard_normal((8, 2)))
    g, v = fedrep.gradient_factors(u, x0, y0, data.user_ids, 3, 4, batch_size)
    grads = g[:, :, None] * v[:, None, :]
    perm = user_permutations(3, fedrep.BATCH_PURPOSE, 4, data.user_ids, x0.shape[1])
    first, second = perm[:, :batch_size], perm[:, batch_size:2 * batch_size]
    rows = np.arange(400)[:, None]
    direct = fedrep.embedding_gradients(u, x0[rows, first], y0[rows, first], x0[rows, second],
                                        y0[rows, second])
    np.testing.assert_allclose(grads, direct, rtol=1e-9, atol=1e-12)
    clip = float(np.median(np.linalg.norm(direct.reshape(400, -1), axis=1)))
    total, clipped = clipped_outer_sum(g, v, clip)
    ref_total, ref_clipped = clipped_sum(direct, clip)
    np.testing.assert_allclose(total, ref_total, rtol=1e-9, atol=1e-12)
    assert clipped == ref_clipped and 150 < clipped < 250


def test_least_squares_is_the_pseudo_inverse_solution_including_degenerate_users(rng):
    """The Gram/inverse fast path of ``least_squares`` against ``pinv``: tall, square and wide
    designs, with rank-deficient and ill-conditioned users mixed in (they take ``pinv``)."""
    for b, k in [(5, 2), (2, 2), (10, 50), (1, 2)]:
        design = rng.standard_normal((300, b, k))
        design[7] = 0.0  # singular
        design[8, :, 0] = design[8, :, -1] if k > 1 else 0.0  # repeated column
        design[9] *= np.logspace(0, -9, k)[None, :]  # ill-conditioned
        targets = rng.standard_normal((300, b))
        expected = np.einsum("nkb,nb->nk", np.linalg.pinv(design), targets)
        np.testing.assert_allclose(least_squares(design, targets), expected, rtol=1e-7,
                                   atol=1e-9)


def test_clipped_u_statistic_sum_is_the_sum_of_clipped_u_statistics(rng):
    problem = SyntheticProblem(600, 12, 2, 10, 0.1, "gaussian", seed=3)
    data = generate_users(problem, np.arange(600))
    (x0, y0), _ = data.split_halves()
    z = private_init.u_statistics(x0, y0)
    clip = float(np.median(np.linalg.norm(z.reshape(600, -1), axis=1)))
    total, clipped = private_init.clipped_u_statistic_sum(x0, y0, clip)
    ref_total, ref_clipped = clipped_sum(z, clip)
    np.testing.assert_allclose(total, ref_total, rtol=1e-9, atol=1e-12)
    assert clipped == ref_clipped and 250 < clipped < 350


def test_a_cancelling_u_statistic_is_still_clipped_to_the_clip_norm(rng):
    """One huge sample and one tiny one: ``||s||^4 - 2||As||^2 + ||AA^T||^2`` cancels to
    rounding noise (the plain formula gives 0 for most such users, which would leave them
    unclipped); the bound with the rounding slack must keep every user's clipped ``Z`` within
    the clip norm, the sensitivity the accountant assumes."""
    m, d = 5, 50
    plain_too_small = 0
    for _ in range(200):
        x, y = np.zeros((1, m, d)), np.ones((1, m))
        x[0, 0] = rng.standard_normal(d) * 1e4
        x[0, 1] = rng.standard_normal(d) * 1e-5
        true = float(np.linalg.norm(private_init.u_statistics(x, y)))
        w = x * y[:, :, None]
        s = w.sum(axis=1)
        gram = w @ w.transpose(0, 2, 1)
        plain = (np.einsum("ni,ni->n", s, s) ** 2
                 - 2 * np.sum(np.einsum("nmd,nd->nm", w, s) ** 2) + np.sum(gram ** 2))[0]
        plain_too_small += np.sqrt(max(plain, 0.0)) / (m * (m - 1)) < 0.99 * true
        clip = true / 2
        out, clipped = private_init.clipped_u_statistic_sum(x, y, clip)
        assert clipped == 1 and np.linalg.norm(out) <= clip * (1 + 1e-9)
    assert plain_too_small > 50  # the hazard is real at this scale
