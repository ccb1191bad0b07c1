"""The users' linear heads fitted by full-batch gradient descent on their features, batched
over users: the rule of fedpriv's deep algorithms (re-exported by ``deep_math``), in plain torch
so that ``fedpriv_flwr`` fits a Flower node's head the same way (``fedpriv_flwr.heads``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["cross_validated_heads", "fit_head_sets", "fit_heads", "head_logits",
           "head_step_sizes", "mix_weights", "pooled"]


def head_step_sizes(feats: torch.Tensor, mask: torch.Tensor, lr: float) -> torch.Tensor:
    """Each user's head step size: ``lr`` times ``1/L``, where ``L = mean ||f||^2 / 2 + 1/2``
    bounds the smoothness of its mean cross-entropy in the head (weights and bias) over its
    valid rows; so ``lr <= 1`` never diverges, whatever the scale of the features. (n,); with
    row sets ``mask`` (n, F, r), one a set (n, F), the rows' norms computed once."""
    rows = feats.pow(2).sum(-1)  # (n, r)
    if mask.dim() == 3:
        rows = rows[:, None, :]
    sq = (rows * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    return lr / (0.5 * sq + 0.5)


def fit_heads(feats: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int,
              steps: int, lr: float, init: torch.Tensor | None = None,
              bias: bool = True, accelerated: bool = False) -> torch.Tensor:
    """Each user's linear head by ``steps`` of gradient descent (step ``head_step_sizes``) on
    its mean cross-entropy over its valid rows: feats (n, r, h), y (n, r), mask (n, r); from
    ``init`` (n, H) or zeros. Returns the flat heads (n, C*h [+ C]) in the model's layout
    (weight, then bias).

    Every step adds ``-rate * g^T f`` to the weights: a combination of the user's own rows.
    So where a user has fewer rows than features (r < h: a batch of 5-30 rows against 128
    features, or 784 raw pixels) the descent runs on the coefficients ``A`` (C x r) of
    ``W = W0 + A f`` with the r x r Gram ``f f^T``: the same iterates, r/h of the work.

    ``accelerated``: Nesterov's momentum (``t / (t + 3)`` at step t), same step size; the
    users' local models on raw pixels use it (the pixels' Gram is ill-conditioned: 100
    accelerated steps reach what 1,000 plain ones do; docs: measurements)."""
    n, r, h = feats.shape
    rate = head_step_sizes(feats, mask, lr)
    c = num_classes
    if init is None:
        w0 = feats.new_zeros(n, c, h)
        b = feats.new_zeros(n, c)
    else:
        w0 = init[:, :c * h].reshape(n, c, h).clone()
        b = init[:, c * h:].clone() if bias else feats.new_zeros(n, c)
    onehot = F.one_hot(y, c).to(feats.dtype)
    weight = mask / mask.sum(1, keepdim=True).clamp_min(1.0)
    if r < h:
        gram = feats @ feats.transpose(1, 2)  # (n, r, r)
        start = feats @ w0.transpose(1, 2) if init is not None else 0.0  # (n, r, c)
        coef = feats.new_zeros(n, r, c)  # A^T
        last = (coef, b)
        for t in range(steps):
            at, bt = _look_ahead((coef, b), last, t, accelerated)
            logits = start + gram @ at + bt[:, None, :]
            g = (torch.softmax(logits, -1) - onehot) * weight[..., None]
            last = (coef, b)
            coef = at - rate[:, None, None] * g
            b = bt - rate[:, None] * g.sum(1) if bias else b
        w = w0 + coef.transpose(1, 2) @ feats
    else:
        w = w0
        last = (w, b)
        for t in range(steps):
            wt, bt = _look_ahead((w, b), last, t, accelerated)
            logits = torch.einsum("nrh,nch->nrc", feats, wt) + bt[:, None, :]
            g = (torch.softmax(logits, -1) - onehot) * weight[..., None]
            last = (w, b)
            w = wt - rate[:, None, None] * torch.einsum("nrc,nrh->nch", g, feats)
            b = bt - rate[:, None] * g.sum(1) if bias else b
    return torch.cat([w.reshape(n, -1), b], 1) if bias else w.reshape(n, -1)


def fit_head_sets(feats: torch.Tensor, y: torch.Tensor, sets: torch.Tensor, num_classes: int,
                  steps: int, lr: float, init: torch.Tensor | None = None, bias: bool = True,
                  accelerated: bool = False) -> torch.Tensor:
    """``fit_heads`` on F row sets a user at once: sets (n, F, r) masks (cross-validation's
    folds and the full fit); returns (n, F, H), head j the one ``fit_heads`` fits on the user's
    mask ``sets[:, j]`` (to float rounding). One pass reads each user's features (or Gram) once
    a step for all F, and the iterates are laid out class first (n, C, F, r): the softmax over
    10 classes then runs along long rows (about 10 times faster than over a last axis of 10)."""
    n, r, h = feats.shape
    f, c = sets.shape[1], num_classes
    rate = head_step_sizes(feats, sets, lr)  # (n, F)
    step = rate[:, None, :, None]  # (n, 1, F, 1)
    if init is None:
        w0 = feats.new_zeros(n, c, h)
        b = feats.new_zeros(n, c, f, 1)
    else:
        w0 = init[:, :c * h].reshape(n, c, h)
        b0 = init[:, c * h:] if bias else feats.new_zeros(n, c)
        b = b0[:, :, None, None].expand(n, c, f, 1).contiguous()
    onehot = F.one_hot(y, c).to(feats.dtype).transpose(1, 2)[:, :, None, :]  # (n, C, 1, r)
    weight = (sets / sets.sum(2, keepdim=True).clamp_min(1.0))[:, None]  # (n, 1, F, r)

    def descend(logits_of: Callable[[torch.Tensor], torch.Tensor], grad_of: Callable[
            [torch.Tensor], torch.Tensor], x: torch.Tensor, b: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        last = (x, b)
        for t in range(steps):
            xt, bt = _look_ahead((x, b), last, t, accelerated)
            g = (torch.softmax(logits_of(xt) + bt, 1) - onehot) * weight  # (n, C, F, r)
            last = (x, b)
            x = xt - step * grad_of(g)
            b = bt - step * g.sum(3, keepdim=True) if bias else b
        return x, b

    if r < h:  # the coefficients A (C x r) of W = W0 + A f, per set: (n, C, F, r)
        gram = feats @ feats.transpose(1, 2)  # (n, r, r), symmetric
        start = (w0 @ feats.transpose(1, 2))[:, :, None, :] if init is not None else 0.0
        coef, b = descend(lambda a: start + (a.reshape(n, c * f, r) @ gram).reshape(n, c, f, r),
                          lambda g: g, feats.new_zeros(n, c, f, r), b)
        w = w0[:, :, None] + (coef.reshape(n, c * f, r) @ feats).reshape(n, c, f, h)
    else:  # the weights themselves, per set: (n, C, F, h)
        w, b = descend(lambda w: (w.reshape(n, c * f, h) @ feats.transpose(1, 2)).reshape(
            n, c, f, r), lambda g: (g.reshape(n, c * f, r) @ feats).reshape(n, c, f, h),
            w0[:, :, None].expand(n, c, f, h).contiguous(), b)
    heads = w.transpose(1, 2).reshape(n, f, c * h)
    return torch.cat([heads, b[..., 0].transpose(1, 2)], 2) if bias else heads


def _look_ahead(now: tuple[torch.Tensor, torch.Tensor], last: tuple[torch.Tensor, torch.Tensor],
                step: int, accelerated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Where step ``step`` takes its gradient: the iterate itself, or Nesterov's look-ahead
    ``x + t/(t+3) (x - x_prev)``."""
    if not accelerated or step == 0:
        return now
    m = step / (step + 3)
    return now[0] + m * (now[0] - last[0]), now[1] + m * (now[1] - last[1])


def pooled(weight: torch.Tensor | float, shared: torch.Tensor, local: torch.Tensor
           ) -> torch.Tensor:
    """The log-linear pool of two models' class probabilities (..., C) with the shared model's
    weight (a number, or one a user broadcast over its rows): ``softmax(w log p_shared + (1 - w)
    log p_local)``, i.e. the interpolation of the two models' logits; each model itself at
    ``w`` = 1 or 0, so the other model's values (non-finite ones included) do not enter."""
    w = torch.as_tensor(weight, dtype=shared.dtype, device=shared.device)
    if w.dim() not in (0, shared.dim() - 2):
        raise ValueError(f"pooled: one weight, or one a user of (users, rows, classes); got "
                         f"weights {tuple(w.shape)} for {tuple(shared.shape)}")
    w = w.reshape(*w.shape, *[1] * (shared.dim() - w.dim()))
    tiny = torch.finfo(shared.dtype).tiny
    inner = (w > 0) & (w < 1)
    mix = torch.softmax(torch.where(inner, w * shared.clamp_min(tiny).log()
                                    + (1 - w) * local.clamp_min(tiny).log(), 0.0), -1)
    return torch.where(w == 1, shared, torch.where(w == 0, local, mix))


def mix_weights(shared: torch.Tensor, local: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                weights: tuple[float, ...], std_errors: float = 0.0) -> torch.Tensor:
    """Each user's weight of the shared model (``weights`` from the shared model's side, largest
    first): the entry whose ``pooled`` mix of the cross-validated class probabilities (n, r, C)
    has the least cross-entropy summed over its valid rows (the first among ties; the first for
    a user without rows), or with ``std_errors`` = z > 0 the first (larger) weight whose
    per-row cross-entropy exceeds that best one's by at most z standard errors of the mean
    paired difference over the user's valid rows (the one-standard-error rule of
    cross-validation, per user: leave the model with more data behind it only where the
    user's own rows say so beyond their noise; a user with one row keeps the first). (n,)

    Cross-entropy, not the count of rows right: on 10 rows a count ties or flips on one row,
    while the probabilities say how sure each model was (on seed 100 of Fashion-MNIST at
    10 rows a user, the count kept 0.672 and the cross-entropy 0.685). The log-linear pool, not
    the mix of probabilities: cross-entropy favours a mix of probabilities for its hedging (at
    2 classes a user it kept mixes for 48% of the users, below their own linear models; docs:
    results)."""
    if not 0 <= std_errors < float("inf"):
        raise ValueError(f"mix_weights: std_errors is a finite number >= 0, got {std_errors}")

    def loss(w: float) -> torch.Tensor:  # per row (n, r), 0 on masked rows
        p = pooled(w, shared, local).gather(-1, y[..., None])[..., 0]
        return -torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) * mask

    rows = torch.stack([loss(w) for w in weights], 1)  # (n, weights, r)
    totals = torch.nan_to_num(rows.sum(2), nan=float("inf"))  # a nan option is never chosen
    best = totals.argmin(1)  # argmin: the first of equal losses
    table = torch.tensor(weights, dtype=shared.dtype, device=shared.device)
    if std_errors == 0:
        return table[best]
    valid = (mask > 0)[:, None, :]  # the rows (mask 0 or 1)
    count = valid.sum(2).to(rows.dtype)  # (n, 1)
    diff = torch.where(valid, rows - rows.gather(1, best[:, None, None].expand_as(rows[:, :1])),
                       0.0)  # paired per-row differences to the best weight (n, weights, r)
    mean = diff.sum(2) / count.clamp_min(1)
    var = torch.where(valid, (diff - mean[..., None]) ** 2, 0.0).sum(2) / (count - 1).clamp_min(1)
    stderr = torch.where(count > 1, (var / count.clamp_min(1)).sqrt(), float("inf"))
    near = (mean <= std_errors * stderr) & totals.isfinite()
    near |= torch.arange(len(weights), device=shared.device) == best[:, None]  # the best itself
    return table[near.to(torch.int8).argmax(1)]  # argmax: the first such weight (the largest)


def head_logits(feats: torch.Tensor, heads: torch.Tensor, num_classes: int,
                bias: bool = True) -> torch.Tensor:
    """Logits of per-user heads (n, H) on per-user features (n, r, h). Heads (n, k, H): k
    heads a user, head j on the j-th of k equal groups of its rows (cross-fitting)."""
    if heads.dim() == 3:
        n, k, size = heads.shape
        r, h = feats.shape[1:]
        return head_logits(feats.reshape(n * k, r // k, h), heads.reshape(n * k, size),
                           num_classes, bias).reshape(n, r, -1)
    n, _, h = feats.shape
    w = heads[:, :num_classes * h].reshape(n, num_classes, h)
    logits = torch.einsum("nrh,nch->nrc", feats, w)
    return logits + heads[:, num_classes * h:][:, None, :] if bias else logits


def cross_validated_heads(inputs: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                          num_classes: int, steps: int, lr: float, folds: int,
                          init: torch.Tensor | None, bias: bool, accelerated: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """k-fold cross-validation of each user's linear head on ``inputs`` (n, r, h): row place j
    is in fold j mod k and is scored by a head fitted on the other folds (class probabilities,
    (n, r, C)); and the heads fitted on all valid rows (n, H)."""
    fold = torch.arange(inputs.shape[1], device=inputs.device) % folds
    used = min(folds, inputs.shape[1])
    # every fold's fit and the fit on all rows, at once: (n, k + 1, r) row sets
    sets = torch.stack([mask * (fold != j) for j in range(used)] + [mask], 1)
    heads = fit_head_sets(inputs, y, sets, num_classes, steps, lr, init, bias, accelerated)
    held = torch.zeros(*y.shape, num_classes, dtype=inputs.dtype, device=inputs.device)
    for j in range(used):
        probs = torch.softmax(head_logits(inputs, heads[:, j], num_classes, bias), -1)
        held = torch.where((fold == j)[None, :, None], probs, held)
    return held, heads[:, used]
