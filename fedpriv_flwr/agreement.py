"""What ``PrivateStrategy`` settles before its first release: the inner strategy's sampling
settings, the nodes connected, and the nodes' personalization schedule. Nothing here is data:
these are settings and protocol. What is wrong in the settings stops the run before round 1;
what the nodes' replies show is reported, never a reason to stop (a reply is a user's).

* **Sampling** (``train_sampling_rate``): the inner strategy's ``fraction_train`` is the Poisson
  rate the plan is calibrated for (each node takes part in a round independently with that
  probability, drawn by the server), unless ``sampling_rate`` says the same or
  ``fraction_train`` is left at 1; a disagreement, a fraction of 0, node-level sampling of
  multi-user nodes, or a ``min_train_nodes`` above FedAvg's default under Poisson sampling (a
  Poisson cohort has no minimum: a fixed one would change the accounted mechanism) is refused.
* **The population** (``population_warning``): with one user per node, ``num_users`` should be
  the number of SuperNodes; the first round warns (Flower's log and the operator report) when
  the connected nodes are not that many. Only a warning: their number changes with one user's
  presence, so stopping on it would disclose that user; the release is private for any number.
* **The schedule** (``PERSONAL_CONFIG``): every train and evaluate message carries the
  server's personal-layer pattern (``""`` for none); the client mod
  (``fedpriv_flwr.personal.personalize``) refuses a message whose pattern is not its own
  (``fedrep``: the same pattern; ``finetune``: none) with an error reply whose reason starts with
  ``SCHEDULE_MISMATCH``, before any training, and the server refuses replies that carry the
  personal layers. A round in which every node that answered disagrees
  is reported (``schedule_mismatch``: Flower's log at ERROR, the operator report, the run's
  closing line) but not stopped: the replies are the users', and a stop that one user's reply
  could cause (the only node of a small Poisson cohort) would tell that user's presence.
* **Evaluation** (``check_evaluation``, ``inner_evaluation``): the inner strategy's own sample
  and aggregate, except that private metrics need every node (their noisy mean divides by
  ``num_users``) and an aggregate the inner strategy refuses (replies with other metric names)
  costs that round's entry in Flower's result, never the run.
"""

from __future__ import annotations

import inspect
import math
from logging import INFO, WARNING

from flwr.app import Message, MetricRecord
from flwr.common import log
from flwr.serverapp.strategy import FedAvg, Strategy

from fedpriv_flwr.personal import PERSONAL_CONFIG

__all__ = ["PERSONAL_CONFIG", "SCHEDULE_MISMATCH", "check_evaluation", "inner_evaluation",
           "no_reply_reason", "no_reply_summary", "population_warning", "rejection_summary",
           "schedule_mismatch", "train_sampling_rate"]

SCHEDULE_MISMATCH = "personalize: schedule mismatch"
"""How the client mod's error reply for a pattern that is not its own begins."""
PROTOCOL_REJECTIONS = ("carries personal layers",)
"""Reasons (``RoundSum.rejected``) of replies whose keys disagree with the server's pattern (a
reply that misses keys is a handler's bug as often as a schedule's: said as it is, below)."""
STRUCTURAL = ("carries personal layers", "misses released keys", "key ", "holds an undecodable")
"""Rejection reasons about the reply's structure that name only the server's own keys (missing,
personal, of the wrong shape or dtype) or a decoding failure: no user's value and no name a node
chose, so Flower's log may say them; the others (non-finite values, norms, counts, keys the
server did not send) are in the operator report only."""


def _fedavg_default(name: str) -> object:
    return inspect.signature(FedAvg.__init__).parameters[name].default


def train_sampling_rate(strategy: Strategy, sampling_rate: float | None,
                        multi_user_nodes: bool, secure_noise: bool = False) -> float:
    """The Poisson rate of the plan: ``sampling_rate``, or the inner strategy's
    ``fraction_train`` (module docstring); ``ValueError`` naming the setting otherwise."""
    name = type(strategy).__name__
    fraction = getattr(strategy, "fraction_train", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
            0 < fraction <= 1):
        raise ValueError(f"{name}(fraction_train={fraction!r}): PrivateStrategy needs a "
                         "fraction in (0, 1], the Poisson rate of each node in a round")
    fraction = float(fraction)
    if fraction < 1 and multi_user_nodes:
        raise ValueError(
            f"{name}(fraction_train={fraction:g}) with multi_user_nodes: each node samples its "
            "own users at sampling_rate; sampling nodes as well is not accounted. Leave "
            "fraction_train at 1 and set sampling_rate")
    if sampling_rate is not None and fraction < 1 and not math.isclose(fraction,
                                                                       sampling_rate):
        raise ValueError(
            f"sampling_rate={sampling_rate:g} and {name}(fraction_train={fraction:g}) disagree: "
            "give one of them (PrivateStrategy samples the nodes itself, by Poisson sampling "
            "at that rate, which the privacy plan is calibrated for)")
    if fraction < 1 and secure_noise:
        raise ValueError(
            f"{name}(fraction_train={fraction:g}) with secure_noise: the discrete noise is "
            "accounted without amplification by sampling, so every node trains every round; "
            "leave fraction_train at 1")
    rate = fraction if sampling_rate is None else float(sampling_rate)
    min_train = getattr(strategy, "min_train_nodes", None)
    default = _fedavg_default("min_train_nodes")
    if rate < 1 and not multi_user_nodes and isinstance(min_train, int) and isinstance(
            default, int) and min_train > default:
        raise ValueError(
            f"{name}(min_train_nodes={min_train}) under Poisson sampling at rate {rate:g}: a "
            "Poisson cohort has no minimum size (a fixed minimum would change the mechanism the "
            f"plan accounts for); leave min_train_nodes at its default ({default}), or train "
            "every node (sampling_rate=1)")
    if fraction < 1 and sampling_rate is None:
        log(INFO, "fedpriv: %s's fraction_train=%g is the Poisson sampling rate: each node "
            "takes part in a round with probability %g, drawn by PrivateStrategy (its cohort "
            "has no minimum size; the privacy plan is calibrated for this rate)", name,
            fraction, fraction)
    return rate


def population_warning(connected: int, num_users: int, rate: float) -> str | None:
    """The warning for a run of one user per node whose connected SuperNodes are not
    ``num_users`` (None when they are). A warning, not a refusal: how many nodes are connected
    changes with one user's presence, so a run that stopped on it would tell whether that user
    is there; the release divides by the public ``rate * num_users`` whatever the count."""
    if connected == num_users:
        return None
    cohort = rate * num_users
    factor = (f"; each round's update is divided by the expected cohort {cohort:g}, so the "
              f"model moves about {num_users / max(connected, 1):.3g} times slower than "
              "FedAvg would" if connected < num_users else "")
    return (f"{connected} SuperNodes are connected but num_users={num_users} (one user per "
            f"node: num_users is the population the guarantee is stated for){factor}. Set "
            "num_users to the number of SuperNodes, or pass multi_user_nodes=True for nodes "
            "that host several users")


def schedule_mismatch(pattern: str | None, failed_reasons: list[str],
                      rejected: dict[str, int], accepted: int) -> str | None:
    """Why every node that answered a round disagrees with the server's personal-layer
    ``pattern``; None if any reply was accepted or failed otherwise (or none answered)."""
    mod = [r for r in failed_reasons if r.startswith(SCHEDULE_MISMATCH)]
    keys = {r: n for r, n in rejected.items() if r.startswith(PROTOCOL_REJECTIONS)}
    others = len(failed_reasons) - len(mod) + sum(rejected.values()) - sum(keys.values())
    if accepted or others or not (mod or keys):
        return None
    server = f"personal_layers={pattern!r}" if pattern else "no personal_layers"
    if mod:
        why = mod[0][len("personalize: "):]
    else:  # PROTOCOL_REJECTIONS: the replies carry the server's personal layers
        why = (f"the nodes' replies carry the personal layers {pattern!r}: their ClientApp "
               "has no personalize(...) mod, or one with schedule='finetune'")
    return (f"every reply disagrees with the server on the personal layers ({why}); the server "
            f"has {server}. Give PrivateStrategy(personal_layers=...) the pattern of the client "
            "mod personalize(pattern, schedule='fedrep'), or none with schedule='finetune'")


def no_reply_reason(row: dict[str, object]) -> str:
    """Why a round's row (``PrivateStrategy``'s operator report) has no accepted reply."""
    sampled = row.get("sampled_nodes")
    if sampled == 0:
        return "no node was sampled (Poisson sampling)"
    failed = row.get("failed_nodes", 0)
    rejected = row.get("rejected_nodes") or {}
    count = sum(rejected.values()) if isinstance(rejected, dict) else 0
    said = rejection_summary(rejected) if isinstance(rejected, dict) else ""
    return (f"no reply was accepted ({sampled} nodes sampled, {failed} failed, {count} "
            f"rejected{': ' + said if said else ''}; reasons in the operator report)")


def rejection_summary(rejected: dict[str, int], most: int = 2) -> str:
    """The commonest structural rejection reasons, for Flower's log (``STRUCTURAL``)."""
    said = sorted(((n, r) for r, n in rejected.items() if r.startswith(STRUCTURAL)),
                  key=lambda item: -item[0])[:most]
    return "; ".join(f"{n} x a reply that {r}" for n, r in said)


def no_reply_summary(rows: list[dict[str, object]], mismatch: str | None = None) -> str | None:
    """The run's closing warning when rounds had no accepted reply (None if every round had),
    with the last schedule ``mismatch`` seen."""
    empty = [row["round"] for row in rows if row.get("no_accepted_reply")]
    if not empty:
        return None
    trained = sum(1 for row in rows if "answered_nodes" in row)
    learned = " and the model learned nothing from the nodes" if len(empty) == trained else ""
    rejected: dict[str, int] = {}
    for row in rows:
        for reason, n in dict(row.get("rejected_nodes") or {}).items():  # type: ignore[call-overload]
            rejected[reason] = rejected.get(reason, 0) + n
    said = rejection_summary(rejected, most=1)
    why = (f"; {mismatch}" if mismatch else f"; {said}" if said
           else "; the reasons are in the operator report")
    return (f"{len(empty)} of {trained} rounds had no accepted reply (rounds {empty[:10]}): "
            f"their releases are noise alone{learned}{why}")


def check_evaluation(strategy: Strategy, private_metrics: bool) -> None:
    """Private metrics need every node's value (the noisy mean divides by ``num_users``):
    refuse an inner strategy that evaluates a fraction of the nodes."""
    fraction = getattr(strategy, "fraction_evaluate", 1.0)
    if private_metrics and isinstance(fraction, (int, float)) and fraction < 1:
        raise ValueError(
            f"{type(strategy).__name__}(fraction_evaluate={fraction:g}) with private_metrics: "
            "their noisy mean divides by num_users, so every node evaluates; a fraction would "
            "scale it down (and 0 would spend budget on noise alone). Leave fraction_evaluate "
            "at 1, or leave out private_metrics")


def inner_evaluation(strategy: Strategy, server_round: int,
                     replies: list[Message]) -> MetricRecord | None:
    """The inner strategy's aggregate of the evaluation replies (Flower's flow), from the
    replies that hold one MetricRecord; None, with a warning, where it refuses them (nodes
    that report other metric names): one node's reply costs that round's entry in Flower's
    result, never the run."""
    readable = [r for r in replies
                if not r.has_error() and len(r.content.metric_records) == 1]
    try:
        return strategy.aggregate_evaluate(server_round, readable)
    except Exception as err:  # noqa: BLE001 -- Flower's checks raise several kinds
        log(WARNING, "fedpriv: round %d: %s could not aggregate the evaluation replies (%s); "
            "Flower's result has no metrics for this round, the operator report has the exact "
            "means", server_round, type(strategy).__name__, type(err).__name__)
        return None
