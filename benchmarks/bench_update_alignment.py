"""Why a private method trails: how much of a round's release is signal.

One round of the users' local work at a given model: each user's update is clipped at the
median update norm C (where adaptive clipping at ``clip-quantile = 0.5`` settles) and the
clipped updates are averaged over the population. The mean's norm over C is the round's
*alignment*: 1 if every user moves the same way, about 1/sqrt(n) if they share no direction.
The Gaussian noise added to that mean has norm about ``z C sqrt(P) / n`` (z: the multiplier the
accountant calibrates for the config's epsilon and rounds, divided by sqrt(1 - clip-count-share)
with adaptive clipping; P: the released parameters; n: the population), so per round

    SNR = alignment * n / (z sqrt(P))

No noise is drawn here: this is the noiseless mean of one round (a diagnostic for the
operator on data they hold, not a release). Measured at the initial model, or with
``--model-from RESULTS.json`` at the model an earlier run released (its ``server_state``: the
body for FedRep, the whole model for DP-FedAvg; the rest stays initial).

    python benchmarks/bench_update_alignment.py [--users 400] [--model-from results.json]
        [--set head-steps=30] [--algorithms deep-private-fedrep,deep-dp-fedavg]

Default: the Fashion-MNIST figure's setting (label skew S = 5, N = 2,000, MLP 784-256-128-10,
epsilon 1, delta 1e-5, each algorithm at its tuned rounds: configs/figure_fmnist_label_skew.toml).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.deep_algorithm import disjoint_batches
from fedpriv.algorithms.deep.problem import problem_of, user_block
from fedpriv.config import RunConfig
from fedpriv.config_files import parse_overrides
from fedpriv.configure import parse_config  # noqa: E402
from fedpriv.registry import get_algorithm
from fedpriv.server.core import check_plan

BASE = {"dataset": "fashion-mnist", "partition": "label-skew", "classes-per-user": 5,
        "num-users": 2000, "delta": 1e-5, "epsilon": 1.0, "model": "mlp",
        "hidden-sizes": "256,128", "head-steps": 100, "final-head-steps": 100, "body-steps": 1,
        "local-lr": 0.1, "server-momentum": 0.9, "clip-quantile": 0.5, "seed": 100}
ROUNDS = {"deep-private-fedrep": 20, "deep-dp-fedavg": 40, "deep-dp-fedavg-ft": 40}


def alignment(config: RunConfig, users: int, released: np.ndarray | None) -> tuple[float, int]:
    """||mean over users of updates clipped at their median norm|| / median norm, and the
    released size P."""
    cls, problem = get_algorithm(config.algorithm), problem_of(config)
    spec = problem.spec
    model = torch.from_numpy(spec.initial(config.seed))
    if released is not None:
        model[:len(released)] = torch.from_numpy(released.astype(np.float32))
    size = cls.round_chunk(config, problem)
    updates = []
    with torch.no_grad():
        for lo in range(0, users, size):
            ids = np.arange(lo, min(users, lo + size))
            block = user_block(problem, ids)
            first, second, mask = disjoint_batches(config.seed, 1, block.keys, block.counts,
                                                   block.y.shape[1], problem.batch_size)
            updates.append(cls.local_work(config, problem, model, block, first, second, mask))
    stacked = torch.cat(updates)
    return dm.clipped_mean_alignment(stacked), stacked.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", default="deep-private-fedrep,deep-dp-fedavg")
    parser.add_argument("--users", type=int, default=400, help="users whose updates are measured")
    parser.add_argument("--model-from", default="", help="a results JSON: its released model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    released = None
    if args.model_from:
        with open(args.model_from) as f:
            released = np.asarray(json.load(f)["server_state"]["parameters"], dtype=np.float64)
    print(f"{'algorithm':<22}{'P':>9}{'alignment':>11}{'z':>8}{'noise/C':>9}{'SNR/round':>11}")
    for name in args.algorithms.split(","):
        values = {**BASE, "algorithm": name, "rounds": ROUNDS.get(name, 20), **overrides}
        config = parse_config(values)
        z = check_plan(config)[0]
        if config.clip_quantile > 0:  # the update's share of the round's Gaussian
            z /= np.sqrt(1.0 - config.clip_count_share)
        align, size = alignment(config, min(args.users, config.num_users), released)
        noise = z * np.sqrt(size) / config.num_users
        print(f"{name:<22}{size:>9}{align:>11.3f}{z:>8.1f}{noise:>9.2f}{align / noise:>11.4f}")


if __name__ == "__main__":
    main()
