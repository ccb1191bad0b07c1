"""Server-side cost of one round of ``fedpriv_flwr.PrivateStrategy`` against Flower's own
``DifferentialPrivacyServerSideFixedClipping``, both around ``FedAvg``.

What is timed is the strategy's own work in a round (``configure_train`` + ``aggregate_train``:
sampling, the replies' checks, clipping, the sum, the noise, the accounting, the report files);
the nodes' replies are built beforehand, so the nodes' training and the transport are not in it.
Default: N = 2,000 one-user nodes and a model of 235,146 parameters (the example app's MLP
784-256-128-10, fedpriv's default deep model), z from the same calibration for both.

    python benchmarks/bench_flower_wrapper.py [--nodes 2000] [--params 235146] [--repeats 3]
        [--round-seconds S]   # a measured round time, to print the share of the round
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedpriv_flwr import PrivateStrategy  # noqa: E402
from tests.flower_grid import FakeGrid, set_identity  # noqa: E402


def _model(params: int) -> ArrayRecord:
    rows = max(1, params // 100)
    return ArrayRecord({"w": Array(np.zeros((rows, 100), np.float32)),
                        "b": Array(np.zeros(params - rows * 100, np.float32))})


def _replies(messages: list[Message], rng: np.random.Generator) -> list[Message]:
    out = []
    for m in messages:
        arrays = {k: Array((v.numpy() + rng.normal(0, 0.01, v.numpy().shape)).astype(np.float32))
                  for k, v in m.content["arrays"].items()}
        out.append(Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(
            {"num-examples": 1})}), reply_to=m))
    return out


def _time(strategy, grid: FakeGrid, model: ArrayRecord, rng: np.random.Generator,
          server_round: int) -> float:
    t0 = time.perf_counter()
    messages = list(strategy.configure_train(server_round, model, ConfigRecord(), grid))
    t1 = time.perf_counter()
    replies = _replies(messages, rng)  # the nodes' work: not timed
    t2 = time.perf_counter()
    strategy.aggregate_train(server_round, replies)
    return (t1 - t0) + (time.perf_counter() - t2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--params", type=int, default=235_146)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--round-seconds", type=float, default=None)
    args = parser.parse_args()
    set_identity()
    n, rounds = args.nodes, args.repeats
    grid = FakeGrid(n, lambda node, arrays: arrays)
    model = _model(args.params)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        ours = PrivateStrategy(FedAvg(min_available_nodes=1), num_users=n, num_rounds=rounds,
                               epsilon=1.0, delta=1e-5, results_path=f"{tmp}/r.json")
        z = ours.plan.multipliers["round"]
        flower = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(min_available_nodes=1, weighted_by_key="num-examples"), z, 1.0, n)
        times: dict[str, list[float]] = {"fedpriv PrivateStrategy": [],
                                         "Flower DP fixed clipping": []}
        for r in range(1, rounds + 1):
            times["fedpriv PrivateStrategy"].append(_time(ours, grid, model, rng, r))
            times["Flower DP fixed clipping"].append(_time(flower, grid, model, rng, r))
    print(f"server-side seconds per round, N = {n} one-user nodes, {args.params} parameters, "
          f"z = {z:.4f} (median of {rounds})")
    base = float(np.median(times["Flower DP fixed clipping"]))
    for name, ts in times.items():
        med = float(np.median(ts))
        share = (f", {100 * med / args.round_seconds:.2f}% of a {args.round_seconds:g} s round"
                 if args.round_seconds else "")
        print(f"  {name:28s} {med:7.3f} s  ({med / base:.2f}x Flower's){share}")


if __name__ == "__main__":
    main()
