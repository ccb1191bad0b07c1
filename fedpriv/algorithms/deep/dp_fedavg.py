"""DP-FedAvg (McMahan et al. 2018) for deep models, with and without each user's final
fine-tuning of the head, and the non-private FedAvg-ft baseline.

Each round every taking-part user runs ``body-steps`` local steps on the *whole* model (head
included) over its two batches; the update is clipped to ``clip-norm`` (L2 over every
parameter), and the server releases the noisy mean and steps with momentum. ``deep-dp-fedavg``
evaluates the one global model on every user; the ``-ft`` versions let each user fine-tune the
head on its own training rows (``final-head-steps``, starting from the global head) with the
released body, a local post-processing that costs no budget.

Privacy: as deep Private FedRep (``fedpriv.algorithms.deep.deep_algorithm``).
"""

from __future__ import annotations

import numpy as np
import torch

from fedpriv.algorithms.deep.batches import LocalProblem, take_rows
from fedpriv.algorithms.deep.deep_algorithm import DeepAlgorithm
from fedpriv.algorithms.deep.ghost_clipping import ghost_layers
from fedpriv.algorithms.deep.models import ModelSpec
from fedpriv.algorithms.deep.params import DP_FEDAVG_DEFAULTS, FEDAVG_FT_DEFAULTS, DeepConfig
from fedpriv.algorithms.deep.problem import DeepProblem, UserBlock


class DeepDPFedAvg(DeepAlgorithm):
    """A round trains and releases the whole model; the final step scores the global model as
    it is on every user."""

    name = "deep-dp-fedavg"
    summary = "DP-FedAvg: one global torch model for every user (baseline)"
    released_part = "model"
    head_from = "none"
    defaults = DP_FEDAVG_DEFAULTS

    @classmethod
    def released_size(cls, spec: ModelSpec) -> int:
        return spec.size

    @classmethod
    def ghost_eligible(cls, spec: ModelSpec) -> bool:
        return bool(ghost_layers(spec, body_only=False))

    @classmethod
    def local_problem(cls, config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                      block: UserBlock, first: np.ndarray, second: np.ndarray,
                      mask: np.ndarray) -> LocalProblem:
        """The whole model trained on both batches' rows (one gather)."""
        weights = torch.from_numpy(mask).to(model.device)
        both = np.concatenate([first, second], 1)
        return LocalProblem(model, None, take_rows(block.x, both), take_rows(block.y, both),
                            torch.cat([weights, weights], 1))


class DeepDPFedAvgFT(DeepDPFedAvg):
    """DP-FedAvg's rounds; the final step fine-tunes each user's head from the global one."""

    name = "deep-dp-fedavg-ft"
    summary = "DP-FedAvg, then each user fine-tunes the head locally"
    head_from = "global"


class DeepFedAvgFT(DeepDPFedAvgFT):
    name = "deep-fedavg-ft"
    summary = "FedAvg, then each user fine-tunes the head (non-private baseline)"
    private = False
    defaults = FEDAVG_FT_DEFAULTS
