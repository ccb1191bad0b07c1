import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedpriv.privacy.mechanisms import (
    clip_by_norm,
    clipped_sum,
    norms,
    symmetric_gaussian_noise,
)

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float64, (5, 3, 2), elements=finite), st.floats(1e-3, 1e3))
def test_clipping_never_increases_a_norm_and_respects_the_bound(values, clip):
    clipped = clip_by_norm(values, clip)
    assert np.all(norms(clipped) <= norms(values) + 1e-9)
    assert np.all(norms(clipped) <= clip * (1 + 1e-9))


def test_clipping_keeps_direction_and_leaves_small_and_zero_entries_alone():
    values = np.array([[3.0, 4.0], [0.0, 0.0], [0.3, 0.4]])
    clipped = clip_by_norm(values, 1.0)
    np.testing.assert_allclose(clipped, [[0.6, 0.8], [0.0, 0.0], [0.3, 0.4]])
    total, count = clipped_sum(values, 1.0)
    np.testing.assert_allclose(total, [0.9, 1.2])
    assert count == 1


def test_symmetric_noise_is_symmetric_with_the_stated_std(rng):
    samples = np.stack([symmetric_gaussian_noise(6, 2.0, rng) for _ in range(4000)])
    np.testing.assert_array_equal(samples, np.transpose(samples, (0, 2, 1)))
    upper = samples[:, np.triu_indices(6)[0], np.triu_indices(6)[1]]
    assert abs(upper.std() - 2.0) < 0.05
    # entries of the upper triangle are independent
    assert abs(np.corrcoef(upper[:, 0], upper[:, 1])[0, 1]) < 0.05
