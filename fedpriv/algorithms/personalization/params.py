"""Run-config keys of the personalization family (shared embedding U, personal v_i): the
synthetic problem, the initializations, and each algorithm's rounds, as typed component classes
(``fedpriv.config``); each algorithm reads the composed class at the end of this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedpriv.algorithms.shared_params import (
    CHOICE_FOLDS,
    CLIP_NORM,
    CLIPPING,
    DIM,
    FEATURE_DIST,
    FINAL_CHOICE,
    LABEL_NOISE,
    LEARNING_RATE,
    RANK,
    RESPONSE_CLIP,
    SAMPLES_PER_USER,
    TEST_SAMPLES,
    VALIDATION_SAMPLES,
)
from fedpriv.config import RunConfig
from fedpriv.params import ConfigError, Param, key, one_of, positive, unit_open

INIT_CHOICES = ("auto", "u-statistic", "pairs", "random")


def check_rank(rank: int, dim: int) -> None:
    if rank > dim:
        raise ConfigError(f"rank: {rank} is not allowed; expected rank <= dim ({dim})")


DATA_DTYPE = Param("data-dtype", str, "float64", "precision users' points are kept in: "
                   "`float64`, or `float32` (each point drawn in float64, then rounded: half "
                   "the memory of the data cache; computation stays float64; at 10^6 users the "
                   "population MSE moved by 5e-9 relative)",
                   *one_of(("float64", "float32")))

@dataclass(frozen=True, kw_only=True)
class ProblemKeys(RunConfig):
    component: ClassVar[str] = "synthetic linear problem"
    dim: int = key(DIM)
    rank: int = key(RANK)
    samples_per_user: int = key(SAMPLES_PER_USER)
    label_noise: float = key(LABEL_NOISE)
    feature_dist: str = key(FEATURE_DIST)
    test_samples_per_user: int = key(TEST_SAMPLES)
    validation_samples_per_user: int = key(VALIDATION_SAMPLES)
    data_dtype: str = key(DATA_DTYPE)

    def check_keys(self) -> None:
        check_rank(self.rank, self.dim)


@dataclass(frozen=True, kw_only=True)
class InitKeys(RunConfig):
    component: ClassVar[str] = "private initialization"
    init: str = key(Param(
        "init", str, "auto", "`u-statistic` (Snedeker et al. Alg. 2), `pairs` (Jain et al. "
        "Alg. 3), `random` (data-free, no budget), `auto` = the algorithm's own paper's",
        *one_of(INIT_CHOICES)))
    init_clip_norm: float = key(Param(
        "init-clip-norm", float, 1.0, "psi_init: per-user Frobenius clip of the U-statistic",
        positive, "a number > 0"))
    init_budget_fraction: float = key(Param(
        "init-budget-fraction", float, 0.5, "share of the privacy budget (1/z^2 units) spent "
        "on the initialization", unit_open, "a number in (0, 1)"))
    response_clip: float = key(RESPONSE_CLIP)
    clipping: bool = key(CLIPPING)


@dataclass(frozen=True, kw_only=True)
class FedRepKeys(RunConfig):
    component: ClassVar[str] = "FedRep rounds"
    learning_rate: float = key(LEARNING_RATE)
    clip_norm: float = key(CLIP_NORM)
    clipping: bool = key(CLIPPING)
    batch_size: str = key(Param(
        "batch-size", str, "max", "b of each of the two disjoint batches: `max` (the "
        "largest two the first half holds), `paper` (max(1, floor(m/(2T)))) or an integer",
        lambda x: x in ("max", "paper") or x.isdigit(), "'max', 'paper' or an integer >= 1"))


@dataclass(frozen=True, kw_only=True)
class AltMinKeys(RunConfig):
    component: ClassVar[str] = "Priv-AltMin rounds"
    user_groups: int = key(Param(
        "user-groups", int, 1, "G disjoint user groups; round t uses group (t-1) mod G, so "
        "each user takes part in rounds/G rounds (G = T is Alg. 1 as written)", positive,
        "an integer >= 1 that divides rounds"))
    feature_clip: float = key(Param(
        "feature-clip", float, 10.0, "eta: per-sample clip of vec(x v^T)", positive,
        "a number > 0"))
    response_clip: float = key(RESPONSE_CLIP)
    cov_budget_share: float = key(Param(
        "cov-budget-share", float, 0.5, "share of a round's privacy loss (1/z^2 units) spent "
        "on sum W W^T; the rest goes to sum y W (0.5 = the paper's equal multipliers)",
        unit_open, "a number in (0, 1)"))
    clipping: bool = key(CLIPPING)

    def check_keys(self) -> None:
        if self.rounds % self.user_groups:
            raise ConfigError(f"user-groups: {self.user_groups} does not divide rounds "
                              f"({self.rounds}); each group must take part in the same number "
                              "of rounds")
        if self.user_groups > self.num_users:
            raise ConfigError(f"user-groups: {self.user_groups} exceeds num-users "
                              f"({self.num_users})")


@dataclass(frozen=True, kw_only=True)
class GlobalModelKeys(RunConfig):
    component: ClassVar[str] = "DP-FedAvg rounds"
    learning_rate: float = key(LEARNING_RATE)
    clip_norm: float = key(CLIP_NORM)
    clipping: bool = key(CLIPPING)


@dataclass(frozen=True, kw_only=True)
class ChoiceKeys(RunConfig):
    component: ClassVar[str] = "final choice"
    final_choice: str = key(FINAL_CHOICE)
    choice_folds: int = key(CHOICE_FOLDS)


# ----- what each algorithm reads ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EmbeddingConfig(ProblemKeys, InitKeys, ChoiceKeys):
    """The shared-embedding algorithms: the problem and the initialization."""


@dataclass(frozen=True, kw_only=True)
class FedRepConfig(EmbeddingConfig, FedRepKeys):
    """Private FedRep and FedRep."""


@dataclass(frozen=True, kw_only=True)
class AltMinConfig(EmbeddingConfig, AltMinKeys):
    """Priv-AltMin and AltMin."""


@dataclass(frozen=True, kw_only=True)
class GlobalModelConfig(ProblemKeys, GlobalModelKeys):
    """DP-FedAvg's one global model."""
