"""How many nodes a run has and how a node computes its users: in blocks.

Memory: a node never computes its whole cohort at once. ``node_step`` cuts its users into
blocks of ``FEDPRIV_BLOCK_USERS`` (environment; default 20,000), runs the algorithm's user step
on each block and adds the blocks' sums (every contribution and final metric is a sum over
users, so the result is the same up to float rounding). The users' data comes from the
process's cache (``fedpriv.data.cache``).

A user's failure costs only that user: where a block's user step raises, or returns a sum or
metric that is not finite (a loss that overflows), the block is split in halves until the
users whose own step fails so are found; each of those takes part with a zero contribution
(``log2(block)`` extra passes per failing user). Where every user of the node fails and the
algorithm's step over no user fails too, the error is not the users' data (a bad broadcast, a
broken model): the node fails.

What leaves the node in a distributed or secure run (``public_reply``): the noisy ring vectors
and nothing exact about its users. Its user count is the public one (hosting and participation
are functions of public values) or 0 where hosting is not public (natural users of a file); no
clipped count, no metrics; metrics steps (the final one, exact evaluations) are not sent to
the nodes at all.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Step, UserContribution
from fedpriv.config import RunConfig
from fedpriv.data.cache import block_users
from fedpriv.shares import encode_shares, split_parameters


def auto_num_nodes(num_users: int, users_per_node: int) -> int:
    """Number of SuperNodes: ``ceil(n / users-per-node)``, or with ``users-per-node = 0`` a
    cohort layout that keeps Flower's per-node overhead small (at most 10 nodes, cohorts of at
    least 100 users)."""
    if users_per_node > 0:
        return -(-num_users // users_per_node)
    return max(1, min(10, num_users // 100))


def node_step(algorithm: type[Algorithm[Any]], config: RunConfig, step: Step,
              arrays: Mapping[str, np.ndarray], hosted: np.ndarray) -> UserContribution:
    """The node's answer to ``step`` for the users it hosts: the algorithm's user step over
    blocks of at most ``block_users()`` hosted users (those of each block that take part in
    the step), summed; in a distributed or secure run, only what ``public_reply`` keeps."""
    arrays, shares = split_parameters(arrays)
    if config.noise_shares and step.is_final:  # the server never sends a metrics step
        raise ValueError(f"{step.label}: a distributed run's nodes send no exact metrics "
                         "(private-metrics = true releases them with noise)")
    if shares is None and config.noise_shares:
        raise ValueError(f"{step.label}: the run is distributed but the server's broadcast "
                         "carries no noise-share parameters; this node sends no exact sums")
    total = _users_step(algorithm, config, step, arrays, hosted)
    if shares is not None:  # aggregation = "distributed" or "secure": this node's noisy share
        return public_reply(algorithm, config, step, hosted,
                            encode_shares(config.seed, step, total, shares))
    return total


def simulated_metrics(algorithm: type[Algorithm[Any]], config: RunConfig, step: Step,
                      arrays: Mapping[str, np.ndarray], hosted: np.ndarray) -> UserContribution:
    """The final step's exact metrics of a node's users, as the in-process simulator measures
    them for its operator (``fedpriv.engine``): never a node's reply to a server."""
    return _users_step(algorithm, config, step, split_parameters(arrays)[0], hosted)


def public_count(algorithm: type[Algorithm[Any]], config: RunConfig, step: Step,
                 hosted: np.ndarray) -> int:
    """The node's users taking part in ``step`` as the server can compute it (0 where hosting
    is not public)."""
    if not algorithm.public_hosting(config):
        return 0
    return len(algorithm.participants(config, step, hosted))


def public_reply(algorithm: type[Algorithm[Any]], config: RunConfig, step: Step,
                 hosted: np.ndarray, contrib: UserContribution) -> UserContribution:
    """A distributed or secure node's reply: its noisy vectors, the public user count, no
    clipped count and no metrics."""
    return UserContribution(dict(contrib.totals),
                            public_count(algorithm, config, step, hosted), 0, None)


def _users_step(algorithm: type[Algorithm[Any]], config: RunConfig, step: Step,
                arrays: Mapping[str, np.ndarray], hosted: np.ndarray) -> UserContribution:
    size = block_users()
    total: UserContribution | None = None
    failed: list[Exception] = []
    for start in range(0, len(hosted), size):
        users = algorithm.participants(config, step, hosted[start:start + size])
        if len(users):
            part = isolated_step(algorithm, config, step, arrays, users, failed)
            if part is not None:
                total = part if total is None else add_contributions(total, part)
    if total is None:  # nobody takes part (or every user failed): the empty answer
        try:
            total = algorithm.user_step(config, step, arrays, hosted[:0])
        except Exception:
            if failed:  # no user's step ran and no empty one either: not the users' data
                raise failed[0] from None
            raise
    if not failed:
        return total
    # the node's own log (a node's operator sees its users), never sent to the server
    print(f"fedpriv node: {step.label}: {len(failed)} user(s) failed and take part with zero "
          f"({type(failed[0]).__name__}: {failed[0]})"[:300], file=sys.stderr)
    return UserContribution(total.totals, total.num_users + len(failed), total.num_clipped,
                            total.metrics)


def isolated_step(algorithm: type[Algorithm[Any]], config: RunConfig, step: Step,
                  arrays: Mapping[str, np.ndarray], users: np.ndarray,
                  failed: list[Exception]) -> UserContribution | None:
    """``user_step`` of ``users``; where it raises or returns a value that is not finite, the
    halves' steps, down to single users: each user whose own step fails so is appended to
    ``failed`` (it takes part with zero sums and metrics). None: every user of ``users``
    failed."""
    try:
        contrib = algorithm.user_step(config, step, arrays, users)
        if finite(contrib):
            return contrib
        raise FloatingPointError("a sum or metric is not finite")
    except Exception as err:  # noqa: BLE001 - one user's data may fail the step in any way
        if len(users) == 1:
            failed.append(err)
            return None
    half = len(users) // 2
    parts = [isolated_step(algorithm, config, step, arrays, users[:half], failed),
             isolated_step(algorithm, config, step, arrays, users[half:], failed)]
    done = [c for c in parts if c is not None]
    return None if not done else done[0] if len(done) == 1 else add_contributions(*done)


def finite(contrib: UserContribution) -> bool:
    """Whether every sum and metric of ``contrib`` is a finite number."""
    try:
        return (all(bool(np.all(np.isfinite(np.asarray(v, dtype=np.float64))))
                    for v in contrib.totals.values())
                and all(np.isfinite(float(v)) for v in (contrib.metrics or {}).values()))
    except (TypeError, ValueError, OverflowError):
        return False


def add_contributions(a: UserContribution, b: UserContribution) -> UserContribution:
    """The contribution of two disjoint sets of users (sums add)."""
    if set(a.totals) != set(b.totals) or (a.metrics is None) != (b.metrics is None):
        raise ValueError("blocks of one step returned different parts")
    metrics = None
    if a.metrics is not None and b.metrics is not None:
        metrics = {k: a.metrics[k] + b.metrics[k] for k in a.metrics}
    return UserContribution({k: a.totals[k] + b.totals[k] for k in a.totals},
                            a.num_users + b.num_users, a.num_clipped + b.num_clipped, metrics)
