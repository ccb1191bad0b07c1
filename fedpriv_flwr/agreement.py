"""What ``PrivateStrategy`` settles before its first release: the inner strategy's sampling
settings, the nodes connected, and the nodes' personalization schedule. Nothing here is data:
these are settings and protocol, so a run that disagrees stops before anything is released.

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
  ``SCHEDULE_MISMATCH``, and the server refuses replies that carry the personal layers or miss
  the shared ones. A round in which every node that answered disagrees on the schedule stops the
  run before its release (``ScheduleMismatch``): it would release noise alone.
"""

from __future__ import annotations

import inspect
import math
from logging import INFO

from flwr.common import log
from flwr.serverapp.strategy import FedAvg, Strategy

from fedpriv_flwr.personal import PERSONAL_CONFIG

__all__ = ["PERSONAL_CONFIG", "SCHEDULE_MISMATCH", "ScheduleMismatch", "no_reply_reason",
           "no_reply_summary", "population_warning", "schedule_mismatch", "train_sampling_rate"]

SCHEDULE_MISMATCH = "personalize: schedule mismatch"
"""How the client mod's error reply for a pattern that is not its own begins."""
PROTOCOL_REJECTIONS = ("carries personal layers", "misses released keys")
"""Reasons (``RoundSum.rejected``) of replies whose keys disagree with the server's pattern."""


class ScheduleMismatch(ValueError):
    """The nodes and the server disagree on the personal layers (the message says how)."""


def _fedavg_default(name: str) -> object:
    return inspect.signature(FedAvg.__init__).parameters[name].default


def train_sampling_rate(strategy: Strategy, sampling_rate: float | None,
                        multi_user_nodes: bool) -> float:
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
    """Why a round whose answering nodes all disagree with the server's personal-layer
    ``pattern`` must stop before its release; None if any node agrees (or none answered)."""
    mod = [r for r in failed_reasons if r.startswith(SCHEDULE_MISMATCH)]
    keys = {r: n for r, n in rejected.items() if r.startswith(PROTOCOL_REJECTIONS)}
    others = len(failed_reasons) - len(mod) + sum(rejected.values()) - sum(keys.values())
    if accepted or others or not (mod or keys):
        return None
    server = f"personal_layers={pattern!r}" if pattern else "no personal_layers"
    if mod:
        why = mod[0][len("personalize: "):]
    elif any(r.startswith("carries personal layers") for r in keys):
        why = (f"the nodes' replies carry the personal layers {pattern!r}: their ClientApp "
               "has no personalize(...) mod, or one with schedule='finetune'")
    else:
        why = ("the nodes' replies miss layers the server sent: their ClientApp keeps layers "
               "personal (personalize(..., schedule='fedrep')) that the server does not know")
    return (f"the nodes and the server disagree on the personal layers ({why}); the server has "
            f"{server}. Give PrivateStrategy(personal_layers=...) the pattern of the client "
            "mod personalize(pattern, schedule='fedrep'), or none with schedule='finetune'. "
            "Stopped before this round's release: nothing was released or spent for it")


def no_reply_reason(row: dict[str, object]) -> str:
    """Why a round's row (``PrivateStrategy``'s operator report) has no accepted reply."""
    sampled = row.get("sampled_nodes")
    if sampled == 0:
        return "no node was sampled (Poisson sampling)"
    failed = row.get("failed_nodes", 0)
    rejected = row.get("rejected_nodes") or {}
    count = sum(rejected.values()) if isinstance(rejected, dict) else 0
    return (f"no reply was accepted ({sampled} nodes sampled, {failed} failed, {count} "
            "rejected; reasons in the operator report)")


def no_reply_summary(rows: list[dict[str, object]]) -> str | None:
    """The run's closing warning when rounds had no accepted reply (None if every round had)."""
    empty = [row["round"] for row in rows if row.get("no_accepted_reply")]
    if not empty:
        return None
    trained = sum(1 for row in rows if "answered_nodes" in row)
    learned = " and the model learned nothing from the nodes" if len(empty) == trained else ""
    return (f"{len(empty)} of {trained} rounds had no accepted reply (rounds {empty[:10]}): "
            f"their releases are noise alone{learned}; the reasons are in the operator report")
