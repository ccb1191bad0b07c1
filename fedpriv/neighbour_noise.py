"""Repeatable cryptographic noise, for the neighbouring-dataset harness ONLY.

A publishable run draws its noise from ChaCha20 streams keyed by the operating system: a
distributed node's Skellam share and conditional rounding (``fedpriv.shares``), the server's
discrete Gaussian on the grid (``Releaser.crypto_stream``) and its exact exponential mechanism
(``secure-noise``). Two runs on D and on a neighbour D' then draw independent noise, and their
releases differ by far more than one user can move them. ``repeatable_noise`` keys each of
those streams by what the harness knows of the draw, the same on D and on D':

- a node's stream by (run seed, step label, partition, draw): the harness names the node
  (``node``) while it computes; ``draw`` counts the streams that node opened in the step. The
  node draws its parts in the step's (public) order from that one stream, so a part's noise
  depends on nothing another node does: one node's failure shifts no other node's noise;
- the server's grid noise by (run seed, step label, part), as ``crypto_stream`` names it;
- the server's exponential mechanism by (run seed, step label, "choice"): the harness names the
  step (``server``) while the server aggregates it.

Never on by default and never reachable from a run config: it is a context manager that only
``fedpriv.neighbours`` enters (anyone who knows the seed could subtract noise drawn this way).
A draw that the harness did not name raises, so a stream that escapes the keying cannot pass as
repeatable; ``draws`` counts the keyed streams, so that the harness can tell that the hooks it
patches are still the ones the nodes and the server call.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from fedpriv.privacy.discrete import CryptoRandom

_DOMAIN = "fedpriv neighbouring-dataset harness: repeatable noise, never for a release"


def stream_key(*names: object) -> int:
    """A 256-bit ChaCha20 key from the names of one draw."""
    return int.from_bytes(hashlib.sha256(repr((_DOMAIN, *names)).encode()).digest(), "big")


class RepeatableNoise:
    """The keyed streams of one harness run (see the module docstring)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.draws: Counter[str] = Counter()  # keyed streams opened: "node", "grid", "choice"
        self._node: tuple[str, int] | None = None
        self._node_draws = 0
        self._step: str | None = None

    @contextlib.contextmanager
    def node(self, label: str, partition: int) -> Iterator[None]:
        """Draws made while ``partition``'s node computes its answer to step ``label``."""
        outer, outer_draws = self._node, self._node_draws
        self._node, self._node_draws = (label, partition), 0
        try:
            yield
        finally:
            self._node, self._node_draws = outer, outer_draws

    @contextlib.contextmanager
    def server(self, label: str) -> Iterator[None]:
        """Draws made while the server aggregates step ``label``."""
        outer, self._step = self._step, label
        try:
            yield
        finally:
            self._step = outer

    def node_stream(self, seed: int | None = None) -> CryptoRandom:
        """What a node's ``CryptoRandom()`` gives (``fedpriv.shares``, ``fedpriv.nodes``; an
        explicit seed is kept)."""
        if seed is not None:
            return CryptoRandom(seed)
        if self._node is None:
            raise RuntimeError("repeatable noise: a node drew a stream outside the harness's "
                               "node scope (its noise would not repeat on D and D')")
        label, partition = self._node
        self._node_draws += 1
        self.draws["node"] += 1
        return CryptoRandom(stream_key(self.seed, label, "node", partition,
                                       self._node_draws - 1))

    def grid_stream(self, label: str, part: str) -> CryptoRandom:
        """The server's stream of one publishable part's noise."""
        self.draws["grid"] += 1
        return CryptoRandom(stream_key(self.seed, label, "server", part))

    def choice_stream(self, seed: int | None = None) -> CryptoRandom:
        """What ``fedpriv.server.release`` gets for ``CryptoRandom()`` (the exact exponential
        mechanism of a ``secure-noise`` run)."""
        if seed is not None:
            return CryptoRandom(seed)
        if self._step is None:
            raise RuntimeError("repeatable noise: the server drew a stream outside the "
                               "harness's server scope")
        self.draws["choice"] += 1
        return CryptoRandom(stream_key(self.seed, self._step, "server", "choice"))


@contextlib.contextmanager
def repeatable_noise(seed: int) -> Iterator[RepeatableNoise]:
    """While active, the nodes' and the server's cryptographic streams are ``RepeatableNoise``'s
    keyed ones (the modules' names are put back on the way out)."""
    import fedpriv.nodes as nodes
    import fedpriv.server.release as release
    import fedpriv.shares as shares

    noise = RepeatableNoise(seed)

    def crypto_stream(_self: Any, step: Any, part: Any) -> CryptoRandom:
        return noise.grid_stream(step.label, part.name)

    # the modules whose CryptoRandom() is a node's noise stream (where they name it)
    patches: list[tuple[Any, str, Any]] = [(m, "CryptoRandom", noise.node_stream)
                                           for m in (shares, nodes) if "CryptoRandom" in vars(m)]
    patches += [(release, "CryptoRandom", noise.choice_stream),
                (release.Releaser, "crypto_stream", crypto_stream)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield noise
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
