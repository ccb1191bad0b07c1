"""Per-user clipped sums of one-step updates without per-user gradients ("ghost clipping").

For one local step the update of user i is ``-lr * grad L_i`` at the shared starting point, and
for an ``nn.Linear`` layer the gradient is a sum over the user's rows,
``G_i = sum_r g_r a_r^T`` (``a_r`` the layer's input, ``g_r`` the gradient at its output for row
r). Its squared Frobenius norm needs only the users' small row Gram matrices
(Goodfellow 2015; Li et al. 2022, "ghost clipping"):

    ||G_i||^2 = sum_{r, r'} (g_r . g_r') (a_r . a_r'),    ||bias_i||^2 = sum_{r, r'} g_r . g_r'

and the clipped sum ``sum_i f_i G_i`` is one product ``(f * g)^T a`` over all rows, where
``f_i = min(1, clip / ||update_i||)``. So a node computes its whole chunk with one forward and
one backward pass as if it were a single large batch, plus ``r x r`` Grams per user and layer;
the (users x parameters) array of per-user gradients is never formed. ``local_updates`` +
``deep_math.clipped_sum`` compute the same numbers (a test checks) and remain the path for
several local steps (the users' parameters then differ) and for layers other than
``nn.Linear`` and plain ``nn.Conv2d`` (``ghost_clipped_sum`` returns None, the caller falls
back).

Convolutions ("mixed ghost clipping", Li et al. 2022; Bu et al. 2023): a conv layer's Gram
would run over every output position of every row, ``(r L)^2`` entries a user, while its
weights are few (the built-in cnn: 160 and 4,640). So its per-user gradient is formed
directly (``G_i = sum_{r, l} g_{r,l} p_{r,l}^T`` over the input patches ``p``, computed as
the weight gradient of one grouped convolution with the users as groups), and clipped and
summed like ``deep_math.clipped_sum`` rows: float32 gradients, their norms and the sum in
float64. The dense layers after it keep the Gram path, so no user's (users x 200k) dense
gradient is formed.

Privacy-relevant: a user whose norm is not finite (its rows overflowed the model or held nan)
gets factor 0 and its rows are zeroed before the products, so it adds exactly nothing. The
norms are computed in float64 from the float32 activations and output
gradients, plus a rounding slack so that cancellation in the Gram sum can never make a norm
come out smaller than it is (a user is never under-clipped). The slack is a worst case that
assumes nothing about cancellation: every Gram entry and every product of two is within
``(d_a + d_g + r^2) u`` of exact relative to ``|g_r| |g_r'| |a_r| |a_r'|`` (Cauchy-Schwarz
bounds ``|g_r . g_r'|`` by the norms), so the squared norm's error is at most that times
``rho^2``, ``rho = sum_r |g_r| |a_r|`` (u = 2^-53; the code adds eight times that, a margin
for the rounding of rho itself and of the sums over layers). A conv layer's squared norm is a
float64 sum of P exact squares of its float32 gradient (the vector that is summed), within
``P u`` of exact relative to itself: its slack is ``P`` times it.
The clipped sum is accumulated in float64, as ``deep_math.clipped_sum`` does: a float32
accumulation over a chunk's thousands of rows could move one user's share by far more than
float64's 2^-53 relative, and that error would depend on the other users' rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.grad import conv2d_weight as _conv2d_weight

from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.models import ModelSpec
from fedpriv.privacy.mechanisms import factors_from_norms

# torch.nn.grad is not annotated: the one function used here, with the type it returns
conv2d_weight: Callable[..., torch.Tensor] = _conv2d_weight


def _plain_conv(module: nn.Module) -> bool:
    """A 2-d convolution whose per-user gradient ``conv_user_gradients`` forms: one group,
    zero padding given as numbers (not ``"same"``)."""
    return (isinstance(module, nn.Conv2d) and module.groups == 1
            and module.padding_mode == "zeros" and not isinstance(module.padding, str))


def ghost_layers(spec: ModelSpec, body_only: bool) -> list[str] | None:
    """The modules owning the trained parameters, if every one is an ``nn.Linear`` or a plain
    ``nn.Conv2d`` whose parameters are all trained; else None (no ghost path for this
    model)."""
    names = spec.names[:spec.num_body] if body_only else spec.names
    owners = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in names))
    for owner in owners:
        module = spec.module.get_submodule(owner)
        if not (isinstance(module, nn.Linear) or _plain_conv(module)):
            return None
        if {f"{owner}.{p}" for p, _ in module.named_parameters()} - set(names):
            return None
    return owners


def conv_user_gradients(module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor,
                        n: int) -> torch.Tensor:
    """Each user's gradient of a conv layer's parameters (weight, then bias), (n, P): a (n r,
    C, H, W) the layer's input, g (n r, O, H', W') the gradient at its output, r rows a user.
    The users become the groups of one grouped convolution (rows as its batch, user i's
    channels as group i), whose weight gradient sums each group over the batch: the n
    per-user weight gradients in one call, without unfolding the input into patches."""
    rows, channels = a.shape[:2]
    r, out = rows // n, g.shape[1]
    grouped_in = a.reshape(n, r, *a.shape[1:]).transpose(0, 1).reshape(r, n * channels,
                                                                      *a.shape[2:])
    grouped_out = g.reshape(n, r, *g.shape[1:]).transpose(0, 1).reshape(r, n * out,
                                                                       *g.shape[2:])
    weight = conv2d_weight(
        grouped_in, (n * out, *module.weight.shape[1:]), grouped_out, module.stride,
        module.padding, module.dilation, groups=n)
    parts = [weight.reshape(n, -1)]
    if module.bias is not None:
        parts.append(g.reshape(n, r, out, -1).sum((1, 3)))
    return torch.cat(parts, 1)


BLOCK_BYTES = 2**23  # the float64 copies of one block of users (``_blocks``)


def _blocks(n: int, r: int, width: int) -> list[slice]:
    """Consecutive blocks of the n users (r rows each) whose float64 copies of a layer's input
    and output gradient (``width`` floats a row) take about ``BLOCK_BYTES``, a size that stays
    in cache: the Grams and the clipped sum are computed block by block from the float32
    tensors, so the chunk's float64 copies never go out to memory (a 160-task chunk of 100
    rows, 784 inputs, 2 cores: the weight product with its float64 copy 66 -> 44 ms; 4-16 MB
    blocks measured alike, 32 MB and more slower). Every sum is accumulated in float64 as
    before, block after block."""
    size = max(1, BLOCK_BYTES // (8 * width * r))
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def layer_norm_terms(a64: torch.Tensor, g64: torch.Tensor,
                     bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per user, the squared Frobenius norm of one ``nn.Linear`` layer's gradient
    ``sum_r g_r a_r^T`` (and its bias's ``sum_r g_r``) from the r x r Grams, and the slack
    that bounds its rounding: (sq, slack), each (n,). a64 (n, r, d_a), g64 (n, r, d_g).

    Worst case, with no assumption on cancellation: every ``|g_r . g_r'| <= |g_r| |g_r'|``
    (Cauchy-Schwarz), so the rounding of the Grams' dot products and of the r^2-term sum is at
    most ``(d_a + d_g + r^2) u rho^2``, ``rho = sum_r |g_r| |a_r|`` (``bounded_norms`` adds it
    with a margin)."""
    r = a64.shape[1]
    gram_g = torch.bmm(g64, g64.transpose(1, 2))  # (n, r, r)
    gram_a = torch.bmm(a64, a64.transpose(1, 2))
    sq = (gram_g * gram_a).sum((1, 2))
    # the rows' norms from the Grams' diagonals (within d u of the exact ones: the margin of
    # ``bounded_norms`` covers it), not another pass over the rows
    g_norms = gram_g.diagonal(dim1=1, dim2=2).clamp_min(0.0).sqrt()  # (n, r)
    rho = (g_norms * gram_a.diagonal(dim1=1, dim2=2).clamp_min(0.0).sqrt()).sum(1)
    slack = rho * rho * (a64.shape[2] + g64.shape[2] + r * r)
    if bias:
        sq = sq + gram_g.sum((1, 2))
        slack = slack + g_norms.sum(1) ** 2 * (g64.shape[2] + r * r)
    return sq, slack


def bounded_norms(sq: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """Norms never below the exact ones: ``sqrt(sq + 8 u slack)``, u = 2^-53 (eight times the
    first-order bound, a margin for the rounding of rho and of the sums over layers)."""
    eps = float(np.finfo(np.float64).eps)  # 2u
    return torch.sqrt((sq + 4.0 * eps * slack).clamp_min(0.0))


def ghost_clipped_sum(spec: ModelSpec, start: torch.Tensor, heads: torch.Tensor | None,
                      x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, lr: float,
                      clip: float) -> tuple[np.ndarray, int] | None:
    """``deep_math.clipped_sum(local_updates(spec, start, heads, x, y, mask, 1, lr), clip)``
    without per-user gradients of the linear layers, or None where the model has trained
    layers other than ``nn.Linear`` and plain ``nn.Conv2d`` (or one called more than once per
    forward pass, or a linear layer on inputs that are not flat rows). Arguments as
    ``local_updates``."""
    n, r = y.shape
    rows = x.reshape(n * r, *spec.input_shape)

    def users_loss(leaf: torch.Tensor) -> torch.Tensor:
        if heads is not None:
            feats = dm.features(spec, leaf, rows).reshape(n, r, -1)
            logits = dm.head_logits(feats, heads, spec.num_classes, spec.head_bias)
        else:
            logits = functional_call(spec.module, spec.unflatten(leaf), (rows,))
            logits = logits.reshape(n, r, -1)
        ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        return ((ce * mask).sum(1) / mask.sum(1).clamp_min(1.0)).sum()

    return ghost_gradient_sum(spec, start, users_loss, n, r, heads is not None, lr, clip)


def ghost_gradient_sum(spec: ModelSpec, start: torch.Tensor,
                       users_loss: Callable[[torch.Tensor], torch.Tensor], n: int, r: int,
                       body_only: bool, lr: float, clip: float) -> tuple[np.ndarray, int] | None:
    """The sum over n users of ``-lr * f_i * grad L_i`` at ``start`` (the body's parameters
    with ``body_only``, else the whole model's), ``f_i = min(1, clip / ||lr grad L_i||)``,
    without per-user gradients (module docstring), and how many were scaled down; None where
    the model's trained layers do not allow it. ``users_loss(leaf)`` is the sum of the users'
    losses, computed with one pass of the model over the users' rows stacked user by user, r
    each (user i's rows ``i r .. i r + r - 1``), where user i's loss depends on its own rows'
    outputs alone (any function of them: a mean cross-entropy, a few-shot task's adapted
    query loss)."""
    owners = ghost_layers(spec, body_only)
    if owners is None:
        return None
    modules = {o: spec.module.get_submodule(o) for o in owners}
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {o: [] for o in owners}
    handles = [modules[o].register_forward_hook(
        lambda _m, inputs, out, o=o: seen[o].append((inputs[0], out))) for o in owners]
    try:
        with torch.enable_grad():
            leaf = start.detach().clone().requires_grad_(True)
            loss = users_loss(leaf)
            if any(len(seen[o]) != 1 or seen[o][0][0].dim() != (
                    4 if isinstance(modules[o], nn.Conv2d) else 2) for o in owners):
                return None
            outs = [seen[o][0][1] for o in owners]
            if not loss.requires_grad:  # nothing trained reaches the loss
                return None
            grads = torch.autograd.grad(loss, outs, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    device = start.device
    sq = torch.zeros(n, dtype=torch.float64, device=device)
    slack = torch.zeros_like(sq)
    layers: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (owner, a, g): (n, r, d)
    formed: list[tuple[str, nn.Conv2d, torch.Tensor]] = []  # conv layers: per-user gradients
    for owner, g in zip(owners, grads, strict=True):
        a = seen[owner][0][0].detach()
        g = torch.zeros_like(seen[owner][0][1]) if g is None else g
        module = modules[owner]
        if isinstance(module, nn.Conv2d):  # per-user gradients, clipped as rows
            user_grads = conv_user_gradients(module, a, g, n).double()
            layer_sq = user_grads.pow(2).sum(1)
            sq += layer_sq
            slack += user_grads.shape[1] * layer_sq
            formed.append((owner, module, user_grads))
            continue
        a3, g3 = a.reshape(n, r, -1), g.reshape(n, r, -1)
        for users in _blocks(n, r, a3.shape[2] + g3.shape[2]):
            layer_sq, layer_slack = layer_norm_terms(
                a3[users].double(), g3[users].double(), module.bias is not None)
            sq[users] += layer_sq
            slack[users] += layer_slack
        layers.append((owner, a3, g3))
    norms = lr * bounded_norms(sq, slack)
    factors = factors_from_norms(norms.cpu().numpy(), clip)  # 0: a non-finite norm (isolated)
    user_weights = torch.from_numpy(-lr * factors).to(device)
    dropped = torch.from_numpy(factors == 0).to(device)
    if factors.min(initial=1.0) == 0:  # a dropped user's rows become zeros: 0 * nan would
        # poison the sum (checked on the host: no device sync)
        formed = [(o, m, u.masked_fill(dropped[:, None], 0.0)) for o, m, u in formed]
    names = spec.names[:spec.num_body] if body_only else spec.names
    total = {}
    for owner, a3, g3 in layers:
        trained_bias = f"{owner}.bias" in names
        weight = torch.zeros(g3.shape[2], a3.shape[2], dtype=torch.float64, device=device)
        bias = torch.zeros(g3.shape[2], dtype=torch.float64, device=device)
        for users in _blocks(n, r, a3.shape[2] + g3.shape[2]):
            a64, g64 = a3[users].double(), g3[users].double()
            if factors[users].min() == 0:  # checked on the host: no device sync a block
                a64 = a64.masked_fill(dropped[users, None, None], 0.0)
                g64 = g64.masked_fill(dropped[users, None, None], 0.0)
            # each row weighted by its user's factor (out of place: a float64 g would be the
            # autograd gradient itself, which two layers may share), summed over the rows
            scaled = (g64 * user_weights[users, None, None]).reshape(-1, g3.shape[2])
            weight.addmm_(scaled.T, a64.reshape(-1, a3.shape[2]))
            if trained_bias:
                bias += scaled.sum(0)
        total[f"{owner}.weight"] = weight
        if trained_bias:
            total[f"{owner}.bias"] = bias
    for owner, conv, user_grads in formed:
        summed = user_weights @ user_grads  # weight entries, then bias
        size = conv.weight.numel()
        total[f"{owner}.weight"] = summed[:size]
        if f"{owner}.bias" in names:
            total[f"{owner}.bias"] = summed[size:]
    flat = torch.cat([total[name].reshape(-1) for name in names])
    return flat.cpu().numpy(), int(np.count_nonzero(factors < 1.0))
