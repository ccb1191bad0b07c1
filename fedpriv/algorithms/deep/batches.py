"""The users' batches of a deep round: two disjoint random batches per user, and k-fold
cross-fitting's arrangement of them, each user's a function of its own key and rows only."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.models import ModelSpec
from fedpriv.algorithms.deep.params import LocalKeys
from fedpriv.algorithms.deep.problem import UserBlock
from fedpriv.randomness import user_uniforms

_BATCH_PURPOSE = 0xDBA


class LocalProblem(NamedTuple):
    """What a chunk's local steps start from and run on, as ``deep_math.local_updates`` takes
    them: the shared ``start`` (the body, or the whole model with ``heads`` None), each user's
    frozen heads (n, H), or (n, k, H) with cross-fitting, and its rows x (n, r, *input), y and
    mask (n, r)."""

    start: torch.Tensor
    heads: torch.Tensor | None
    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor


def disjoint_batches(seed: int, round_index: int, keys: np.ndarray, counts: np.ndarray,
                     width: int, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two disjoint random batches of positions among each user's ``counts`` rows, a pure
    function of (seed, round, the user's key, its own count): any node computes the same, and
    no user moves another's batches. User i's batches hold ``b_i = min(batch, counts_i // 2)``
    rows (a user with fewer than 2b rows is handled within itself): (first, second, mask),
    each (n, batch), mask 1 on the first b_i entries (the rest point at position 0)."""
    cols = max(width, 2 * batch)
    u = user_uniforms(seed, _BATCH_PURPOSE, round_index, keys, cols)
    u[np.arange(cols)[None, :] >= counts[:, None]] = 2.0  # padding sorts last
    order = np.argsort(u, axis=1, kind="stable")
    own = np.minimum(batch, counts // 2)[:, None]
    j = np.arange(batch)[None, :]
    mask = j < own
    first = np.where(mask, order[:, :batch], 0)
    second = np.where(mask, np.take_along_axis(order, np.minimum(own + j, cols - 1), 1), 0)
    return first, second, mask.astype(np.float32)


def take_rows(t: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    rows = torch.arange(t.shape[0], device=t.device)[:, None]
    return t[rows, torch.from_numpy(index).to(t.device)]


def folds(first: np.ndarray, second: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """k-fold cross-fitting's rows: both batches' 2b positions a user in k folds of
    ``2b // k`` (the remainder unused), (n, k g) fold by fold, and ``others`` (k, k - 1): the
    folds whose rows fit head j."""
    both = np.concatenate([first, second], 1)
    g = both.shape[1] // k
    others = np.array([[i for i in range(k) if i != j] for j in range(k)], dtype=np.int64)
    return both[:, :k * g], others


def cross_fitted(spec: ModelSpec, body: torch.Tensor, block: UserBlock, first: np.ndarray,
                 second: np.ndarray, mask: np.ndarray, config: LocalKeys) -> LocalProblem:
    """FedRep's round with k-fold cross-fitting (``cross-fit = k``): per user k heads, head j
    fitted with the body frozen on every fold but j, and the body's rows fold by fold, so
    that ``local_updates`` scores fold j with head j: (body, heads (n, k, H), x, y, mask)."""
    k = config.cross_fit
    scored, others = folds(first, second, k)
    valid, _ = folds(mask, mask, k)
    (n, rows), g = scored.shape, scored.shape[1] // k
    x, y = take_rows(block.x, scored), take_rows(block.y, scored)
    weights = torch.from_numpy(valid).to(x.device)
    feats = dm.features(spec, body, x.reshape(n * rows, *spec.input_shape)).reshape(n, k, g, -1)
    fits = torch.from_numpy(others).to(feats.device)
    train_feats = feats[:, fits].reshape(n * k, (k - 1) * g, -1)
    train_y = y.reshape(n, k, g)[:, fits].reshape(n * k, (k - 1) * g)
    train_w = weights.reshape(n, k, g)[:, fits].reshape(n * k, (k - 1) * g)
    heads = dm.fit_heads(train_feats, train_y, train_w, spec.num_classes, config.head_steps,
                         config.head_lr, bias=spec.head_bias)
    return LocalProblem(body, heads.reshape(n, k, -1), x, y, weights)
