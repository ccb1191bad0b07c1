"""The deep family without PyTorch: a plain ``pip install -e .`` installs no torch (its CPU build
is chosen by hand: a ``torch`` from PyPI is the CUDA build, gigabytes on a machine without a
GPU), and everything else runs without it. The deep algorithms are then registered as these
stand-ins: the same names, summaries and keys (a test compares them with the real classes), and
a config that names one is refused before the run with how to install torch."""

from __future__ import annotations

from fedpriv.algorithms.base import Algorithm
from fedpriv.algorithms.deep.params import DeepConfig, DeepLocalConfig
from fedpriv.params import ConfigError

INSTALL_TORCH = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
                 "(the CPU build; on a GPU machine leave out --index-url), then "
                 "pip install -e \".[deep]\"")

# name, private, summary, config class: as the classes in deep/dp_fedavg.py etc. declare them
DEEP: tuple[tuple[str, bool, str, type[DeepLocalConfig]], ...] = (
    ("deep-private-fedrep", True,
     "Private FedRep with a torch body and personal linear heads (real data)", DeepConfig),
    ("deep-fedrep", False,
     "FedRep with a torch body, without noise (baseline; clipping optional)", DeepConfig),
    ("deep-dp-fedavg", True, "DP-FedAvg: one global torch model for every user (baseline)",
     DeepConfig),
    ("deep-dp-fedavg-ft", True, "DP-FedAvg, then each user fine-tunes the head locally",
     DeepConfig),
    ("deep-fedavg-ft", False,
     "FedAvg, then each user fine-tunes the head (non-private baseline)", DeepConfig),
    ("deep-local-only", False,
     "each user alone: a linear model on raw inputs or its own network (baseline)",
     DeepLocalConfig),
)


class NeedsTorch(Algorithm[DeepLocalConfig]):
    """A deep algorithm whose implementation needs PyTorch, which is not installed."""

    config_type = DeepLocalConfig

    @classmethod
    def validate(cls, config: DeepLocalConfig) -> None:
        raise ConfigError(f"algorithm: {cls.name} needs PyTorch, which is not installed in "
                          f"this environment: {INSTALL_TORCH}")


def stand_ins() -> tuple[type[NeedsTorch], ...]:
    """One ``NeedsTorch`` subclass per deep algorithm, reading the same config class."""
    return tuple(type(name.replace("-", "_"), (NeedsTorch,),
                      {"name": name, "private": private, "summary": summary,
                       "config_type": config_type, "__module__": __name__})
                 for name, private, summary, config_type in DEEP)
