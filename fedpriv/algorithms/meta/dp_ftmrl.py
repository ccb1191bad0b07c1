"""DP-FTMRL and its non-private version: one pass over the tasks in T disjoint batches, the
running sum of batch-mean meta-gradients kept private with the tree mechanism of DP-FTRL
(Kairouz et al. 2021). A task's batch is in at most ``floor(log2 T) + 1`` released tree nodes,
so each task is charged that many Gaussian mechanisms (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedpriv.algorithms.base import Part, Step
from fedpriv.algorithms.meta import meta_math as ml
from fedpriv.algorithms.meta.meta_algorithm import MetaAlgorithm, clip_of
from fedpriv.algorithms.meta.params import OnePassConfig
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import gaussian_noise
from fedpriv.randomness import user_groups


class _OnePass(MetaAlgorithm[OnePassConfig]):
    """DP-FTMRL: every task once, in T disjoint batches, tree-aggregated noise."""

    # the released batch means are summed into prefix sums whose tree noise cancels only if
    # every batch keeps its scale: rescaling for missing nodes did worse (docs/measurements.md)
    rescale_for_missing_nodes = False
    config_type = OnePassConfig

    def __init__(self, config: OnePassConfig) -> None:
        super().__init__(config)
        self.start = self.models.copy()
        self.gradient_sum = np.zeros_like(self.models)
        self.nodes: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def validate(cls, config: OnePassConfig) -> None:
        super().validate(config)
        if config.rounds > config.num_users:
            raise ConfigError(f"rounds: {cls.name} visits each task once in {config.rounds} "
                              f"batches, which needs rounds <= num-users ({config.num_users})")

    @classmethod
    def batch_size(cls, config: OnePassConfig) -> int:
        return config.num_users // config.rounds

    def privacy_plan(self) -> list[PlannedRelease]:
        if not self.private:
            return []
        return [PlannedRelease("round", 1.0, ml.max_nodes_per_round(self.config.rounds))]

    def steps(self) -> list[Step]:
        c = self.config
        part = Part("grads", (1, c.dim), clip_of(c))
        release = "round" if self.private else None
        m = self.batch_size(c)
        return [*(Step("round", t, release, (part,), population=m, group=t - 1)
                  for t in range(1, c.rounds + 1)), Step("final")]

    def charge(self, step: Step) -> tuple[list[int] | None, float]:
        node = ml.new_tree_node(step.index)
        return [t - 1 for t in ml.node_rounds(node)], 1.0

    @classmethod
    def participants(cls, config: OnePassConfig, step: Step, user_ids: np.ndarray) -> np.ndarray:
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


class DPFTMRL(_OnePass):
    name = "dp-ftmrl"
    summary = "DP-FTMRL: one-pass meta-learning with tree-aggregated noise (Zhou & Bassily 2022)"


class FTMRL(_OnePass):
    name = "ftmrl"
    private = False
    summary = "FTMRL without noise (one-pass non-private baseline)"
