"""Run-config keys of the exponential-mechanism constructions (A_Exp, JL + exponential
mechanism), as typed component classes (``fedpriv.config``); each algorithm reads the composed
class at the end of this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedpriv.algorithms.personalization.params import ProblemKeys, check_rank
from fedpriv.algorithms.shared_params import (
    DIM,
    FEATURE_DIST,
    RANK,
    RESPONSE_CLIP,
    SAMPLES_PER_USER,
    TEST_SAMPLES,
)
from fedpriv.config import RunConfig
from fedpriv.params import Param, key, positive


@dataclass(frozen=True, kw_only=True)
class CostKeys(RunConfig):
    component: ClassVar[str] = "cost guard"
    max_score_evaluations: float = key(Param(
        "max-score-evaluations", float, 2e8, "refuse a run that would score more (candidate, "
        "user) pairs, before it starts", positive, "a number > 0"))


@dataclass(frozen=True, kw_only=True)
class AExpKeys(RunConfig):
    component: ClassVar[str] = "A_Exp"
    candidates: int = key(Param(
        "candidates", int, 2000, "number of Haar-random candidate embeddings (from the seed)",
        positive, "an integer >= 1"))
    projected_feature_clip: float = key(Param(
        "projected-feature-clip", float, 3.0, "L_f: L2 clip of U^T x in the score", positive,
        "a number > 0"))
    local_norm: float = key(Param(
        "local-norm", float, 5.0, "C: bound on ||v|| (score and local fit)", positive,
        "a number > 0"))
    response_clip: float = key(RESPONSE_CLIP)


@dataclass(frozen=True, kw_only=True)
class MarginProblemKeys(RunConfig):
    component: ClassVar[str] = "margin classification problem"
    dim: int = key(DIM)
    rank: int = key(RANK)
    samples_per_user: int = key(SAMPLES_PER_USER)
    feature_dist: str = key(FEATURE_DIST)
    test_samples_per_user: int = key(TEST_SAMPLES)

    def check_keys(self) -> None:
        check_rank(self.rank, self.dim)


@dataclass(frozen=True, kw_only=True)
class JLKeys(RunConfig):
    component: ClassVar[str] = "JL + exponential mechanism"
    jl_dim: int = key(Param(
        "jl-dim", int, 4, "JL target dimension k'", positive, "an integer >= 1"))
    margin: float = key(Param(
        "margin", float, 0.1, "margin rho of the data and of the score's margin loss",
        positive, "a number > 0"))
    cover_radius: float = key(Param(
        "cover-radius", float, 0.25, "gamma of the grid cover of the Frobenius ball",
        positive, "a number > 0"))


# ----- what each algorithm reads ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AExpConfig(ProblemKeys, AExpKeys, CostKeys):
    """A_Exp and its non-private best-score version: the synthetic linear problem."""


@dataclass(frozen=True, kw_only=True)
class JLExpConfig(MarginProblemKeys, JLKeys, CostKeys):
    """The JL construction and its non-private best-score version: the margin problem."""
