"""The strategy's own poll of Flower's Grid (strategies.private.exchange): every reply comes
back, the first pause is 10 ms, the pauses grow 1.5x to at most 30 ms, the timeout holds;
a stand-in that is not a Flower Grid answers through its own send_and_receive."""

from __future__ import annotations

import time

from flower_grid import set_identity
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from strategies.private import POLL_FIRST, POLL_GROWTH, POLL_MAX, exchange


class SlowGrid(Grid):
    """Replies become available ``delay`` seconds after the push (one for each message, ids
    0, 1, ...); never for the nodes in ``silent``."""

    def __init__(self, delay: float, silent: frozenset[int] = frozenset()) -> None:
        self.delay, self.silent, self.pulls = delay, silent, []
        self.pushed: dict[str, Message] = {}

    def push_messages(self, messages):
        self.t0 = time.monotonic()
        ids = []
        for i, m in enumerate(messages):
            ids.append(str(i))
            self.pushed[str(i)] = m
        return ids

    def pull_messages(self, message_ids):
        self.pulls.append(time.monotonic() - self.t0)
        if time.monotonic() - self.t0 < self.delay:
            return []
        out = []
        for i in sorted(message_ids):
            if int(i) in self.silent:
                continue
            reply = Message(RecordDict({}), reply_to=self.pushed[i])
            reply.metadata.__dict__["_reply_to_message_id"] = i
            out.append(reply)
        return out

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover - not used
        raise AssertionError("exchange polls the grid itself")

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self):  # pragma: no cover
        return []

    def set_run(self, run_id):  # pragma: no cover
        pass

    @property
    def run(self):  # pragma: no cover
        return None


def _messages(n):
    set_identity()
    return [Message(RecordDict({}), dst_node_id=i + 1, message_type="query") for i in range(n)]


def test_every_reply_comes_back_after_a_short_first_poll_and_growing_pauses(monkeypatch):
    import strategies.private as private

    pauses: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(private.time, "sleep", lambda s: (pauses.append(s), real_sleep(s)))
    grid = SlowGrid(delay=2.0)
    replies = exchange(grid, _messages(3), timeout=10.0)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["0", "1", "2"]
    # Flower's own loop waits 0.1 s (simulation) or 3 s (deployment) between pulls
    assert pauses[0] == POLL_FIRST and all(
        b == min(a * POLL_GROWTH, POLL_MAX) for a, b in zip(pauses, pauses[1:], strict=False))
    assert max(pauses) == POLL_MAX and len(grid.pulls) == len(pauses) + 1


def test_the_timeout_holds_and_the_replies_that_came_are_kept():
    grid = SlowGrid(delay=0.0, silent=frozenset({1}))
    started = time.monotonic()
    replies = exchange(grid, _messages(3), timeout=0.4)
    assert 0.4 <= time.monotonic() - started < 0.4 + POLL_MAX + 1.0  # + slack for a busy CPU
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["0", "2"]


def test_a_stand_in_grid_answers_through_its_own_send_and_receive():
    class StandIn:
        def send_and_receive(self, messages, *, timeout=None):
            return [f"reply to {m.metadata.dst_node_id}" for m in messages]

    assert exchange(StandIn(), _messages(2), timeout=1.0) == ["reply to 1", "reply to 2"]
