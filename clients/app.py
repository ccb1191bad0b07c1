"""The fedpriv ClientApp.

A SuperNode hosts the users of its partition (``partition-id`` of ``num-partitions`` in its node
config), regenerates their data from (seed, user id), and answers each step by calling the
registered algorithm's ``user_step`` for the whole cohort at once. A deep run on your own data
reads it from the run config's ``data-file``, or from the node config's ``data-file`` where a
SuperNode has its own copy: of a csv/parquet table it then reads only its own users' rows.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.typing import MetricRecordValues
from flwr.clientapp import ClientApp

from clients.records import from_records, load_state, save_state, to_records
from fedpriv import allocator
from fedpriv import protocol as P
from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.algorithms.deep.params import FILE_SOURCES
from fedpriv.config import RunConfig
from fedpriv.configure import parse_config
from fedpriv.evaluation import algorithm_for
from fedpriv.faults import corrupted, failing_partitions
from fedpriv.nodes import node_step
from fedpriv.secagg import node as secure

app = ClientApp()
allocator.tune()  # a node's steps reuse their pages (fedpriv.allocator)


def _partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config[P.KEY_PARTITION]), int(
            context.node_config[P.KEY_NUM_PARTITIONS]
        )
    except KeyError as err:
        raise ValueError(
            f"node config lacks {err.args[0]!r}: start the SuperNode with --node-config "
            '"partition-id=<i> num-partitions=<N>"'
        ) from None


def _run_config(context: Context, pid: int, parts: int) -> RunConfig:
    """The run config, with this node's own copy of the data where its node config names one
    (``data-file=...``): a csv/parquet node then reads only its own users' rows."""
    values = dict(context.run_config)
    own_file = context.node_config.get(P.KEY_DATA_FILE)
    if own_file and values.get("dataset") in FILE_SOURCES:  # else the run reads no data file
        values.update({P.KEY_DATA_FILE: str(own_file), P.KEY_DATA_PART: f"{pid}/{parts}"})
    return parse_config(values)


def _step(msg: Message) -> Step:
    return Step.from_json(str(msg.content[P.CONFIG][P.KEY_STEP]))


def _load_algorithms() -> None:
    """The built-in algorithms (torch among their imports, slow to load cold): loaded during
    node discovery, not in a node's first step, where they counted against node-timeout; and
    only by the handlers that compute (a deployment starts a ClientApp process per message, and
    secure aggregation's key, collect and unmask stages need no model)."""
    import fedpriv.algorithms.catalogue  # noqa: F401


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    _load_algorithms()
    pid, parts = _partition(context)
    info = ConfigRecord({P.KEY_PARTITION: pid, P.KEY_NUM_PARTITIONS: parts})
    return Message(RecordDict({P.CONFIG: info}), reply_to=msg)


def _answer(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    _load_algorithms()
    pid, parts = _partition(context)
    config = _run_config(context, pid, parts)
    step = _step(msg)
    faulty = pid in failing_partitions(config.seed, step.label, parts, config.node_fault_rate)
    if faulty and config.node_fault_kind == "crash":
        raise RuntimeError(f"simulated crash of partition {pid} in {step.label} "
                           "(node-fault-rate)")
    if faulty and config.node_fault_kind == "timeout":
        time.sleep(config.node_timeout + 2.0)  # answer only after the server stopped waiting
    algorithm = algorithm_for(config)
    arrays: dict[str, np.ndarray] = {}
    if P.ARRAYS in msg.content:
        record = msg.content[P.ARRAYS]
        if not isinstance(record, ArrayRecord):
            raise TypeError(f"{P.ARRAYS} is a {type(record).__name__}, not an ArrayRecord")
        arrays = {k: v.numpy() for k, v in record.items()}
    decoded = time.perf_counter()
    contrib = node_step(algorithm, config, step, arrays,
                        algorithm.hosted_users(config, pid, parts))
    computed = time.perf_counter()
    if faulty and config.node_fault_kind == "corrupt":
        contrib = corrupted(contrib)
    metrics: dict[str, MetricRecordValues] = {
        P.KEY_NUM_USERS: int(contrib.num_users), P.KEY_NUM_CLIPPED: contrib.num_clipped,
        P.KEY_PARTITION: pid}
    if not config.noise_shares:  # a distributed node's timing could tell of its users' data
        metrics.update({P.KEY_COMPUTE_S: computed - decoded, P.KEY_DECODE_S: decoded - started})
    for key, value in (contrib.metrics or {}).items():
        metrics[P.METRIC_PREFIX + key] = float(value)
    content = RecordDict({P.METRICS: MetricRecord(metrics)})
    content[P.ARRAYS] = ArrayRecord({name: Array(np.asarray(total))
                                     for name, total in contrib.totals.items()})
    return Message(content, reply_to=msg)


@app.train("step")
def step(msg: Message, context: Context) -> Message:
    return _answer(msg, context)


@app.evaluate("final")
def final(msg: Message, context: Context) -> Message:
    return _answer(msg, context)


# ----- secure aggregation (aggregation = "secure"): one handler per stage -------------------
def _secure(msg: Message, context: Context, stage: str) -> Message:
    pid, parts = _partition(context)
    config = _run_config(context, pid, parts)
    state = load_state(context.state)
    payload = from_records(msg.content)
    if stage == "setup":
        _load_algorithms()
        step = Step.from_json(str(payload["step"]))
        faulty = pid in failing_partitions(config.seed, step.label, parts,
                                           config.node_fault_rate)
        state["fault"] = int(faulty)

        def compute(step: Step, arrays: Mapping[str, np.ndarray]) -> UserContribution:
            algorithm = algorithm_for(config)
            contrib = node_step(algorithm, config, step, arrays,
                                algorithm.hosted_users(config, pid, parts))
            return (corrupted(contrib) if faulty and config.node_fault_kind == "corrupt"
                    else contrib)

        arrays = {k: v for k, v in payload.items() if isinstance(v, np.ndarray)}
        reply = secure.setup(config, pid, parts, state, payload, arrays, compute)
    elif stage == "share-keys":
        reply = secure.share_keys(pid, parts, state, payload)
    elif stage == "collect":
        if state.get("fault") and config.node_fault_kind == "crash":
            raise RuntimeError(f"simulated crash of partition {pid} mid-protocol "
                               "(node-fault-rate)")
        if state.get("fault") and config.node_fault_kind == "timeout":
            time.sleep(config.node_timeout + 2.0)
        reply = secure.collect(pid, state, payload)
    else:
        reply = secure.unmask(config, pid, parts, state, payload)
    save_state(context.state, state)
    return Message(to_records(reply), reply_to=msg)


@app.train("secagg_setup")
def secagg_setup(msg: Message, context: Context) -> Message:
    return _secure(msg, context, "setup")


@app.query("secagg_keys")
def secagg_keys(msg: Message, context: Context) -> Message:
    return _secure(msg, context, "share-keys")


@app.query("secagg_collect")
def secagg_collect(msg: Message, context: Context) -> Message:
    return _secure(msg, context, "collect")


@app.query("secagg_unmask")
def secagg_unmask(msg: Message, context: Context) -> Message:
    return _secure(msg, context, "unmask")
