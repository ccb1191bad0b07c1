"""The record-level DP meta-learning baseline (``fewshot-dp-reptile``): DP-Reptile in the manner
of Li, Khodak, Caldas & Talwalkar 2020 (the record-level method task-level DP is compared
against in Zhou & Bassily 2022's Appendix C).

Each round, a Poisson sample of the tasks (Meta-NSGD's, rate m/K). A sampled task copies the
whole network (body and head), takes ``inner-steps`` full-batch DP-SGD steps on its own records
(support and query rows; each record's gradient clipped to ``clip-norm``, Gaussian noise on the
task's sum, drawn on the node: ``record_dp``) and sends ``start - end``; the server divides the
sum by the public m and steps ``theta <- theta - learning-rate * mean`` (Reptile's outer step;
1 = the average of the tasks' networks), with no noise of its own. Fresh tasks are scored as
every few-shot algorithm scores them: prototypes on the body's embedding.

Privacy: **record-level only**. One record changes one step's noised sum of its task by at most
``clip-norm`` (zeroed out: its rows contribute nothing, the task's row count public; ``2
clip-norm`` replaced); a task's ``s`` steps in a round are ``mu``-GDP (``mu = sqrt(s) /
z_step``, adaptive composition). Sampling the *task* does not amplify a
*record's* privacy (the task's other records and noise are there either way), so the rounds are
accounted as a binomial mixture over how many the task takes part in
(``fedpriv.privacy.participation``), ``mu`` calibrated to the run's (epsilon, delta); it holds
whoever knows which tasks were sampled. A task's whole data is not protected: at task level the
baseline is not private (``private = False``: the run's ledger is empty), which is the
difference the comparison shows. Li et al. also sample records inside each task (minibatch
DP-SGD, which does amplify); here every step is full-batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from fedpriv.algorithms.base import Step, UserContribution
from fedpriv.algorithms.fewshot.algorithms import FewShotBase, models_of
from fedpriv.algorithms.fewshot.params import REPTILE_DEFAULTS, FewShotReptileConfig
from fedpriv.algorithms.fewshot.problem import (
    FewShotProblem,
    problem_of,
    task_block,
)
from fedpriv.algorithms.fewshot.record_dp import dp_sgd_updates, mlp_layers
from fedpriv.algorithms.meta.schedule import SampledRounds
from fedpriv.params import ConfigError
from fedpriv.privacy.bounds import InfeasiblePlanError, mean_sensitivity
from fedpriv.privacy.participation import participation_epsilon, participation_mu
from fedpriv.randomness import user_uniforms

_NOISE_PURPOSE = 0x5EC0  # the tasks' record-level noise streams


@lru_cache(maxsize=16)
def _round_mu(epsilon: float, delta: float, rounds: int, rate: float) -> float:
    return participation_mu(epsilon, delta, rounds, rate)


def round_mu(config: FewShotReptileConfig) -> float:
    """The GDP ``mu`` of a task's round (its inner steps composed) that meets the run's
    (epsilon, delta) at record level over its rounds (``fedpriv.privacy.participation``)."""
    return _round_mu(config.epsilon, config.delta, config.rounds,
                     FewShotDPReptile.sampling_rate(config))


def step_multiplier(config: FewShotReptileConfig) -> float:
    """Each inner step's noise multiplier: s Gaussian steps of multiplier z are exactly one
    ``sqrt(s) / z``-GDP mechanism, so ``z = sqrt(s) / mu_round``."""
    return math.sqrt(config.inner_steps) / round_mu(config)


def step_noise_std(config: FewShotReptileConfig) -> float:
    """The std of the Gaussian noise on a task's sum of clipped record gradients, each inner
    step: the step's multiplier times the sum's sensitivity (``clip-norm``; twice that for a
    replaced record)."""
    return step_multiplier(config) * mean_sensitivity(config.clip_norm, 1,
                                                      config.neighbouring_relation)


def task_generators(config: FewShotReptileConfig, round_index: int,
                    task_ids: np.ndarray) -> list[torch.Generator]:
    """Each task's noise generator this round: seeded from (noise-seed or seed, round, task
    id), a pure function of them (reproducible, like the server's seeded noise; whatever node
    hosts the task)."""
    seed = config.noise_seed if config.noise_seed >= 0 else config.seed
    u = user_uniforms(seed, _NOISE_PURPOSE, round_index, task_ids, 1)[:, 0]
    return [torch.Generator().manual_seed(int(v * 2.0**53)) for v in u]


def chunk_reptile(config: FewShotReptileConfig, problem: FewShotProblem) -> int:
    """Tasks computed at once within ``chunk-mb``: each task's rows (inputs, activations and
    their gradients) and its copies of the network (or, off the MLP path, its per-record
    gradients)."""
    rows = config.ways * (config.shots + config.queries)
    spec = problem.spec
    copies = 8 if mlp_layers(spec) is not None else 6 * rows + 8
    per_task = 4 * (4 * rows * spec.row_floats + copies * spec.size)
    return max(1, int(config.chunk_mb * 2**20 // per_task))


class FewShotDPReptile(SampledRounds[FewShotReptileConfig], FewShotBase[FewShotReptileConfig]):
    name = "fewshot-dp-reptile"
    private = False  # no task-level guarantee: its privacy is record-level (record_level_privacy)
    summary = ("record-level DP baseline (DP-Reptile, Li et al. 2020): DP-SGD inside each "
               "task; protects single records, not tasks")
    config_type = FewShotReptileConfig
    defaults = REPTILE_DEFAULTS
    whole_network = True  # Reptile meta-learns the head's start too

    @classmethod
    def validate(cls, config: FewShotReptileConfig) -> None:
        super().validate(config)
        if not config.clipping:
            raise ConfigError(f"clipping: {cls.name} clips every record's gradient (its "
                              "record-level noise is calibrated to clip-norm); remove "
                              "clipping = false")
        if not math.isfinite(config.epsilon) or config.epsilon > 1e3:
            raise ConfigError(f"epsilon: {cls.name} adds record-level noise calibrated to an "
                              "epsilon of at most 1000; for no noise use fewshot-meta-sgd")
        if config.secure_noise:
            raise ConfigError(f"secure-noise: {cls.name} is a research baseline whose "
                              "record-level noise is torch's float Gaussian, drawn on the nodes "
                              "from seeded streams (never publishable); remove secure-noise")
        try:
            step_noise_std(config)
        except InfeasiblePlanError as err:
            raise ConfigError(f"epsilon: {cls.name}'s record-level plan: {err}") from None

    def steps(self) -> list[Step]:
        """Meta-NSGD's rounds; a task's update is bounded by no task-level clip."""
        return [replace(s, parts=tuple(replace(p, clip_norm=math.inf) for p in s.parts))
                for s in super().steps()]

    @classmethod
    def user_step(cls, config: FewShotReptileConfig, step: Step,
                  arrays: Mapping[str, np.ndarray], user_ids: np.ndarray) -> UserContribution:
        if step.is_final:
            return super().user_step(config, step, arrays, user_ids)
        problem = problem_of(config)
        start = models_of(arrays, problem)[0]
        std = step_noise_std(config)
        total = torch.zeros(problem.spec.size, dtype=torch.float64, device=problem.device)
        size = chunk_reptile(config, problem)
        for at in range(0, len(user_ids), size):
            ids = user_ids[at:at + size]
            block = task_block(config, problem, "train", ids)
            updates = dp_sgd_updates(
                problem.spec, start, block.x, torch.cat([block.ys, block.yq], 1),
                config.inner_steps, config.inner_lr, config.clip_norm, std,
                task_generators(config, step.index, ids))
            total += updates.sum(0)
        # no clipped count: it is a function of the records, outside the accounted noise
        return UserContribution({"grads": total.cpu().numpy()[None]}, len(user_ids), 0)

    def record_level_privacy(self) -> dict[str, Any]:
        c = self.config
        rate = self.sampling_rate(c)
        # no more than the target: the calibration confirmed delta(target) over all its rounds
        spent = min(participation_epsilon(round_mu(c), self.iterates, rate, c.delta), c.epsilon)
        return {"level": "record", "epsilon": spent, "target_epsilon": c.epsilon,
                "delta": c.delta,
                "accountant": "gdp binomial mixture (fedpriv.privacy.participation)",
                "neighbouring_relation": ("zero-out (a record's rows made to contribute "
                                          "nothing; a task's row count is public)"
                                          if c.neighbouring_relation == "add-remove"
                                          else "replace-one"),
                "rounds_accounted": self.iterates, "task_sampling_rate": rate,
                "task_sampling_amplifies": False, "mu_per_round": round_mu(c),
                "inner_steps": c.inner_steps, "clip_norm": c.clip_norm,
                "noise_multiplier_per_step": step_multiplier(c),
                "noise_std_per_step": step_noise_std(c),
                "trust": {"noise": "added by each node to each task's sum of clipped record "
                                   "gradients (torch float Gaussian, seeded per task and round)",
                          "server": "adds no noise; receives each node's sum of its tasks' "
                                    "noised updates, task counts (public: the seeded sample) "
                                    "and the exact final metrics of the fresh tasks "
                                    "(not accounted)",
                          "hostile nodes": "unbounded: a task's update has no task-level clip",
                          "protects": "one record (a task's row); not a task's whole data; "
                                      "an image several tasks draw from the shared pool is "
                                      "several records (group privacy)"}}

    def state(self) -> dict[str, Any]:
        """The released network (body and head); fresh tasks use its body's embedding."""
        spec = problem_of(self.config).spec
        return {**super().state(), "embedding_parameters": list(spec.names[:spec.num_body]),
                "network_parameters": list(spec.names)}
