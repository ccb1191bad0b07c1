"""The final step of the deep algorithms: each user's personal model and the metric sums a node
reports (to the operator, never released).

Two ways to the personal model, chosen by each algorithm's ``head_from``: a linear head fitted
on the user's training rows with the released body frozen (``fitted_head_scores``: from zero, or
from the global model's head), or the global model as it is (``global_model_scores``). The
metric sums hold each user's accuracy and loss and a histogram of the per-user accuracy (for
the 10th-percentile user); ``summarize`` turns them into the run's metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.models import ModelSpec
from fedpriv.algorithms.deep.params import DeepLocalConfig
from fedpriv.algorithms.deep.problem import DeepProblem, chunk_users, user_block

HISTOGRAM_BINS = 101  # per-user accuracy to 1% (for the percentile)

Scores = tuple[np.ndarray, np.ndarray, np.ndarray]  # per user: accuracy, loss, rows scored


def bin_keys(prefix: str = "acc") -> list[str]:
    return [f"{prefix}_bin_{k:03d}" for k in range(HISTOGRAM_BINS)]


def accuracy_sums(acc: np.ndarray, loss: np.ndarray, counts: np.ndarray,
                  prefix: str = "acc") -> dict[str, float]:
    """Metric sums of users with test rows: accuracy, loss, how many, and the histogram of
    per-user accuracy (for the 10th-percentile user). A user whose loss or accuracy is not
    finite (its data overflowed the model, or was isolated) is left out and counted apart
    (``_unscored``): one user's data never makes its node's metrics unusable."""
    scored = np.isfinite(acc) & np.isfinite(loss)
    seen = (counts > 0) & scored
    hist = np.bincount(np.rint(acc[seen] * 100).astype(np.int64), minlength=HISTOGRAM_BINS)
    return {f"{prefix}_sum": float(acc[seen].sum()), f"{prefix}_loss_sum": float(loss[seen].sum()),
            f"{prefix}_users": float(seen.sum()),
            f"{prefix}_unscored": float(((counts > 0) & ~scored).sum()),
            **{k: float(v) for k, v in zip(bin_keys(prefix), hist, strict=True)}}


def summarize(sums: Mapping[str, float], prefix: str = "acc") -> dict[str, float]:
    """Mean per-user accuracy, 10th-percentile user's accuracy (1% bins) and mean test loss."""
    users = sums[f"{prefix}_users"]
    unscored = {"users_not_scored": sums[f"{prefix}_unscored"]} if sums.get(
        f"{prefix}_unscored") else {}
    if not users:
        return {"accuracy": float("nan"), "accuracy_p10": float("nan"),
                "test_loss": float("nan"), **unscored}
    hist = np.array([sums[k] for k in bin_keys(prefix)])
    p10 = int(np.searchsorted(np.cumsum(hist), 0.1 * users)) / 100.0
    return {"accuracy": sums[f"{prefix}_sum"] / users, "accuracy_p10": p10,
            "test_loss": sums[f"{prefix}_loss_sum"] / users, "users_evaluated": users,
            **unscored}


def final_chunk(config: DeepLocalConfig, problem: DeepProblem, user_ids: np.ndarray) -> int:
    """Users per chunk of the final fit and evaluation (their training rows, and their test
    or held-back validation rows)."""
    train = int(problem.users.train.counts[user_ids].max(initial=1))
    scored = max(int(problem.users.test.counts.max(initial=1)),
                 0 if problem.validation is None else int(problem.validation.counts.max()))
    own = 0
    if getattr(config, "final_choice", "off") == "best":  # a local head on the raw inputs,
        # and the two models' probabilities on the training and scored rows
        classes = problem.spec.num_classes
        own = classes * (int(np.prod(problem.spec.input_shape)) + 1) + 2 * classes * (
            train + scored)
    return chunk_users(problem, train + scored, own, config.chunk_mb)


def functional_logits(spec: ModelSpec, model: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The global model's logits on rows x (N, *input)."""
    logits: torch.Tensor = torch.func.functional_call(spec.module, spec.unflatten(model), (x,))
    return logits


def global_model_scores(problem: DeepProblem, model: torch.Tensor, ids: np.ndarray,
                        split: str = "test") -> Scores:
    """Each user's accuracy and loss on its ``split`` rows with the global model as it is,
    and how many rows it has there."""
    spec = problem.spec
    test = user_block(problem, ids, split)
    n, r = test.y.shape
    logits = functional_logits(spec, model, test.x.reshape(n * r, *spec.input_shape))
    acc, loss = dm.accuracy_and_loss(logits.reshape(n, r, -1), test.y, test.mask)
    return acc, loss, test.counts


def fitted_head_scores(config: DeepLocalConfig, problem: DeepProblem, model: torch.Tensor,
                       ids: np.ndarray, split: str = "test",
                       start: torch.Tensor | None = None) -> Scores:
    """Each user's accuracy and loss on its ``split`` rows after fitting its head on all its
    training rows (``final-head-steps``) with the model's body frozen, from ``start`` (one
    head per user, (n, H)) or from zero, and how many rows it has there."""
    spec = problem.spec
    train, test = user_block(problem, ids, "train"), user_block(problem, ids, split)
    n, r = test.y.shape
    body = model[:spec.body_size]
    nt, rt = train.y.shape
    feats = dm.features(spec, body, train.x.reshape(nt * rt, *spec.input_shape))
    heads = dm.fit_heads(feats.reshape(nt, rt, -1), train.y, train.mask, spec.num_classes,
                         config.final_head_steps, config.head_lr, start, spec.head_bias)
    test_feats = dm.features(spec, body, test.x.reshape(n * r, *spec.input_shape))
    logits = dm.head_logits(test_feats.reshape(n, r, -1), heads, spec.num_classes,
                            spec.head_bias)
    acc, loss = dm.accuracy_and_loss(logits, test.y, test.mask)
    return acc, loss, test.counts
