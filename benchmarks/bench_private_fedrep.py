"""Benchmark: Private FedRep end to end through Flower's simulation engine vs in-process.

Prints wall time (start-up included) of `fedpriv run` on the Flower simulation engine, the same
core math in one process without Flower, their ratio, the peak memory of each, and utility.

    python benchmarks/bench_private_fedrep.py                    # paper setting, n = 20,000
    python benchmarks/bench_private_fedrep.py --users 100000     # scale check
    python benchmarks/bench_private_fedrep.py --epsilons 1 2 4 8 # utility table (in-process)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedpriv.config import RunConfig  # noqa: E402
from fedpriv.config_files import load_run_config  # noqa: E402
from fedpriv.engine import run_in_process  # noqa: E402


class ProcessMemorySampler(threading.Thread):
    """Samples the RSS of every Flower and Ray process started after it (they are detached from
    this process, so getrusage cannot see them): peak of the sum and of the largest one."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.before = set(os.listdir("/proc"))
        self.peak_total = self.peak_single = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            total = 0.0
            for pid in set(os.listdir("/proc")) - self.before:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if not any(t in cmd for t in (b"ray", b"flwr", b"flower", b"fedpriv")):
                        continue
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            rss = int(line.split()[1]) / 1024
                            total += rss
                            self.peak_single = max(self.peak_single, rss)
                except OSError:
                    continue
            self.peak_total = max(self.peak_total, total)


def flower_run(sets: list[str]) -> tuple[float, dict]:
    short = tempfile.mkdtemp(prefix="fpb", dir="/tmp")
    env = dict(os.environ, FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               FLWR_TELEMETRY_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               FLWR_HOME=f"{short}/flwr", RAY_TMPDIR=f"{short}/ray")
    os.makedirs(env["RAY_TMPDIR"])
    out = Path(short) / "results.json"
    cmd = [sys.executable, "-m", "fedpriv.cli", "run", str(ROOT / "configs/private_fedrep.toml"),
           "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    start = time.perf_counter()
    sampler = ProcessMemorySampler()
    sampler.start()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    print(f"flower processes: peak RSS sum {sampler.peak_total:.0f} MB, largest single process "
          f"{sampler.peak_single:.0f} MB")
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-4000:] + proc.stderr[-4000:])
    return wall, json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=20000)
    ap.add_argument("--epsilons", type=float, nargs="*", default=None,
                    help="only the in-process utility table over these epsilons")
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args()
    sets = [f"num-users={args.users}"]
    if args.epsilons:
        print(f"{'epsilon':>8} {'seed':>4} {'population_mse':>15} {'subspace_dist':>14} "
              f"{'local_only':>10} {'eps_spent':>9}")
        for eps in args.epsilons:
            for seed in range(args.seeds):
                config = RunConfig.from_mapping(load_run_config(
                    str(ROOT / "configs/private_fedrep.toml"),
                    sets + [f"epsilon={eps}", f"seed={seed}"]))
                r = run_in_process(config, log=lambda _: None)
                m = r["metrics"]
                print(f"{eps:>8g} {seed:>4} {m['population_mse']:>15.4g} "
                      f"{m['subspace_distance']:>14.4g} {m['local_only_mse']:>10.4g} "
                      f"{r['privacy']['epsilon']:>9.4f}")
        return
    config = RunConfig.from_mapping(load_run_config(str(ROOT / "configs/private_fedrep.toml"),
                                                    sets))
    start = time.perf_counter()
    local = run_in_process(config, log=lambda _: None)
    in_process = time.perf_counter() - start
    in_process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    wall, flower = flower_run(sets)
    print(f"users={args.users} d={config.dim} k={config.rank} m={config.samples_per_user} "
          f"T={config.rounds} epsilon={config.epsilon} nodes={flower['num_nodes']}")
    print(f"{'engine':<12} {'wall_s':>8} {'peak_MB':>9} {'population_mse':>15} {'eps':>8}")
    print(f"{'flower':<12} {wall:>8.1f} {'n/a':>9} "
          f"{flower['metrics']['population_mse']:>15.4g} {flower['privacy']['epsilon']:>8.4f}")
    print(f"{'in-process':<12} {in_process:>8.1f} {in_process_peak:>9.0f} "
          f"{local['metrics']['population_mse']:>15.4g} {local['privacy']['epsilon']:>8.4f}")
    print(f"flower / in-process wall-time ratio: {wall / in_process:.2f}")
    print("(peak_MB: max RSS of this process; for the Flower run see the sampled line above)")


if __name__ == "__main__":
    main()
