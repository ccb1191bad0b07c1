"""Flower's simulation engine hands each node its messages in O(messages) per node, not
O(messages x nodes) per sweep.

In flwr 1.41 the simulation engine's dispatcher thread (``vce_api.add_messages_to_queue``) asks
the in-memory LinkState, for every node in turn, for that node's next undelivered message, and
``InMemoryLinkState.get_message_ins`` answers by scanning every stored message (checking each
one's expiry). While a round's K messages wait, every sweep (every 0.1 s) costs K x K checks
under the state's lock: at 1,000 nodes that thread held a core (64% of the simulation process's
samples) and the replies waited on the lock.

``index_dispatch(grid)`` gives that LinkState a per-node index of its stored messages (kept by
the store's own writes, so every path that stores or deletes a message keeps it) and answers a
node from its own entries, with the same checks (expiry and federation via the state's own
``_check_stored_messages``, run, not yet delivered), the same order and the same delivery mark.
The messages, what the nodes and the server receive and the release do not change. One side
effect of Flower's scan is not kept: asking for one node's messages also dropped every other
node's expired ones; here each node's are checked when that node is asked (every sweep asks
every node), and the server's pull checks the ones it waits for.

It applies only where it was checked: Flower's simulation engine (an ``InMemoryLinkState``
behind the grid) of a Flower version in ``CHECKED``; elsewhere (a deployment's grid, another
Flower) it does nothing. ``FEDPRIV_FLOWER_DISPATCH=flower`` in the environment of the
simulation process (that of ``fedpriv run``, for the SuperLink it starts) keeps Flower's own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import flwr
from flwr.app import Message

CHECKED = ("1.41.",)
"""Flower versions whose ``InMemoryLinkState`` this was read against and tested with."""

ENV = "FEDPRIV_FLOWER_DISPATCH"


class NodeIndexedStore(MutableMapping[str, Message]):
    """A message store (message id -> Message) that also keeps, per destination node, its
    message ids in the order they were stored (``by_node``), and the node each id is filed
    under (a message whose ``dst_node_id`` changed is filed again when asked for)."""

    def __init__(self, items: MutableMapping[str, Message]) -> None:
        self._data: dict[str, Message] = {}
        self.by_node: dict[int, dict[str, None]] = {}
        self._node_of: dict[str, int] = {}
        for key, value in items.items():
            self[key] = value

    def __getitem__(self, key: str) -> Message:
        return self._data[key]

    def __setitem__(self, key: str, value: Message) -> None:
        self._data[key] = value  # an existing key keeps its place, as in a dict
        self.file(key, value.metadata.dst_node_id)

    def __delitem__(self, key: str) -> None:
        del self._data[key]
        self._unfile(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def file(self, key: str, node: int) -> None:
        """File ``key`` under ``node`` (where it is filed already: kept in its place)."""
        if self._node_of.get(key) == node:
            return
        self._unfile(key)
        self._node_of[key] = node
        self.by_node.setdefault(node, {})[key] = None

    def _unfile(self, key: str) -> None:
        node = self._node_of.pop(key, None)
        if node is None:
            return
        ids = self.by_node[node]
        ids.pop(key, None)
        if not ids:
            del self.by_node[node]


def indexed_get_message_ins(state: Any, store: NodeIndexedStore,
                            now: Callable[[], Any]) -> Callable[..., list[Message]]:
    """``state.get_message_ins`` answered from ``store``'s per-node index (see the module)."""

    def get_message_ins(node_id: int, limit: int | None, *,
                        run_id: int | None = None) -> list[Message]:
        if limit is not None and limit < 1:
            raise AssertionError("`limit` must be >= 1")
        found: list[Message] = []
        with state.lock:
            for msg_id in list(store.by_node.get(node_id, ())):
                state._check_stored_messages({msg_id})  # noqa: SLF001 - Flower's own checks
                msg = store.get(msg_id)
                if msg is not None and msg.metadata.dst_node_id != node_id:
                    store.file(msg_id, msg.metadata.dst_node_id)  # readdressed: not this node's
                    continue
                if (msg is not None and (run_id is None or msg.metadata.run_id == run_id)
                        and msg.metadata.delivered_at == ""):
                    found.append(msg)
                if limit and len(found) == limit:
                    break
        delivered_at = now().isoformat()
        for msg in found:
            msg.metadata.delivered_at = delivered_at
        return found

    return get_message_ins


def index_dispatch(grid: object) -> bool:
    """Index the simulation engine's LinkState behind ``grid`` (see the module); whether it did."""
    if os.environ.get(ENV, "").strip().lower() == "flower":
        return False
    if not flwr.__version__.startswith(CHECKED):
        return False
    try:
        from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
        from flwr.supercore.date import now
    except ImportError:
        return False
    found = getattr(grid, "state", None)
    if type(found) is not InMemoryLinkState:
        return False
    state: Any = found  # its attributes are replaced below
    lock = getattr(state, "lock", None)
    if (not isinstance(lock, type(threading.RLock()))
            or not callable(getattr(state, "_check_stored_messages", None))):
        return False
    with lock:  # the store read under the lock its writers hold
        store = getattr(state, "message_ins_store", None)
        if isinstance(store, NodeIndexedStore):
            return True
        if type(store) is not dict:
            return False
        indexed = NodeIndexedStore(store)
        state.message_ins_store = indexed
        state.get_message_ins = indexed_get_message_ins(state, indexed, now)
    return True
