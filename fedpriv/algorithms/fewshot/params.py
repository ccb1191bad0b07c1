"""Run-config keys of the few-shot meta-learning family: the tasks (their images, N ways, K
shots, Q queries), how a task adapts the meta-model, and the composed config classes each
algorithm reads (the network keys are the deep family's, the rounds and sampling keys the
meta-learning family's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from fedpriv.algorithms.deep.params import ModelKeys
from fedpriv.algorithms.meta.params import META_MODELS, MetaRoundKeys, SampledRoundsConfig
from fedpriv.config import RunConfig
from fedpriv.params import ConfigError, Param, key, non_negative, one_of, positive

TASK_SOURCES = ("digits", "fashion-mnist", "omniglot")
# the family's own defaults of the per-algorithm keys (docs/results.md: how they were chosen)
FEWSHOT_DEFAULTS: Mapping[str, Any] = {"rounds": 80, "learning-rate": 0.25}
META_GRADIENTS = ("unrolled", "first-order")


@dataclass(frozen=True, kw_only=True)
class FewShotTaskKeys(RunConfig):
    component: ClassVar[str] = "few-shot tasks"
    task_source: str = key(Param(
        "task-source", str, "digits", "the images tasks are drawn from: `digits` "
        "(scikit-learn's bundled 8x8 digits: fast), `fashion-mnist` (Debian's IDX files; "
        "meta-test tasks from the test split's images: the same 10 classes, other images) or "
        "`omniglot` (task-dir holds images_background/ and images_evaluation/: meta-test "
        "tasks from disjoint characters)", *one_of(TASK_SOURCES)))
    task_dir: str = key(Param(
        "task-dir", str, "", "omniglot: its folder (required); fashion-mnist: the IDX "
        "folder (`\"\"` = /usr/share/datasets/fashion-mnist)", public=False))
    ways: int = key(Param(
        "ways", int, 5, "N: classes a task (its labels 0..N-1 in a random order per task)",
        lambda n: n >= 2, "an integer >= 2"))
    shots: int = key(Param(
        "shots", int, 5, "K: support images a class (what a task adapts on)", positive,
        "an integer >= 1"))
    queries: int = key(Param(
        "queries", int, 15, "Q: query images a class (what the adapted model is scored on)",
        positive, "an integer >= 1"))
    adapt_steps: int = key(Param(
        "adapt-steps", int, 0, "how a task adapts: `0` = its classes' mean support "
        "embeddings (prototypes, Snell et al. 2017); s > 0 = then s gradient steps of a linear "
        "head on the support, started from the prototypes (ProtoMAML)", non_negative,
        "an integer >= 0"))
    adapt_lr: float = key(Param(
        "adapt-lr", float, 0.1, "adapt-steps > 0: the head's step size", positive,
        "a number > 0"))
    meta_gradient: str = key(Param(
        "meta-gradient", str, "unrolled", "the meta-gradient of the adapted query loss "
        "(adapt-steps > 0): `unrolled` (through the head steps) or `first-order` (MAML's "
        "first-order approximation: the steps' change of the head held fixed, the gradient "
        "through the prototypes they start from); the same with adapt-steps = 0",
        *one_of(META_GRADIENTS)))

    eval_tasks: str = key(Param(
        "eval-tasks", str, "test", "the fresh tasks of the final evaluation: `test` = "
        "meta-test tasks (the test split's images; Omniglot's evaluation characters); "
        "`validation` = tasks of a held-out sixth of the meta-training images (Omniglot: of "
        "its background characters), which the training tasks then do not draw from: what "
        "settings are chosen on, the test tasks untouched",
        *one_of(("test", "validation"))))

    def check_keys(self) -> None:
        if self.task_source == "omniglot" and not self.task_dir:
            raise ConfigError("task-dir: task-source = \"omniglot\" needs task-dir, the folder "
                              "that holds images_background/ and images_evaluation/ (nothing "
                              "is downloaded)")


@dataclass(frozen=True, kw_only=True)
class FewShotConfig(FewShotTaskKeys, ModelKeys):
    """Every few-shot algorithm: the tasks and the network (``fewshot-local`` reads these)."""


@dataclass(frozen=True, kw_only=True)
class FewShotSampledConfig(FewShotConfig, SampledRoundsConfig):
    """Meta-NSGD and its non-private version on few-shot tasks."""


@dataclass(frozen=True, kw_only=True)
class FewShotClusterKeys(RunConfig):
    component: ClassVar[str] = "few-shot meta-model clusters"
    meta_models: int = key(META_MODELS)


@dataclass(frozen=True, kw_only=True)
class FewShotClusterConfig(FewShotSampledConfig, FewShotClusterKeys):
    """Private clustering-based meta-learning on few-shot tasks: q networks."""


@dataclass(frozen=True, kw_only=True)
class FewShotOnePassConfig(FewShotConfig, MetaRoundKeys):
    """DP-FTMRL on few-shot tasks."""


# the record-level baseline's own defaults (docs/results.md: chosen on validation tasks)
REPTILE_DEFAULTS: Mapping[str, Any] = {"rounds": 40}


@dataclass(frozen=True, kw_only=True)
class RecordDPKeys(RunConfig):
    component: ClassVar[str] = "record-level noisy steps inside a task"
    inner_steps: int = key(Param(
        "inner-steps", int, 3, "fewshot-dp-reptile: full-batch DP-SGD steps a sampled task "
        "takes on its own records from the meta-model (each record's gradient clipped to "
        "clip-norm, Gaussian noise on the task's sum)", positive, "an integer >= 1"))
    inner_lr: float = key(Param(
        "inner-lr", float, 0.5, "fewshot-dp-reptile: the step size of those DP-SGD steps",
        positive, "a number > 0"))


@dataclass(frozen=True, kw_only=True)
class FewShotReptileConfig(FewShotSampledConfig, RecordDPKeys):
    """The record-level baseline (``fewshot-dp-reptile``): Meta-NSGD's rounds and sampling,
    DP-SGD inside each task."""
