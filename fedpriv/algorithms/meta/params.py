"""Run-config keys of the task-level meta-learning family (Zhou & Bassily 2022): the task
distribution, the base learner, the meta-training rounds, task sampling and clustering, as typed
component classes (``fedpriv.config``); each algorithm reads one of the composed classes at the
end of this module."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

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
from fedpriv.config import RunConfig
from fedpriv.data.meta import LOSSES
from fedpriv.params import ConfigError, Param, key, non_negative, one_of, positive

META_MODELS = Param("meta-models", int, 1, "q, the number of meta-models", positive,
                    "an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class TaskKeys(RunConfig):
    component: ClassVar[str] = "task distribution"
    dim: int = key(DIM)
    samples_per_user: int = key(SAMPLES_PER_USER)
    label_noise: float = key(LABEL_NOISE)
    feature_dist: str = key(FEATURE_DIST)
    test_samples_per_user: int = key(TEST_SAMPLES)
    task_loss: str = key(Param(
        "task-loss", str, "squared", "the tasks' loss: `squared` (regression) or `logistic` "
        "(labels +-1 with P(y=1|x) = sigma(<w, x>))", *one_of(LOSSES)))
    task_clusters: int = key(Param(
        "task-clusters", int, 1, "clusters of the task distribution; 1: w ~ N(task-mean * 1, "
        "task-std^2 I); c > 1: c orthogonal block centers (-1)^j 2(j+1) (c = 3, d = 30: the "
        "paper's)", positive, "an integer in [1, dim]"))
    task_mean: float = key(Param(
        "task-mean", float, 4.0, "one cluster: every entry of the mean task vector",
        math.isfinite, "a finite number"))
    task_std: float = key(Param(
        "task-std", float, 1.0, "std of task vectors around their center", non_negative,
        "a number >= 0"))

    def check_keys(self) -> None:
        if self.task_clusters > self.dim:
            raise ConfigError(f"task-clusters: {self.task_clusters} is not allowed; expected "
                              f"task-clusters <= dim ({self.dim})")


@dataclass(frozen=True, kw_only=True)
class BaseLearnerKeys(RunConfig):
    component: ClassVar[str] = "base learner"
    meta_lambda: float = key(Param(
        "meta-lambda", float, 0.05, "lambda of the base learner min_w R_Z(w) + lambda/2 "
        "||w - h||^2", positive, "a number > 0"))
    base_accuracy: float = key(Param(
        "base-accuracy", float, 1e-6, "the base learner stops at ||grad|| <= b, which "
        "certifies ||w^ - w_h|| <= b/lambda", positive, "a number > 0"))


@dataclass(frozen=True, kw_only=True)
class MetaRoundKeys(RunConfig):
    component: ClassVar[str] = "meta-training rounds"
    learning_rate: float = key(LEARNING_RATE)
    clip_norm: float = key(CLIP_NORM)
    clipping: bool = key(CLIPPING)
    meta_radius: float = key(Param(
        "meta-radius", float, 50.0, "radius of the ball W the meta-model(s) are projected "
        "onto", positive, "a number > 0"))


@dataclass(frozen=True, kw_only=True)
class SamplingKeys(RunConfig):
    component: ClassVar[str] = "task sampling"
    tasks_per_round: int = key(Param(
        "tasks-per-round", int, 0, "expected sampled tasks per round m (Poisson rate m/K); "
        "0 = the paper's m = max(K sqrt(eps/(4T)), 1)", non_negative, "an integer >= 0"))


@dataclass(frozen=True, kw_only=True)
class ClusterKeys(RunConfig):
    component: ClassVar[str] = "meta-model clusters"
    meta_models: int = key(META_MODELS)
    meta_init_scale: float = key(Param(
        "meta-init-scale", float, 1.0, "q > 1: norm of the seeded random starting "
        "meta-models", non_negative, "a number >= 0"))


# ----- what each algorithm reads ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MetaConfig(TaskKeys, BaseLearnerKeys):
    """Every meta-learning algorithm: the task distribution and the base learner (the
    references ``meta-local`` and ``meta-oracle`` read nothing more)."""


@dataclass(frozen=True, kw_only=True)
class OnePassConfig(MetaConfig, MetaRoundKeys):
    """DP-FTMRL and FTMRL: one pass over the tasks in ``rounds`` disjoint batches."""


@dataclass(frozen=True, kw_only=True)
class SampledRoundsConfig(MetaRoundKeys, SamplingKeys):
    """What the sampled schedule reads (``schedule.SampledRounds``), whatever the tasks."""


@dataclass(frozen=True, kw_only=True)
class SampledMetaConfig(MetaConfig, SampledRoundsConfig):
    """Meta-NSGD and Meta-SGD: rounds over Poisson samples of the tasks."""


@dataclass(frozen=True, kw_only=True)
class ClusterMetaConfig(SampledMetaConfig, ClusterKeys):
    """Private clustering-based meta-learning and its non-private version: q meta-models."""
