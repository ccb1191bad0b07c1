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

from fedpriv.algorithms.deep.deep_algorithm import DeepAlgorithm


class DeepDPFedAvg(DeepAlgorithm):
    name = "deep-dp-fedavg"
    summary = "DP-FedAvg: one global torch model for every user (baseline)"
    trains = "model"
    final_fit = "none"


class DeepDPFedAvgFT(DeepDPFedAvg):
    name = "deep-dp-fedavg-ft"
    summary = "DP-FedAvg, then each user fine-tunes the head locally"
    final_fit = "fine-tune"


class DeepFedAvgFT(DeepDPFedAvgFT):
    name = "deep-fedavg-ft"
    summary = "FedAvg, then each user fine-tunes the head (non-private baseline)"
    private = False
    defaults = {"rounds": 40, "learning-rate": 1.0}
