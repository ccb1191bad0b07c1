"""A feasibility probe for issue 50 (task-level private meta-learning of a deep model on few-shot
image tasks): **not** a fedpriv algorithm. No Flower, no ledger, no release: a loop in one
process that measures whether the issue's targets are within reach before the algorithms are
built into the framework.

Tasks: 5-way K-shot Fashion-MNIST tasks (``fedpriv.data.fewshot``), meta-training from the train
split's images, fresh meta-test tasks from the test split's (the same 10 classes: new images and
label orders, not new classes). Learner: an MLP body meta-learned with the prototypical loss
(Snell et al. 2017: a task adapts in closed form, its classes' mean support features; the
adapted loss is the query cross-entropy of the negative squared distances to them), Meta-NSGD's
round (Zhou & Bassily 2022, Alg. 1): Poisson-sampled tasks (rate q), each task's meta-gradient
clipped to C, the sum plus Gaussian noise N(0, (z C)^2) divided by the expected batch q n, a
momentum step. z is fedpriv's PLD calibration of T sampled releases (``calibrate_gaussian_plan``).
``--epsilon 0``: the same without clipping or noise. ``--scratch``: each meta-test task alone
(a linear softmax model on its support pixels, fitted by gradient descent).

    python benchmarks/probe_fewshot_meta.py --scratch
    python benchmarks/probe_fewshot_meta.py --epsilon 1
    python benchmarks/probe_fewshot_meta.py --epsilon 0
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from fedpriv.data.fewshot import Tasks, draw_tasks, source_pool
from fedpriv.data.sources import load_source
from fedpriv.privacy.accounting import PlannedRelease, calibrate_gaussian_plan


def proto_logits(fs: torch.Tensor, ys: torch.Tensor, fq: torch.Tensor, ways: int
                 ) -> torch.Tensor:
    """Negative squared distances of query features to the classes' mean support features."""
    onehot = (ys[..., None] == torch.arange(ways)).to(fs.dtype)
    proto = torch.einsum("...sw,...sh->...wh", onehot, fs) / onehot.sum(-2)[..., None]
    return -((fq[..., :, None, :] - proto[..., None, :, :]) ** 2).sum(-1)


def linear_scratch(xs: torch.Tensor, ys: torch.Tensor, xq: torch.Tensor, ways: int,
                   steps: int = 300) -> torch.Tensor:
    """Query logits of linear softmax models (with a bias) fitted on each task's support."""
    f = torch.cat([xs, torch.ones(*xs.shape[:2], 1)], -1)
    lip = f.pow(2).sum(-1).max(-1).values / 2
    w = torch.zeros(len(xs), ways, f.shape[-1])
    target = (ys[..., None] == torch.arange(ways)).to(xs.dtype)
    for _ in range(steps):
        probs = torch.softmax(torch.einsum("bsh,bwh->bsw", f, w), -1)
        w = w - torch.einsum("bsw,bsh->bwh", probs - target, f) / f.shape[1] / lip[:, None, None]
    return torch.einsum("bqh,bwh->bqw", torch.cat([xq, torch.ones(*xq.shape[:2], 1)], -1), w)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epsilon", type=float, default=1.0, help="0: no clipping, no noise")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--tasks", type=int, default=10_000, help="meta-training tasks (users)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.05, help="Poisson sampling rate q")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ways", type=int, default=5)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--queries", type=int, default=15)
    p.add_argument("--eval-tasks", type=int, default=1000)
    p.add_argument("--validation", action="store_true",
                   help="score validation tasks (other test-split draws) instead of test tasks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scratch", action="store_true", help="each meta-test task alone")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    pool = source_pool(load_source("fashion-mnist"))
    x = torch.from_numpy(pool.x.reshape(len(pool.x), -1))
    first = 10**6 if a.validation else 0
    scored = draw_tasks(pool, "test", np.arange(first, first + a.eval_tasks), a.ways, a.shots,
                        a.queries, a.seed)

    def block(tasks: Tasks, idx: np.ndarray) -> tuple[torch.Tensor, ...]:
        return (x[torch.from_numpy(tasks.rows("support")[idx])],
                torch.from_numpy(tasks.labels("support")[idx]),
                x[torch.from_numpy(tasks.rows("query")[idx])],
                torch.from_numpy(tasks.labels("query")[idx]))

    def accuracy(logits_of: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                 ) -> float:
        right = []
        with torch.no_grad():
            for start in range(0, a.eval_tasks, 250):
                xs, ys, xq, yq = block(scored, np.arange(start, min(start + 250, a.eval_tasks)))
                right.append((logits_of(xs, ys, xq).argmax(-1) == yq).float().mean(1))
        return float(torch.cat(right).mean())

    if a.scratch:
        alone = accuracy(lambda s, y, q: linear_scratch(s, y, q, a.ways))
        print(f"scratch (a linear model on each task's support pixels): {alone:.4f}")
        return
    body = torch.nn.Sequential(torch.nn.Linear(x.shape[1], a.hidden), torch.nn.ReLU())
    params = {k: v.detach().clone() for k, v in body.named_parameters()}

    def feats(prm: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(body, prm, (rows,))
        return out

    def task_loss(prm: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor,
                  xq: torch.Tensor, yq: torch.Tensor) -> torch.Tensor:
        logits = proto_logits(feats(prm, xs), ys, feats(prm, xq), a.ways)
        return torch.nn.functional.cross_entropy(logits, yq)

    private = a.epsilon > 0
    z = calibrate_gaussian_plan([PlannedRelease("meta-gradient", 1.0, a.rounds, a.rate)],
                                a.epsilon, a.delta)[0] if private else 0.0
    train = draw_tasks(pool, "train", np.arange(a.tasks), a.ways, a.shots, a.queries, a.seed)
    per_task = vmap(grad(task_loss), in_dims=(None, 0, 0, 0, 0))
    noise_gen = torch.Generator().manual_seed(a.seed + 1)
    sample_gen = np.random.default_rng(a.seed)
    velocity = {k: torch.zeros_like(v) for k, v in params.items()}
    print(f"epsilon {a.epsilon} delta {a.delta} z {z:.3f} rounds {a.rounds} q {a.rate} "
          f"(expected {a.rate * a.tasks:.0f} tasks a round)", flush=True)
    start = time.perf_counter()
    for r in range(a.rounds):
        idx = np.flatnonzero(sample_gen.random(a.tasks) < a.rate)
        total = {k: torch.zeros_like(v) for k, v in params.items()}
        for s in range(0, len(idx), 256):
            g = per_task(params, *block(train, idx[s:s + 256]))
            norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
            scale = ((a.clip / (norms + 1e-12)).clamp(max=1.0) if private
                     else torch.ones_like(norms))
            for k in total:
                total[k] += torch.einsum("b,b...->...", scale, g[k])
        for k in params:
            noise = torch.randn(params[k].shape, generator=noise_gen) * z * a.clip
            velocity[k] = a.momentum * velocity[k] + (total[k] + noise) / (a.rate * a.tasks)
            params[k] = params[k] - a.lr * velocity[k]
        if (r + 1) % max(1, a.rounds // 4) == 0:
            kept = accuracy(lambda s, y, q: proto_logits(feats(params, s), y, feats(params, q),
                                                         a.ways))
            print(f"round {r + 1}: {time.perf_counter() - start:.0f} s, accuracy {kept:.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
