"""The networks of the deep family and their split into a shared body and a personal head.

A model is any ``torch.nn.Module`` mapping a batch of inputs (B, *input_shape) to logits
(B, num_classes): the built-in ``mlp`` and ``cnn``, or a factory named by import path
(``model = "package.module:make"``, called as ``make(input_shape, num_classes)``). Its *last*
``nn.Linear`` layer is the personal head (the v_i of the linear case); every other parameter is
the shared body (the embedding U). A model whose output does not match the classes, or whose
split leaves no body parameters, is refused before the run with a ``ConfigError`` naming
``model``.

``ModelSpec`` holds the module (as a stateless template: parameters are passed to
``torch.func.functional_call``) and the flat layout of its parameters: the server keeps the
model as one flat float32 vector, body entries first, then the head.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

from fedpriv.algorithms.deep.params import sizes
from fedpriv.params import ConfigError

# builds a model for (input shape, number of classes); a user's factory is checked after the call
Factory = Callable[[tuple[int, ...], int], nn.Module]


def mlp(input_shape: tuple[int, ...], num_classes: int,
        hidden: tuple[int, ...] = (256, 128)) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = int(np.prod(input_shape))
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two 3x3 conv layers (16, 32 channels) with 2x2 max-pooling, a 128-wide dense layer and
    the linear head. Needs image inputs (C, H, W) with H, W >= 4."""
    if len(input_shape) != 3 or min(input_shape[1:]) < 4:
        raise ConfigError(f"model: cnn needs image inputs (channels, height >= 4, width >= 4); "
                          f"the dataset's inputs are {input_shape} (a table's or npz's flat "
                          "features become images with input-shape, e.g. input-shape = "
                          "\"1,8,8\" for 64 pixels)")
    c, h, w = input_shape
    flat = 32 * (h // 4) * (w // 4)
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(flat, 128), nn.ReLU(), nn.Linear(128, num_classes))


def conv4(input_shape: tuple[int, ...], num_classes: int, channels: int = 64) -> nn.Module:
    """The four-block network of the few-shot literature (Vinyals et al. 2016; Snell et al.
    2017): four blocks of a 3x3 convolution (64 channels), ReLU and 2x2 max-pooling, then the
    linear head on the flattened output (64 features for 28 x 28 inputs). Without the batch
    normalization of the original: it mixes the rows of a batch (DESIGN: models may not mix
    users). Needs image inputs (C, H, W) with H, W >= 16."""
    if len(input_shape) != 3 or min(input_shape[1:]) < 16:
        raise ConfigError(f"model: conv4 needs image inputs (channels, height >= 16, width >= "
                          f"16); the data's inputs are {input_shape}")
    c, h, w = input_shape
    blocks: list[nn.Module] = []
    for i in range(4):
        blocks += [nn.Conv2d(c if i == 0 else channels, channels, 3, padding=1), nn.ReLU(),
                   nn.MaxPool2d(2)]
    flat = channels * (h // 16) * (w // 16)
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(flat, num_classes))


def _factory(model: str, hidden: str) -> Factory:
    if model == "mlp":
        widths = sizes(hidden)
        return lambda shape, classes: mlp(shape, classes, widths)
    if model == "cnn":
        return cnn
    if model == "conv4":
        return conv4
    module_name, _, attr = model.partition(":")
    try:
        factory: Factory = getattr(importlib.import_module(module_name), attr)
        return factory
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"model: cannot import {model!r}: {err}") from None


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """A model template and its flat parameter layout (body first, then head)."""

    module: nn.Module
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    num_body: int  # the first num_body names are the body's
    input_shape: tuple[int, ...]
    num_classes: int
    factory: Factory
    activations: int  # floats of every layer's output for one input (memory estimates)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s)) for s in self.shapes)

    @property
    def row_floats(self) -> int:
        """Floats of one row's input and every layer's output (memory estimates)."""
        return int(np.prod(self.input_shape)) + self.activations

    @property
    def body_size(self) -> int:
        return sum(self.sizes[:self.num_body])

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def head_bias(self) -> bool:
        return self.size - self.body_size > self.num_classes * self.head_in

    @property
    def head_in(self) -> int:
        """Width of the features the head reads."""
        return self.shapes[self.num_body][1]

    def unflatten(self, flat: torch.Tensor, body_only: bool = False) -> dict[str, torch.Tensor]:
        """Named parameters from a flat vector (..., P) (leading axes kept: stacked users)."""
        names = self.names[:self.num_body] if body_only else self.names
        out, start = {}, 0
        for name, shape, size in zip(names, self.shapes, self.sizes, strict=False):
            out[name] = flat[..., start:start + size].reshape(*flat.shape[:-1], *shape)
            start += size
        return out

    def unflatten_head(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The head's named parameters from a flat head vector (..., C * h + C)."""
        out, start = {}, 0
        for name, shape, size in zip(self.names[self.num_body:], self.shapes[self.num_body:],
                                     self.sizes[self.num_body:], strict=True):
            out[name] = flat[..., start:start + size].reshape(*flat.shape[:-1], *shape)
            start += size
        return out

    def initial(self, seed: int) -> np.ndarray:
        """The starting parameters, a pure function of the seed: the factory's own
        initialization under a seeded torch generator (global RNG state restored)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self.factory(self.input_shape, self.num_classes)
        params = dict(module.named_parameters())
        return np.concatenate([params[n].detach().reshape(-1).numpy() for n in self.names]
                              ).astype(np.float32)


PROBE_ROWS = 4


def row_coupling(module: nn.Module, input_shape: tuple[int, ...]) -> str | None:
    """Where ``module`` lets rows of a batch interact, found functionally: a batch of random
    rows goes through it twice, the second time with row 0 changed, and the other rows'
    outputs must stay the same at every submodule, and the gradient of their outputs must not
    reach row 0. Returns a description naming the first submodule (in call order; the
    innermost) whose output for another row moved, or None. Any layer type is caught,
    whatever its name: batch norm without running statistics, attention across the batch,
    ``x - x.mean(0)`` written inline."""
    gen = torch.Generator().manual_seed(0x9A0BE)
    x = torch.randn(PROBE_ROWS, *input_shape, generator=gen)
    changed = x.clone()
    changed[0] = 3.0 * torch.randn(*input_shape, generator=gen) + 1.0
    names = {id(m): name or "the model" for name, m in module.named_modules()}

    def trace(batch: torch.Tensor) -> list[tuple[str, Any, torch.Tensor]]:
        seen: list[tuple[str, Any, torch.Tensor]] = []
        def record(m: nn.Module, inputs: tuple[Any, ...], out: Any) -> None:
            first = out[0] if isinstance(out, (tuple, list)) and out else out  # (out, weights)
            if isinstance(first, torch.Tensor):
                seen.append((names[id(m)], inputs[0] if inputs else None, first))

        hooks = [m.register_forward_hook(record) for m in module.modules()]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)  # the same dropout masks in both passes
                module(batch)
        finally:
            for hook in hooks:
                hook.remove()
        return seen

    def moved(a: Any, b: Any) -> bool:
        """Whether rows 1.. of two per-row tensors differ (beyond float noise)."""
        if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != PROBE_ROWS:
            return False
        scale = 1e-6 * (1.0 + float(a[1:].abs().max()))
        return not torch.allclose(a[1:], b[1:], rtol=0.0, atol=scale, equal_nan=True)

    for (name, a_in, a), (_, b_in, b) in zip(trace(x), trace(changed), strict=True):
        if a.dim() == 0 or a.shape[0] != PROBE_ROWS or a.shape != b.shape:
            return f"{name} does not keep one output row per input row (shape {tuple(a.shape)})"
        if not moved(a, b):
            continue
        if moved(a_in, b_in):  # its input was mixed already: by its parent's own code
            parent = name.rpartition(".")[0] if name != "the model" else ""
            where = parent or "the model"
            return (f"the forward of {where} ({type(_module_at(module, where)).__name__}) "
                    f"mixes rows before calling {name}")
        return (f"{name} ({type(_module_at(module, name)).__name__}) changes its output for "
                "other rows when one row changes")
    probe = changed.clone().requires_grad_(True)
    with torch.enable_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = module(probe)
        out[1:].sum().backward()
    module.zero_grad(set_to_none=True)
    if probe.grad is not None and float(probe.grad[0].abs().max()) > 0.0:
        return "the gradient of other rows' outputs reaches row 0"
    return None


def _module_at(module: nn.Module, name: str) -> nn.Module:
    return module if name == "the model" else module.get_submodule(name)


@lru_cache(maxsize=8)
def model_spec(model: str, hidden: str, input_shape: tuple[int, ...],
               num_classes: int) -> ModelSpec:
    """The model named by the ``model`` (and ``hidden-sizes``) keys for the data's input
    shape and classes, checked."""
    factory = _factory(model, hidden)
    try:
        module = factory(input_shape, num_classes)
    except ConfigError:
        raise
    except Exception as err:  # a user factory may fail in any way
        raise ConfigError(f"model: {model!r} failed to build for inputs {input_shape}, "
                          f"{num_classes} classes: {err}") from None
    if not isinstance(module, nn.Module):
        raise ConfigError(f"model: {model!r} returned {type(module).__name__}, not a "
                          "torch.nn.Module")
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: sizes.append(o[0].numel()))
             for m in module.modules() if not list(m.children())]
    with torch.no_grad():
        try:
            out = module(torch.zeros(2, *input_shape))
        except Exception as err:
            raise ConfigError(f"model: {model!r} cannot take inputs of shape {input_shape}: "
                              f"{err}") from None
        finally:
            for hook in hooks:
                hook.remove()
    if tuple(out.shape) != (2, num_classes):
        raise ConfigError(f"model: {model!r} outputs shape {tuple(out.shape[1:])} per input; "
                          f"the data has {num_classes} classes")
    mixer = row_coupling(module, input_shape)
    if mixer is not None:
        raise ConfigError(f"model: {model!r} mixes the rows of a batch: {mixer}. fedpriv runs "
                          "many users' rows through the model as one batch, so a layer whose "
                          "output for one row depends on another row (batch norm, attention "
                          "across the batch) would let one user's data move another user's "
                          "update; use a per-row layer (LayerNorm, GroupNorm)")
    if any(True for _ in module.buffers()):
        raise ConfigError(f"model: {model!r} has buffers (batch norm?); per-user "
                          "vectorization needs a stateless model (use GroupNorm or LayerNorm)")
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError(f"model: {model!r} has no nn.Linear layer to be the personal head")
    head = linears[-1]
    head_names = [f"{head}.weight"] + ([f"{head}.bias"] if getattr(module.get_submodule(head),
                                                                   "bias", None) is not None
                                       else [])
    params = dict(module.named_parameters())
    body_names = [n for n in params if n not in head_names]
    if not body_names:
        raise ConfigError(f"model: {model!r} splits into a head ({head}) and no body "
                          "parameters: the shared representation would be empty")
    if params[head_names[0]].shape[0] != num_classes:
        raise ConfigError(f"model: {model!r}: its last Linear layer ({head}) has "
                          f"{params[head_names[0]].shape[0]} outputs, not the {num_classes} "
                          "classes; the head must be the layer that outputs the logits")
    names = tuple(body_names + head_names)
    module.requires_grad_(False)
    return ModelSpec(module, names, tuple(tuple(params[n].shape) for n in names),
                     len(body_names), input_shape, num_classes, factory, sum(sizes))
