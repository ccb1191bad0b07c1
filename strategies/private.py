"""``PrivateStrategy``: a Flower Strategy that runs any registered fedpriv algorithm.

Flower's ``Strategy.start`` loop knows only train/evaluate rounds; fedpriv algorithms have an
initialization, T rounds and a final fit, so ``run`` drives the Grid through the algorithm's steps
while ``configure_train``/``aggregate_train`` do the per-step work. The privacy-relevant work
(per-node bounding, rejection, noise, accounting) happens in ``fedpriv.server.PrivateServer``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from clients.records import from_records, to_records
from fedpriv import protocol as P
from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.progress import Waiting
from fedpriv.secagg.node import Failure
from fedpriv.server import NodeReply, PrivateServer, summary_lines
from fedpriv.server.secagg import KeysAhead, Reply, SecureRound


def _log(text: str) -> None:
    print(text, flush=True)


POLL_FIRST, POLL_GROWTH, POLL_MAX = 0.01, 1.5, 0.03


def exchange(grid: Grid, messages: Iterable[Message], timeout: float) -> list[Message]:
    """``grid.send_and_receive`` with a shorter poll: Flower's waits 0.1 s (simulation) or 3 s
    (deployment) between pulls, which a secure round pays in each of its exchanges; this one
    pulls after 10 ms, then 1.5x longer each time, at most 30 ms. A stand-in that is not a
    Flower ``Grid`` (tests' loopback grids) answers through its own ``send_and_receive``."""
    if not isinstance(grid, Grid):
        return list(grid.send_and_receive(messages, timeout=timeout))
    pending = set(grid.push_messages(messages))
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    pause = POLL_FIRST
    while pending:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * POLL_GROWTH, POLL_MAX)
    return replies


def discover_partitions(grid: Grid, timeout: float) -> dict[int, int]:
    """Wait for the nodes, ask each its partition once; returns {node id: partition id}. A node
    that registers later is asked when it appears (in a deployment each question starts a
    ClientApp process on the node: the nodes that answered are not asked again)."""
    deadline = time.monotonic() + timeout
    expected = None
    partitions: dict[int, int] = {}
    while True:
        nodes = set(grid.get_node_ids())
        partitions = {n: p for n, p in partitions.items() if n in nodes}  # a node that left
        msgs = [Message(RecordDict({}), dst_node_id=n, message_type=P.MSG_HELLO)
                for n in sorted(nodes - set(partitions))]
        if msgs:
            for reply in exchange(grid, msgs, timeout):
                if reply.has_content():
                    cfg = reply.content[P.CONFIG]
                    partitions[reply.metadata.src_node_id] = int(_scalar(cfg[P.KEY_PARTITION]))
                    expected = int(_scalar(cfg[P.KEY_NUM_PARTITIONS]))
        if expected is not None and set(partitions.values()) == set(range(expected)):
            return partitions
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(nodes)} node(s) of {expected or '?'} connected "
                               f"after {timeout:.0f}s")
        time.sleep(0.2)


def _scalar(value: object) -> int | float | str | bytes:
    """A record's value where a number is expected (Flower types a record's values as any
    value a record may hold): what ``int``/``float`` convert, anything else (an array, a list)
    a ``TypeError``, as those conversions would raise."""
    if not isinstance(value, (int, float, str, bytes)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return value


def _seconds(reply: Message, key: str) -> float:
    """A node's own timing from its reply, for the profile only: the node's word, so anything
    but a finite number in [0, 1e6] counts as 0 (an error reply has none)."""
    try:
        value = float(_scalar(reply.content[P.METRICS][key]))
    except Exception:  # noqa: BLE001 -- an error reply, a missing or malformed value
        return 0.0
    return value if math.isfinite(value) and 0.0 <= value <= 1e6 else 0.0


def _count(value: object) -> int:
    """A user count from a MetricRecord: a non-negative integer (a float must be integral)."""
    number = float(_scalar(value))
    if not number.is_integer() or number < 0:
        raise ValueError(f"count {value!r} is not a non-negative integer")
    return int(number)


class PrivateStrategy(Strategy):
    """Runs one fedpriv algorithm over a Flower Grid."""

    def __init__(self, config: RunConfig, partitions: dict[int, int],
                 checkpoint_path: Path | None = None) -> None:
        self.config = config
        self.partitions = partitions
        self.server = PrivateServer(config, len(partitions), log=_log,
                                    checkpoint_path=checkpoint_path)
        self._step: Step | None = None  # the step under way (set by run)
        self._started = 0.0
        self.profile: list[dict[str, str | float]] = []

    # -- per-step work, in Flower's vocabulary ------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        step = self._step
        assert step is not None, "configure_train runs inside run()"
        message_type = P.MSG_FINAL if step.is_final else P.MSG_STEP
        content = RecordDict({P.ARRAYS: arrays, P.CONFIG: config})
        return [Message(content, dst_node_id=n, message_type=message_type)
                for n in self.partitions]

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        step = self._step
        assert step is not None, "aggregate_train runs inside run()"
        node_replies: list[NodeReply] = []
        answered: set[int] = set()
        received = time.perf_counter()
        compute: list[float] = []
        decode: list[float] = []
        for reply in replies:
            node = reply.metadata.src_node_id
            answered.add(node)
            node_replies.append(self._to_node_reply(self.partitions.get(node, -1), reply))
            compute.append(_seconds(reply, P.KEY_COMPUTE_S))
            decode.append(_seconds(reply, P.KEY_DECODE_S))
        for node, pid in self.partitions.items():
            if node not in answered:
                node_replies.append(NodeReply(pid, error="no reply before the timeout",
                                              failure="timeout"))
        report = self.server.aggregate(step, node_replies, self._started)
        # where the step's time went (operator report only; see benchmarks/profile_flower.py)
        done = time.perf_counter()
        self.profile.append({"step": step.label, "wall_s": done - self._started,
                             "nodes_compute_s": sum(compute),
                             "max_node_compute_s": max(compute, default=0.0),
                             "nodes_decode_s": sum(decode), "server_s": done - received})
        return None, MetricRecord({k: float(v) for k, v in report.items()
                                   if isinstance(v, (int, float))})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # evaluation is the algorithm's own final step

    def aggregate_evaluate(self, server_round: int,
                           replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        for line in summary_lines(self.server.results(0.0, "flower")):
            _log(line)

    @staticmethod
    def _to_node_reply(pid: int, reply: Message) -> NodeReply:
        if reply.has_error():
            lost = reply.error.code in (ErrorCode.MESSAGE_UNAVAILABLE,
                                        ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
                                        ErrorCode.NODE_UNAVAILABLE)
            return NodeReply(pid, error=f"{reply.error.code}: {reply.error.reason}"[:300],
                             failure="unavailable" if lost else "node-error")
        try:
            metrics = reply.content[P.METRICS]
            record = reply.content[P.ARRAYS]
            if not isinstance(record, ArrayRecord):
                raise TypeError(f"{P.ARRAYS} is a {type(record).__name__}, not an ArrayRecord")
            totals = {name: array.numpy() for name, array in record.items()}
            extra = {k[len(P.METRIC_PREFIX):]: float(_scalar(v)) for k, v in metrics.items()
                     if k.startswith(P.METRIC_PREFIX)}
            contrib = UserContribution(totals, _count(metrics[P.KEY_NUM_USERS]),
                                       _count(metrics[P.KEY_NUM_CLIPPED]), extra or None)
        except Exception as err:  # anything a hostile or broken node may send
            return NodeReply(pid, error=f"malformed reply: {err!r}"[:300], failure="malformed")
        return NodeReply(pid, contrib)

    def _secure_send(self, grid: Grid) -> Any:
        """A secure round's transport: one message per addressed node, its reply back."""
        node_of = {pid: node for node, pid in self.partitions.items()}

        def send(stage: str, messages: dict[int, dict[str, Any]]) -> dict[int, Reply]:
            out: dict[int, Reply] = {}
            msgs = [Message(to_records(m), dst_node_id=node_of[pid],
                            message_type=P.MSG_SECAGG[stage]) for pid, m in messages.items()]
            for reply in exchange(grid, msgs, self.config.node_timeout):
                pid = self.partitions.get(reply.metadata.src_node_id)
                if pid is None or pid not in messages:
                    continue
                if reply.has_error():
                    failed = self._to_node_reply(pid, reply)
                    out[pid] = Failure(failed.failure, str(failed.error))
                    continue
                try:
                    out[pid] = from_records(reply.content)
                except Exception as err:  # noqa: BLE001 -- anything a broken node sends
                    out[pid] = Failure("malformed", f"malformed reply: {err!r}"[:300])
            return out

        return send

    # -- the whole run ------------------------------------------------------------------------
    def run(self, grid: Grid) -> dict[str, Any]:
        started = time.perf_counter()
        ahead: KeysAhead | None = None  # after a resume: none, a full setup first
        while (step := self.server.next_step()) is not None:
            number = self.server.completed + 1
            self._step, self._started = step, time.perf_counter()
            if not self.server.sends(step):  # a distributed run's metrics step: nodes send none
                self.server.record_unsent(step, self._started)
                continue
            if self.server.secure:  # the server sees only the masked vectors and their sum
                outcome = SecureRound(self._secure_send(grid), step, self.server.payload(step),
                                      sorted(self.partitions.values()), self.server.graph,
                                      self.server.history(), _log,
                                      count=self.server.num_partitions, ahead=ahead).run()
                ahead = outcome.ahead  # the next secure round: three exchanges
                self.server.aggregate_secure(step, outcome, self._started)
                continue
            arrays = ArrayRecord({k: Array(np.asarray(v))
                                  for k, v in self.server.payload(step).items()})
            config = ConfigRecord({P.KEY_STEP: step.to_json()})
            messages = list(self.configure_train(number, arrays, config, grid))
            with Waiting(step.label, len(messages), _log):
                replies = exchange(grid, messages, self.config.node_timeout)
            self.aggregate_train(number, replies)
        return self.server.results(time.perf_counter() - started, runtime="flower")
