"""Each user's final choice between training alone and the shared model (``final-choice =
"best"``, the default of the deep rounds algorithms): never worse than training alone.

On its node, every user has two models at the end of a run: its **local** model (a linear
softmax model on its raw inputs, fitted on its own training rows alone by accelerated gradient
descent, as deep-local-only's linear learner) and the method's **shared** personal model
(FedRep's head on the released body, DP-FedAvg's global model, or the global head fine-tuned).
It keeps one of five predictors: the log-linear pool ``softmax(w log p_shared + (1 - w) log
p_local)`` of the two models' class probabilities (the interpolation of their logits) for a
weight ``w`` in ``MIX_WEIGHTS`` (1: the shared model alone; 0: the local model alone; between:
a mix, as the per-user interpolation of adaptive personalized FL, Deng et al. 2020; not the mix
of the probabilities, whose hedging cross-entropy rewards without more rows right).

The choice is made on the user's **own training rows** by k-fold cross-validation
(``choice-folds``): row j of a user is in fold j mod k; both models are refitted on the other
folds and score the held-back fold, so each training row is scored once by fits that never saw
it, and the user keeps the largest weight whose mix's cross-entropy on its rows is within
``choice-std-errors`` standard errors of the least (the one-standard-error rule per user,
``head_fit.mix_weights``: the model with more data behind it is left only where the user's
rows say so beyond their noise; a tiny validation set also says more through the
probabilities than through a count of rows right). Test rows are never read. Then both
models are fitted on all the user's training rows (the models a run without the choice uses)
and mixed with the chosen weight.

The released body or model enters each user's choice only through what the user computes with
it on its own rows: the choice is a post-processing on the node and costs no privacy. The
release is the same with the choice on or off; only the metric sums reported to the operator
(never released) change: the accuracy of what the users keep, of the shared model alone and of
the local model alone, how many users chose each, and how many end more than 5 points below
their own local model. Only the heads and the local model are refitted per fold: the body (or
DP-FedAvg's model) was trained on every user's rows, these included; a private method saw
them only through the user's clipped, noised share, which bounds what it can have learnt of
them, while for a non-private baseline the held-back score flatters the shared model.

An algorithm states its final head in ``head_from`` (``HEAD_FROM``), which both this choice
and ``DeepAlgorithm.final_scores`` (the personal model without the choice) follow.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.final_fit import accuracy_sums, functional_logits, summarize
from fedpriv.algorithms.deep.head_fit import cross_validated_heads, mix_weights, pooled
from fedpriv.algorithms.deep.params import DeepConfig
from fedpriv.algorithms.deep.problem import DeepProblem, UserBlock, user_block
from fedpriv.algorithms.shared_params import MIX_WEIGHTS

BELOW_LOCAL = 0.05  # "below its own local model": by more than 5 points of accuracy

HEAD_FROM = ("zero", "global", "none")  # the shared model's final head: fitted from zero,
# fine-tuned from the global head, or the global model as it is (no fit)

Predictions = tuple[torch.Tensor, torch.Tensor]  # class probabilities: cross-validated on the
# training rows (n, r, C), and on the scored rows (n, r', C)


def row_folds(width: int, folds: int, device: torch.device) -> torch.Tensor:
    """The fold of each row place of a user's training rows: place j in fold j mod k."""
    return torch.arange(width, device=device) % folds


def _cross_validated(inputs: torch.Tensor, scored: torch.Tensor, train: UserBlock,
                     config: DeepConfig, classes: int, start: torch.Tensor | None,
                     bias: bool, accelerated: bool = False) -> Predictions:
    """Linear heads on ``inputs`` (n, r, h) of the training rows: each fold's rows scored by
    heads fitted on the other folds, and ``scored`` (n, r', h) by heads fitted on all."""
    held, heads = cross_validated_heads(inputs, train.y, train.mask, classes,
                                        config.final_head_steps, config.head_lr,
                                        config.choice_folds, start, bias, accelerated)
    return held, torch.softmax(dm.head_logits(scored, heads, classes, bias), -1)


def shared_predictions(config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                       train: UserBlock, scored: UserBlock, head_from: str) -> Predictions:
    """The method's personal model: its head on the released body fitted (from zero or from
    the global head), or the global model as it is (``head_from = "none"``: nothing fitted,
    so its predictions on a held-back fold are its predictions there)."""
    spec = problem.spec
    n, r = train.y.shape
    if head_from == "none":
        def probs(block: UserBlock) -> torch.Tensor:
            m, w = block.y.shape
            x = block.x.reshape(m * w, *spec.input_shape)
            return torch.softmax(functional_logits(spec, model, x), -1).reshape(m, w, -1)
        return probs(train), probs(scored)
    body = model[:spec.body_size]
    start = (model[spec.body_size:].expand(n, -1) if head_from == "global" else None)
    feats = dm.features(spec, body, train.x.reshape(n * r, *spec.input_shape)).reshape(n, r, -1)
    m, w = scored.y.shape
    scored_feats = dm.features(spec, body, scored.x.reshape(m * w, *spec.input_shape))
    return _cross_validated(feats, scored_feats.reshape(m, w, -1), train, config,
                            spec.num_classes, start, spec.head_bias)


def local_predictions(config: DeepConfig, problem: DeepProblem, train: UserBlock,
                      scored: UserBlock) -> Predictions:
    """The user's own model: a linear softmax model on its raw inputs (with a bias), fitted
    on its training rows alone by accelerated descent (as deep-local-only's linear learner,
    to float rounding: the folds and the full fit run in one pass, ``head_fit.fit_head_sets``)."""
    n, r = train.y.shape
    m, w = scored.y.shape
    return _cross_validated(train.x.reshape(n, r, -1), scored.x.reshape(m, w, -1), train,
                            config, problem.spec.num_classes, None, True, accelerated=True)


def chosen_weights(shared: torch.Tensor, local: torch.Tensor, y: torch.Tensor,
                   mask: torch.Tensor, std_errors: float) -> torch.Tensor:
    """Each user's weight of the shared model among ``MIX_WEIGHTS``: the largest whose
    cross-validated cross-entropy is within ``std_errors`` standard errors of the least
    (``head_fit.mix_weights``). (n,)"""
    return mix_weights(shared, local, y, mask, MIX_WEIGHTS, std_errors)


def mixed(weight: torch.Tensor, shared: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Each user's mix (n, r, C) with its weight (n,) (``head_fit.pooled``): the shared or the
    local model itself at 1 or 0, so that the other model's values (non-finite ones included)
    do not enter."""
    return pooled(weight, shared, local)


def _scores(probs: torch.Tensor, block: UserBlock) -> tuple[np.ndarray, np.ndarray]:
    logp = torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))
    return dm.accuracy_and_loss(logp, block.y, block.mask)


def choice_scores(config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                  ids: np.ndarray, head_from: str, split: str = "test"
                  ) -> dict[str, np.ndarray]:
    """Per user: accuracy and loss on its ``split`` rows of what it keeps (``acc``,
    ``loss``), the accuracy of the shared model alone and of its local model alone, the
    chosen weight, and how many rows it has there."""
    train, scored = user_block(problem, ids, "train"), user_block(problem, ids, split)
    shared_cv, shared = shared_predictions(config, problem, model, train, scored, head_from)
    local_cv, local = local_predictions(config, problem, train, scored)
    weight = chosen_weights(shared_cv, local_cv, train.y, train.mask,
                            config.choice_std_errors)
    acc, loss = _scores(mixed(weight, shared, local), scored)
    local_acc, local_loss = _scores(local, scored)
    return {"acc": acc, "loss": loss, "shared": _scores(shared, scored)[0],
            # a local model that is not finite (its user's rows were not) is right on nothing
            "local": np.where(np.isfinite(local_loss), local_acc, 0.0),
            "weight": weight.double().cpu().numpy(), "counts": scored.counts}


def choice_sums(scores: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Metric sums of a chunk of users (operator side): those of what the users keep
    (``accuracy_sums``), the shared and local models' accuracy sums, how many users chose
    each kind, and how many end more than 5 points below their own local model, with and
    without the choice. Users left out of ``accuracy_sums`` are left out of every sum."""
    acc, loss, counts = scores["acc"], scores["loss"], scores["counts"]
    sums = accuracy_sums(acc, loss, counts)
    seen = (counts > 0) & np.isfinite(acc) & np.isfinite(loss) & np.isfinite(scores["shared"])
    weight, local = scores["weight"][seen], scores["local"][seen]
    sums.update({
        "shared_acc_sum": float(scores["shared"][seen].sum()),
        "local_acc_sum": float(local.sum()),
        "chose_shared": float((weight == 1.0).sum()),
        "chose_local": float((weight == 0.0).sum()),
        "chose_mix": float(((weight > 0.0) & (weight < 1.0)).sum()),
        "below_local": float((acc[seen] < local - BELOW_LOCAL).sum()),
        "shared_below_local": float((scores["shared"][seen] < local - BELOW_LOCAL).sum())})
    return sums


CHOICE_KEYS = ("shared_acc_sum", "local_acc_sum", "chose_shared", "chose_local", "chose_mix",
               "below_local", "shared_below_local")


def empty_choice_sums() -> dict[str, float]:
    none = np.zeros(0)
    return {**accuracy_sums(none, none, none.astype(np.int64)),
            **{k: 0.0 for k in CHOICE_KEYS}}


def summarize_choice(sums: Mapping[str, float]) -> dict[str, float]:
    """The run's metrics: ``summarize``'s of what the users keep, and beside them the mean
    accuracy of the shared model alone (``accuracy_shared``: the method without the choice)
    and of the users' local models (``accuracy_local``), the share of users choosing each kind,
    and the share more than 5 points below their own local model with and without the
    choice."""
    metrics = summarize(sums)
    users = sums["acc_users"]
    if not users or "chose_shared" not in sums:
        return metrics
    return {**metrics, "accuracy_shared": sums["shared_acc_sum"] / users,
            "accuracy_local": sums["local_acc_sum"] / users,
            "chose_shared": sums["chose_shared"] / users,
            "chose_mix": sums["chose_mix"] / users,
            "chose_local": sums["chose_local"] / users,
            "below_local": sums["below_local"] / users,
            "below_local_without_choice": sums["shared_below_local"] / users}
