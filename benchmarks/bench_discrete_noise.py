"""Cost of exact discrete noise from ChaCha20 against today's floating-point samplers.

Times (best of --reps) per coordinate: numpy's ``default_rng().standard_normal`` (PCG64,
floating point: today's sampler), the raw ChaCha20 words everything exact is built from, the
exact discrete Gaussian at several sigma, and Skellam at the same variance; then per draw the
exact exponential mechanism against the Gumbel-max one. Writes nothing.

    python benchmarks/bench_discrete_noise.py [--coords 1000000] [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from fedpriv.privacy.discrete import (
    CryptoRandom,
    discrete_gaussian,
    exact_exponential_mechanism,
    skellam,
)
from fedpriv.privacy.mechanisms import exponential_mechanism

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_user_math import best_of  # noqa: E402 - the same best-of-n timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coords", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--draws", type=int, default=1000, help="exponential-mechanism draws")
    args = ap.parse_args()
    n, reps = args.coords, args.reps
    rng, pcg = CryptoRandom(), np.random.default_rng()

    rows: list[tuple[str, float]] = [
        ("numpy standard_normal (PCG64, float; today)", best_of(lambda: pcg.standard_normal(n),
                                                               reps)),
        ("raw ChaCha20 64-bit words", best_of(lambda: rng.uint64(n), reps)),
    ]
    for log_sigma in (10, 17, 24):
        sigma = 2**log_sigma
        rows.append((f"discrete_gaussian sigma = 2^{log_sigma} (exact)",
                     best_of(lambda s=sigma: discrete_gaussian(s, n, rng), reps)))
        rows.append((f"skellam mu = 2^{2 * log_sigma} (same variance)",
                     best_of(lambda s=sigma: skellam(float(s) ** 2, n, rng), reps)))
    print(f"{n:,} coordinates, best of {reps}\n")
    print("| sampler | ms total | ns per coordinate |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / n * 1e9:.1f} |")

    print(f"\nexponential mechanism, {args.draws:,} draws, epsilon = 1, sensitivity = 1\n")
    print("| candidates | scores | Gumbel-max µs per draw | exact µs per draw | ratio |")
    print("|---|---|---|---|---|")
    gen = np.random.default_rng(0)
    for k in (10, 1000):
        cases = {"uniform on [0, 10]": gen.uniform(0, 10, k),
                 "one winner, rest +100": np.r_[0.0, np.full(k - 1, 100.0)]}
        for label, scores in cases.items():
            gumbel = best_of(lambda s=scores: [exponential_mechanism(s, 1.0, 1.0, pcg)
                                               for _ in range(args.draws)], reps)
            exact = best_of(lambda s=scores: [exact_exponential_mechanism(s, 1.0, 1.0, rng)
                                              for _ in range(args.draws)], reps)
            print(f"| {k} | {label} | {gumbel / args.draws * 1e6:.1f} | "
                  f"{exact / args.draws * 1e6:.1f} | {exact / gumbel:.1f} |")


if __name__ == "__main__":
    main()
