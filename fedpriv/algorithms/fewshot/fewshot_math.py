"""The few-shot family's math, over a chunk of tasks (a leading task axis): a task's adaptation
of the meta-learned embedding to its support set, its adapted query loss, the clipped sum of
the tasks' meta-gradients, and the scores of fresh tasks (adapted, and trained alone).

A task's rows are stacked support first (``N K`` rows, label ``j`` at rows ``j K .. j K + K -
1``), then its queries (``N Q``); ``x`` is (n, N (K + Q), *input). The meta-model is the body
of a deep-family network (``fedpriv.algorithms.deep.models``): its last linear layer is not
used; the embedding is the body's output (the head's input).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.ghost_clipping import ghost_gradient_sum
from fedpriv.algorithms.deep.models import ModelSpec


def adapted_logits(fs: torch.Tensor, ys: torch.Tensor, fq: torch.Tensor, ways: int,
                   steps: int, lr: float, first_order: bool) -> torch.Tensor:
    """Query logits (..., NQ, N) of tasks adapted to their support embeddings ``fs`` (..., NK,
    h) with labels ``ys`` (..., NK): the classes' mean support embeddings (prototypes) score
    a query by minus its squared distance to each (Snell et al. 2017; up to a constant per
    query, which neither the softmax nor the argmax sees); with ``steps`` > 0, the
    same classifier written as a linear head (``W = 2 c``, ``b = -||c||^2``) then takes
    ``steps`` gradient steps of the support's mean cross-entropy (ProtoMAML, Triantafillou et
    al. 2020), in closed form (no second backward pass). ``first_order`` (steps > 0): the
    first-order approximation of MAML, the steps' change of the head held fixed (their
    Jacobian taken as the identity: the gradient reaches the body through the prototypes the
    head starts from and the query embeddings, not through the steps); with ``steps = 0``
    there is nothing to approximate."""
    onehot = (ys[..., None] == torch.arange(ways, device=ys.device)).to(fs.dtype)
    counts = onehot.sum(-2)[..., None]
    proto = torch.einsum("...sw,...sh->...wh", onehot, fs) / counts
    # -||q - c||^2 = 2 q.c - ||c||^2 - ||q||^2: the last term is the same for every class of a
    # query, which neither the softmax nor the argmax sees, so it is left out (no (queries x
    # classes x width) difference tensor is formed)
    w0, b0 = 2.0 * proto, -(proto ** 2).sum(-1)
    if steps == 0:
        return torch.einsum("...qh,...wh->...qw", fq, w0) + b0[..., None, :]
    if first_order:
        with torch.no_grad():
            w, b = _head_steps(fs.detach(), onehot, w0.detach(), b0.detach(), steps, lr)
        w, b = w0 + (w - w0.detach()), b0 + (b - b0.detach())
    else:
        w, b = _head_steps(fs, onehot, w0, b0, steps, lr)
    return torch.einsum("...qh,...wh->...qw", fq, w) + b[..., None, :]


def _head_steps(fs: torch.Tensor, onehot: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                steps: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` gradient steps of a linear head's mean support cross-entropy."""
    for _ in range(steps):
        probs = torch.softmax(torch.einsum("...sh,...wh->...sw", fs, w) + b[..., None, :], -1)
        err = (probs - onehot) / fs.shape[-2]
        w = w - lr * torch.einsum("...sw,...sh->...wh", err, fs)
        b = b - lr * err.sum(-2)
    return w, b


def task_losses(spec: ModelSpec, body: torch.Tensor, x: torch.Tensor, ys: torch.Tensor,
                yq: torch.Tensor, ways: int, steps: int, lr: float,
                first_order: bool) -> torch.Tensor:
    """Each task's mean query cross-entropy after adapting to its support (n,): one pass of
    the body over every row of the chunk (each row embedded alone)."""
    n, support = ys.shape
    feats = dm.features(spec, body, x.reshape(-1, *spec.input_shape)).reshape(n, x.shape[1], -1)
    # split, not two slices: its backward joins the two gradients in one copy (two slices'
    # backward would fill two zero tensors of the chunk's size and add them)
    fs, fq = torch.split(feats, [support, x.shape[1] - support], 1)
    logits = adapted_logits(fs, ys, fq, ways, steps, lr, first_order)
    return F.cross_entropy(logits.transpose(1, 2), yq, reduction="none").mean(1)


def clipped_meta_gradients(spec: ModelSpec, body: torch.Tensor, x: torch.Tensor,
                           ys: torch.Tensor, yq: torch.Tensor, ways: int, steps: int,
                           lr: float, first_order: bool, clip: float) -> tuple[np.ndarray, int]:
    """The sum over the chunk's tasks of each task's meta-gradient (the gradient of its
    adapted query loss with respect to the body) scaled to L2 norm at most ``clip`` (float64),
    and how many were scaled down. A task whose gradient is not finite adds exactly nothing.
    Ghost clipping where the body allows it (``ghost_gradient_sum``: no per-task gradient
    formed), else per-task gradients (``torch.func``) and ``deep_math.clipped_sum``."""
    n, r = x.shape[:2]

    def total(leaf: torch.Tensor) -> torch.Tensor:
        return task_losses(spec, leaf, x, ys, yq, ways, steps, lr, first_order).sum()

    ghost = ghost_gradient_sum(spec, body, total, n, r, True, 1.0, clip)
    if ghost is not None:  # the sum of -f_i grad_i: the step's direction
        return -ghost[0], ghost[1]

    def one(leaf: torch.Tensor, xi: torch.Tensor, ysi: torch.Tensor,
            yqi: torch.Tensor) -> torch.Tensor:
        return task_losses(spec, leaf, xi[None], ysi[None], yqi[None], ways, steps, lr,
                           first_order)[0]

    with torch.enable_grad():
        grads = vmap(grad(one), in_dims=(None, 0, 0, 0))(body, x, ys, yq)
    return dm.clipped_sum(grads, clip)


def query_accuracy(spec: ModelSpec, body: torch.Tensor, x: torch.Tensor, ys: torch.Tensor,
                   yq: torch.Tensor, ways: int, steps: int, lr: float) -> torch.Tensor:
    """Each task's query accuracy after adapting the body's embedding to its support (n,)."""
    n, support = ys.shape
    with torch.no_grad():
        feats = dm.features(spec, body, x.reshape(-1, *spec.input_shape)).reshape(
            n, x.shape[1], -1)
        logits = adapted_logits(feats[:, :support], ys, feats[:, support:], ways, steps, lr,
                                True)
    return (logits.argmax(-1) == yq).to(torch.float64).mean(1)


def support_losses(spec: ModelSpec, body: torch.Tensor, x: torch.Tensor, ys: torch.Tensor,
                   ways: int) -> torch.Tensor:
    """Each task's mean support cross-entropy under its own prototypes (n,): how well a
    meta-model's embedding separates the task's support (the clustering's choice of model,
    made on the support alone). A non-finite loss is +inf (never chosen over a finite one)."""
    n, support = ys.shape
    with torch.no_grad():
        feats = dm.features(spec, body, x[:, :support].reshape(-1, *spec.input_shape))
        fs = feats.reshape(n, support, -1)
        logits = adapted_logits(fs, ys, fs, ways, 0, 0.0, True)
        loss = F.cross_entropy(logits.transpose(1, 2), ys, reduction="none").mean(1)
    return torch.where(torch.isfinite(loss), loss, torch.full_like(loss, float("inf")))


def scratch_accuracy(x: torch.Tensor, ys: torch.Tensor, yq: torch.Tensor, ways: int,
                     steps: int = 300) -> torch.Tensor:
    """Each task trained alone (n,): a linear softmax model (with a bias) on its support's raw
    pixels, ``steps`` of gradient descent from zero with step ``1 / L`` (L: a bound on the
    loss's smoothness from the task's own rows), scored on its queries. Run in the span of the
    support rows (the iterates never leave it: ``w = A X_s``), so each step costs the
    (N K)-square Gram, not the pixels."""
    n, support = ys.shape
    flat = x.reshape(n, x.shape[1], -1).to(torch.float64)
    f = torch.cat([flat, torch.ones(n, x.shape[1], 1, dtype=flat.dtype, device=x.device)], -1)
    fs, fq = f[:, :support], f[:, support:]
    gram = torch.einsum("bsh,bth->bst", fs, fs)
    cross = torch.einsum("bqh,bsh->bqs", fq, fs)
    step = 1.0 / (support * gram.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(1e-12) / 2)
    coef = torch.zeros(n, ways, support, dtype=flat.dtype, device=x.device)
    target = F.one_hot(ys, ways).to(flat.dtype)
    with torch.no_grad():
        for _ in range(steps):
            probs = torch.softmax(torch.einsum("bst,bwt->bsw", gram, coef), -1)
            coef = coef - (probs - target).transpose(1, 2) * step[:, None, None]
        logits = torch.einsum("bqs,bws->bqw", cross, coef)
    return (logits.argmax(-1) == yq).to(torch.float64).mean(1)
