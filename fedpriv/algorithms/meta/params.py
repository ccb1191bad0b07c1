"""Run-config keys of the task-level meta-learning family (Zhou & Bassily 2022): the task
distribution, the base learner, the meta-training rounds, task sampling and clustering.
Algorithms list these groups in their ``components``; see ``fedpriv.params``."""

from __future__ import annotations

import math
from typing import Any

from fedpriv.algorithms.shared_params import (
    CLIP_NORM,
    CLIPPING,
    DIM,
    FEATURE_DIST,
    LABEL_NOISE,
    LEARNING_RATE,
    SAMPLES_PER_USER,
    TEST_SAMPLES,
)
from fedpriv.data.meta import LOSSES
from fedpriv.params import ConfigError, Param, ParamGroup, non_negative, one_of, positive


def check_clusters(config: Any) -> None:
    if config.task_clusters > config.dim:
        raise ConfigError(f"task-clusters: {config.task_clusters} is not allowed; expected "
                          f"task-clusters <= dim ({config.dim})")


TASKS = ParamGroup("task distribution", (
    DIM, SAMPLES_PER_USER, LABEL_NOISE, FEATURE_DIST, TEST_SAMPLES,
    Param("task-loss", str, "squared", "the tasks' loss: `squared` (regression) or `logistic` "
          "(labels +-1 with P(y=1|x) = sigma(<w, x>))", *one_of(LOSSES)),
    Param("task-clusters", int, 1, "clusters of the task distribution; 1: w ~ N(task-mean * 1, "
          "task-std^2 I); c > 1: c orthogonal block centers (-1)^j 2(j+1) (c = 3, d = 30: the "
          "paper's)", positive, "an integer in [1, dim]"),
    Param("task-mean", float, 4.0, "one cluster: every entry of the mean task vector",
          math.isfinite, "a finite number"),
    Param("task-std", float, 1.0, "std of task vectors around their center", non_negative,
          "a number >= 0"),
), check_clusters)

BASE_LEARNER = ParamGroup("base learner", (
    Param("meta-lambda", float, 0.05, "lambda of the base learner min_w R_Z(w) + lambda/2 "
          "||w - h||^2", positive, "a number > 0"),
    Param("base-accuracy", float, 1e-6, "the base learner stops at ||grad|| <= b, which "
          "certifies ||w^ - w_h|| <= b/lambda", positive, "a number > 0"),
))

META_ROUNDS = ParamGroup("meta-training rounds", (
    LEARNING_RATE, CLIP_NORM, CLIPPING,
    Param("meta-radius", float, 50.0, "radius of the ball W the meta-model(s) are projected "
          "onto", positive, "a number > 0"),
))

SAMPLING = ParamGroup("task sampling", (
    Param("tasks-per-round", int, 0, "expected sampled tasks per round m (Poisson rate m/K); "
          "0 = the paper's m = max(K sqrt(eps/(4T)), 1)", non_negative, "an integer >= 0"),
))

CLUSTERS = ParamGroup("meta-model clusters", (
    Param("meta-models", int, 1, "q, the number of meta-models", positive, "an integer >= 1"),
    Param("meta-init-scale", float, 1.0, "q > 1: norm of the seeded random starting "
          "meta-models", non_negative, "a number >= 0"),
))
