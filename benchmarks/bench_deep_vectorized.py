"""Users per second of the deep algorithms' local work: vectorized over users (``torch.func``,
what the nodes run) against a plain per-user loop (one ``nn.Module`` and ``torch.optim.SGD``
per user, the way a Flower or Opacus example computes one client's update).

Default: the Fashion-MNIST setting of docs/results.md (label skew, S = 5, N = 2,000 users, about 30
training images each, the default MLP). One round of each algorithm family's local work, up
to the chunk's clipped sum (what a node sends; ``clip-norm`` as configured):

* FedRep: the head fitted on one batch (``head-steps``), the body updated on the other
  (``body-steps``);
* FedAvg: ``body-steps`` steps of the whole model on both batches.

With ``body-steps = 1`` and an MLP or the cnn the vectorized path is ghost clipping
(``fedpriv/algorithms/deep/ghost_clipping.py``: no per-user gradients of the dense layers
formed; the cnn's conv layers' per-user gradients from one grouped convolution); otherwise
``vmap(grad)`` per-user updates and their clipped sum.

    python benchmarks/bench_deep_vectorized.py [--dataset digits] [--model cnn] [--users 400]
        [--body-steps 5] [--chunk-mb 64] [--per-user-floats N] [--allocator both|default|sweep]

After the table, a ceiling for the whole-model algorithms: the same users' rows (both batches)
as *one* float32 batch, one forward and one backward pass of the model to its batch-mean
gradient, nothing computed per user. It is what non-private FedAvg's node does, and no path
that clips each user can beat it (it does that pass and more: norms, the clipped sum in
float64), so its ratio to the per-user loop bounds what any vectorization can reach on the
machine.

glibc's allocator settings move the per-user loop (its many small allocations) more than the
vectorized path, so by default the table is printed twice: with glibc's defaults and with the
sweep workers' malloc settings (``fedpriv.allocator.ENV``), each in a fresh process (glibc
reads them at start-up).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedpriv.algorithms.deep import deep_algorithm
from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.deep_algorithm import disjoint_batches
from fedpriv.algorithms.deep.problem import problem_of, user_block
from fedpriv.allocator import ENV as MALLOC_ENV
from fedpriv.configure import parse_config
from fedpriv.registry import get_algorithm


def loop_round(cfg, problem, model, block, first, second, trains):
    """The per-user loop's round: ``trains`` = "body" (FedRep: the head fitted on the first
    batch, the body trained on the second) or "model" (FedAvg: the whole model on both)."""
    spec, b = problem.spec, problem.batch_size
    rows = np.arange(len(block.user_ids))[:, None]
    x1, y1 = block.x[rows, first], block.y[rows, first]
    x2, y2 = block.x[rows, second], block.y[rows, second]
    full = np.full(len(block.user_ids), b)
    if trains == "body":
        body = model[:spec.body_size]
        heads = []
        for i in range(len(full)):  # per user: its own forward pass for its features
            with torch.no_grad():
                feats = dm.features(spec, body, x1[i])
            heads.append(dm.loop_fit_heads(feats[None], y1[i:i + 1], full[:1],
                                           spec.num_classes, cfg.head_steps, cfg.head_lr)[0])
        return dm.loop_local_updates(spec, body, torch.stack(heads), x2, y2, full,
                                     cfg.body_steps, cfg.local_lr)
    return dm.loop_local_updates(spec, model, None, torch.cat([x1, x2], 1),
                                 torch.cat([y1, y2], 1), 2 * full, cfg.body_steps, cfg.local_lr)


def batch_step(problem, model, block, first, second) -> torch.Tensor:
    """The ceiling's work: the users' rows of both batches as one float32 batch, the gradient
    of its mean loss (one forward, one backward pass; nothing per user)."""
    rows = np.arange(len(block.user_ids))[:, None]
    both = np.concatenate([first, second], 1)
    x = block.x[rows, both].reshape(-1, *problem.spec.input_shape)
    y = block.y[rows, both].reshape(-1)
    with torch.enable_grad():
        leaf = model.detach().clone().requires_grad_(True)
        logits = functional_call(problem.spec.module, problem.spec.unflatten(leaf), (x,))
        return torch.autograd.grad(F.cross_entropy(logits, y), leaf)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--num-users", type=int, default=2000)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--users", type=int, default=400, help="users timed (vectorized)")
    parser.add_argument("--loop-users", type=int, default=40, help="users timed (loop)")
    parser.add_argument("--body-steps", type=int, default=1)
    parser.add_argument("--chunk-mb", type=float, default=None,
                        help="memory budget of a chunk of users (default: the key's default)")
    parser.add_argument("--per-user-floats", type=int, default=None,
                        help="the per-user path's cap on a chunk's per-user parameter floats "
                             "(default: deep_algorithm.PER_USER_FLOATS; 1000000000000 lifts it)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    parser.add_argument("--allocator", choices=("both", "default", "sweep"), default="both",
                        help="glibc malloc settings: its defaults, the sweep workers' "
                             "(MALLOC_ENV), or both in turn (each in a fresh process)")
    args = parser.parse_args()
    if args.allocator == "both":
        argv = [part for key, value in vars(args).items()
                if key != "allocator" and value is not None
                for part in (f"--{key.replace('_', '-')}", str(value))]
        for allocator in ("default", "sweep"):
            subprocess.run([sys.executable, __file__, *argv, "--allocator", allocator],
                           check=True, env=_allocator_env(allocator))
        return
    print(f"glibc malloc: {args.allocator}")
    if args.per_user_floats is not None:
        deep_algorithm.PER_USER_FLOATS = args.per_user_floats
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"dataset {args.dataset}, N = {args.num_users}, model {args.model}")
    print(f"{'algorithm':<22}{'chunk':>6}{'vectorized users/s':>20}{'loop users/s':>14}"
          f"{'ratio':>8}")
    ceilings = []
    for name in ("deep-private-fedrep", "deep-dp-fedavg"):
        cfg = parse_config({"algorithm": name, "dataset": args.dataset,
                            "num-users": args.num_users, "model": args.model,
                            "body-steps": args.body_steps,
                            **({} if args.chunk_mb is None else {"chunk-mb": args.chunk_mb})},
                           strict=True)
        cls, problem = get_algorithm(name), problem_of(cfg)
        trains = cls.released_part  # what a round trains and releases: "body" or "model"
        model = torch.from_numpy(problem.spec.initial(0))
        size = cls.round_chunk(cfg, problem)  # users per vectorized call, as a node splits
        work = []
        for count in (args.users, args.loop_users):
            ids = np.arange(count)
            block = user_block(problem, ids)
            first, second, mask = disjoint_batches(0, 1, ids, block.counts,
                                                   block.y.shape[1], problem.batch_size)
            work.append((block, first, second, mask))
        best = [float("inf")] * 3
        paths = [0, 1, 2] if trains == "model" else [0, 1]
        for _ in range(args.repeats):  # best of the repeats, the paths interleaved
            for path in paths:
                block, first, second, mask = work[1 if path == 1 else 0]
                t0 = time.perf_counter()
                if path == 2:  # the ceiling: the vectorized users as one batch
                    for lo in range(0, len(block.user_ids), size):
                        part = slice(lo, lo + size)
                        batch_step(problem, model, block.part(part), first[part],
                                   second[part])
                    best[2] = min(best[2], time.perf_counter() - t0)
                    continue
                if path == 0:
                    with torch.no_grad():  # as the nodes call it (it enables grad inside)
                        for lo in range(0, len(block.user_ids), size):
                            part = slice(lo, lo + size)
                            out = cls.clipped_work(cfg, problem, model, block.part(part),
                                                   first[part], second[part], mask[part],
                                                   cfg.clip_norm)
                else:
                    updates = loop_round(cfg, problem, model, block, first, second, trains)
                    out = dm.clipped_sum(updates, cfg.clip_norm)
                best[path] = min(best[path], time.perf_counter() - t0)
                assert out[0].shape == (cls.released_size(problem.spec),)
        rates = [args.users / best[0], args.loop_users / best[1]]
        print(f"{name:<22}{size:>6}{rates[0]:>20.0f}{rates[1]:>14.0f}{rates[0] / rates[1]:>7.1f}x")
        if 2 in paths:
            ceiling = args.users / best[2]
            ceilings.append((name, ceiling, rates[1]))
    for name, ceiling, loop in ceilings:
        print(f"ceiling for {name}: its users' rows as one float32 batch, one forward and "
              f"backward pass, nothing per user: {ceiling:.0f} users/s, "
              f"{ceiling / loop:.1f}x its loop")


def _allocator_env(allocator: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    return {**env, **MALLOC_ENV} if allocator == "sweep" else env


if __name__ == "__main__":
    main()
