"""Benchmark: Flower's own SecAgg+ (``flwr.server.workflow.SecAggPlusWorkflow`` on the server,
``flwr.client.mod.secaggplus_mod`` on the clients), no differential privacy, in Flower's
simulation engine (``flwr.simulation.run_simulation``, backend Ray), to put beside fedpriv's
secure aggregation (benchmarks/bench_secure_aggregation.py).

* Workload: a legacy ``FedAvg`` (every node sampled, no evaluation) run by ``DefaultWorkflow``
  with ``SecAggPlusWorkflow`` as its fit workflow, ``rounds`` rounds. The model is one float32
  array of ``dim`` values; node ``p`` (its partition id) always returns
  ``x_p[j] = ((7 p + j) mod 17 - 8) / 8`` with ``num_examples = 1 + p mod 4``.
* Dropouts: each round ``round(dropout * nodes)`` nodes, drawn by ``default_rng([seed, round])``,
  fail in the "collect masked vectors" stage, i.e. after they shared their keys: a client mod
  in front of ``secaggplus_mod`` answers that stage with an error reply (``--drop-mode error``,
  what the engine sends when a ClientApp raises) or raises (``--drop-mode raise``), so the
  server must rebuild their secret keys from the neighbours' shares and strip their masks.
* Check: ``aggregate_fit`` receives (for every result) the unmasked weighted mean; it must equal
  ``sum(r_p x_p) / sum(r_p)`` over the surviving nodes, ``r_p`` the quantized weight
  ``round(num_examples / max_weight * Q) / Q``, within the quantization bound
  ``n * 2 * clipping_range / Q / sum(r_p)``; the survivors must be exactly the non-dropped nodes.
* Time: a round's seconds are the wall time of one ``SecAggPlusWorkflow`` call (configure_fit
  .. aggregate_fit, server side), with each stage's seconds and the part of it spent waiting
  in ``grid.send_and_receive``; ``s/round`` averages the rounds after the first (round 1 also
  waits in configure_fit for the nodes to register and for the Ray actors' first messages;
  with ``--rounds 1`` it is round 1); ``sim s`` is the whole ``run_simulation`` call (Ray
  start, node registration, rounds); ``proc s`` the worker process (imports included).
* Bytes: every message of the four SecAgg+ stages, to and from the nodes, measured in the
  ServerApp around ``grid.send_and_receive`` as the protobuf size of the whole Message,
  ``flwr.common.serde.message_to_proto(msg).ByteSize()`` (content and metadata, the outgoing
  ones after the grid stamped their ids): what a deployment carries, gRPC framing and Flower's
  splitting of a message into objects aside; the time this takes is left out of the seconds.
  ``B/node/round`` divides a round's total by the sampled nodes (dropped ones included). The
  third stage's FitIns carries the global model, so "to" includes the model broadcast: float32
  in round 1, float64 from round 2 (SecAgg+ hands the strategy a float64 aggregate); the masked
  vectors come back as int64.

Each node count runs in its own worker process (a new session, private FLWR_HOME and
RAY_TMPDIR); one that runs past ``--timeout`` is stopped (process group, then any process
whose environment holds its RAY_TMPDIR) and reported as timed out, with the stages and rounds
it finished (the worker rewrites a partial result after every stage, and counts the replies of
the stage it is in); larger counts are then skipped unless ``--keep-going``. Ray gets
``--cpus`` CPUs and one per ClientApp, so ``--cpus`` actors run the nodes' messages.

    python benchmarks/bench_flower_secaggplus.py --nodes 10           # smoke
    python benchmarks/bench_flower_secaggplus.py --nodes 10 100 1000 --json /tmp/flwr.json
    python benchmarks/bench_flower_secaggplus.py --nodes 100 --dim 235146   # Fashion-MNIST MLP
"""

from __future__ import annotations

import os
import sys
import tempfile

for _key, _value in (("FLWR_TELEMETRY_ENABLED", "0"),
                     ("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1"),
                     ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")):
    os.environ[_key] = _value
CREATED: list[str] = []  # the private folders made here (removed at the end)
for _key, _prefix in (("FLWR_HOME", "fsh"), ("RAY_TMPDIR", "fsr")):
    if not os.environ.get(_key):  # short paths: Ray's socket paths must stay < 108 chars
        os.environ[_key] = tempfile.mkdtemp(prefix=_prefix, dir="/tmp")
        CREATED.append(os.environ[_key])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from flwr.app import Context, Error, Message, MessageType  # noqa: E402
from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.clientapp.typing import ClientAppCallable  # noqa: E402
from flwr.common import (  # noqa: E402
    FitIns,
    FitRes,
    NDArrays,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: E402
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
)
from flwr.common.serde import message_to_proto  # noqa: E402
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig  # noqa: E402
from flwr.server.client_manager import ClientManager  # noqa: E402
from flwr.server.client_proxy import ClientProxy  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import (  # noqa: E402
    WorkflowState,
)
from flwr.simulation import run_simulation  # noqa: E402

STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")
MAX_WEIGHT = 1000.0  # SecAggPlusWorkflow's defaults, used by the check
CLIPPING_RANGE = 8.0
QUANTIZATION_RANGE = 2**22


def default_shares(nodes: int) -> tuple[int, int]:
    """fedpriv's neighbourhood size and threshold: (41, 21) from 41 nodes, else all nodes and
    a majority."""
    return (41, 21) if nodes >= 41 else (nodes, nodes // 2 + 1)


def dropped(nodes: int, fraction: float, seed: int, server_round: int) -> set[int]:
    """The partition ids that drop in ``server_round``."""
    count = round(fraction * nodes)
    rng = np.random.default_rng([seed, server_round])
    return {int(p) for p in rng.choice(nodes, size=count, replace=False)}


def node_vector(pid: int, dim: int) -> np.ndarray:
    return ((((7 * pid + np.arange(dim)) % 17) - 8) / 8).astype(np.float32)


def node_weight(pid: int) -> int:
    return 1 + pid % 4


def expected_mean(pids: Iterable[int], dim: int) -> tuple[np.ndarray, float]:
    """The weighted mean SecAgg+ should return for ``pids`` and its quantization bound."""
    pids = list(pids)
    ratios = np.array([round(node_weight(p) / MAX_WEIGHT * QUANTIZATION_RANGE)
                       / QUANTIZATION_RANGE for p in pids])
    total = np.zeros(dim)
    for p, r in zip(pids, ratios, strict=True):
        total += r * node_vector(p, dim).astype(np.float64)
    bound = len(pids) * 2 * CLIPPING_RANGE / QUANTIZATION_RANGE / ratios.sum()
    return total / ratios.sum(), float(bound)


# ----------------------------------------------------------------------------- client side

class FixedClient(NumPyClient):
    def __init__(self, pid: int, dim: int) -> None:
        self.pid, self.dim = pid, dim

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]
            ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        return [node_vector(self.pid, self.dim)], node_weight(self.pid), {"pid": self.pid}


def make_client_app(nodes: int, dim: int, fraction: float, seed: int, mode: str) -> ClientApp:
    def client_fn(context: Context) -> Any:
        return FixedClient(int(context.node_config["partition-id"]), dim).to_client()

    def dropout_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        """Fail the chosen nodes where they would send their masked vectors."""
        if msg.metadata.message_type == MessageType.TRAIN and msg.has_content():
            cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            pid = int(ctxt.node_config["partition-id"])
            if (cfg is not None and cfg.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS
                    and pid in dropped(nodes, fraction, seed, int(msg.metadata.group_id))):
                reason = f"simulated dropout of partition {pid}"
                if mode == "raise":
                    raise RuntimeError(reason)
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                               reply_to=msg)
        return call_next(msg, ctxt)

    return ClientApp(client_fn=client_fn, mods=[dropout_mod, secaggplus_mod])


# ----------------------------------------------------------------------------- server side

class Meter:
    """Per round and stage: seconds, seconds waiting for the nodes, bytes, messages."""

    def __init__(self, partial: Path | None = None) -> None:
        self.rounds: dict[int, dict[str, Any]] = {}
        self.round = 0
        self.stage = ""
        self.partial = partial  # rewritten after every stage: what a timed-out run finished
        self.overhead = 0.0  # seconds spent measuring bytes, taken off the stage/round times
        self.stage_start = self.last_dump = 0.0

    def summary(self) -> list[dict[str, Any]]:
        rounds = []
        for r in sorted(self.rounds):
            entry = self.rounds[r]
            stages = entry["stages"]
            rounds.append({"round": r, "s": entry.get("s"), "stages": stages,
                           "configure_fit_s": entry.get("configure_fit_s"),
                           "to_bytes": sum(s["to_bytes"] for s in stages.values()),
                           "from_bytes": sum(s["from_bytes"] for s in stages.values()),
                           "check": entry.get("check", {"passed": False,
                                                        "why": "aggregate_fit not reached"})})
        return rounds

    def dump(self) -> None:
        self.last_dump = time.perf_counter()
        if self.partial is not None:
            tmp = self.partial.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rounds": self.summary()}, default=float))
            tmp.replace(self.partial)

    def entry(self) -> dict[str, Any]:
        stages = self.rounds.setdefault(self.round, {"stages": {}})["stages"]
        return stages.setdefault(self.stage, {"s": 0.0, "wait_s": 0.0, "to_bytes": 0,
                                              "from_bytes": 0, "to_msgs": 0, "from_msgs": 0,
                                              "errors": 0})

    def wrap(self, send_and_receive: Callable[..., Iterable[Message]]
             ) -> Callable[..., Iterable[Message]]:
        def counted(messages: Iterable[Message], *, timeout: float | None = None
                    ) -> Iterable[Message]:
            out = list(messages)
            start = time.perf_counter()
            replies = list(send_and_receive(out, timeout=timeout))
            e = self.entry()
            measuring = time.perf_counter()
            e["wait_s"] += measuring - start
            e["to_bytes"] += sum(message_to_proto(m).ByteSize() for m in out)
            e["from_bytes"] += sum(message_to_proto(m).ByteSize() for m in replies)
            e["measure_s"] = e.get("measure_s", 0.0) + time.perf_counter() - measuring
            self.overhead += time.perf_counter() - measuring
            e["to_msgs"] += len(out)
            e["from_msgs"] += len(replies)
            e["errors"] += sum(m.has_error() for m in replies)
            return replies

        return counted

    def wrap_pull(self, pull_messages: Callable[[Iterable[str]], Iterable[Message]]
                  ) -> Callable[[Iterable[str]], Iterable[Message]]:
        """Count the replies as they arrive (a timed-out run shows how far its stage got)."""
        def pulled(message_ids: Iterable[str]) -> Iterable[Message]:
            replies = list(pull_messages(message_ids))
            if replies:
                e = self.entry()
                e["replies_pulled"] = e.get("replies_pulled", 0) + len(replies)
                e["last_reply_after_s"] = time.perf_counter() - self.stage_start
                if time.perf_counter() - self.last_dump > 5.0:
                    self.dump()
            return replies

        return pulled


class TimedSecAggPlus(SecAggPlusWorkflow):
    """SecAggPlusWorkflow with every call and stage timed into ``meter``."""

    def __init__(self, meter: Meter, num_shares: int, threshold: int) -> None:
        super().__init__(num_shares=num_shares, reconstruction_threshold=threshold)
        self.meter = meter

    def __call__(self, grid: Grid, context: Context) -> None:
        self.meter.round += 1
        start, overhead = time.perf_counter(), self.meter.overhead
        super().__call__(grid, context)
        self.meter.rounds.setdefault(self.meter.round, {"stages": {}})["s"] = (
            time.perf_counter() - start - (self.meter.overhead - overhead))
        self.meter.dump()

    def _timed(self, stage: str, fn: Callable[..., bool], *args: Any) -> bool:
        self.meter.stage = stage
        start, overhead = time.perf_counter(), self.meter.overhead
        self.meter.stage_start = start
        self.meter.entry()  # an unfinished stage shows in the partial results too
        self.meter.dump()
        ok = fn(*args)
        entry = self.meter.entry()
        entry["s"] += time.perf_counter() - start - (self.meter.overhead - overhead)
        entry["ok"] = ok
        self.meter.dump()
        return ok

    def setup_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        return self._timed("setup", super().setup_stage, grid, context, state)

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState
                         ) -> bool:
        return self._timed("share_keys", super().share_keys_stage, grid, context, state)

    def collect_masked_vectors_stage(self, grid: Grid, context: LegacyContext,
                                     state: WorkflowState) -> bool:
        return self._timed("collect_masked_vectors", super().collect_masked_vectors_stage,
                           grid, context, state)

    def unmask_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        return self._timed("unmask", super().unmask_stage, grid, context, state)


class CheckedFedAvg(FedAvg):
    """FedAvg that checks the unmasked aggregate against the surviving nodes' vectors."""

    def __init__(self, args: argparse.Namespace, nodes: int, meter: Meter) -> None:
        super().__init__(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=nodes,
                         min_available_clients=nodes, initial_parameters=ndarrays_to_parameters(
                             [np.zeros(args.dim, dtype=np.float32)]))
        self.args, self.nodes, self.meter = args, nodes, meter

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        start = time.perf_counter()
        out = super().configure_fit(server_round, parameters, client_manager)
        self.meter.rounds.setdefault(server_round, {"stages": {}})["configure_fit_s"] = (
            time.perf_counter() - start)
        return out

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException]
                      ) -> tuple[Parameters | None, dict[str, Scalar]]:
        gone = dropped(self.nodes, self.args.dropout, self.args.seed, server_round)
        survivors = sorted(int(res.metrics["pid"]) for _, res in results)
        want = sorted(set(range(self.nodes)) - gone)
        check: dict[str, Any] = {"survivors": len(survivors), "dropped": len(gone),
                                 "failures": len(failures), "survivors_match": survivors == want}
        if results:
            got = parameters_to_ndarrays(results[0][1].parameters)
            mean, bound = expected_mean(survivors, self.args.dim)
            err = float(np.max(np.abs(got[0].astype(np.float64) - mean)))
            same = all(res.parameters is results[0][1].parameters
                       or parameters_to_ndarrays(res.parameters)[0].tobytes() == got[0].tobytes()
                       for _, res in results)
            check.update(max_abs_err=err, bound=bound, same_for_all=same,
                         dtype=str(got[0].dtype), shape=list(got[0].shape))
            check["passed"] = bool(check["survivors_match"] and same and err <= bound)
        else:
            check["passed"] = False
        self.meter.rounds.setdefault(server_round, {"stages": {}})["check"] = check
        return super().aggregate_fit(server_round, results, failures)


def make_server_app(args: argparse.Namespace, nodes: int, meter: Meter) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        grid.send_and_receive = meter.wrap(grid.send_and_receive)  # type: ignore[method-assign]
        pull = meter.wrap_pull(grid.pull_messages)
        grid.pull_messages = pull  # type: ignore[method-assign,assignment]
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=args.rounds),
                               strategy=CheckedFedAvg(args, nodes, meter))
        fit = TimedSecAggPlus(meter, args.num_shares, args.threshold)
        DefaultWorkflow(fit_workflow=fit)(grid, legacy)

    return app


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One node count in this process: the simulation, then its measurements."""
    nodes = args.nodes[0]
    meter = Meter(Path(args.worker).with_suffix(".partial.json"))
    start = time.perf_counter()
    run_simulation(server_app=make_server_app(args, nodes, meter),
                   client_app=make_client_app(nodes, args.dim, args.dropout, args.seed,
                                              args.drop_mode),
                   num_supernodes=nodes, backend_name="ray",
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": args.cpus}})
    sim_s = time.perf_counter() - start
    return {"sim_s": sim_s, "rounds": meter.summary()}


# ----------------------------------------------------------------------------- driver

from bench_secure_aggregation import proc_tree  # noqa: E402 -- after the environment above


def stop(proc: subprocess.Popen[bytes], marker: bytes) -> list[int]:
    """SIGTERM the worker's group and processes, SIGKILL what is left; the leftovers. The group
    only while its leader is not reaped (its id cannot have been reused), then the processes
    whose environment holds ``marker`` (the worker's private RAY_TMPDIR: Ray's processes)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        for pid in proc_tree([proc.pid] if proc.poll() is None else [], marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (proc.poll() is None or proc_tree([], marker)):
            time.sleep(0.3)
    return sorted(proc_tree([], marker))


def run_count(args: argparse.Namespace, nodes: int, logs: Path) -> dict[str, Any]:
    """Run one node count in a worker process, within ``args.timeout`` seconds."""
    shares, threshold = default_shares(nodes)
    shares = args.num_shares or shares
    threshold = args.threshold or threshold
    entry: dict[str, Any] = {"nodes": nodes, "dim": args.dim, "num_rounds": args.rounds,
                             "num_shares": shares, "threshold": threshold,
                             "dropout": args.dropout, "dropped_per_round": round(
                                 args.dropout * nodes), "load_before": os.getloadavg()[0]}
    if shares < nodes and shares % 2 == 0:  # seen with Flower 1.41: every client fails
        print(f"warning: an even num_shares ({shares}) below the node count: the workflow sends "
              "it to the clients, then uses shares + 1 neighbours itself, and the clients' "
              "share_keys stage fails (IndexError)", flush=True)
    private = Path(tempfile.mkdtemp(prefix=f"n{nodes}_", dir=os.environ["RAY_TMPDIR"]))
    env = {**os.environ, "RAY_TMPDIR": str(private / "r"), "FLWR_HOME": str(private / "f")}
    env.pop("RAY_ADDRESS", None)
    for sub in ("r", "f"):
        (private / sub).mkdir()
    marker = f"RAY_TMPDIR={env['RAY_TMPDIR']}".encode()
    result = private / "result.json"
    log_path = logs / f"nodes{nodes}_dim{args.dim}.log"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(result),
            "--nodes", str(nodes), "--dim", str(args.dim), "--rounds", str(args.rounds),
            "--num-shares", str(shares), "--threshold", str(threshold),
            "--dropout", str(args.dropout), "--drop-mode", args.drop_mode,
            "--seed", str(args.seed), "--cpus", str(args.cpus)]
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=args.timeout)
        entry["status"] = "ok" if proc.returncode == 0 and result.exists() else "error"
    except subprocess.TimeoutExpired:
        entry["status"] = "timeout"
    except BaseException:  # interrupted: leave nothing running
        stop(proc, marker)
        raise
    entry["proc_s"] = time.perf_counter() - start
    entry["left_processes"] = stop(proc, marker)
    entry["log"] = str(log_path)
    partial = result.with_suffix(".partial.json")
    if result.exists():
        entry.update(json.loads(result.read_text()))
    elif partial.exists():  # timed out or failed: the stages and rounds it finished
        entry.update(json.loads(partial.read_text()), partial=True)
    if entry["status"] == "error" and not result.exists():
        entry["error"] = log_path.read_text(errors="replace")[-2000:]
    if not entry["left_processes"]:
        shutil.rmtree(private, ignore_errors=True)
    entry["load_after"] = os.getloadavg()[0]
    return entry


def summarize(entry: dict[str, Any]) -> None:
    """s/round, bytes per node per round and the check, over the rounds that finished."""
    done = [r for r in entry.get("rounds") or [] if r["s"] is not None]
    entry["rounds_done"] = len(done)
    if not done:
        return
    nodes = entry["nodes"]
    steady = done[1:] or done  # round 1 also waits for the nodes to register, actors to warm
    entry["s_per_round"] = sum(r["s"] for r in steady) / len(steady)
    entry["to_per_node_round"] = sum(r["to_bytes"] for r in done) / len(done) / nodes
    entry["from_per_node_round"] = sum(r["from_bytes"] for r in done) / len(done) / nodes
    entry["check_passed"] = all(r["check"].get("passed") for r in done) and len(
        done) == entry["num_rounds"]


def fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


def table(runs: list[dict[str, Any]]) -> list[str]:
    rows = ["| nodes | dim | shares/threshold | dropped/round | s/round from r2 (each round) | "
            "to B/node/round | from B/node/round | check (max err / bound) | sim s | proc s |",
            "|" + "---|" * 10]
    for r in runs:
        head = (f"| {r['nodes']} | {r['dim']} | {r['num_shares']}/{r['threshold']} | "
                f"{r['dropped_per_round']} |")
        status = "" if r["status"] == "ok" else (
            f"{r['status'].upper()} after {r['proc_s']:.0f} s, {r.get('rounds_done', 0)} of "
            f"{r['num_rounds']} rounds done; ")
        sim = f"{r['sim_s']:.1f}" if "sim_s" in r else "-"
        if not r.get("rounds_done"):
            rows.append(f"{head} {status}| - | - | - | {sim} | {r['proc_s']:.1f} |")
            continue
        done = [x for x in r["rounds"] if x["s"] is not None]
        each = "/".join(f"{x['s']:.2f}" for x in done)
        errs = "/".join(f"{x['check']['max_abs_err']:.1e}" if "max_abs_err" in x["check"]
                        else "no aggregate" for x in done)
        bound = max(x["check"].get("bound", 0.0) for x in done)
        check = "passed" if all(x["check"].get("passed") for x in done) else "FAILED"
        rows.append(f"{head} {status}{r['s_per_round']:.2f} ({each}) | "
                    f"{fmt_bytes(r['to_per_node_round'])} | {fmt_bytes(r['from_per_node_round'])}"
                    f" | {check} ({errs} / {bound:.1e}) | {sim} | {r['proc_s']:.1f} |")
    return rows


def stage_lines(r: dict[str, Any]) -> list[str]:
    """Per stage, averaged over the rounds: seconds (waiting), bytes per node to/from."""
    out = []
    rounds = r.get("rounds") or []
    for stage in STAGES:
        got = [x["stages"][stage] for x in rounds if "ok" in x["stages"].get(stage, {})]
        if not got:
            continue
        k = len(got)
        out.append(f"    {stage:<23} {sum(g['s'] for g in got) / k:8.2f} s "
                   f"(waiting {sum(g['wait_s'] for g in got) / k:7.2f} s)  to "
                   f"{fmt_bytes(sum(g['to_bytes'] for g in got) / k / r['nodes']):>10}  from "
                   f"{fmt_bytes(sum(g['from_bytes'] for g in got) / k / r['nodes']):>10}  "
                   f"error replies {sum(g['errors'] for g in got) / k:.0f}")
    for x in rounds:
        c = x["check"]
        secs = ", ".join(f"{k} {v['s']:.2f}" if "ok" in v else
                         f"{k} unfinished: {v['replies_pulled']} replies, the last "
                         f"{v['last_reply_after_s']:.0f} s into the stage"
                         if v.get("replies_pulled") else f"{k} unfinished: no replies yet"
                         for k, v in x["stages"].items())
        total = "unfinished" if x["s"] is None else f"{x['s']:.2f} s"
        out.append(f"    round {x['round']}: {total} (configure_fit "
                   f"{x.get('configure_fit_s') or 0.0:.2f} s; {secs}), survivors "
                   f"{c.get('survivors')} (match {c.get('survivors_match')}), failures passed to "
                   f"aggregate_fit {c.get('failures')}, aggregate {c.get('dtype')} "
                   f"{c.get('shape')}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--dim", type=int, default=50, help="model parameters (float32)")
    parser.add_argument("--num-shares", type=int, default=None,
                        help="SecAggPlusWorkflow num_shares (default: min(nodes, 41))")
    parser.add_argument("--threshold", type=int, default=None,
                        help="reconstruction_threshold (default: 21 from 41 nodes, else "
                        "nodes // 2 + 1)")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="fraction of the nodes that drop in each round (default 0.1)")
    parser.add_argument("--drop-mode", choices=("error", "raise"), default="error",
                        help="a dropped node replies with an error, or its ClientApp raises")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus", type=int, default=2, help="Ray CPUs = ClientApp actors")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="wall limit per node count, seconds (default 600)")
    parser.add_argument("--keep-going", action="store_true",
                        help="after a timeout, still run the larger node counts")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--logs", help="worker logs folder (default: a new temporary one)")
    parser.add_argument("--worker", metavar="RESULT", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        try:
            Path(args.worker).write_text(json.dumps(run_worker(args), indent=1))
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return

    logs = Path(args.logs or tempfile.mkdtemp(prefix="flwr_secaggplus_logs_"))
    logs.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"flwr": __import__("flwr").__version__, "cpus": os.cpu_count(),
                              "ray_cpus": args.cpus, "timeout_s": args.timeout,
                              "drop_mode": args.drop_mode, "seed": args.seed, "runs": []}
    print(f"worker logs: {logs}", flush=True)
    for nodes in sorted(args.nodes):
        if any(r["status"] == "timeout" for r in record["runs"]) and not args.keep_going:
            print(f"nodes={nodes}: skipped (a smaller count timed out)", flush=True)
            record["runs"].append({"nodes": nodes, "status": "skipped"})
            continue
        print(f"nodes={nodes} dim={args.dim} ...", end=" ", flush=True)
        entry = run_count(args, nodes, logs)
        summarize(entry)
        record["runs"].append(entry)
        print(entry["status"], f"{entry['proc_s']:.1f} s", flush=True)
        print("\n".join(stage_lines(entry)), flush=True)
        if entry.get("error"):
            print(entry["error"][-800:], flush=True)
        if entry["left_processes"]:
            print(f"  warning: processes left: {entry['left_processes']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1, default=float))
    print("\n".join(table([r for r in record["runs"] if r["status"] != "skipped"])), flush=True)
    if args.json:
        print(f"wrote {args.json}")
    if not any(r.get("left_processes") for r in record["runs"]):
        for path in CREATED:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
