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

from fedpriv.algorithms.deep.deep_algorithm import DeepAlgorithm


class DeepPrivateFedRep(DeepAlgorithm):
    name = "deep-private-fedrep"
    summary = "Private FedRep with a torch body and personal linear heads (real data)"
    trains = "body"
    final_fit = "head"


class DeepFedRep(DeepPrivateFedRep):
    name = "deep-fedrep"
    summary = "FedRep with a torch body, without noise (baseline; clipping optional)"
    private = False
    defaults = {"rounds": 40, "learning-rate": 2.0}
