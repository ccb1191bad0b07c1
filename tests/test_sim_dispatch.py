"""strategies.sim_dispatch: Flower's simulation LinkState answers a node from a per-node index,
with the same answers as Flower's own scan.

The states are built as Flower's simulation engine builds its own (``_main_loop`` of
``flwr.simulation.run_simulation`` and ``_register_nodes`` of ``vce_api``), one indexed and one
left as Flower made it, fed the same messages, and asked the same questions.
"""

from __future__ import annotations

import datetime
import random
import threading
import time
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task  # type: ignore[attr-defined]
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from strategies import sim_dispatch
from strategies.sim_dispatch import NodeIndexedStore, index_dispatch

RUN_ID, TASK_ID = 4242, 77


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity Flower's simulation gives its process (``run_simulation``), for this test."""
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_run_id", RUN_ID)
    monkeypatch.setattr(TaskIdentity, "_node_id", SUPERLINK_NODE_ID)


def _grid(nodes: int, run_id: int = RUN_ID) -> tuple[InMemoryGrid, list[int]]:
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                               ObjectStoreFactory())
    state: Any = factory.state()
    run = Run.create_empty(run_id=run_id)
    run.primary_task_id = TASK_ID
    run.federation_id = NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[TASK_ID] = Task(task_id=TASK_ID, run_id=run.run_id)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return grid, list(_register_nodes(nodes, factory))


def _messages(grid: InMemoryGrid, targets: list[int], ttl: float | None = None) -> list[str]:
    out = [Message(RecordDict({"c": ConfigRecord({"i": i})}), dst_node_id=node,
                   message_type="train", ttl=ttl)
           for i, node in enumerate(targets)]
    return list(grid.push_messages(out))


def _sweep(state: Any, nodes: list[int], **kw: Any) -> list[tuple[int, int]]:
    """One dispatcher sweep (``vce_api.add_messages_to_queue``): (node, payload) pairs."""
    got = []
    for node in nodes:
        for msg in state.get_message_ins(node_id=node, **{"limit": 1, **kw}):
            assert msg.metadata.delivered_at != ""
            got.append((node, int(msg.content["c"]["i"])))
    return got


def _twins(nodes: int) -> tuple[InMemoryGrid, InMemoryGrid, list[int], list[int]]:
    flower, a = _grid(nodes)
    ours, b = _grid(nodes)
    assert index_dispatch(ours) and not isinstance(flower.state.message_ins_store,
                                                   NodeIndexedStore)
    return flower, ours, a, b


def test_same_answers_as_flowers_scan() -> None:
    flower, ours, a, b = _twins(6)
    # three messages for node 0, one each for nodes 1..3, none for 4 and 5
    plan = [0, 1, 0, 2, 3, 0]
    _messages(flower, [a[i] for i in plan])
    _messages(ours, [b[i] for i in plan])
    sweeps = []
    for _ in range(4):  # sweep after sweep: node 0's messages one at a time, in order
        left = [(a.index(n), i) for n, i in _sweep(flower.state, a)]
        right = [(b.index(n), i) for n, i in _sweep(ours.state, b)]
        assert left == right
        sweeps.append(right)
    assert sweeps == [[(0, 0), (1, 1), (2, 3), (3, 4)], [(0, 2)], [(0, 5)], []]


def test_limit_none_run_filter_and_bad_limit() -> None:
    flower, ours, a, b = _twins(3)
    _messages(flower, [a[0], a[0], a[1]])
    _messages(ours, [b[0], b[0], b[1]])
    assert _sweep(ours.state, b, run_id=RUN_ID + 1) == []  # another run's: none, none marked
    assert ([i for _, i in _sweep(flower.state, a, limit=None)]
            == [i for _, i in _sweep(ours.state, b, limit=None)] == [0, 1, 2])
    with pytest.raises(AssertionError, match="limit"):
        ours.state.get_message_ins(node_id=b[0], limit=0)


def test_expired_messages_are_dropped_as_flower_drops_them() -> None:
    flower, ours, a, b = _twins(2)
    for grid, nodes in ((flower, a), (ours, b)):
        _messages(grid, [nodes[0]], ttl=0.05)
        _messages(grid, [nodes[1]])
    time.sleep(0.1)
    assert [(a.index(n), i) for n, i in _sweep(flower.state, a)] == [(1, 0)]
    assert [(b.index(n), i) for n, i in _sweep(ours.state, b)] == [(1, 0)]
    assert len(ours.state.message_ins_store) == len(flower.state.message_ins_store) == 1
    assert list(ours.state.message_ins_store.by_node) == [b[1]]


def test_the_index_follows_replies_and_deletions() -> None:
    """A node's message, answered and pulled, leaves the store and the index (Flower deletes it
    through ``delete_messages``), and a new one is dispatched."""
    _, ours, _, b = _twins(2)
    [sent] = _messages(ours, [b[0]])
    [msg] = ours.state.get_message_ins(node_id=b[0], limit=1)
    reply = Message(RecordDict(), reply_to=msg)
    reply.metadata.__dict__["_message_id"] = "reply-1"
    assert ours.state.store_message_res(reply) is not None
    assert [m.metadata.reply_to_message_id for m in ours.pull_messages([sent])] == [sent]
    store = ours.state.message_ins_store
    assert len(store) == 0 and store.by_node == {}
    _messages(ours, [b[0]])
    assert len(ours.state.get_message_ins(node_id=b[0], limit=1)) == 1


def test_index_dispatch_applies_only_where_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not index_dispatch(object())  # a deployment's grid has no in-memory state
    grid, _ = _grid(1)
    monkeypatch.setenv(sim_dispatch.ENV, "flower")
    assert not index_dispatch(grid)
    monkeypatch.delenv(sim_dispatch.ENV)
    monkeypatch.setattr(sim_dispatch.flwr, "__version__", "9.0.0")
    assert not index_dispatch(grid)
    assert type(grid.state.message_ins_store) is dict
    monkeypatch.setattr(sim_dispatch.flwr, "__version__", "1.41.0")
    assert index_dispatch(grid)
    first = grid.state.message_ins_store
    assert index_dispatch(grid) and grid.state.message_ins_store is first  # kept, not rewrapped


def test_installed_on_a_state_that_holds_messages() -> None:
    """Discovery's messages may be stored, delivered or not, when the index is installed."""
    grid, nodes = _grid(3)
    _messages(grid, [nodes[0], nodes[1], nodes[0]])
    assert [i for _, i in _sweep(grid.state, nodes)] == [0, 1]  # Flower's: delivered two
    assert index_dispatch(grid)
    assert [i for _, i in _sweep(grid.state, nodes)] == [2]
    assert _sweep(grid.state, nodes) == []


def test_a_readdressed_message_goes_to_its_new_node() -> None:
    _, ours, _, b = _twins(3)
    [sent] = _messages(ours, [b[0]])
    ours.state.message_ins_store[sent].metadata.dst_node_id = b[1]
    assert ours.state.get_message_ins(node_id=b[0], limit=1) == []
    assert len(ours.state.get_message_ins(node_id=b[1], limit=1)) == 1
    ours.state.delete_messages({sent})
    assert ours.state.message_ins_store.by_node == {}


def test_random_operations_give_flowers_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded random pushes (some expiring), sweeps of every limit, deletions and waits, on
    Flower's state and the indexed one side by side. The states' clock is the test's: it moves
    10 s at each wait, and an expiring message lives 5 s of it, so both states see the same
    expiries whatever the machine's load (with the wall clock, a message could expire between
    the two sweeps)."""
    from flwr.server.superlink.linkstate import in_memory_linkstate

    base, waits = time.time(), [0]

    def clock() -> float:
        return base + 10.0 * waits[0]

    monkeypatch.setattr(in_memory_linkstate, "now",
                        lambda: datetime.datetime.fromtimestamp(clock(), datetime.UTC))
    rng = random.Random(7)
    for _ in range(8):
        flower, ours, a, b = _twins(5)
        ids: list[tuple[str, str]] = []
        for _ in range(40):
            op = rng.random()
            if op < 0.4:
                targets = [rng.randrange(5) for _ in range(rng.randint(1, 4))]
                expiring = rng.random() < 1 / 3  # 5 s of the states' clock from now
                ttl = clock() - time.time() + 5.0 if expiring else None
                ids += zip(_messages(flower, [a[i] for i in targets], ttl=ttl),
                           _messages(ours, [b[i] for i in targets], ttl=ttl), strict=True)
            elif op < 0.8:
                limit = rng.choice([1, 1, 2, None])
                assert ([(a.index(n), i) for n, i in _sweep(flower.state, a, limit=limit)]
                        == [(b.index(n), i) for n, i in _sweep(ours.state, b, limit=limit)])
            elif op < 0.9 and ids:
                left, right = ids[rng.randrange(len(ids))]
                flower.state.delete_messages({left})
                ours.state.delete_messages({right})
            else:
                waits[0] += 1
            store = ours.state.message_ins_store
            assert sorted(k for v in store.by_node.values() for k in v) == sorted(store)


def test_installed_while_the_dispatcher_runs_nothing_is_lost_or_repeated() -> None:
    grid, nodes = _grid(30)
    stop, got = threading.Event(), []

    def dispatcher() -> None:  # vce_api.add_messages_to_queue, its 0.1 s pause made 1 ms
        while not stop.is_set():
            for node in nodes:
                got.extend(m.metadata.message_id
                           for m in grid.state.get_message_ins(node_id=node, limit=1))
            stop.wait(0.001)

    thread = threading.Thread(target=dispatcher)
    thread.start()
    sent: list[str] = []
    try:
        for r in range(12):
            sent += _messages(grid, nodes)
            if r == 6:
                assert index_dispatch(grid)
        deadline = time.monotonic() + 20
        while len(got) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
    assert len(got) == len(set(got)) == len(sent) and set(got) == set(sent)


def test_store_keeps_its_index_through_every_write() -> None:
    grid, nodes = _grid(3)
    ids = _messages(grid, [nodes[0], nodes[1], nodes[0]])
    store = NodeIndexedStore(dict(grid.state.message_ins_store))
    assert {n: list(v) for n, v in store.by_node.items()} == {
        nodes[0]: [ids[0], ids[2]], nodes[1]: [ids[1]]}
    store[ids[0]] = store[ids[0]]  # stored again: keeps its place, as a dict does
    assert list(store.by_node[nodes[0]]) == [ids[0], ids[2]] and list(store)[0] == ids[0]
    msg = store.pop(ids[0])
    assert list(store.by_node[nodes[0]]) == [ids[2]]
    store[ids[0]] = msg  # stored after removal: last in its node's order
    assert list(store.by_node[nodes[0]]) == [ids[2], ids[0]]
    store.update({ids[1]: store[ids[2]]})  # an id re-pointed at another node's message
    assert nodes[1] not in store.by_node and list(store.by_node[nodes[0]]) == [ids[2], ids[0],
                                                                                 ids[1]]
    store.clear()
    assert store.by_node == {} and len(store) == 0 and store.get("x") is None
