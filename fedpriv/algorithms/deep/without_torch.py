"""The deep family's declarations without PyTorch: the same names, summaries and keys as the
real classes (a test compares them). The registry holds these stand-ins until a deep algorithm
is asked for (``load``): a run of any other family never imports torch (its import is a second
or more in every process of a run: the command, the ServerApp, each ClientApp actor). Where
torch is not installed (a plain ``pip install -e .``: its CPU build is chosen by hand, a
``torch`` from PyPI is the CUDA build, gigabytes on a machine without a GPU), the stand-in
stays, and a config that names one is refused before the run with how to install torch."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from fedpriv.algorithms.base import Algorithm
from fedpriv.algorithms.deep.params import (
    DP_FEDAVG_DEFAULTS,
    FEDAVG_FT_DEFAULTS,
    FEDREP_DEFAULTS,
    PRIVATE_DEFAULTS,
    DeepConfig,
    DeepLocalConfig,
)
from fedpriv.algorithms.fewshot.params import (
    FEWSHOT_DEFAULTS,
    REPTILE_DEFAULTS,
    FewShotClusterConfig,
    FewShotConfig,
    FewShotOnePassConfig,
    FewShotReptileConfig,
    FewShotSampledConfig,
)
from fedpriv.config import RunConfig
from fedpriv.params import ConfigError

INSTALL_TORCH = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
                 "(the CPU build; on a GPU machine leave out --index-url), then "
                 "pip install -e \".[deep]\"")

_P = "fedpriv.algorithms.deep."
_NONE: Mapping[str, Any] = {}
# name, private, summary, config class, own defaults, implementation: as the real classes
# declare them
_F = "fedpriv.algorithms.fewshot.algorithms:"
DEEP: tuple[tuple[str, bool, str, type[RunConfig], Mapping[str, Any], str], ...] = (
    ("deep-private-fedrep", True,
     "Private FedRep with a torch body and personal linear heads (real data)", DeepConfig,
     PRIVATE_DEFAULTS, _P + "private_fedrep:DeepPrivateFedRep"),
    ("deep-fedrep", False,
     "FedRep with a torch body, without noise (baseline; clipping optional)", DeepConfig,
     FEDREP_DEFAULTS, _P + "private_fedrep:DeepFedRep"),
    ("deep-dp-fedavg", True, "DP-FedAvg: one global torch model for every user (baseline)",
     DeepConfig, DP_FEDAVG_DEFAULTS, _P + "dp_fedavg:DeepDPFedAvg"),
    ("deep-dp-fedavg-ft", True, "DP-FedAvg, then each user fine-tunes the head locally",
     DeepConfig, DP_FEDAVG_DEFAULTS, _P + "dp_fedavg:DeepDPFedAvgFT"),
    ("deep-fedavg-ft", False,
     "FedAvg, then each user fine-tunes the head (non-private baseline)", DeepConfig,
     FEDAVG_FT_DEFAULTS, _P + "dp_fedavg:DeepFedAvgFT"),
    ("deep-local-only", False,
     "each user alone: a linear model on raw inputs or its own network (baseline)",
     DeepLocalConfig, _NONE, _P + "local_only:DeepLocalOnly"),
    # few-shot meta-learning of a network's embedding (fedpriv.algorithms.fewshot)
    ("fewshot-meta-nsgd", True,
     "Meta-NSGD on few-shot image tasks: task-level DP meta-learning of a network",
     FewShotSampledConfig, FEWSHOT_DEFAULTS, _F + "FewShotMetaNSGD"),
    ("fewshot-meta-sgd", False,
     "few-shot Meta-NSGD without noise (non-private meta-learning baseline)",
     FewShotSampledConfig, FEWSHOT_DEFAULTS, _F + "FewShotMetaSGD"),
    ("fewshot-private-meta-cluster", True,
     "private clustering-based meta-learning of q networks on few-shot tasks",
     FewShotClusterConfig, FEWSHOT_DEFAULTS, _F + "FewShotPrivateMetaCluster"),
    ("fewshot-meta-cluster", False,
     "clustering-based meta-learning of q networks on few-shot tasks (baseline)",
     FewShotClusterConfig, FEWSHOT_DEFAULTS, _F + "FewShotMetaCluster"),
    ("fewshot-dp-ftmrl", True,
     "DP-FTMRL on few-shot image tasks: one pass, tree-aggregated noise",
     FewShotOnePassConfig, FEWSHOT_DEFAULTS, _F + "FewShotDPFTMRL"),
    ("fewshot-ftmrl", False, "FTMRL on few-shot image tasks without noise (one-pass baseline)",
     FewShotOnePassConfig, FEWSHOT_DEFAULTS, _F + "FewShotFTMRL"),
    ("fewshot-dp-reptile", False,
     "record-level DP baseline (DP-Reptile, Li et al. 2020): DP-SGD inside each task; "
     "protects single records, not tasks", FewShotReptileConfig, REPTILE_DEFAULTS,
     "fedpriv.algorithms.fewshot.reptile:FewShotDPReptile"),
    ("fewshot-local", False,
     "each few-shot task alone: a linear model on its support pixels (baseline)",
     FewShotConfig, _NONE, _F + "FewShotLocal"),
)


class NeedsTorch(Algorithm[RunConfig]):
    """A deep algorithm's declaration; its implementation (``module:Class``) needs PyTorch."""

    config_type = DeepLocalConfig
    implementation = ""

    @classmethod
    def validate(cls, config: RunConfig) -> None:
        raise ConfigError(f"algorithm: {cls.name} needs PyTorch, which is not installed in "
                          f"this environment: {INSTALL_TORCH}")


def stand_ins() -> tuple[type[NeedsTorch], ...]:
    """One ``NeedsTorch`` subclass per deep algorithm, reading the same config class."""
    return tuple(type(name.replace("-", "_"), (NeedsTorch,),
                      {"name": name, "private": private, "summary": summary,
                       "config_type": config_type, "defaults": defaults,
                       "implementation": where, "__module__": __name__})
                 for name, private, summary, config_type, defaults, where in DEEP)


def load(stand_in: type[NeedsTorch]) -> type[Algorithm[Any]]:
    """The real class the stand-in declares, or the stand-in itself where torch is missing."""
    module, _, attr = stand_in.implementation.partition(":")
    try:
        cls: type[Algorithm[Any]] = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        return stand_in
    return cls
