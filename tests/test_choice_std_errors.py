"""The final choice's one-standard-error rule (``choice-std-errors``, ``head_fit.mix_weights``):
a user leaves the model with more data behind it only where its own rows say so beyond their
noise. Checked against a per-user loop written from the rule's statement."""

import math

import numpy as np
import pytest
import torch

from fedpriv.algorithms.deep import choice
from fedpriv.algorithms.deep.head_fit import mix_weights, pooled
from fedpriv.algorithms.shared_params import MIX_WEIGHTS
from fedpriv.params import ConfigError
from tests.test_deep import config


def _reference(shared, local, y, mask, z):
    """One user at a time: the per-row cross-entropy of each weight's pool on the user's valid
    rows; the least total (first of ties); then the first weight whose mean paired difference to
    it is at most z standard errors (sample sd / sqrt(rows)); with one row, the first weight."""
    out = []
    for u in range(len(y)):
        rows = np.flatnonzero(mask[u].numpy() > 0)
        losses = []
        for w in MIX_WEIGHTS:
            p = pooled(w, shared[u:u + 1], local[u:u + 1])[0].double().numpy()
            picked = p[rows, y[u, rows].numpy()]
            with np.errstate(invalid="ignore", divide="ignore"):
                row = -np.log(np.maximum(picked, np.finfo(np.float32).tiny))
            losses.append(np.where(np.isnan(row), np.inf, row))
        totals = [float(row.sum()) for row in losses]
        best = int(np.argmin(totals))
        chosen = best
        for c in range(best):
            if not math.isfinite(totals[c]):
                continue
            diff = losses[c] - losses[best]
            if len(rows) <= 1:
                chosen = c
                break
            stderr = diff.std(ddof=1) / math.sqrt(len(rows))
            if diff.mean() <= z * stderr + 1e-6 * max(1.0, abs(diff.mean())):
                chosen = c
                break
        out.append(MIX_WEIGHTS[chosen])
    return out


def _random_users(seed, users=60, width=12, classes=4):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (users, width), generator=g)
    counts = torch.randint(0, width + 1, (users,), generator=g)
    counts[:3] = torch.tensor([0, 1, 2])  # users with no row, one row, two rows
    mask = (torch.arange(width)[None, :] < counts[:, None]).float()
    # models of varied confidence, the local one sometimes better on the user's rows
    shared = torch.softmax(torch.randn(users, width, classes, generator=g) * 2, -1)
    local = torch.softmax(torch.randn(users, width, classes, generator=g) * 2
                          + 3 * torch.nn.functional.one_hot(y, classes)
                          * torch.rand(users, 1, 1, generator=g), -1)
    return shared, local, y, mask


@pytest.mark.parametrize("z", [0.5, 1.0, 2.0])
def test_the_vectorized_rule_is_the_per_user_rule(z):
    for seed in range(3):
        shared, local, y, mask = _random_users(seed)
        got = mix_weights(shared, local, y, mask, MIX_WEIGHTS, z).tolist()
        assert got == _reference(shared, local, y, mask, z)


def test_zero_standard_errors_is_the_least_cross_validated_loss():
    for seed in range(3):
        shared, local, y, mask = _random_users(seed)
        shared[5:8, 0] = float("nan")  # a non-finite shared model on a row (a masked one too)
        mask[7, 0] = 0.0
        least = mix_weights(shared, local, y, mask, MIX_WEIGHTS, 0.0)
        totals = torch.stack([  # the rule as it shipped before choice-std-errors
            -(pooled(w, shared, local).gather(-1, y[..., None])[..., 0].log() * mask).sum(1)
            for w in MIX_WEIGHTS], 1).nan_to_num(nan=float("inf"))
        assert least.tolist() == [MIX_WEIGHTS[i] for i in totals.argmin(1).tolist()]
        assert least.tolist() != mix_weights(shared, local, y, mask, MIX_WEIGHTS, 1.0).tolist()


def test_a_consistent_gain_leaves_the_shared_model_and_a_noisy_one_does_not():
    # 10 rows of class 0. User 0: the local model better by the same margin on every row (no
    # noise: it goes local at any z). User 1: the shared model sure and wrong on row 0, the local
    # one a little worse on the other nine. Its least total loss is the pool at w = 0.25; the
    # per-row differences to it (mean / standard error, by hand): w = 1: 0.235 / 0.300, w =
    # 0.75: 0.090 / 0.134, w = 0.5: 0.010 / 0.032.
    y = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.ones(2, 10)
    shared = torch.tensor([0.6, 0.4]).expand(2, 10, 2).clone()
    local = shared.clone()
    local[0] = torch.tensor([0.8, 0.2])
    local[1] = torch.tensor([0.55, 0.45])
    local[1, 0] = torch.tensor([0.99, 0.01])
    shared[1, 0] = torch.tensor([0.05, 0.95])
    for z, kept in ((0.0, 0.25), (0.4, 0.5), (0.5, 0.5), (0.7, 0.75), (1.0, 1.0), (100.0, 1.0)):
        assert mix_weights(shared, local, y, mask, MIX_WEIGHTS, z).tolist() == [0.0, kept], z


def test_a_user_with_one_row_keeps_the_shared_model_unless_it_is_not_finite():
    y = torch.tensor([[1, 0], [1, 0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    shared = torch.tensor([[[0.9, 0.1], [0.5, 0.5]], [[0.5, float("nan")], [0.5, 0.5]]])
    local = torch.tensor([[[0.1, 0.9], [0.5, 0.5]], [[0.1, 0.9], [0.5, 0.5]]])
    assert mix_weights(shared, local, y, mask, MIX_WEIGHTS, 0.0).tolist() == [0.0, 0.0]
    # user 1's shared model is not finite: it keeps what it can (the local model at the least
    # loss; a pool with a non-finite shared model is never chosen)
    assert mix_weights(shared, local, y, mask, MIX_WEIGHTS, 0.5).tolist() == [1.0, 0.0]


def test_the_deep_choice_reads_the_key_and_a_bad_one_fails_before_the_run():
    assert config().choice_std_errors == 0.5
    assert config(choice_std_errors=0.0).choice_std_errors == 0.0
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="choice-std-errors"):
            config(choice_std_errors=bad)
    with pytest.raises(ValueError, match="std_errors"):
        mix_weights(*_random_users(0), MIX_WEIGHTS, -1.0)
    shared, local, y, mask = _random_users(1)
    assert torch.equal(choice.chosen_weights(shared, local, y, mask, 1.0),
                       mix_weights(shared, local, y, mask, MIX_WEIGHTS, 1.0))
