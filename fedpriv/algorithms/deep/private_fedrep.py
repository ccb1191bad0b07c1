"""Private FedRep for deep models (Snedeker, Zhou & Bassily 2025, Alg. 1, with a torch body in
place of the embedding U) and its non-private version.

Each round every taking-part user fits its linear head from zero with the body frozen on one
batch (``head-steps`` steps), then computes its body update with that head frozen on a *disjoint*
batch (``body-steps`` local steps): the head never sees the rows the released update is
computed on, as in the paper's analysis. The update is clipped to ``clip-norm`` (L2 over every
body parameter); the server releases the noisy mean over the population and steps with
momentum. At the end each user fits its head on all its training rows with the released body.

``cross-fit = k >= 2`` (k-fold cross-fitting, as in double machine learning): the 2b rows of
both batches in k folds; each user fits k heads a round, head j on every fold but j, and its
body update is the gradient on each fold j through head j. Every row of both batches reaches
the body and still no head scores a row it was fitted on. A head fitted to ~15 rows nearly
interpolates them, so the gradient through it on fresh rows is the user's generalization
error: it points the same way across users more often, and Private FedRep is more accurate
with k = 2 (docs: results, measurements). The default is k = 2. The update is
still one user's, clipped once: the privacy argument below does not change.

Privacy: one Gaussian release per round of sensitivity ``clip-norm / population``
(``fedpriv.algorithms.deep.deep_algorithm``), T rounds in one calibrated plan. Heads never
leave the users.
"""

from __future__ import annotations

import numpy as np
import torch

from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.batches import LocalProblem, cross_fitted, take_rows
from fedpriv.algorithms.deep.deep_algorithm import DeepAlgorithm
from fedpriv.algorithms.deep.ghost_clipping import ghost_layers
from fedpriv.algorithms.deep.models import ModelSpec
from fedpriv.algorithms.deep.params import FEDREP_DEFAULTS, DeepConfig
from fedpriv.algorithms.deep.problem import DeepProblem, UserBlock


class DeepPrivateFedRep(DeepAlgorithm):
    """A round trains and releases the body, through heads fitted on the user's own rows; the
    final step fits each user's head from zero with the released body."""

    name = "deep-private-fedrep"
    summary = "Private FedRep with a torch body and personal linear heads (real data)"
    released_part = "body"

    @classmethod
    def released_size(cls, spec: ModelSpec) -> int:
        return spec.body_size

    @classmethod
    def ghost_eligible(cls, spec: ModelSpec) -> bool:
        return bool(ghost_layers(spec, body_only=True))

    @classmethod
    def heads_per_user(cls, config: DeepConfig) -> int:
        return max(1, config.cross_fit)  # k heads a user with cross-fit = k

    @classmethod
    def local_problem(cls, config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                      block: UserBlock, first: np.ndarray, second: np.ndarray,
                      mask: np.ndarray) -> LocalProblem:
        """Each user's head fitted on the first batch (body frozen), the body trained on the
        second through it; with cross-fit = k, k heads on the folds of both batches
        (``batches.cross_fitted``)."""
        spec = problem.spec
        weights = torch.from_numpy(mask).to(model.device)
        body = model[:spec.body_size]
        if config.cross_fit:
            return cross_fitted(spec, body, block, first, second, mask, config)
        x1, y1 = take_rows(block.x, first), take_rows(block.y, first)
        n, b = y1.shape
        feats = dm.features(spec, body, x1.reshape(n * b, *spec.input_shape))
        heads = dm.fit_heads(feats.reshape(n, b, -1), y1, weights, spec.num_classes,
                             config.head_steps, config.head_lr, bias=spec.head_bias)
        return LocalProblem(body, heads, take_rows(block.x, second), take_rows(block.y, second),
                            weights)


class DeepFedRep(DeepPrivateFedRep):
    name = "deep-fedrep"
    summary = "FedRep with a torch body, without noise (baseline; clipping optional)"
    private = False
    defaults = FEDREP_DEFAULTS
