"""How long the default job takes from the command to the prompt, and where the time goes.

Runs ``fedpriv run`` (the default job: Private FedRep, 2,000 users, through Flower's simulation
engine) and the same job with ``--engine inprocess`` ``--repeat`` times each, in fresh
processes with a private FLWR_HOME and RAY_TMPDIR, and prints the median of each phase, read
from the time each line of the command's output arrives:

* checks: the command to its ``launching Flower simulation`` line (parsing, the size guard,
  the privacy plan);
* Flower start: to the ServerApp's first line (``flwr run``, the local SuperLink, the
  SuperExec, the simulation process);
* nodes: to the first step's line (Ray, the ClientApp actors, node discovery; the ServerApp
  calibrates meanwhile);
* steps: the first step's line to the last one's;
* results and exit: the last step's line to the command's exit (summary, files, stopping
  the SuperLink and Ray).

Each run starts with an empty folder of the accountant's remembered answers
(``FEDPRIV_ACCOUNTING_CACHE``): a first run's figures. ``--warm`` shares one folder, so every
run but the first reads its privacy plan back (a config run again).

    python benchmarks/bench_startup.py --repeat 5 [--warm]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("checks", "Flower start", "nodes", "steps", "results and exit")
MARKS = (re.compile(r"fedpriv: launching Flower simulation"),
         re.compile(r"^fedpriv: [\w-]+, \d+ users, target"),
         re.compile(r"^\[1/\d+\] "),
         re.compile(r"^\[(\d+)/\1\] "))


def timed_run(args: list[str], env: dict[str, str]) -> tuple[float, list[tuple[float, str]]]:
    """The command's wall seconds and each output line with the second it arrived."""
    started = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    lines = [(time.perf_counter() - started, line.rstrip()) for line in proc.stdout]
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n" + "\n".join(t for _, t in lines[-20:]))
    return time.perf_counter() - started, lines


def phases(wall: float, lines: list[tuple[float, str]]) -> list[float]:
    """The seconds of each of ``PHASES`` in one Flower run."""
    marks = []
    for pattern in MARKS:
        hit = next((t for t, text in lines if pattern.search(text)), None)
        if hit is None:
            raise SystemExit(f"no line matching {pattern.pattern!r} in the run's output")
        marks.append(hit)
    points = [0.0, *marks, wall]
    return [b - a for a, b in zip(points, points[1:], strict=False)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warm", action="store_true",
                        help="one accountant cache for every run (a config run again)")
    args = parser.parse_args(argv)
    flower: list[list[float]] = []
    walls: dict[str, list[float]] = {"flower": [], "inprocess": []}
    with tempfile.TemporaryDirectory(prefix="fpsu", dir="/tmp") as tmp:
        for i in range(args.repeat):
            for engine in ("flower", "inprocess"):
                home = Path(tmp, f"{engine}-{i}")
                (home / "ray").mkdir(parents=True)
                env = {**os.environ, "FLWR_HOME": str(home / "flwr"),
                       "RAY_TMPDIR": str(home / "ray"), "FLWR_TELEMETRY_ENABLED": "0",
                       "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                       "FEDPRIV_ACCOUNTING_CACHE": str(Path(tmp, "memo") if args.warm
                                                       else home / "memo")}
                cmd = [sys.executable, "-m", "fedpriv.cli", "run", "--out",
                       str(home / "run.json"), "--engine", engine]
                wall, lines = timed_run(cmd, env)
                walls[engine].append(wall)
                if engine == "flower":
                    flower.append(phases(wall, lines))
                print(f"run {i + 1}/{args.repeat} {engine}: {wall:.1f} s", flush=True)
    print(f"\nthe default job (`fedpriv run`), median of {args.repeat} runs, {os.cpu_count()} "
          f"cores, accountant cache {'warm' if args.warm else 'empty'}\n\n"
          "| phase | seconds |\n|---|---:|")
    for name, values in zip(PHASES, zip(*flower, strict=True), strict=True):
        print(f"| {name} | {statistics.median(values):.1f} |")
    for engine, values in walls.items():
        print(f"| **{engine}, command to prompt** | **{statistics.median(values):.1f}** "
              f"(min {min(values):.1f}, max {max(values):.1f}) |")


if __name__ == "__main__":
    main()
