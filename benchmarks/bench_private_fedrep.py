"""Benchmark: Private FedRep end to end through Flower's simulation engine vs in-process.

Prints wall time (start-up included) of `fedpriv run` on the Flower simulation engine, the same
core math in one process without Flower, their ratio, the peak memory of each, and utility.

    python benchmarks/bench_private_fedrep.py                    # paper setting, n = 20,000
    python benchmarks/bench_private_fedrep.py --users 100000     # scale check
    python benchmarks/bench_private_fedrep.py --epsilons 1 2 4 8 # utility table (in-process)

The Flower run's memory is sampled over every process it starts (``measured_run``, shared with
``bench_scaling.py``); its output goes to results/bench_private_fedrep/ (ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from fedpriv.config_files import load_run_config  # noqa: E402
from fedpriv.configure import parse_config  # noqa: E402
from fedpriv.engine import run_in_process  # noqa: E402

RUN_MARKER_ENV = "FEDPRIV_BENCH_RUN"
"""Set to a fresh id in the environment of each measured run: every process of the run (the
``fedpriv`` CLI, ``flwr``, the SuperLink, the simulation, Ray's daemons and workers) inherits it,
which tells them apart from other Flower/Ray processes on the machine (a test run beside)."""


def _label(pid: str) -> str:
    """A short name for a process: Ray's title (``ray::ClientAppActor``, without the method it
    runs), else the program, script or module it runs (past the Python interpreter)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if args[0].startswith("ray::"):
        return args[0].split()[0].split(".")[0]
    args = [a for a in args if a and a not in ("-u", "-m")]
    if args and Path(args[0]).name.startswith("python"):
        args = args[1:]
    return Path(args[0]).name if args else Path(f"/proc/{pid}/comm").read_text().strip()


class ProcessMemorySampler(threading.Thread):
    """Samples, every ``interval`` s, the RSS (and PSS: shared pages split between the processes
    that map them) of every process whose environment holds ``RUN_MARKER_ENV=marker`` (Flower's
    and Ray's processes are detached from the process that starts them, so getrusage cannot see
    them): peaks of the sums and of the largest process, and the processes at the peak sum."""

    def __init__(self, marker: str, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.marker, self.interval = f"{RUN_MARKER_ENV}={marker}".encode(), interval
        self.peak_total = self.peak_single = self.peak_pss = 0.0
        self.at_peak: dict[str, float] = {}  # label (xcount) -> RSS MB at the peak sum
        self.stop = threading.Event()
        self._ours: dict[str, bool] = {}

    def pids(self) -> list[str]:
        """This run's live processes."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if pid not in self._ours:
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                self._ours[pid] = self.marker in env
            if self._ours[pid]:
                found.append(pid)
        return found

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            total = pss = 0.0
            parts: dict[str, list[float]] = {}
            for pid in self.pids():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                    label = _label(pid)
                except OSError:
                    continue
                rss = next((int(x.split()[1]) / 1024 for x in status.splitlines()
                            if x.startswith("VmRSS:")), 0.0)
                pss += next((int(x.split()[1]) / 1024 for x in rollup.splitlines()
                             if x.startswith("Pss:")), 0.0)
                total += rss
                self.peak_single = max(self.peak_single, rss)
                parts.setdefault(label, []).append(rss)
            self.peak_pss = max(self.peak_pss, pss)
            if total > self.peak_total:
                self.peak_total = total
                self.at_peak = {f"{k} x{len(v)}" if len(v) > 1 else k: sum(v)
                                for k, v in sorted(parts.items(), key=lambda kv: -sum(kv[1]))}

    def kill_all(self) -> list[str]:
        """SIGKILL every live process of this run (they are ours: they carry its marker)."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        return pids


@dataclass
class Measured:
    """One ``fedpriv run`` in a fresh process: wall time, memory, results (None unless ok)."""

    status: str  # "ok", "timeout" or "failed (exit N)"
    wall: float
    peak_total: float  # MB: peak of the summed RSS of the run's processes
    peak_single: float  # MB: the largest single process
    peak_pss: float  # MB: peak of the summed PSS (shared pages counted once)
    at_peak: dict[str, float]
    results: dict | None
    log: Path
    leftovers: list[str] = field(default_factory=list)  # processes killed after the end


def measured_run(sets: list[str], out: Path,
                 config: str | Path = ROOT / "configs/private_fedrep.toml",
                 engine: str = "flower", timeout: float | None = None) -> Measured:
    """``fedpriv run CONFIG --engine ENGINE --out OUT`` in a fresh process group (its output in
    OUT with suffix ``.log``), with a private FLWR_HOME, a short RAY_TMPDIR and free local
    SuperLink ports (runs beside it are left alone). A run past ``timeout`` s, or interrupted,
    is killed: its group and every process that carries its marker."""
    short = tempfile.mkdtemp(prefix="fpb", dir="/tmp")  # Ray's socket paths: keep them short
    marker = uuid.uuid4().hex
    env = dict(os.environ, FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               FLWR_TELEMETRY_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               FLWR_HOME=f"{short}/flwr", RAY_TMPDIR=f"{short}/ray",
               FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
               FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()), **{RUN_MARKER_ENV: marker},
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [
                   os.environ.get("PYTHONPATH")] if p]))  # this checkout's fedpriv
    os.makedirs(env["RAY_TMPDIR"])
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    cmd = [sys.executable, "-m", "fedpriv.cli", "run", str(config), "--engine", engine,
           "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    sampler = ProcessMemorySampler(marker)
    sampler.start()
    start = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    status = None
    try:
        while status is None:  # wait4: the child's own peak RSS, which sampling may miss
            pid, code, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(code)
                status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            elif timeout is not None and time.perf_counter() - start > timeout:
                status, usage = "timeout", None
            else:
                time.sleep(0.05)
    finally:
        if status in (None, "timeout"):  # timed out, or interrupted (Ctrl-C)
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            sampler.kill_all()
        if status is None:  # interrupted: a last sweep for processes started meanwhile
            time.sleep(1)
            sampler.kill_all()
            shutil.rmtree(short, ignore_errors=True)
    wall = time.perf_counter() - start
    leftovers = []
    for _ in range(40):  # Flower/Ray processes that outlive the run: give them 10 s
        if not sampler.pids():
            break
        time.sleep(0.25)
    else:
        leftovers = [_label(p) for p in sampler.pids()]
        sampler.kill_all()
    sampler.stop.set()
    sampler.join()
    own = usage.ru_maxrss / 1024 if usage else 0.0
    results = json.loads(out.read_text()) if status == "ok" and out.is_file() else None
    shutil.rmtree(short, ignore_errors=True)
    return Measured(status, wall, max(sampler.peak_total, own), max(sampler.peak_single, own),
                    sampler.peak_pss, sampler.at_peak, results, log, leftovers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_run(sets: list[str]) -> tuple[float, dict]:
    """The paper setting with ``sets`` through Flower: wall time and results (exits on failure)."""
    m = measured_run(sets, ROOT / "results/bench_private_fedrep/flower.json")
    print(f"flower processes: peak RSS sum {m.peak_total:.0f} MB, largest single process "
          f"{m.peak_single:.0f} MB")
    if m.results is None:
        raise SystemExit(f"{m.log.read_text()[-4000:]}\nthe Flower run {m.status}; its output: "
                         f"{m.log}")
    return m.wall, m.results


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
                config = parse_config(load_run_config(
                    str(ROOT / "configs/private_fedrep.toml"),
                    sets + [f"epsilon={eps}", f"seed={seed}"]))
                r = run_in_process(config, log=lambda _: None)
                m = r["metrics"]
                print(f"{eps:>8g} {seed:>4} {m['population_mse']:>15.4g} "
                      f"{m['subspace_distance']:>14.4g} {m['local_only_mse']:>10.4g} "
                      f"{r['privacy']['epsilon']:>9.4f}")
        return
    config = parse_config(load_run_config(str(ROOT / "configs/private_fedrep.toml"),
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
