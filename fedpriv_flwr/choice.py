"""Each node keeps the better of training alone and the shared personal model, chosen on its own
training rows: the Flower counterpart of fedpriv's ``final-choice = "best"``
(``fedpriv.algorithms.deep.choice``; docs/algorithms/deep.md), for the evaluate handler::

    model = keep_best(model, context, trainloader)  # instead of fit_personal(...)
    loss, acc = test(model, testloader)

The node has two models: the **shared** personal model (its head fitted on the current body as
``fit_personal`` fits it: from the global head under ``finetune``, from the node's own head
under ``fedrep``; that head was fitted on all the node's rows in earlier rounds, held-back folds
included, so under ``fedrep`` the cross-validation flatters the shared model a little, the
direction ties go too) and its **local** model (a linear softmax model on its raw inputs, fitted
on its rows alone by accelerated descent). It keeps the log-linear pool ``softmax(w log p_shared
+ (1 - w) log p_local)`` of their class probabilities (the interpolation of their logits) for
the largest weight ``w`` in ``MIX_WEIGHTS`` (1: the shared model; 0: the local model) whose
cross-entropy by k-fold cross-validation on its training rows (row j in fold j mod k; both
models refitted on the other folds) is within ``std_errors`` standard errors of the least one
(``head_fit.mix_weights``: fedpriv's ``choice-std-errors``, 0.5 by default; 0 keeps the least
loss, ties to the larger weight); then both are fitted on all its rows. Test rows are never
read, and nothing leaves the node: a post-processing of the release, at no privacy cost. The
returned module gives log-probabilities (its argmax is the kept prediction and
``CrossEntropyLoss`` on it is the mix's cross-entropy); ``.weight`` is the chosen ``w``.
"""

from __future__ import annotations

import torch
from flwr.app import Context

from fedpriv.algorithms.deep.head_fit import cross_validated_heads, mix_weights
from fedpriv_flwr.heads import flat_head, head_inputs, head_module, set_head
from fedpriv_flwr.personal import personal_phases

__all__ = ["MIX_WEIGHTS", "Kept", "keep_best"]

MIX_WEIGHTS = (1.0, 0.75, 0.5, 0.25, 0.0)  # as fedpriv.algorithms.shared_params (tested)


class Kept(torch.nn.Module):
    """The kept predictor: the log-probabilities of ``head_fit.pooled`` (the shared model's own
    at ``w = 1``, the local model's at ``w = 0``)."""

    def __init__(self, model: torch.nn.Module, local: torch.Tensor, classes: int,
                 weight: float) -> None:
        super().__init__()
        self.model, self.weight, self.classes = model, float(weight), classes
        self.register_buffer("local", local.detach().clone())  # the local model, flat

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        local = self.get_buffer("local")
        flat = x.reshape(len(x), -1).to(local.dtype)
        d = flat.shape[1]
        w, b = local[:self.classes * d].reshape(self.classes, d), local[self.classes * d:]
        return flat @ w.T + b

    def local_probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.local_logits(x), -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight == 1.0:
            return torch.log_softmax(self.model(x), -1)
        if self.weight == 0.0:
            return torch.log_softmax(self.local_logits(x), -1)
        # head_fit.pooled, in log space (no probability underflows at large logit gaps)
        shared = torch.log_softmax(self.model(x), -1)
        local = torch.log_softmax(self.local_logits(x), -1)
        return torch.log_softmax(self.weight * shared + (1 - self.weight) * local, -1)


def keep_best(model: torch.nn.Module, context: Context, data: object, steps: int = 100,
              lr: float = 1.0, folds: int = 5, std_errors: float = 0.5) -> Kept:
    """The node's kept predictor (module docstring); ``model``'s head is left fitted on all
    the node's rows (the shared personal model). ``data``: a DataLoader of ``(inputs, labels)``
    or one pair, the node's training rows; ``steps``/``lr`` as ``fit_personal``'s."""
    if folds < 2:
        raise ValueError(f"keep_best: folds >= 2, got {folds}")
    if not 0 <= std_errors < float("inf"):
        raise ValueError(f"keep_best: std_errors is a finite number >= 0, "
                         f"got {std_errors}")
    phases = personal_phases(model, context)
    if phases[0].name != "personal" or len(phases) != 1:
        raise ValueError("keep_best: call it in the evaluate handler (the train handler's "
                         "line is fit_personal)")
    head = head_module(model, phases[0].trains)
    feats, y, raw = head_inputs(model, head, data)
    assert raw is not None
    classes, bias = head.out_features, head.bias is not None
    start = flat_head(head)  # as fit_personal: the node's stored head, or the global one
    rows = torch.ones(y.shape, dtype=feats.dtype, device=feats.device)
    shared_held, shared_full = cross_validated_heads(feats, y, rows, classes, steps, lr, folds,
                                                     start, bias)
    local_held, local_full = cross_validated_heads(raw, y, rows, classes, steps, lr, folds,
                                                   None, True, accelerated=True)
    weight = mix_weights(shared_held, local_held, y, rows, MIX_WEIGHTS, std_errors)
    set_head(head, shared_full[0])
    return Kept(model, local_full[0], classes, float(weight[0]))
