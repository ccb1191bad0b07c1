"""A plug-in algorithm from another package: a private mean with a key of its own.

Each user i holds one value ``toy-scale * u_i`` with ``u_i`` uniform in [0, 1) from the run seed.
One round releases the mean over the population, each user's value clipped to ``toy-scale`` (so
the sensitivity is ``toy-scale / n``), with calibrated Gaussian noise; the final step reports the
released estimate, the exact mean (a test reference) and the scale the nodes used.
"""

from __future__ import annotations

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.params import Param, ParamGroup, positive
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.randomness import user_uniforms

TOY = ParamGroup("toy mean", (
    Param("toy-scale", float, 1.0, "scale of every user's value (and its clip)", positive,
          "a number > 0"),
))


def user_values(seed: int, scale: float, user_ids: np.ndarray) -> np.ndarray:
    return scale * user_uniforms(seed, 0x70F, 0, user_ids, 1)[:, 0]


class ToyMean(Algorithm):
    name = "toy-mean"
    summary = "plug-in test algorithm: private mean of one value per user"
    components = (TOY,)

    def __init__(self, config):
        super().__init__(config)
        self.estimate = 0.0

    def privacy_plan(self):
        return [PlannedRelease("round", 1.0)]

    def steps(self):
        part = Part("total", (1,), self.config.toy_scale)
        return [Step("round", 1, "round", (part,)), Step("final")]

    def broadcast(self, step):
        return {}

    def apply(self, step, noisy_means):
        self.estimate = float(noisy_means["total"][0])
        return {"estimate": self.estimate}

    def finalize(self, metric_sums, num_users):
        return {"estimate": self.estimate, "exact_mean": metric_sums["value"] / num_users,
                "scale_seen_by_nodes": metric_sums["scale"] / num_users}

    def state(self):
        return {"estimate": self.estimate}

    @classmethod
    def user_step(cls, config, step, arrays, user_ids):
        values = user_values(config.seed, config.toy_scale, user_ids)
        if step.is_final:
            return UserContribution({}, len(user_ids), 0,
                                    {"value": float(values.sum()),
                                     "scale": config.toy_scale * len(user_ids)})
        clipped = np.clip(values, -config.toy_scale, config.toy_scale)
        return UserContribution({"total": np.array([clipped.sum()])}, len(user_ids))
