"""Run-config keys of the personalization family (shared embedding U, personal v_i): the
synthetic problem, the initializations, and each algorithm's rounds. Algorithms list these
groups in their ``components``; see ``fedpriv.params``."""

from __future__ import annotations

from typing import Any

from fedpriv.algorithms.shared_params import (
    CLIP_NORM,
    CLIPPING,
    DIM,
    FEATURE_DIST,
    LABEL_NOISE,
    LEARNING_RATE,
    RANK,
    RESPONSE_CLIP,
    SAMPLES_PER_USER,
    TEST_SAMPLES,
    VALIDATION_SAMPLES,
)
from fedpriv.params import ConfigError, Param, ParamGroup, one_of, positive, unit_open

INIT_CHOICES = ("auto", "u-statistic", "pairs", "random")


def check_rank(config: Any) -> None:
    if config.rank > config.dim:
        raise ConfigError(f"rank: {config.rank} is not allowed; expected rank <= dim "
                          f"({config.dim})")


DATA_DTYPE = Param("data-dtype", str, "float64", "precision users' points are kept in: "
                   "`float64`, or `float32` (each point drawn in float64, then rounded: half "
                   "the memory of the data cache; computation stays float64; at 10^6 users the "
                   "population MSE moved by 5e-9 relative)",
                   *one_of(("float64", "float32")))

PROBLEM = ParamGroup("synthetic linear problem", (
    DIM, RANK, SAMPLES_PER_USER, LABEL_NOISE, FEATURE_DIST, TEST_SAMPLES, VALIDATION_SAMPLES,
    DATA_DTYPE,
), check_rank)

INIT = ParamGroup("private initialization", (
    Param("init", str, "auto", "`u-statistic` (Snedeker et al. Alg. 2), `pairs` (Jain et al. "
          "Alg. 3), `random` (data-free, no budget), `auto` = the algorithm's own paper's",
          *one_of(INIT_CHOICES)),
    Param("init-clip-norm", float, 1.0, "psi_init: per-user Frobenius clip of the U-statistic",
          positive, "a number > 0"),
    Param("init-budget-fraction", float, 0.5, "share of the privacy budget (1/z^2 units) spent "
          "on the initialization", unit_open, "a number in (0, 1)"),
    RESPONSE_CLIP, CLIPPING,
))

FEDREP = ParamGroup("FedRep rounds", (
    LEARNING_RATE, CLIP_NORM, CLIPPING,
    Param("batch-size", str, "max", "b of each of the two disjoint batches: `max` (the "
          "largest two the first half holds), `paper` (max(1, floor(m/(2T)))) or an integer",
          lambda x: x in ("max", "paper") or x.isdigit(), "'max', 'paper' or an integer >= 1"),
))


def check_user_groups(config: Any) -> None:
    if config.rounds % config.user_groups:
        raise ConfigError(f"user-groups: {config.user_groups} does not divide rounds "
                          f"({config.rounds}); each group must take part in the same number "
                          "of rounds")
    if config.user_groups > config.num_users:
        raise ConfigError(f"user-groups: {config.user_groups} exceeds num-users "
                          f"({config.num_users})")


ALTMIN = ParamGroup("Priv-AltMin rounds", (
    Param("user-groups", int, 1, "G disjoint user groups; round t uses group (t-1) mod G, so "
          "each user takes part in rounds/G rounds (G = T is Alg. 1 as written)", positive,
          "an integer >= 1 that divides rounds"),
    Param("feature-clip", float, 10.0, "eta: per-sample clip of vec(x v^T)", positive,
          "a number > 0"),
    RESPONSE_CLIP,
    Param("cov-budget-share", float, 0.5, "share of a round's privacy loss (1/z^2 units) spent "
          "on sum W W^T; the rest goes to sum y W (0.5 = the paper's equal multipliers)",
          unit_open, "a number in (0, 1)"),
    CLIPPING,
), check_user_groups)

GLOBAL_MODEL = ParamGroup("DP-FedAvg rounds", (LEARNING_RATE, CLIP_NORM, CLIPPING))
