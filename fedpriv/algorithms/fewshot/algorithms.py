"""The registered few-shot meta-learning algorithms (the package docstring): a schedule of the
meta-learning family (``fedpriv.algorithms.meta.schedule``) over few-shot tasks and a deep
network's embedding (``FewShotBase``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.algorithms.fewshot import fewshot_math as fm
from fedpriv.algorithms.fewshot.params import (
    FEWSHOT_DEFAULTS,
    FewShotClusterConfig,
    FewShotConfig,
    FewShotOnePassConfig,
    FewShotSampledConfig,
)
from fedpriv.algorithms.fewshot.problem import (
    FewShotProblem,
    TaskBlock,
    chunk_tasks,
    problem_of,
    starting_bodies,
    task_block,
)
from fedpriv.algorithms.meta.schedule import MetaModels, OnePassRounds, SampledRounds
from fedpriv.data.fewshot import draw_tasks
from fedpriv.data.sources import DatasetError
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease

FC = TypeVar("FC", bound=FewShotConfig)


def _choices(config: FewShotConfig, problem: FewShotProblem, models: torch.Tensor,
             block: TaskBlock) -> np.ndarray:
    """Each task's meta-model: the one whose embedding separates its support best (the
    least support loss; the first of ties); 0 with one model."""
    if len(models) == 1:
        return np.zeros(len(block.ys), dtype=np.int64)
    losses = torch.stack([fm.support_losses(problem.spec, m, block.x, block.ys, config.ways)
                          for m in models], 1)
    choice: np.ndarray = losses.argmin(1).cpu().numpy()
    return choice


def models_of(arrays: Mapping[str, np.ndarray], problem: FewShotProblem) -> torch.Tensor:
    """The broadcast embedding(s), (q, body size) float32 on the problem's device."""
    return torch.from_numpy(np.atleast_2d(np.asarray(arrays["models"], np.float32))).to(
        problem.device)


class FewShotBase(MetaModels[FC]):
    """Every few-shot algorithm: the network's embedding as the meta-model(s), the tasks'
    clipped meta-gradients, the final evaluation on fresh meta-test tasks."""

    config_type = FewShotConfig
    defaults = FEWSHOT_DEFAULTS
    average_iterates = False  # a network's iterates are not averaged: the last is released
    scores_meta_models: ClassVar[bool] = True
    # the meta-model: the network's embedding (its body), or the whole network (the head too)
    whole_network: ClassVar[bool] = False

    @classmethod
    def validate(cls, config: FC) -> None:
        super().validate(config)
        problem = problem_of(config)  # the images and the network, or a ConfigError
        for part in ("train", "test"):
            try:
                draw_tasks(problem.pool, part, np.zeros(1, dtype=np.int64), config.ways,
                           config.shots, config.queries, config.seed)
            except DatasetError as err:
                raise ConfigError(f"ways/shots/queries: {err}") from None

    @classmethod
    def model_size(cls, config: FC) -> int:
        spec = problem_of(config).spec
        return spec.size if cls.whole_network else spec.body_size

    @classmethod
    def starting_models(cls, config: FC) -> np.ndarray:
        return starting_bodies(config, cls.num_models(config), whole=cls.whole_network)

    @classmethod
    def user_step(cls, config: FC, step: Step, arrays: Mapping[str, np.ndarray],
                  user_ids: np.ndarray) -> UserContribution:
        problem = problem_of(config)
        models = models_of(arrays, problem)
        if step.is_final:
            return UserContribution({}, len(user_ids), 0,
                                    cls.final_sums(config, problem, models, user_ids))
        total = np.zeros(tuple(models.shape))
        clipped = 0
        size = chunk_tasks(config, problem)
        for start in range(0, len(user_ids), size):
            block = task_block(config, problem, "train", user_ids[start:start + size])
            choice = _choices(config, problem, models, block)
            for j in np.unique(choice):
                mine = torch.from_numpy(choice == j).to(problem.device)
                summed, scaled = fm.clipped_meta_gradients(
                    problem.spec, models[j], block.x[mine], block.ys[mine], block.yq[mine],
                    config.ways, config.adapt_steps, config.adapt_lr,
                    config.meta_gradient == "first-order", step.parts[0].clip_norm)
                total[j] += summed
                clipped += scaled
        return UserContribution({"grads": total}, len(user_ids), clipped)

    @classmethod
    def fresh_scores(cls, config: FC, problem: FewShotProblem, models: torch.Tensor,
                     task_ids: np.ndarray, local: bool = True) -> dict[str, np.ndarray]:
        """Per fresh task (one per id; ``eval-tasks``: a meta-test task, or a validation task
        of the held-out meta-training images: ``problem.problem_of``): ``accuracy`` of the
        adapted meta-model (the task's choice among several), ``local`` (trained alone; not
        computed with ``local = False``), ``choice``."""
        out: dict[str, list[np.ndarray]] = {"accuracy": [], "local": [], "choice": []}
        size = chunk_tasks(config, problem)
        for start in range(0, len(task_ids), size):
            block = task_block(config, problem, "test", task_ids[start:start + size])
            choice = _choices(config, problem, models, block)
            acc = torch.zeros(len(choice), dtype=torch.float64, device=problem.device)
            if cls.scores_meta_models:
                for j in np.unique(choice):
                    mine = torch.from_numpy(choice == j).to(problem.device)
                    acc[mine] = fm.query_accuracy(problem.spec, models[j], block.x[mine],
                                                  block.ys[mine], block.yq[mine], config.ways,
                                                  config.adapt_steps, config.adapt_lr)
            out["accuracy"].append(acc.cpu().numpy())
            if local:
                out["local"].append(fm.scratch_accuracy(block.x, block.ys, block.yq,
                                                        config.ways).cpu().numpy())
            out["choice"].append(choice)
        return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}

    @classmethod
    def final_sums(cls, config: FC, problem: FewShotProblem, models: torch.Tensor,
                   task_ids: np.ndarray) -> dict[str, float]:
        scores = cls.fresh_scores(config, problem, models, task_ids)
        sums = {"accuracy": float(scores["accuracy"].sum()),
                "local_accuracy": float(scores["local"].sum())}
        for j in range(len(models) if len(models) > 1 else 0):
            sums[f"chose_{j}"] = float((scores["choice"] == j).sum())
        return sums

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        n = max(num_users, 1)
        metrics = {"transfer_accuracy": metric_sums["accuracy"] / n,
                   "local_accuracy": metric_sums["local_accuracy"] / n,
                   "fresh_tasks": float(num_users)}
        for j in range(len(self.models) if len(self.models) > 1 else 0):
            metrics[f"model_{j}_share"] = metric_sums.get(f"chose_{j}", 0.0) / n
        return metrics

    # ----- private evaluation (private-metrics; fedpriv.evaluation) ---------------------------
    @staticmethod
    def evaluation_bounds(config: FewShotConfig) -> dict[str, float]:
        """Each fresh task's query error rate after adapting, in [0, 1]."""
        return {"transfer_error": 1.0}

    @classmethod
    def evaluation_values(cls, config: FC, arrays: Mapping[str, np.ndarray],
                          user_ids: np.ndarray) -> dict[str, np.ndarray]:
        problem = problem_of(config)
        scores = cls.fresh_scores(config, problem, models_of(arrays, problem), user_ids,
                                  local=False)  # the released metric needs no local training
        return {"transfer_error": 1.0 - scores["accuracy"]}

    def state(self) -> dict[str, Any]:
        """The released embedding(s), and the network's parameters they hold (in order)."""
        spec = problem_of(self.config).spec
        return {**super().state(), "embedding_parameters": list(spec.names[:spec.num_body])}


class FewShotLocal(FewShotBase[FewShotConfig]):
    """Each fresh meta-test task alone: a linear model on its support's pixels. Nothing is
    released."""

    name = "fewshot-local"
    private = False
    summary = "each few-shot task alone: a linear model on its support pixels (baseline)"
    scores_meta_models = False
    defaults: ClassVar[Mapping[str, Any]] = {}  # it has no rounds

    def privacy_plan(self) -> list[PlannedRelease]:
        return []

    def steps(self) -> list[Step]:
        return [Step("final")]

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        metrics = super().finalize(metric_sums, num_users)
        metrics["transfer_accuracy"] = metrics["local_accuracy"]
        return metrics


class FewShotMetaNSGD(SampledRounds[FewShotSampledConfig], FewShotBase[FewShotSampledConfig]):
    name = "fewshot-meta-nsgd"
    summary = "Meta-NSGD on few-shot image tasks: task-level DP meta-learning of a network"
    config_type = FewShotSampledConfig


class FewShotMetaSGD(SampledRounds[FewShotSampledConfig], FewShotBase[FewShotSampledConfig]):
    name = "fewshot-meta-sgd"
    private = False
    summary = "few-shot Meta-NSGD without noise (non-private meta-learning baseline)"
    config_type = FewShotSampledConfig


class _FewShotCluster(SampledRounds[FewShotClusterConfig], FewShotBase[FewShotClusterConfig]):
    config_type = FewShotClusterConfig

    @classmethod
    def num_models(cls, config: FewShotClusterConfig) -> int:
        return config.meta_models


class FewShotPrivateMetaCluster(_FewShotCluster):
    name = "fewshot-private-meta-cluster"
    summary = "private clustering-based meta-learning of q networks on few-shot tasks"


class FewShotMetaCluster(_FewShotCluster):
    name = "fewshot-meta-cluster"
    private = False
    summary = "clustering-based meta-learning of q networks on few-shot tasks (baseline)"


class _FewShotOnePass(OnePassRounds[FewShotOnePassConfig], FewShotBase[FewShotOnePassConfig]):
    config_type = FewShotOnePassConfig


class FewShotDPFTMRL(_FewShotOnePass):
    name = "fewshot-dp-ftmrl"
    summary = "DP-FTMRL on few-shot image tasks: one pass, tree-aggregated noise"


class FewShotFTMRL(_FewShotOnePass):
    name = "fewshot-ftmrl"
    private = False
    summary = "FTMRL on few-shot image tasks without noise (one-pass baseline)"
