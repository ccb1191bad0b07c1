"""Benchmark: what secure aggregation (``aggregation = "secure"``, issue 37) costs per round
against the distributed mode it builds on (same noisy shares, no masking), and central for
reference, everything else equal: Private FedRep on synthetic data (dim 50, rank 2),
``users-per-node`` users per node, ``num-users = nodes * users-per-node``, RDP, epsilon 1.

* ``inprocess``: ``fedpriv.engine.run_in_process``; the nodes run one after the other, so a
  step's seconds (its round report's) add up every node's work. Bytes: secure rounds count
  their own messages (``secure_bytes_to_nodes/_from_nodes``: ``payload_bytes``); distributed
  and central are counted the same way here (broadcast arrays + step JSON; sums + counts +
  metrics at 8 B). "Flower bytes": every message as fedpriv's records serialized by
  ``flwr.common.serde`` plus one message's metadata; its time is taken off the step's seconds.
* ``flower``: ``python -m fedpriv.cli run`` in Flower's simulation engine (Ray).
* ``processes``: SuperLink + one SuperNode process per node on 127.0.0.1 (no TLS), submitted
  with ``fedpriv deploy submit``; each SuperNode starts a ``flwr-clientapp`` process per
  message. A node count is skipped when its peak memory, predicted from the last process run,
  exceeds half the available memory. Memory: peak summed PSS of the run's processes.

    python benchmarks/bench_secure_aggregation.py --quick    # smoke: 4 nodes, 1 round
    python benchmarks/bench_secure_aggregation.py            # 10, 50, 100 nodes, 2 rounds
    python benchmarks/bench_secure_aggregation.py --nodes 10 100 1000 --engines inprocess \
        flower --fault-rate 0.1                  # SecAgg+ neighbourhoods, 10% crashing
    python benchmarks/bench_secure_aggregation.py --table results/bench_secure/bench.json
                                          # writes bench.json (after every run) and bench.png
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from flwr.common import Metadata  # noqa: E402
from flwr.common.serde import metadata_to_proto, recorddict_to_proto  # noqa: E402

import fedpriv.engine as engine  # noqa: E402
from clients.records import to_records  # noqa: E402
from fedpriv import deploy as dep  # noqa: E402
from fedpriv import protocol as P  # noqa: E402
from fedpriv.configure import parse_config  # noqa: E402
from fedpriv.secagg.local import LocalNodes  # noqa: E402
from fedpriv.secagg.node import Failure  # noqa: E402
from fedpriv.server.report import measured_metrics  # noqa: E402
from fedpriv.server.secagg import SecureRound, payload_bytes  # noqa: E402

MODES = ("secure", "distributed", "central")
AVAILABLE = ("/proc/meminfo", "MemAvailable:")
ENGINES = ("inprocess", "flower", "processes")


def workload(nodes: int, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    return {"algorithm": "private-fedrep", "num-users": nodes * args.users_per_node,
            "users-per-node": args.users_per_node, "dim": args.dim, "rank": args.rank,
            "samples-per-user": 10, "epsilon": 1.0, "delta": 1e-6, "accountant": "rdp",
            "rounds": args.rounds, "seed": 0, "aggregation": mode,
            **({"node-fault-rate": args.fault_rate} if args.fault_rate else {})}


def flower_bytes(content: Any, message_type: str, reply: bool) -> int:
    """The protobuf size of a message with ``content`` (full-length ids in its metadata)."""
    meta = metadata_to_proto(Metadata(
        run_id=2**63 - 1, message_id="0" * 64, src_node_id=2**63 - 1, dst_node_id=2**63 - 1,
        reply_to_message_id="0" * 64 if reply else "", group_id="1", created_at=time.time(),
        ttl=43200.0, message_type=message_type))
    return int(recorddict_to_proto(content).ByteSize() + meta.ByteSize())


def plain_records(step: Any, arrays: dict[str, Any], contrib: Any) -> tuple[Any, Any]:
    """The broadcast and reply of a distributed/central step as strategies/private.py and
    clients/app.py build them."""
    ask = RecordDict({P.ARRAYS: ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()}),
                      P.CONFIG: ConfigRecord({P.KEY_STEP: step.to_json()})})
    metrics: dict[str, Any] = {P.KEY_NUM_USERS: int(contrib.num_users),
                               P.KEY_NUM_CLIPPED: int(contrib.num_clipped), P.KEY_PARTITION: 0,
                               P.KEY_COMPUTE_S: 0.0, P.KEY_DECODE_S: 0.0}
    metrics.update({P.METRIC_PREFIX + k: float(v) for k, v in (contrib.metrics or {}).items()})
    answer = RecordDict({P.METRICS: MetricRecord(metrics), P.ARRAYS: ArrayRecord(
        {k: Array(np.asarray(v)) for k, v in contrib.totals.items()})})
    return ask, answer


def run_inprocess(values: dict[str, Any]) -> dict[str, Any]:
    """One in-process run, counting payload and Flower bytes (serialization time excluded)."""
    counts: dict[str, dict[str, Any]] = {}

    def count(label: str) -> dict[str, Any]:
        return counts.setdefault(label, {"to": 0, "from": 0, "flower_to": 0, "flower_from": 0,
                                         "serde_s": 0.0})

    originals = {name: getattr(engine, name) for name in ("node_step", "LocalNodes",
                                                          "SecureRound")}

    def node_step(algorithm: Any, config: Any, step: Any, arrays: Any, hosted: Any) -> Any:
        contrib = originals["node_step"](algorithm, config, step, arrays, hosted)
        t0, c = time.perf_counter(), count(step.label)
        c["to"] += payload_bytes({**arrays, P.KEY_STEP: step.to_json()})
        c["from"] += payload_bytes({**contrib.totals, "n": 0, "c": 0, **(contrib.metrics or {})})
        ask, answer = plain_records(step, arrays, contrib)
        kind = P.MSG_FINAL if step.is_final else P.MSG_STEP
        c["flower_to"] += flower_bytes(ask, kind, False)
        c["flower_from"] += flower_bytes(answer, kind, True)
        c["serde_s"] += time.perf_counter() - t0
        return contrib

    class CountingNodes(LocalNodes):
        def send(self, stage: str, messages: Any) -> Any:
            replies = super().send(stage, messages)
            assert self.step is not None
            t0, c, kind = time.perf_counter(), count(self.step.label), P.MSG_SECAGG[stage]
            c["flower_to"] += sum(flower_bytes(to_records(m), kind, False)
                                  for m in messages.values())
            c["flower_from"] += sum(flower_bytes(to_records(r), kind, True)
                                    for r in replies.values() if not isinstance(r, Failure))
            c.setdefault("stage_serde_s", {})[stage] = time.perf_counter() - t0
            c["serde_s"] += c["stage_serde_s"][stage]
            return replies

    class TimedRound(SecureRound):  # each stage's seconds (its sends, the nodes' work in them)
        def run(self) -> Any:
            outcome, c = super().run(), count(self.step.label)
            c["stages_s"] = {k: v - c.get("stage_serde_s", {}).get(k, 0.0)
                             for k, v in outcome.seconds.items()}
            return outcome

    patched = {"node_step": node_step, "LocalNodes": CountingNodes, "SecureRound": TimedRound}
    for name, value in patched.items():  # counting wrappers, undone below
        setattr(engine, name, value)
    try:
        started = time.perf_counter()
        results = engine.run_in_process(parse_config(values), log=lambda _: None)
        wall = time.perf_counter() - started
    finally:
        for name, value in originals.items():
            setattr(engine, name, value)
    steps = []
    for row in results["rounds"]:
        c = count(row["step"])
        if "secure_bytes_to_nodes" in row:
            c["to"], c["from"] = row["secure_bytes_to_nodes"], row["secure_bytes_from_nodes"]
        steps.append({"step": row["step"], "seconds": row["seconds"] - c["serde_s"],
                      "seconds_with_serde": row["seconds"],
                      "nodes_answered": row["nodes_answered"], **c})
    return {"wall_s": wall, "steps": steps, "num_nodes": results["num_nodes"],
            "population_mse": measured_metrics(results).get("population_mse")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_tree(roots: list[int], marker: bytes) -> set[int]:
    """``roots``, their descendants, and the processes whose environment holds ``marker``."""
    children: dict[int, list[int]] = {}
    found = set(roots)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
            if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.add(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    todo, out = list(found), set()
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def meminfo(path: str, key: str) -> int:
    """A ``key: N kB`` line of a /proc file, in bytes (0 if unreadable)."""
    try:
        line = next(x for x in Path(path).read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 0


class Group:
    """The processes of one run: private FLWR_HOME (the marker), logs, a memory sampler."""

    def __init__(self, workdir: Path) -> None:
        self.short = Path(tempfile.mkdtemp(prefix="fpb", dir="/tmp"))  # Ray: short socket paths
        self.logs = workdir
        self.env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "FLWR_TELEMETRY_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    "FLWR_HOME": str(self.short / "flwr"), "RAY_TMPDIR": str(self.short / "ray"),
                    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port())}
        self.env.pop("RAY_ADDRESS", None)
        for sub in ("flwr", "ray"):
            (self.short / sub).mkdir()
        self.marker = f"FLWR_HOME={self.env['FLWR_HOME']}".encode()
        self.started: list[subprocess.Popen[bytes]] = []
        self.peak_bytes = self.peak_procs = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:  # every second: the peak summed PSS and process count
        while not self._stop.wait(1.0):
            pids = proc_tree([p.pid for p in self.started], self.marker)
            pss = sum(meminfo(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
            self.peak_bytes = max(self.peak_bytes, pss)
            self.peak_procs = max(self.peak_procs, len(pids))

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.logs,
                                    start_new_session=True)
        self.started.append(proc)
        return proc

    def stop(self) -> list[int]:
        """SIGTERM every process of the group, SIGKILL what is left after 15 s; the leftovers."""
        self._stop.set()
        for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            pids = proc_tree([p.pid for p in self.started if p.poll() is None], self.marker)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and proc_tree([], self.marker):
                for p in self.started:
                    p.poll()
                time.sleep(0.3)
        left = sorted(proc_tree([], self.marker))
        shutil.rmtree(self.short, ignore_errors=True)
        if left:
            print(f"  warning: processes left after the run: {left}", flush=True)
        return left


def run_engine(engine_name: str, values: dict[str, Any], nodes: int, workdir: Path,
               timeout: float) -> dict[str, Any]:
    """``flower``: ``fedpriv run`` in the simulation engine. ``processes``: a SuperLink and
    ``nodes`` SuperNodes on 127.0.0.1, the run submitted (its time counts from the nodes'
    start). Everything started is stopped by PID afterwards."""
    out, group = workdir / "results.json", Group(workdir)
    try:
        if engine_name == "flower":
            argv = [sys.executable, "-m", "fedpriv.cli", "run", "--out", str(out)]
            argv += [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
        else:
            d = dep.Deployment(num_nodes=nodes, superlink_host="127.0.0.1",
                               bind_host="127.0.0.1", superlink_port=free_port(),
                               node_ports=tuple(free_port() for _ in range(nodes)), certs=None,
                               mounted=False, app_dir=str(ROOT))
            link, deadline = group.start("superlink", dep.superlink_command(d)), time.time() + 120
            while not dep.check_health(d.superlink_address, None):
                if link.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the SuperLink did not come up: " + (
                        workdir / "superlink.log").read_text(errors="replace")[-2000:])
                time.sleep(0.5)
            argv = [sys.executable, "-m", "fedpriv.cli",
                    *dep.submit_command(d, str(out), values)[1:]]
        started = time.perf_counter()
        for i in range(nodes if engine_name == "processes" else 0):
            group.start(f"supernode-{i}", dep.supernode_command(d, i))
        code = group.start("run", argv).wait(timeout=timeout)
        wall = time.perf_counter() - started
        if code != 0:
            tail = (workdir / "run.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the run exited {code}: {tail}")
    finally:
        group.stop()
    results = json.loads(out.read_text())
    return {"wall_s": wall, "flower_wall_time_s": results.get("wall_time_s"),
            "num_nodes": results["num_nodes"], "peak_pss_mb": group.peak_bytes / 2**20,
            "peak_processes": group.peak_procs,
            "population_mse": measured_metrics(results).get("population_mse"),
            "steps": [{"step": r["step"], "seconds": r["seconds"],
                       "nodes_answered": r["nodes_answered"],
                       "to": r.get("secure_bytes_to_nodes"),
                       "from": r.get("secure_bytes_from_nodes")} for r in results["rounds"]]}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Per training round (steps round-*): mean seconds and bytes."""
    rounds = [s for s in run["steps"] if s["step"].startswith("round-")] or run["steps"]
    run["s_per_round"] = statistics.mean(s["seconds"] for s in rounds)
    run["s_all_steps"] = sum(s["seconds"] for s in run["steps"])
    for key in ("to", "from", "flower_to", "flower_from"):
        vals = [s.get(key) for s in rounds]
        run[f"{key}_per_round"] = statistics.mean(vals) if None not in vals else None
    if all("stages_s" in s for s in rounds):  # secure in process: stages, and the rest
        run["stages_per_round"] = {k: statistics.mean(s["stages_s"][k] for s in rounds)
                                   for k in rounds[0]["stages_s"]}
        run["stages_per_round"]["rest"] = run["s_per_round"] - sum(
            run["stages_per_round"].values())
    return run


def fill_bytes(runs: list[dict[str, Any]]) -> None:
    """Byte counts a Flower or process run lacks (distributed/central payloads; Flower bytes):
    the in-process run's of the same config (the same messages), listed in ``filled``."""
    base = {(r["mode"], r["nodes"]): r for r in runs if r["engine"] == "inprocess"
            and "error" not in r}
    for r in runs:
        ref = base.get((r["mode"], r["nodes"]))
        for key in ("to", "from", "flower_to", "flower_from"):
            if ref is not None and "error" not in r and r.get(f"{key}_per_round") is None:
                r[f"{key}_per_round"] = ref.get(f"{key}_per_round")
                r.setdefault("filled", []).append(key)


def fmt_bytes(x: float | None) -> str:
    unit, size = next(((u, v) for u, v in (("MiB", 2**20), ("KiB", 2**10)) if (x or 0) >= v),
                      ("B", 1))
    return "-" if x is None else f"{x / size:.1f} {unit}" if size > 1 else f"{x:.0f} B"


def table(runs: list[dict[str, Any]]) -> list[str]:
    ok = [r for r in runs if "error" not in r]
    ref = {(r["engine"], r["nodes"]): r for r in ok if r["mode"] == "distributed"}
    rows = ["| nodes | engine | mode | runtime s | s/round | to nodes/round | from nodes/round "
            "| Flower bytes to/from per round | secure/distributed s/round | "
            "secure/distributed bytes | peak mem |", "|" + "---|" * 11]
    for r in sorted(ok, key=lambda r: (r["nodes"], ENGINES.index(r["engine"]),
                                       MODES.index(r["mode"]))):
        d, s_ratio, b_ratio = ref.get((r["engine"], r["nodes"])), "-", "-"
        if r["mode"] == "secure" and d is not None:
            s_ratio = f"{r['s_per_round'] / d['s_per_round']:.1f}x"
            if r["to_per_round"] and d["to_per_round"]:
                total = r["to_per_round"] + r["from_per_round"]
                b_ratio = f"{total / (d['to_per_round'] + d['from_per_round']):.1f}x"
        mem = f"{r['peak_pss_mb']:.0f} MB" if r.get("peak_pss_mb") else "-"
        b = {k: fmt_bytes(r.get(f"{k}_per_round")) + ("*" if k in r.get("filled", []) else "")
             for k in ("to", "from", "flower_to", "flower_from")}
        rows.append(f"| {r['nodes']} | {r['engine']} | {r['mode']} | {r['wall_s']:.1f} | "
                    f"{r['s_per_round']:.3f} | {b['to']} | {b['from']} | {b['flower_to']} / "
                    f"{b['flower_from']} | {s_ratio} | {b_ratio} | {mem} |")
    return rows + [f"| {r['nodes']} | {r['engine']} | {r['mode']} | failed: {r['error'][:120]} |"
                   for r in runs if "error" in r]


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in runs if "error" not in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    for engine_name in ENGINES:
        for mode, style in zip(MODES, ("-o", "--s", ":^"), strict=True):
            pts = sorted((r for r in ok if r["engine"] == engine_name and r["mode"] == mode),
                         key=lambda r: r["nodes"])
            if not pts:  # an engine or mode not run this time: nothing to draw
                continue
            x = [r["nodes"] for r in pts]
            a.plot(x, [r["s_per_round"] for r in pts], style, label=f"{engine_name} {mode}")
            if engine_name == "inprocess":
                b.plot(x, [(r["to_per_round"] + r["from_per_round"]) / 2**20 for r in pts],
                       style, label=mode)
    a.set(xlabel="nodes", ylabel="seconds per round", xscale="log", yscale="log",
          title="time per round")
    b.set(xlabel="nodes", ylabel="MiB per round (to + from nodes)", xscale="log",
          yscale="log" if b.lines else "linear", title="payload bytes per round")
    for axis in (a, b):
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke: 4 nodes, 1 round")
    parser.add_argument("--nodes", type=int, nargs="*", help="default 10 50 100 (--quick: 4)")
    parser.add_argument("--engines", nargs="*", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--process-nodes", type=int, nargs="*",
                        help="node counts run as processes (default: those of --nodes up to 20;"
                        " a count is also skipped when its predicted memory is too high)")
    parser.add_argument("--flower-nodes", type=int, nargs="*",
                        help="node counts run in the simulation engine (default: all)")
    parser.add_argument("--rounds", type=int, help="training rounds (default 2; --quick 1)")
    parser.add_argument("--fault-rate", type=float, default=0.0,
                        help="node-fault-rate: the share of nodes that crash in each step (a "
                             "secure node after it shared its keys); default 0")
    parser.add_argument("--repeats", type=int, default=1, help="in-process runs per point "
                        "(the one with the least s/round is kept; all are saved)")
    for name, default in (("--dim", 50), ("--rank", 2), ("--users-per-node", 20)):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--timeout", type=float, default=3600.0, help="per Flower/process run")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_secure"))
    parser.add_argument("--table", metavar="JSON", help="print the table of a saved run")
    args = parser.parse_args()
    if args.table:
        print("\n".join(table(json.loads(Path(args.table).read_text())["runs"])))
        return
    nodes = args.nodes or ([4] if args.quick else [10, 50, 100])
    args.rounds = args.rounds or (1 if args.quick else 2)
    process_nodes = (args.process_nodes if args.process_nodes is not None
                     else [n for n in nodes if n <= 20])
    flower_nodes = args.flower_nodes if args.flower_nodes is not None else nodes
    out = Path(args.out).resolve()  # the runs may change the working directory
    (out / "runs").mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "quick": args.quick, "nodes": nodes, "rounds": args.rounds, "dim": args.dim,
        "rank": args.rank, "users_per_node": args.users_per_node, "cpus": os.cpu_count(),
        "fault_rate": args.fault_rate,
        "mem_available_gb": meminfo(*AVAILABLE) / 2**30, "runs": [], "skipped": []}

    def save() -> None:
        fill_bytes(record["runs"])
        (out / "bench.json").write_text(json.dumps(record, indent=1, default=float))

    def attempt(engine_name: str, n: int, mode: str, fn: Callable[[], dict[str, Any]]) -> None:
        entry: dict[str, Any] = {"engine": engine_name, "mode": mode, "nodes": n,
                                 "load_before": os.getloadavg()[0], "code": subprocess.run(
                                     ["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip()}
        print(f"{engine_name:>9} {mode:>11} nodes={n:<4} (load {entry['load_before']:.2f}) ...",
              end=" ", flush=True)
        try:
            entry.update(fn())
            summarize(entry)
            print(f"{entry['wall_s']:.1f} s, {entry['s_per_round']:.3f} s/round, "
                  f"to {fmt_bytes(entry['to_per_round'])} from "
                  f"{fmt_bytes(entry['from_per_round'])} per round", flush=True)
        except Exception as exc:  # noqa: BLE001 -- report it and go on
            entry.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            print(f"FAILED: {entry['error'][:300]}", flush=True)
        entry["load_after"] = os.getloadavg()[0]
        record["runs"].append(entry)
        save()

    if "inprocess" in args.engines:
        run_inprocess(workload(4, args, "secure"))  # warm-up: imports, caches (not recorded)
        for n, mode in itertools.product(nodes, args.modes):
            def inproc(values: dict[str, Any] = workload(n, args, mode)  # noqa: B008
                       ) -> dict[str, Any]:
                tries = [summarize(run_inprocess(values)) for _ in range(args.repeats)]
                best = min(tries, key=lambda t: t["s_per_round"])
                best["repeats_s_per_round"] = [t["s_per_round"] for t in tries]
                return best

            attempt("inprocess", n, mode, inproc)
    for engine_name, counts in (("flower", flower_nodes), ("processes", process_nodes)):
        if engine_name not in args.engines:
            continue
        per_node: float | None = None  # measured peak memory per node, last process run
        for n in counts:
            for mode in args.modes:
                need = per_node * n if per_node else 0.0
                if engine_name == "processes" and need > 0.5 * meminfo(*AVAILABLE):
                    why = (f"predicted peak {need / 2**30:.1f} GiB > half the available "
                           f"{meminfo(*AVAILABLE) / 2**30:.1f} GiB")
                    record["skipped"].append({"engine": engine_name, "mode": mode,
                                              "nodes": n, "why": why})
                    print(f"{engine_name:>9} {mode:>11} nodes={n:<4} skipped: {why}")
                    save()
                    continue
                work = out / "runs" / f"{engine_name}-{mode}-{n}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                attempt(engine_name, n, mode, functools.partial(
                    run_engine, engine_name, workload(n, args, mode), n, work, args.timeout))
                last = record["runs"][-1]
                if engine_name == "processes" and last.get("peak_pss_mb"):
                    per_node = max(per_node or 0.0, last["peak_pss_mb"] * 2**20 / n)
    record["plot"] = plot(record["runs"], out / "bench.png")
    save()
    print(f"\n{args.rounds} round(s), Private FedRep dim {args.dim} rank {args.rank}, "
          f"{args.users_per_node} users per node, node-fault-rate {args.fault_rate:g}, "
          f"{os.cpu_count()} CPUs; per round = mean over "
          "steps round-*; bytes: fedpriv payload (arrays at nbytes, numbers at 8 B) and "
          "Flower's protobuf; * = counted in process (same messages)\n")
    print("\n".join(table(record["runs"])))
    for s in record["skipped"]:
        print(f"skipped: {s['engine']} {s['mode']} {s['nodes']} nodes: {s['why']}")
    print(f"\nresults: {out / 'bench.json'}" + (f", {out / 'bench.png'}" if record["plot"]
                                                 else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
