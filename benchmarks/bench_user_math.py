"""Per-user cost of the pieces of a paper-setting node step, on one block of users.

Times (best of five) the generation of a block's training data and the user-side math of
Private FedRep on it: the clipped U-statistic sum (init), one round's factored gradients and
their clipped sum, the final S1 fits and the local-only reference fits.

    python benchmarks/bench_user_math.py [--users 20000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedpriv.algorithms.personalization import fedrep_math, init_math
from fedpriv.algorithms.personalization.problem import embedding_models, local_models
from fedpriv.data.synthetic import SyntheticProblem, generate_users
from fedpriv.privacy.mechanisms import clipped_outer_sum


def best_of(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, default=20000)
    n = ap.parse_args().users
    problem = SyntheticProblem(n, 50, 2, 10, 0.01)
    ids = np.arange(n)
    data = generate_users(problem, ids)
    (x0, y0), _ = data.split_halves()
    embedding = np.linalg.qr(np.random.default_rng(0).standard_normal((50, 2)))[0]

    def round_step():
        g, v = fedrep_math.gradient_factors(embedding, x0, y0, ids, 0, 1, 2)
        return clipped_outer_sum(g, v, 0.5)

    pieces = {
        "generate a user's training data": lambda: generate_users(problem, ids),
        "init: clipped U-statistic sum": lambda: init_math.clipped_u_statistic_sum(x0, y0, 1.0),
        "round: gradients and clipped sum": round_step,
        "final: S1 fits (U v_i)": lambda: embedding_models(problem, embedding, ids, data),
        "final: local-only fits": lambda: local_models(problem, ids, data),
    }
    print(f"{n:,} users, d = 50, k = 2, m = 10\n")
    print("| piece | ms per block | µs per user |\n|---|---|---|")
    for name, fn in pieces.items():
        seconds = best_of(fn)
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / n * 1e6:.2f} |")


if __name__ == "__main__":
    main()
