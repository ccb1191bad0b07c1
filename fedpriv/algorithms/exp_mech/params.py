"""Run-config keys of the exponential-mechanism constructions (A_Exp, JL + exponential
mechanism). Algorithms list these groups in their ``components``; see ``fedpriv.params``."""

from __future__ import annotations

from fedpriv.algorithms.personalization.params import check_rank
from fedpriv.algorithms.shared_params import (
    DIM,
    FEATURE_DIST,
    RANK,
    RESPONSE_CLIP,
    SAMPLES_PER_USER,
    TEST_SAMPLES,
)
from fedpriv.params import Param, ParamGroup, positive

COST = ParamGroup("cost guard", (
    Param("max-score-evaluations", float, 2e8, "refuse a run that would score more (candidate, "
          "user) pairs, before it starts", positive, "a number > 0"),
))

A_EXP = ParamGroup("A_Exp", (
    Param("candidates", int, 2000, "number of Haar-random candidate embeddings (from the seed)",
          positive, "an integer >= 1"),
    Param("projected-feature-clip", float, 3.0, "L_f: L2 clip of U^T x in the score", positive,
          "a number > 0"),
    Param("local-norm", float, 5.0, "C: bound on ||v|| (score and local fit)", positive,
          "a number > 0"),
    RESPONSE_CLIP,
))

MARGIN_PROBLEM = ParamGroup("margin classification problem", (
    DIM, RANK, SAMPLES_PER_USER, FEATURE_DIST, TEST_SAMPLES,
), check_rank)

JL = ParamGroup("JL + exponential mechanism", (
    Param("jl-dim", int, 4, "JL target dimension k'", positive, "an integer >= 1"),
    Param("margin", float, 0.1, "margin rho of the data and of the score's margin loss",
          positive, "a number > 0"),
    Param("cover-radius", float, 0.25, "gamma of the grid cover of the Frobenius ball",
          positive, "a number > 0"),
))
