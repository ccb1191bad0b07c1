"""What the neighbouring-dataset harness compares besides the released values: what the server
received from the nodes, what it broadcast, its privacy ledger and its release document.

Every item is one of: public (fixed before the run from public values), inside an accounted
release, or not sent (``docs``: "What each party sees"). So on D and on a neighbour D', with
the same seeds and the same history, an item that is not a released value must be identical;
a difference is something one user's data changed outside an accounted release.

- **The server's view** (``received``): per step, each node's reply as the server got it:
  which nodes answered, their error strings and failure kinds, the counts ``num_users`` and
  ``num_clipped``, the metrics, the vectors, and the rejections the server counted.
  ``must_match`` says which of these items must be identical for a config's mode: a trusted
  server (``aggregation = "central"``) may see its nodes' exact counts, metrics and sums; in a
  distributed or secure run the server is not trusted, and nothing but the noised ring vectors
  may differ.
- **The broadcast**: the server's state is a function of released values, so what it sends
  the nodes is the same on both.
- **The ledger**: the same releases, mechanisms, sensitivities, noise and rho; only the index
  the exponential mechanism chose (``chosen``: the release itself) may differ.
- **The release document** (``fedpriv.outputs.release_document``): the same keys and values,
  except the chosen indices and the config keys that name D' itself (its data file).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fedpriv.config import RunConfig
from fedpriv.server import NodeReply
from fedpriv.server.secagg import SecureOutcome

# what the server receives in a step, item by item
VIEW_ITEMS = ("answered", "errors", "rejections", "num_users", "num_clipped", "metrics",
              "vectors")
# ledger and release-document keys that hold a released value of the exponential mechanism
RELEASED_KEYS = frozenset({"chosen"})
# how many differences a comparison lists (the first ones)
SHOWN = 3


@dataclass(frozen=True)
class Received:
    """Everything the server received in one step (``received``)."""

    step: str
    answered: tuple[int, ...]  # partitions that replied without an error
    errors: tuple[tuple[int, str, str], ...]  # (partition, failure kind, error text)
    rejections: tuple[tuple[str, int], ...]  # the step's rejections by kind
    num_users: tuple[tuple[int, int], ...]  # (partition, count), per reply with content
    num_clipped: tuple[tuple[int, int], ...]
    metrics: tuple[tuple[int, tuple[tuple[str, float], ...] | None], ...]
    vectors: tuple[tuple[int, tuple[tuple[str, bytes], ...]], ...]  # exact bytes, per part


def received(step: str, replies: Sequence[NodeReply] | SecureOutcome,
             rejections: Mapping[str, int]) -> Received:
    """The server's view of one step: ``replies`` as it received them (a secure round: the
    unmasked sum, as partition -1, and which nodes survived or failed in which stage) and the
    rejections it counted in the step. (The masked vectors of a secure round are uniformly
    random whatever the data: not recorded.)"""
    if isinstance(replies, SecureOutcome):
        failed = [NodeReply(n, error=f"{stage}: {detail}", failure=kind)
                  for n, (stage, kind, detail) in sorted(replies.failures.items())]
        view = received(step, [NodeReply(-1, replies.total), *failed], rejections)
        return replace(view, answered=tuple(sorted(replies.survivors)))
    with_content = [r for r in replies if r.contribution is not None and r.error is None]
    return Received(
        step,
        tuple(sorted(r.partition_id for r in with_content)),
        tuple((r.partition_id, r.failure, r.error) for r in replies if r.error is not None),
        tuple(sorted((str(k), int(v)) for k, v in rejections.items() if v)),
        tuple((r.partition_id, int(r.contribution.num_users)) for r in with_content
              if r.contribution is not None),
        tuple((r.partition_id, int(r.contribution.num_clipped)) for r in with_content
              if r.contribution is not None),
        tuple((r.partition_id, None if r.contribution.metrics is None else tuple(
            sorted((str(k), float(v)) for k, v in r.contribution.metrics.items())))
              for r in with_content if r.contribution is not None),
        tuple((r.partition_id, tuple((str(k), np.asarray(v).tobytes() + str(
            np.asarray(v).dtype).encode()) for k, v in sorted(r.contribution.totals.items())))
              for r in with_content if r.contribution is not None))


def mode(config: RunConfig) -> str:
    """The run's trust mode: "central" (the server adds the noise), "distributed" or
    "secure"."""
    return str(config.aggregation) if config.noise_shares else "central"


def must_match(config: RunConfig, metrics_step: bool = False) -> frozenset[str]:
    """The items of the server's view (``VIEW_ITEMS``) that must be identical on D and D' in
    a step (``metrics_step``: the final one or an exact evaluation, which release nothing):
    not user-dependent outside an accounted release. A distributed or secure run's server is
    not trusted and sees only the noised ring vectors: everything else must match, in every
    step. Central mode trusts the server with its nodes' exact counts, metrics and sums; in a
    step that releases, which nodes answered, their errors and the rejections must match (a
    user's data may make no node fail: an honest node isolates the user, and the missing-node
    rescale must not move); its metrics steps are the trusted server's exact evaluation for
    the operator, with nothing released, so nothing there must match."""
    if mode(config) != "central":
        return frozenset(VIEW_ITEMS) - {"vectors"}
    return frozenset() if metrics_step else frozenset({"answered", "errors", "rejections"})


def view_differences(config: RunConfig, ours: Received, theirs: Received,
                     metrics_step: bool = False) -> list[str]:
    """Where D''s view of a step differs from D's in an item that must match."""
    out = []
    for item in VIEW_ITEMS:
        if item not in must_match(config, metrics_step):
            continue
        a, b = getattr(ours, item), getattr(theirs, item)
        if a != b:
            why = ("nothing but the noised ring vectors may differ" if mode(config) != "central"
                   else "no user's data may make a node fail or be rejected")
            out.append(f"{ours.step}: the server received {item} {_short(a)} on D and "
                       f"{_short(b)} on D' ({mode(config)} mode: {why})")
    return out


def broadcast_differences(step: str, ours: Mapping[str, np.ndarray],
                          theirs: Mapping[str, np.ndarray]) -> list[str]:
    """Where the broadcast of D''s server differs from D's (same history: none may)."""
    if set(ours) != set(theirs):
        return [f"{step}: the broadcast holds {sorted(ours)} on D and {sorted(theirs)} on D'"]
    return [f"{step}: the broadcast's {k!r} differs (max |difference| "
            f"{_max_difference(ours[k], theirs[k]):.3g})"
            for k in sorted(ours) if not _same_array(ours[k], theirs[k])]


def ledger_differences(ours: Sequence[Mapping[str, Any]],
                       theirs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where D''s ledger differs from D's: the same releases with the same sensitivities, noise
    and rho (only a released value, ``RELEASED_KEYS``, may differ)."""
    if len(ours) != len(theirs):
        return [f"the ledger holds {len(ours)} releases on D and {len(theirs)} on D'"]
    out: list[str] = []
    for a, b in zip(ours, theirs, strict=True):
        out += [f"{a.get('release')}: ledger{d}" for d in _differences(a, b, "")]
    return out


def document_differences(ours: Mapping[str, Any], theirs: Mapping[str, Any],
                         own_keys: frozenset[str] = frozenset()) -> list[str]:
    """Where D''s release document differs from D's (``own_keys``: config keys that differ
    between the two configs by construction, such as the data file)."""
    a, b = dict(ours), dict(theirs)
    for doc in (a, b):
        doc["config"] = {k: v for k, v in doc.get("config", {}).items() if k not in own_keys}
    return [f"release document{d}" for d in _differences(a, b, "")]


def config_differences(a: RunConfig, b: RunConfig) -> frozenset[str]:
    """The config keys on which D's and D''s configs differ (the neighbour's own)."""
    ma, mb = a.to_mapping(), b.to_mapping()
    return frozenset(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))


# ----- comparing nested values -------------------------------------------------------------
def _differences(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} on one side only"]
        out: list[str] = []
        for k in sorted(a, key=str):
            if k not in RELEASED_KEYS:
                out += _differences(a[k], b[k], f"{path}[{k!r}]")
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path}: {len(a)} entries on D, {len(b)} on D'"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in _differences(x, y, f"{path}[{i}]")]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if _same_array(a, b) else [f"{path}: arrays differ"]
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, int | float) and isinstance(b, int | float) and (
                a == b or (math.isnan(a) and math.isnan(b))):
            return []
    elif a == b:
        return []
    return [f"{path}: {_short(a)} on D, {_short(b)} on D'"]


def _same_array(a: Any, b: Any) -> bool:
    x, y = np.asarray(a), np.asarray(b)
    return x.shape == y.shape and x.dtype == y.dtype and bool(
        np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))


def _max_difference(a: Any, b: Any) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(x - y), initial=0.0)) if x.shape == y.shape else math.inf


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def summary(differences: Sequence[str]) -> str:
    """The first ``SHOWN`` differences on one line (and how many more)."""
    more = len(differences) - SHOWN
    return "; ".join(differences[:SHOWN]) + (f"; and {more} more" if more > 0 else "")
