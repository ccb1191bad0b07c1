"""Local-only for deep personalization: each user trains alone on its own training rows and
nothing leaves it (nothing is released: epsilon 0).

Two local learners, both computed for every user, vectorized over users: a linear softmax model
on the raw inputs (``final-head-steps`` steps of Nesterov-accelerated gradient descent of step
``head-lr``/L: the pixels' Gram is ill-conditioned, and plain steps, as the heads are fitted,
stop far short), and the configured network trained alone from the common initialization
(``final-head-steps`` full-batch steps of ``local-lr``). The run reports both
(``accuracy_linear``, ``accuracy_model``) and, as ``accuracy`` (with its percentile and loss),
the stronger of the two on the mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedpriv.algorithms.base import Step
from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.deep_algorithm import DeepBase
from fedpriv.algorithms.deep.final_fit import accuracy_sums, summarize
from fedpriv.algorithms.deep.params import DeepLocalConfig
from fedpriv.algorithms.deep.problem import DeepProblem, chunk_users, model_of, user_block
from fedpriv.privacy.accounting import PlannedRelease


class DeepLocalOnly(DeepBase[DeepLocalConfig]):
    name = "deep-local-only"
    summary = "each user alone: a linear model on raw inputs or its own network (baseline)"
    private = False
    config_type = DeepLocalConfig  # no rounds

    def privacy_plan(self) -> list[PlannedRelease]:
        return []

    def steps(self) -> list[Step]:
        return [Step("final")]

    def state(self) -> dict[str, Any]:
        """The common initialization's body (a function of the seed alone: no user's data)."""
        body = self.model[:model_of(self.config).body_size]
        return {"model": self.config.model, "released": "body",
                "parameters": body.astype(float).tolist()}

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        linear, model = summarize(metric_sums, "lin"), summarize(metric_sums, "own")
        best = linear if not model["accuracy"] > linear["accuracy"] else model
        return {**best, "accuracy_linear": linear["accuracy"],
                "accuracy_model": model["accuracy"],
                "local_learner": 0.0 if best is linear else 1.0}

    @classmethod
    def empty_sums(cls, config: DeepLocalConfig) -> dict[str, float]:
        none = np.zeros(0)
        return {**accuracy_sums(none, none, none.astype(np.int64), "lin"),
                **accuracy_sums(none, none, none.astype(np.int64), "own")}

    @classmethod
    def final_sums(cls, config: DeepLocalConfig, problem: DeepProblem, model: torch.Tensor,
                   ids: np.ndarray) -> dict[str, float]:
        spec = problem.spec
        train, test = user_block(problem, ids, "train"), user_block(problem, ids, "test")
        sums: dict[str, float] = {}
        # a chunk of the final step is sized for inference; training every user's own network
        # holds its parameters too, so it runs in sub-chunks
        size = chunk_users(problem, train.y.shape[1], 3 * spec.size, config.chunk_mb)
        n, r = test.y.shape
        raw = train.x.reshape(*train.y.shape, -1)
        heads = dm.fit_heads(raw, train.y, train.mask, spec.num_classes,
                             config.final_head_steps, config.head_lr, accelerated=True)
        logits = dm.head_logits(test.x.reshape(n, r, -1), heads, spec.num_classes)
        acc, loss = dm.accuracy_and_loss(logits, test.y, test.mask)
        sums.update(accuracy_sums(acc, loss, test.counts, "lin"))
        accs, losses = [], []
        for start in range(0, n, size):
            part = slice(start, start + size)
            with torch.enable_grad():
                delta = dm.local_updates(spec, model, None, train.x[part], train.y[part],
                                         train.mask[part], config.final_head_steps,
                                         config.local_lr)
            logits = dm.model_logits(spec, model + delta, test.x[part])
            a, lo = dm.accuracy_and_loss(logits, test.y[part], test.mask[part])
            accs.append(a)
            losses.append(lo)
        sums.update(accuracy_sums(np.concatenate(accs), np.concatenate(losses), test.counts,
                                  "own"))
        return sums
