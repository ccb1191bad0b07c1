"""Per-user streams started for a whole block at once are NumPy's own per-user streams, bit for
bit (``fedpriv.data.streams``), and the data drawn from them is what the original one-generator-
per-user code drew."""

import numpy as np
import pytest

from fedpriv.data.streams import StreamWriter, pcg64_states, seed_sequence_states
from fedpriv.data.synthetic import SyntheticProblem, generate_users, ground_truth_embedding

KEYS = [(0, 1), (3, 0, 1), (0, 0, 2), (2**40 + 7, 2), (2**64 + 5, 3), (123456789,)]


@pytest.mark.parametrize("key", KEYS)
def test_block_states_are_those_of_seed_sequence_and_pcg64(key):
    ids = np.concatenate([[0, 1, 2, 2**32 - 1],
                          np.random.default_rng(7).integers(0, 2**32, 100)])
    words = seed_sequence_states(key, ids)
    states = pcg64_states(key, ids)
    for row, uid in enumerate(ids):
        seq = np.random.SeedSequence([*key, int(uid)])
        assert np.array_equal(words[row], seq.generate_state(4, np.uint64))
        ref = np.random.PCG64(seq).state["state"]
        assert (int(states[row, 1]) << 64) | int(states[row, 0]) == ref["state"]
        assert (int(states[row, 3]) << 64) | int(states[row, 2]) == ref["inc"]


@pytest.mark.parametrize("fast", [True, False])
def test_a_rewound_generator_draws_what_default_rng_draws(fast):
    writer = StreamWriter()
    assert writer.fast  # the layout check passes on the NumPy this project pins
    if not fast:  # the public-setter fallback, as on a NumPy with another state layout
        writer._words = None
    states = pcg64_states((5, 1), np.arange(300))
    for uid in range(300):
        rng = writer.start(states[uid])
        ref = np.random.default_rng([5, 1, uid])
        assert np.array_equal(rng.standard_normal(37), ref.standard_normal(37))
        assert np.array_equal(rng.integers(0, 2, size=5), ref.integers(0, 2, size=5))
        assert np.array_equal(rng.integers(0, 3), ref.integers(0, 3))
        assert np.array_equal(rng.uniform(-1, 1, 4), ref.uniform(-1, 1, 4))
        assert np.array_equal(rng.random(3, dtype=np.float32), ref.random(3, dtype=np.float32))


def test_bad_user_ids_are_refused():
    with pytest.raises(ValueError, match="user ids"):
        pcg64_states((0, 1), np.array([-1]))
    with pytest.raises(ValueError, match="non-negative"):
        pcg64_states((-3, 1), np.array([0]))


@pytest.mark.parametrize("family", ["gaussian", "rademacher", "uniform", "mixed"])
@pytest.mark.parametrize("purpose", ["train", "test", "validation"])
def test_user_data_is_the_one_generator_per_user_draw(family, purpose):
    """As the original code drew it: ``default_rng([seed, stream, uid])`` per user."""
    seed = 2**33 + 3
    problem = SyntheticProblem(700, 6, 2, 8, 0.1, family, seed=seed)
    ids = np.array([0, 699, 17, 250, 4096 % 700, 511])
    data = generate_users(problem, ids, samples=8, purpose=purpose)
    stream = {"train": 1, "test": 2, "validation": 3}[purpose]
    u_star = ground_truth_embedding(problem)
    for row, uid in enumerate(ids):
        kind = family
        if kind == "mixed":
            pick = np.random.default_rng([seed, 0, 2, int(uid)]).integers(0, 3)
            kind = ("gaussian", "rademacher", "uniform")[int(pick)]
        rng = np.random.default_rng([seed, stream, int(uid)])
        if kind == "gaussian":
            x = rng.standard_normal((8, 6))
        elif kind == "rademacher":
            x = rng.integers(0, 2, size=(8, 6)) * 2.0 - 1.0
        else:
            x = rng.uniform(-np.sqrt(3.0), np.sqrt(3.0), size=(8, 6))
        noise = rng.standard_normal(8) * 0.1
        v = np.random.default_rng([seed, 0, 1, int(uid)]).standard_normal(2)
        assert np.array_equal(data.features[row], x)
        assert np.array_equal(data.true_local_vectors[row], v)
        assert np.allclose(data.labels[row], x @ (u_star @ v) + noise, rtol=0, atol=1e-12)
