"""Progress on long steps: a line now and then while a step that takes more than a few seconds
(loading the users' data, local-only or final fits, evaluation) is still running.

``StepProgress``: where the nodes answer in turn (the in-process engine), a line after a node
once the step has run ``after`` seconds, then at most every ``every`` seconds. ``Waiting``:
where the server waits for replies it cannot count until they arrive (Flower's
``send_and_receive``), a line every ``every`` seconds from a background thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType


class StepProgress:
    """``done(k)`` after each of ``total`` nodes of step ``label``."""

    def __init__(self, label: str, total: int, log: Callable[[str], None],
                 after: float = 5.0, every: float = 10.0) -> None:
        self.label, self.total, self.log = label, total, log
        self.after, self.every = after, every
        self.started = time.perf_counter()
        self.last: float | None = None

    def done(self, nodes: int) -> None:
        now = time.perf_counter()
        if now - self.started >= self.after and (self.last is None
                                                 or now - self.last >= self.every):
            self.last = now
            rate = (now - self.started) / max(nodes, 1)
            left = rate * (self.total - nodes)
            self.log(f"      {self.label}: {nodes}/{self.total} nodes done, "
                     f"{now - self.started:.0f} s so far, about {left:.0f} s left")


class Waiting:
    """A context: while it is open, a line every ``every`` seconds saying the server still
    waits for the nodes' replies to ``label``."""

    def __init__(self, label: str, nodes: int, log: Callable[[str], None],
                 every: float = 15.0) -> None:
        self.label, self.nodes, self.log, self.every = label, nodes, log, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        started = time.perf_counter()
        while not self._stop.wait(self.every):
            self.log(f"      {self.label}: waiting for {self.nodes} nodes' replies, "
                     f"{time.perf_counter() - started:.0f} s so far")

    def __enter__(self) -> Waiting:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
