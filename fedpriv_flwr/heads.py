"""Fitting a node's personal head the way fedpriv's deep FedRep fits each user's head, for the
``personal`` phase of a torch ClientApp (``Phase.fit_head``)::

    for phase in personal_phases(model, context):
        with phase:
            if phase.name == "personal":
                phase.fit_head(trainloader)  # the node's head, its body frozen
            else:
                train(model, trainloader, ...)

The same handler serves both schedules of the ``personalize`` mod (``finetune``: the head is
fitted before evaluating; ``fedrep``: also before each round's body training), so switching
schedules is the mod's one argument (and the server's ``personal_layers``).

The rule is fedpriv's (``fedpriv.algorithms.deep.deep_math.fit_heads``): the personal layers
are one ``torch.nn.Linear`` (weight, and bias if it has one); its inputs ``f`` over all the
node's rows are computed once with the body frozen (the model in eval mode); then ``steps``
full-batch gradient steps on the mean cross-entropy, from the current head, each of size
``lr / L`` where ``L = mean ||f||^2 / 2 + 1/2`` bounds the smoothness of that loss in the head,
so ``lr <= 1`` never diverges whatever the scale of the features.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fedpriv.algorithms.deep.head_fit import fit_heads

__all__ = ["fit_head", "flat_head", "head_inputs", "head_module", "set_head"]


def head_module(model: torch.nn.Module, names: Iterable[str]) -> torch.nn.Linear:
    """The ``torch.nn.Linear`` whose parameters are exactly ``names``."""
    wanted = set(names)
    for prefix, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        own = {f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters()}
        if own == wanted:
            return module
    raise ValueError(f"fit_head fits a linear head: the personal layers {sorted(wanted)[:4]} "
                     "must be the weight (and bias) of one torch.nn.Linear; fit other "
                     "personal layers with your own training loop")


def _rows(data: object) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, torch.Tensor)
                                                          for t in data):
        return [(data[0], data[1])]
    if isinstance(data, Iterable):
        return data  # a DataLoader of (inputs, labels) batches
    raise TypeError(f"fit_head: expected a DataLoader of (inputs, labels) or an (inputs, "
                    f"labels) pair of tensors, got {type(data).__name__}")


def fit_head(model: torch.nn.Module, trains: Iterable[str], data: object, steps: int = 100,
             lr: float = 1.0) -> float:
    """Fit the personal head of ``model`` (the ``torch.nn.Linear`` whose parameters are
    ``trains``, a phase's) on ``data`` (module docstring): a DataLoader of ``(inputs, labels)``
    batches (all of them are used), or an ``(inputs, labels)`` pair. Returns the mean
    cross-entropy of the fitted head over the rows."""
    if steps < 0 or not lr > 0:
        raise ValueError(f"fit_head: steps >= 0 and lr > 0, got steps={steps}, lr={lr}")
    head = head_module(model, trains)
    feats, y, _ = head_inputs(model, head, data, with_raw=False)
    mask = torch.ones(y.shape, dtype=feats.dtype, device=feats.device)
    bias = head.bias is not None
    flat = fit_heads(feats, y, mask, head.out_features, steps, lr, init=flat_head(head),
                     bias=bias)[0]
    set_head(head, flat)
    with torch.no_grad():
        logits = feats[0] @ head.weight.T + (head.bias if head.bias is not None else 0.0)
        return float(torch.nn.functional.cross_entropy(logits, y[0]))


def head_inputs(model: torch.nn.Module, head: torch.nn.Linear, data: object,
                with_raw: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inputs of ``head`` (1, rows, h), the labels (1, rows) and, ``with_raw``, the raw
    inputs flattened (1, rows, d) over all of ``data``, the model in eval mode and without
    gradients."""
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda mod, args, out: captured.append(
        args[0].detach().reshape(len(args[0]), -1)))
    labels: list[torch.Tensor] = []
    raw: list[torch.Tensor] = []
    training = model.training
    device = head.weight.device
    model.eval()
    try:
        with torch.no_grad():
            for x, y in _rows(data):
                model(x.to(device))
                labels.append(y.to(device).long().reshape(-1))
                if with_raw:
                    raw.append(x.to(device).reshape(len(x), -1))
    finally:
        hook.remove()
        model.train(training)
    if not captured:
        raise ValueError("fit_head: no rows to fit the head on")
    dtype = head.weight.dtype
    if with_raw and len({r.shape[1] for r in raw}) > 1:
        raise ValueError("keep_best: the local model reads the raw inputs, flattened; the "
                         "batches have inputs of different sizes "
                         f"{sorted({r.shape[1] for r in raw})[:4]}")
    flat = torch.cat(raw).to(dtype)[None] if with_raw else None
    return torch.cat(captured).to(dtype)[None], torch.cat(labels)[None], flat


def flat_head(head: torch.nn.Linear) -> torch.Tensor:
    """The head as fit_heads lays it out: (1, C*h [+ C])."""
    start = head.weight.detach().reshape(1, -1)
    if head.bias is not None:
        start = torch.cat([start, head.bias.detach().reshape(1, -1)], 1)
    return start


def set_head(head: torch.nn.Linear, flat: torch.Tensor) -> None:
    c, h = head.out_features, head.in_features
    with torch.no_grad():
        head.weight.copy_(flat[:c * h].reshape(c, h))
        if head.bias is not None:
            head.bias.copy_(flat[c * h:])
