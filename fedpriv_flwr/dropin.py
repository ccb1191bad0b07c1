"""``PrivateStrategy`` built with the arguments of Flower's DP wrappers.

Where an app built ``DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier,
clipping_norm, num_sampled_clients, accountant=...)``, the same call with ``PrivateStrategy``
runs: ``clipping_norm`` is the clip, ``num_sampled_clients`` the population (one user per node,
every node each round, as Flower's fixed-clipping wrapper has it), the accountant's
``PrivacyConfig`` gives delta, the population, ``max_epsilon`` and the neighbouring relation,
and without ``num_rounds`` the plan is made when ``start(num_rounds=...)`` is called. The given
accountant also sees each training release (a ``GaussianPrivacyEvent`` of the round's noise
multiplier), so its own ``get_privacy_spent()`` keeps working; the epsilon ``PrivateStrategy``
prints and enforces is fedpriv's (PLD). A setting given two ways that disagree is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from logging import WARNING
from typing import Any

from flwr.common import log
from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyAccountant,
    SamplingMethod,
)
from flwr.serverapp.strategy import Strategy

__all__ = ["DEFAULT_EPSILON", "Resolved", "feed_accountant", "flower_arguments", "note_no_ceiling",
           "sampling_note"]

_RELATIONS = {NeighboringRelation.ADD_OR_REMOVE_ONE: "add-remove",
              NeighboringRelation.REPLACE_ONE: "replace-one"}


class _Default(float):
    """The type of ``DEFAULT_EPSILON``: 1.0, told apart from a 1.0 the caller gave."""


DEFAULT_EPSILON: float = _Default(1.0)
"""``PrivateStrategy``'s default ``epsilon``: the target 1.0, or none in Flower's form."""


@dataclass(frozen=True)
class Resolved:
    num_users: Any  # checked by the plan (a positive integer)
    clip_norm: float
    epsilon: float | None
    delta: float
    max_epsilon: float | None
    relation: str


def _one(name: str, flower_name: str, ours: Any, theirs: Any) -> Any:
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(f"{name}={ours!r} and {flower_name}={theirs!r} disagree: give one")
    return ours if ours is not None else theirs


def flower_arguments(strategy: Strategy, *, noise_multiplier: float | None,
                     clipping_norm: float | None, num_sampled_clients: int | None,
                     accountant: PrivacyAccountant | None, num_users: int | None,
                     clip_norm: float | None, epsilon: float | None, delta: float | None,
                     max_epsilon: float | None, relation: str | None) -> Resolved:
    """fedpriv's settings from its own arguments and Flower's (module docstring)."""
    config = accountant.config if accountant is not None else None
    if num_sampled_clients is not None:
        fraction = getattr(strategy, "fraction_train", 1.0)
        if isinstance(fraction, (int, float)) and 0 < fraction < 1 and num_users is None:
            raise ValueError(
                f"num_sampled_clients={num_sampled_clients} with {type(strategy).__name__}"
                f"(fraction_train={fraction:g}): that is a per-round count; PrivateStrategy "
                "samples each node with probability fraction_train and needs the population: "
                "replace num_sampled_clients by num_users (the number of nodes, one user each)")
    users = _one("num_users", "num_sampled_clients", num_users, num_sampled_clients)
    users = _one("num_users", "accountant's population_size", users,
                 config.population_size if config else None)
    if users is None:
        raise ValueError("num_users: the population the guarantee is stated for (with one user "
                         "per node: the number of SuperNodes); Flower's num_sampled_clients or "
                         "an accountant's population_size also give it")
    theirs = _RELATIONS[config.neighboring_relation] if config else None
    clip = _one("clip_norm", "clipping_norm", clip_norm, clipping_norm)
    target = _one("delta", "accountant's target_delta", delta,
                  config.target_delta if config else None)
    relation = _one("relation", "accountant's neighboring_relation", relation, theirs)
    # Flower's form (a given z, no target) has no epsilon: it spends what z spends, up to
    # max_epsilon; fedpriv's own keywords keep their target of 1.0 (a ceiling for a given z)
    flower_form = any(v is not None for v in (clipping_norm, num_sampled_clients, accountant))
    if epsilon is DEFAULT_EPSILON:  # not given: explicit values (None included) are kept
        epsilon = None if noise_multiplier is not None and flower_form else 1.0
    return Resolved(
        num_users=users, clip_norm=1.0 if clip is None else clip, epsilon=epsilon,
        delta=1e-5 if target is None else target,
        max_epsilon=_one("max_epsilon", "accountant's max_epsilon", max_epsilon,
                         config.max_epsilon if config else None),
        relation="add-remove" if relation is None else relation)


def feed_accountant(accountant: PrivacyAccountant | None, multiplier: float, num_users: int,
                    sampling_rate: float) -> None:
    """The user's Flower accountant sees the round's release (its own accounting method)."""
    if accountant is None:
        return
    size = max(1, min(num_users, math.ceil(sampling_rate * num_users)))  # never below q N
    accountant.compose(GaussianPrivacyEvent(noise_multiplier=multiplier, sample_size=size,
                                            population_size=num_users))


def sampling_note(accountant: PrivacyAccountant | None, sampling_rate: float) -> None:
    """Say where the accountant's ``sampling_method`` is not the sampling the run does: the
    epsilon fedpriv prints is for the run's (Poisson at the inner ``fraction_train``, or none)."""
    if accountant is None:
        return
    method = accountant.config.sampling_method
    run = SamplingMethod.POISSON if sampling_rate < 1 else SamplingMethod.NO_AMPLIFICATION
    if method == run:
        return
    log(WARNING, "fedpriv: the accountant says sampling_method=%s, but the nodes are %s: the "
        "epsilon PrivateStrategy prints and enforces is for the latter (the accountant you "
        "passed keeps its own method)", method.value,
        f"Poisson-sampled at rate {sampling_rate:g} (fraction_train)" if sampling_rate < 1
        else "all trained every round (no amplification)")


def note_no_ceiling(epsilon: float | None, max_epsilon: float | None, projected: float) -> None:
    """A given noise multiplier with neither a target nor ``max_epsilon``: said before round 1."""
    if epsilon is None and max_epsilon is None:
        log(WARNING, "fedpriv: noise_multiplier given without epsilon or max_epsilon: the planned "
            "rounds will spend epsilon = %.4f (PLD); pass max_epsilon (or the accountant's) to "
            "refuse more", projected)
