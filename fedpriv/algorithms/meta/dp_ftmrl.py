"""DP-FTMRL and its non-private version: one pass over the tasks in T disjoint batches, the
running sum of batch-mean meta-gradients kept private with the tree mechanism of DP-FTRL
(Kairouz et al. 2021). A task's batch is in at most ``floor(log2 T) + 1`` released tree nodes,
so each task is charged that many Gaussian mechanisms (see the package docstring).
"""

from __future__ import annotations

from fedpriv.algorithms.meta.meta_algorithm import MetaAlgorithm
from fedpriv.algorithms.meta.params import OnePassConfig
from fedpriv.algorithms.meta.schedule import OnePassRounds


class _OnePass(OnePassRounds[OnePassConfig], MetaAlgorithm[OnePassConfig]):
    """DP-FTMRL on the linear tasks: every task once, in T disjoint batches."""

    config_type = OnePassConfig


class DPFTMRL(_OnePass):
    name = "dp-ftmrl"
    summary = "DP-FTMRL: one-pass meta-learning with tree-aggregated noise (Zhou & Bassily 2022)"


class FTMRL(_OnePass):
    name = "ftmrl"
    private = False
    summary = "FTMRL without noise (one-pass non-private baseline)"
