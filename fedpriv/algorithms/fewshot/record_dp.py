"""Record-level DP-SGD inside each task (the record-level baseline ``fewshot-dp-reptile``; Li,
Khodak, Caldas & Talwalkar 2020): over a chunk of tasks, each with its own copy of the whole
network (body and head), full-batch DP-SGD steps on the task's own records (support and query
rows, each record's cross-entropy a loss of its own), each record's gradient clipped to
``clip`` and Gaussian noise added to each task's sum, the task's noise from its own generator.

One step's noised sum changes by at most ``clip`` (a record zeroed out: its rows contribute
nothing, the task's row count r public) or ``2 clip`` (replaced) whatever the record holds, at a
fixed iterate: a record whose gradient is not finite
adds exactly nothing. Two paths give the same sums: a plain MLP (``Flatten``, ``Linear`` and
``ReLU`` layers: the deep family's ``mlp``) is computed as batched matrix products, each record's
gradient norm from its layer inputs and output gradients (``||g a^T||^2 = ||g||^2 ||a||^2``), no
per-record gradient formed; any other network through ``torch.func`` per-record gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fedpriv.algorithms.deep.models import ModelSpec

_TINY = torch.finfo(torch.float64).tiny


def mlp_layers(spec: ModelSpec) -> list[str] | None:
    """The child names of a plain MLP's linear layers (``Flatten`` first, then ``Linear``
    with a bias and ``ReLU`` layers, the parameters in that order), or None for any other
    network."""
    module = spec.module
    if not isinstance(module, nn.Sequential):
        return None
    linear: list[str] = []
    for position, (name, child) in enumerate(module.named_children()):
        if isinstance(child, nn.Linear) and child.bias is not None:
            linear.append(name)
        elif not (isinstance(child, nn.ReLU) or isinstance(child, nn.Flatten) and position == 0):
            return None
    names = [f"{n}.{p}" for n in linear for p in ("weight", "bias")]
    return linear if tuple(names) == tuple(spec.names) else None


def _factors(sq: torch.Tensor, clip: float) -> torch.Tensor:
    """``min(1, clip / norm)`` per record from squared norms (float64), shaved by 2^-20 so
    that its float32 cast never rounds a record over the clip; 0 where the norm is not finite
    or the factor is below 1e-30 (where float32 has no precision left: dropping a record is
    always within the bound)."""
    norms = sq.sqrt()
    factors = torch.clamp(clip / norms.clamp_min(_TINY), max=1.0) * (1.0 - 2.0**-20)
    keep = torch.isfinite(norms) & (factors >= 1e-30)
    return torch.where(keep, factors, torch.zeros_like(factors))


def _mlp_sums(spec: ModelSpec, linear: list[str], params: torch.Tensor, x: torch.Tensor,
              y: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    n, r = y.shape
    with torch.enable_grad():
        named = spec.unflatten(params.detach().requires_grad_(True))
        h = x.reshape(n, r, -1)
        inputs, outputs = [], []
        for name, child in spec.module.named_children():
            if isinstance(child, nn.Linear):
                inputs.append(h)
                h = torch.baddbmm(named[f"{name}.bias"][:, None, :], h,
                                  named[f"{name}.weight"].transpose(1, 2))
                outputs.append(h)
            elif isinstance(child, nn.ReLU):
                h = torch.relu(h)
        loss = F.cross_entropy(h.reshape(n * r, -1), y.reshape(-1), reduction="sum")
        grads = torch.autograd.grad(loss, outputs)
    sq = torch.zeros(n, r, dtype=torch.float64, device=x.device)
    for a, g in zip(inputs, grads, strict=True):
        sq += g.double().pow(2).sum(-1) * (a.detach().double().pow(2).sum(-1) + 1.0)
    factors = _factors(sq, clip)
    dropped = (factors == 0)[..., None]
    weights = factors.to(params.dtype)[..., None]
    sums: dict[str, torch.Tensor] = {}
    for name, a, g in zip(linear, inputs, grads, strict=True):
        a = a.detach().masked_fill(dropped, 0.0)  # 0 * nan would poison the task's sum
        g = g.masked_fill(dropped, 0.0) * weights
        sums[f"{name}.weight"] = torch.bmm(g.transpose(1, 2), a)
        sums[f"{name}.bias"] = g.sum(1)
    flat = torch.cat([sums[name].reshape(n, -1) for name in spec.names], 1)
    return flat, factors


def _per_record_sums(spec: ModelSpec, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                     clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    def record_loss(flat: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(spec.module, spec.unflatten(flat), (xi[None],))
        return F.cross_entropy(out, yi[None])

    with torch.enable_grad():
        per = vmap(vmap(grad(record_loss), in_dims=(None, 0, 0)))(params.detach(), x, y)
    factors = _factors(per.double().pow(2).sum(-1), clip)
    per = per.masked_fill((factors == 0)[..., None], 0.0)
    return torch.einsum("nrp,nr->np", per, factors.to(per.dtype)), factors


def clipped_record_sums(spec: ModelSpec, params: torch.Tensor, x: torch.Tensor,
                        y: torch.Tensor, clip: float,
                        per_record: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each task's sum of its records' loss gradients, each scaled to norm at most ``clip``, at
    the task's own parameters: ``params`` (n, P) (the whole network, flat), rows ``x`` (n, r,
    *input), labels ``y`` (n, r). Returns the sums (n, P) and the scale factors (n, r; 0 for a
    record whose gradient is not finite). ``per_record``: the ``torch.func`` path even for an
    MLP (the tests compare the two)."""
    linear = None if per_record else mlp_layers(spec)
    if linear is not None:
        return _mlp_sums(spec, linear, params, x, y, clip)
    return _per_record_sums(spec, params, x, y, clip)


def dp_sgd_updates(spec: ModelSpec, start: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                   steps: int, lr: float, clip: float, noise_std: float,
                   generators: list[torch.Generator]) -> torch.Tensor:
    """Each task's ``steps`` full-batch DP-SGD steps from ``start`` (P,): ``theta <- theta -
    lr (sum of clipped record gradients + N(0, noise_std^2 I)) / r`` with r the task's
    (public) number of records, the noise of task i from ``generators[i]`` (CPU). Returns
    ``start - theta`` per task (n, P) float64 (the direction a Reptile step moves against).
    How many records were clipped is not returned: a count of records' values would reach the
    server outside the accounted noise."""
    n, r = y.shape
    params = start.to(torch.float32).expand(n, -1).clone()
    for _ in range(steps):
        sums, _ = clipped_record_sums(spec, params, x, y, clip)
        noise = torch.stack([torch.randn(params.shape[1], generator=g) for g in generators])
        params = params - (lr / r) * (sums + noise_std * noise.to(params.device))
    return start.double() - params.double()
