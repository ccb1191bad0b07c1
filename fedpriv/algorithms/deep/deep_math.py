"""The users' local work of the deep algorithms, batched over users with ``torch.func``.

Every function takes a chunk of users stacked on a leading axis and computes all of them in a
few batched calls: the shared body's features of every row in one forward pass; the users'
linear heads fitted by full-batch gradient descent on those features (the cross-entropy
gradient in closed form, ``(softmax - onehot)^T features``); each user's body (or whole-model)
update by ``vmap(grad(loss))`` over per-user parameters (``functional_call``). No Python loop
runs over users. ``loop_*`` are the plain per-user references (one ``nn.Module`` and one
``torch.optim.SGD`` per user, the way a Flower or Opacus example computes one client's update):
tests check that both compute the same, the benchmark compares their speed.

Privacy-relevant: ``clipped_sum`` bounds each user's update to ``clip`` in L2 over all its
parameters, with norms and scaling in float64 (a float32 norm could let a clipped update exceed
the bound by a rounding error), before anything is summed; an update that is not finite (the
user's data overflowed the model) is dropped to zero. Every function treats each user (and each
row) alone: one user's data reaches no other user's numbers.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedpriv.algorithms.deep.head_fit import fit_heads as fit_heads  # re-exported
from fedpriv.algorithms.deep.head_fit import head_logits as head_logits
from fedpriv.algorithms.deep.head_fit import head_step_sizes as head_step_sizes
from fedpriv.algorithms.deep.models import ModelSpec
from fedpriv.privacy.mechanisms import factors_from_norms


class _Stop(Exception):
    pass


def _head_module(spec: ModelSpec) -> torch.nn.Module:
    return spec.module.get_submodule(spec.names[spec.num_body].rsplit(".", 1)[0])


def features(spec: ModelSpec, body: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The shared body's output (the head's input) for rows ``x`` (N, *input): (N, h)."""
    captured: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        captured.append(inputs[0])
        raise _Stop

    params = spec.unflatten(body, body_only=True)
    params.update(spec.unflatten_head(torch.zeros(spec.size - spec.body_size,
                                                  dtype=body.dtype, device=body.device)))
    handle = _head_module(spec).register_forward_pre_hook(hook)
    try:
        functional_call(spec.module, params, (x,))
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured[0].reshape(len(x), -1)


Params = dict[str, torch.Tensor]  # named parameters (or a part of them), as functional_call


def _user_loss(spec: ModelSpec, params: Params, x: torch.Tensor, y: torch.Tensor,
               mask: torch.Tensor, head: Params | None = None, groups: int = 0) -> torch.Tensor:
    """One user's mean cross-entropy over its valid rows. ``groups = k > 0``: the head's
    tensors have a leading axis of k and head j scores the j-th of k equal groups of the rows
    (cross-fitting); else ``params`` holds the whole model."""
    if groups:
        assert head is not None  # k heads a user: the groups' heads
        size = x.shape[0] // groups
        logits = torch.cat([
            functional_call(spec.module, {**params, **{n: t[j] for n, t in head.items()}},
                            (x[j * size:(j + 1) * size],)) for j in range(groups)])
    else:
        logits = functional_call(spec.module, {**params, **(head or {})}, (x,))
    ce = F.cross_entropy(logits, y, reduction="none")
    return (ce * mask).sum() / mask.sum().clamp_min(1.0)


def local_updates(spec: ModelSpec, start: torch.Tensor, heads: torch.Tensor | None,
                  x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, steps: int,
                  lr: float) -> torch.Tensor:
    """Each user's update after ``steps`` of gradient descent from the shared ``start``.

    ``heads`` (n, H) given: ``start`` is the body (P_body,), each user's head is frozen at its
    row and the update is the body's (n, P_body); heads (n, k, H): k frozen heads a user, head j
    on the j-th of k equal groups of its rows (cross-fitting). ``heads = None``: ``start`` is
    the whole model (P,) and every parameter moves (n, P). x (n, r, *input), y and mask
    (n, r)."""
    if steps < 1 or not lr > 0:  # a config that skipped parse_config (0: a placeholder)
        raise ValueError(f"local_updates: steps {steps} and lr {lr} must be >= 1 and > 0")
    body_only = heads is not None
    n = x.shape[0]
    groups = heads.shape[1] if heads is not None and heads.dim() == 3 else 0

    def loss(own: Params, head: Params, xi: torch.Tensor, yi: torch.Tensor,
             mi: torch.Tensor) -> torch.Tensor:
        return _user_loss(spec, own, xi, yi, mi, head, groups)

    head_params = spec.unflatten_head(heads) if heads is not None else {}
    shared = vmap(grad(loss), in_dims=(None, 0, 0, 0, 0))  # step 1: every user at ``start``
    stacked = vmap(grad(loss), in_dims=(0, 0, 0, 0, 0))
    # each user's own parameters, stepped in place through per-layer views as the per-user
    # loop's ``p -= lr * grad``; one step starts from zero, so it returns -lr * grad exactly
    own = (torch.zeros(n, start.shape[0], dtype=start.dtype, device=start.device) if steps == 1
           else start.repeat(n, 1))
    views = spec.unflatten(own, body_only=body_only)
    for step in range(steps):
        params = views if step else spec.unflatten(start, body_only=body_only)
        grads = (stacked if step else shared)(params, head_params, x, y, mask)
        for name, view in views.items():
            view.sub_(grads[name], alpha=lr)
    return own if steps == 1 else own - start


BLOCK_ELEMENTS = 1 << 19
"""Float64 elements (4 MiB) of the reused buffer ``clipped_sum`` casts a block of users' rows
into on the CPU: casting all (n, P) updates at once allocated a new n x P float64 array every
call, and writing to fresh pages took about ten times the arithmetic (a random 512 x 110,000
float32 block, one core: 0.56 s into a new array, 0.05 s block by block; docs/measurements.md).
On an accelerator the whole block is cast at once (one pass, one copy back)."""


def clipped_sum(updates: torch.Tensor, clip: float) -> tuple[np.ndarray, int]:
    """Sum over users of ``updates[i] * min(1, clip / ||updates[i]||)`` (float64), and how many
    were scaled down: ``fedpriv.privacy.mechanisms.clipped_sum`` for torch rows. Each block of
    rows is cast to float64 into one reused buffer, normed, scaled and summed there."""
    n, width = updates.shape
    rows = max(1, n if updates.device.type != "cpu" else min(n, BLOCK_ELEMENTS // max(1, width)))
    buffer = torch.empty(rows, width, dtype=torch.float64, device=updates.device)
    total = torch.zeros(width, dtype=torch.float64, device=updates.device)
    clipped = 0
    for lo in range(0, n, rows):
        block = buffer[: min(rows, n - lo)]
        block.copy_(updates[lo: lo + block.shape[0]])
        norms = torch.linalg.vector_norm(block, dim=1).cpu().numpy()
        factors = factors_from_norms(norms, clip)  # 0 for a non-finite update: its user isolated
        clipped += int(np.count_nonzero(factors < 1.0))
        dropped = torch.from_numpy(factors == 0).to(block.device)
        if bool(dropped.any()):
            block.masked_fill_(dropped[:, None], 0.0)  # 0 * nan would poison the sum
        total.addmv_(block.T, torch.from_numpy(factors).to(block.device))
    return total.cpu().numpy(), clipped


def clipped_mean_alignment(updates: torch.Tensor) -> float:
    """How much users agree: the norm of the mean of the updates (n, P) clipped at their
    median norm C, over C. 1 where every user's update is the same; 1/sqrt(n) for n updates of
    equal norm in orthogonal directions. Against the noise of a release of that mean (norm
    about z C sqrt(P) / n) it is the round's signal-to-noise ratio
    (``benchmarks/bench_update_alignment.py``)."""
    rows = updates.double()
    norms = torch.linalg.vector_norm(rows, dim=1)
    clip = norms.median()
    factors = torch.clamp(clip / norms.clamp_min(torch.finfo(torch.float64).tiny), max=1.0)
    return float(torch.linalg.vector_norm((rows * factors[:, None]).mean(0)) / clip)


def accuracy_and_loss(logits: torch.Tensor, y: torch.Tensor,
                      mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per user: the fraction of valid rows classified right, and the mean cross-entropy.
    logits (n, r, C), y and mask (n, r)."""
    count = mask.sum(1).clamp_min(1.0)
    right = ((logits.argmax(-1) == y).to(mask.dtype) * mask).sum(1) / count
    ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
    loss = (ce * mask).sum(1) / count
    return right.double().cpu().numpy(), loss.double().cpu().numpy()


def model_logits(spec: ModelSpec, models: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Logits of per-user whole models (n, P) on their rows x (n, r, *input)."""
    def one(flat: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = functional_call(spec.module, spec.unflatten(flat), (xi,))
        return logits
    stacked: torch.Tensor = vmap(one)(models, x)
    return stacked


# ----- per-user references (tests and the benchmark) -------------------------------------------
def _module_with(spec: ModelSpec, flat: torch.Tensor) -> torch.nn.Module:
    module = copy.deepcopy(spec.module)
    module.requires_grad_(True)
    with torch.no_grad():
        for (name, value) in spec.unflatten(flat).items():
            module.get_parameter(name).copy_(value)
    return module


def loop_fit_heads(feats: torch.Tensor, y: torch.Tensor, counts: np.ndarray,
                   num_classes: int, steps: int, lr: float) -> torch.Tensor:
    """``fit_heads`` one user at a time with an ``nn.Linear`` and ``torch.optim.SGD``."""
    heads = []
    for i, count in enumerate(counts):
        head = torch.nn.Linear(feats.shape[2], num_classes).to(feats.dtype)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        sq = float(feats[i, :count].pow(2).sum(-1).mean()) if count else 0.0
        opt = torch.optim.SGD(head.parameters(), lr=lr / (0.5 * sq + 0.5))
        for _ in range(steps):
            opt.zero_grad()
            torch.autograd.backward(F.cross_entropy(head(feats[i, :count]), y[i, :count]))
            opt.step()
        heads.append(torch.cat([head.weight.detach().reshape(-1), head.bias.detach()]))
    return torch.stack(heads)


def loop_local_updates(spec: ModelSpec, start: torch.Tensor, heads: torch.Tensor | None,
                       x: torch.Tensor, y: torch.Tensor, counts: np.ndarray, steps: int,
                       lr: float) -> torch.Tensor:
    """``local_updates`` one user at a time: a model copy, ``torch.optim.SGD`` on its body
    (or all of it), ``steps`` steps on the user's rows. Heads (n, k, H): a copy of the model per
    head, sharing the body's parameters, head j on the j-th of k equal groups of the rows."""
    out = []
    for i, count in enumerate(counts):
        user_heads: list[torch.Tensor] = [] if heads is None else list(
            heads[i] if heads.dim() == 3 else heads[i:i + 1])
        full = start if heads is None else torch.cat([start, user_heads[0]])
        module = _module_with(spec, full)
        names = spec.names if heads is None else spec.names[:spec.num_body]
        params = [module.get_parameter(n) for n in names]
        copies = [module]
        for head in user_heads[1:]:  # the same body parameters, another frozen head
            other = copy.deepcopy(module)
            for name in names:
                parent, _, leaf = name.rpartition(".")
                setattr(other.get_submodule(parent), leaf, module.get_parameter(name))
            with torch.no_grad():
                for name, value in spec.unflatten_head(head).items():
                    other.get_parameter(name).copy_(value)
            copies.append(other)
        size = count // len(copies)
        opt = torch.optim.SGD(params, lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            logits = torch.cat([m(x[i, j * size:(j + 1) * size])
                                for j, m in enumerate(copies)])
            torch.autograd.backward(F.cross_entropy(logits, y[i, :size * len(copies)]))
            opt.step()
        after = torch.cat([p.detach().reshape(-1) for p in params])
        out.append(after - start)
    return torch.stack(out)
