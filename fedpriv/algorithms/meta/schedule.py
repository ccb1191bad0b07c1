"""The server side of the meta-learning algorithms, whatever the tasks and the model: the
meta-model(s) as flat vectors, and the two schedules of Zhou & Bassily 2022.

* ``SampledRounds`` (Meta-NSGD, Alg. 1, and private clustering, Alg. 2): T rounds, each over a
  Poisson sample of the tasks (rate m/K, drawn from the seed and the task id, secret to the
  server); the sum of the sampled tasks' clipped meta-gradients divided by the public m, plus
  Gaussian noise; a projected gradient step.
* ``OnePassRounds`` (DP-FTMRL): every task once, in T disjoint batches; the running sum of the
  batch means kept private by the tree mechanism, an FTRL step from the start.

A family (``meta_algorithm.MetaAlgorithm``: linear tasks; ``fedpriv.algorithms.fewshot``: deep
few-shot tasks) adds what the nodes compute (``user_step``), the starting point and size of
its meta-model(s) (``starting_models``, ``model_size``) and its final evaluation; a registered
algorithm is a schedule and a family (``class MetaNSGD(SampledRounds[C], MetaAlgorithm[C])``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step
from fedpriv.algorithms.meta import meta_math as ml
from fedpriv.algorithms.meta.params import MetaRoundKeys, SampledRoundsConfig, SamplingKeys
from fedpriv.config import RunConfig
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import gaussian_noise
from fedpriv.randomness import user_groups, user_uniforms

_SAMPLING_PURPOSE = 0x5A3
AC = TypeVar("AC", bound=RunConfig)
SR = TypeVar("SR", bound=SampledRoundsConfig)
OR = TypeVar("OR", bound=MetaRoundKeys)


def paper_tasks_per_round(config: SamplingKeys) -> int:
    """Algorithm 1, line 1: ``m = max(K sqrt(epsilon / (4T)), 1)`` (capped at K)."""
    m = config.num_users * math.sqrt(config.epsilon / (4.0 * config.rounds))
    return int(min(config.num_users, max(1, round(m))))


def clip_of(config: MetaRoundKeys) -> float:
    return config.clip_norm if config.clipping else float("inf")


class MetaModels(Algorithm[AC]):
    """The meta-model(s), a (q, size) array: what is broadcast, released and recorded."""

    average_iterates: ClassVar[bool] = True  # release the average of the iterates, or the last

    @classmethod
    def num_models(cls, config: AC) -> int:
        return 1

    @classmethod
    def model_size(cls, config: AC) -> int:
        """The length of one meta-model (the released part's width)."""
        raise NotImplementedError

    @classmethod
    def starting_models(cls, config: AC) -> np.ndarray:
        """The meta-model(s) before the first round, (q, size), from public values only."""
        raise NotImplementedError

    def __init__(self, config: AC) -> None:
        super().__init__(config)
        self.models = self.starting_models(config)
        self.iterate_sum = np.zeros_like(self.models)
        self.iterates = 0

    def output(self) -> np.ndarray:
        """The released meta-model(s): the average of the iterates, or the last ones."""
        if self.average_iterates and self.iterates:
            return self.iterate_sum / self.iterates
        return self.models

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {"models": self.output() if step.is_final else self.models}

    def _record_iterate(self) -> dict[str, float]:
        if self.average_iterates:
            self.iterate_sum += self.models
        self.iterates += 1
        return {"meta_model_norm": float(np.linalg.norm(self.models, axis=1).max())}

    def state(self) -> dict[str, Any]:
        return {"meta_models": self.output().tolist(), "last_iterates": self.models.tolist(),
                "iterates_averaged": self.iterates if self.average_iterates else 0}


class SampledRounds(MetaModels[SR]):
    """Algorithms 1 and 2: T rounds over Poisson samples of the tasks. Privacy: each sampled
    task's meta-gradient is clipped to ``clip-norm`` and the sum divided by the public expected
    batch size m, so the sensitivity is ``clip-norm / m`` whoever was sampled; the T releases
    are Poisson-subsampled Gaussian mechanisms (rate m/K), accounted exactly by the plan. With
    q meta-models a task changes one row of the (q, size) release by at most ``clip-norm``:
    the same sensitivity and accounting (Theorem 6)."""

    @classmethod
    def tasks_per_round(cls, config: SR) -> int:
        return config.tasks_per_round or paper_tasks_per_round(config)

    @classmethod
    def sampling_rate(cls, config: SR) -> float:
        return cls.tasks_per_round(config) / config.num_users

    @classmethod
    def validate(cls, config: SR) -> None:
        super().validate(config)
        if config.tasks_per_round > config.num_users:
            raise ConfigError(f"tasks-per-round: {config.tasks_per_round} exceeds num-users "
                              f"({config.num_users}), the number of tasks")

    def privacy_plan(self) -> list[PlannedRelease]:
        if not self.private:
            return []
        rate = self.sampling_rate(self.config)
        return [PlannedRelease("round", 1.0 / self.config.rounds, self.config.rounds, rate)]

    def steps(self) -> list[Step]:
        c = self.config
        part = Part("grads", (self.num_models(c), self.model_size(c)), clip_of(c))
        release = "round" if self.private else None
        m = self.tasks_per_round(c)
        return [*(Step("round", t, release, (part,), population=m)
                  for t in range(1, c.rounds + 1)), Step("final")]

    def charge(self, step: Step) -> tuple[list[int] | None, float]:
        return None, self.sampling_rate(self.config)

    @classmethod
    def participants(cls, config: SR, step: Step, user_ids: np.ndarray) -> np.ndarray:
        if step.is_final:
            return user_ids  # every fresh task is evaluated
        u = user_uniforms(config.seed, _SAMPLING_PURPOSE, step.index, user_ids, 1)[:, 0]
        return user_ids[u < cls.sampling_rate(config)]

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        c = self.config
        self.models = ml.project_to_ball(self.models - c.learning_rate * noisy_means["grads"],
                                         c.meta_radius)
        return self._record_iterate()


class OnePassRounds(MetaModels[OR]):
    """DP-FTMRL: every task once, in T disjoint batches, tree-aggregated noise (the meta
    package's docstring). A task's batch is in at most ``floor(log2 T) + 1`` released tree
    nodes, so each task is charged that many Gaussian mechanisms."""

    # the released batch means are summed into prefix sums whose tree noise cancels only if
    # every batch keeps its scale: rescaling for missing nodes did worse (docs/measurements.md)
    rescale_for_missing_nodes = False

    def __init__(self, config: OR) -> None:
        super().__init__(config)
        self.start = self.models.copy()
        self.gradient_sum = np.zeros_like(self.models)
        self.nodes: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def validate(cls, config: OR) -> None:
        super().validate(config)
        if config.rounds > config.num_users:
            raise ConfigError(f"rounds: {cls.name} visits each task once in {config.rounds} "
                              f"batches, which needs rounds <= num-users ({config.num_users})")

    @classmethod
    def batch_size(cls, config: OR) -> int:
        return config.num_users // config.rounds

    def privacy_plan(self) -> list[PlannedRelease]:
        if not self.private:
            return []
        return [PlannedRelease("round", 1.0, ml.max_nodes_per_round(self.config.rounds))]

    def steps(self) -> list[Step]:
        c = self.config
        part = Part("grads", (self.num_models(c), self.model_size(c)), clip_of(c))
        release = "round" if self.private else None
        m = self.batch_size(c)
        return [*(Step("round", t, release, (part,), population=m, group=t - 1)
                  for t in range(1, c.rounds + 1)), Step("final")]

    def charge(self, step: Step) -> tuple[list[int] | None, float]:
        node = ml.new_tree_node(step.index)
        return [t - 1 for t in ml.node_rounds(node)], 1.0

    @classmethod
    def participants(cls, config: OR, step: Step, user_ids: np.ndarray) -> np.ndarray:
        if step.is_final:
            return user_ids
        groups = user_groups(config.seed, config.num_users, config.rounds)
        taking_part: np.ndarray = user_ids[groups[user_ids] == step.group]
        return taking_part

    def noise(self, step: Step, part: Part, std: float, rng: np.random.Generator) -> np.ndarray:
        """``N_t - N_{t-1}``: the change of the tree noise of the prefix sum, so that the sum of
        the released noisy batch means is ``S_t`` plus the sum of the dyadic nodes of [1, t]."""
        t = step.index
        self.nodes[ml.new_tree_node(t)] = gaussian_noise(part.shape, std, rng)
        now = sum(self.nodes[n] for n in ml.prefix_nodes(t))
        before = sum((self.nodes[n] for n in ml.prefix_nodes(t - 1)), np.zeros(part.shape))
        keep = set(ml.prefix_nodes(t))
        self.nodes = {n: v for n, v in self.nodes.items() if n in keep}
        change: np.ndarray = now - before
        return change

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        c = self.config
        self.gradient_sum = self.gradient_sum + noisy_means["grads"]
        self.models = ml.project_to_ball(self.start - c.learning_rate * self.gradient_sum,
                                         c.meta_radius)
        return self._record_iterate()
