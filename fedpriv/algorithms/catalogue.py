"""The built-in algorithms, listed once: the registry loads this catalogue (algorithm modules do
not import the registry, so there is no import circle). Plug-ins from other packages register
through the ``fedpriv.algorithms`` entry point group instead."""

from __future__ import annotations

from fedpriv.algorithms.deep.without_torch import stand_ins
from fedpriv.algorithms.exp_mech.a_exp import AExp, AExpBest
from fedpriv.algorithms.exp_mech.jl_exp import JLExp, JLExpBest
from fedpriv.algorithms.meta.dp_ftmrl import DPFTMRL, FTMRL
from fedpriv.algorithms.meta.meta_nsgd import MetaCluster, MetaNSGD, MetaSGD, PrivateMetaCluster
from fedpriv.algorithms.meta.references import MetaLocal, MetaOracle
from fedpriv.algorithms.personalization.baselines import DPGlobalModel, KnownEmbedding, LocalOnly
from fedpriv.algorithms.personalization.priv_altmin import AltMin, PrivAltMin
from fedpriv.algorithms.personalization.private_fedrep import FedRep, PrivateFedRep

BUILTIN: tuple[type, ...] = (
    # personalization (shared embedding U, personal v_i)
    PrivateFedRep, FedRep, PrivAltMin, AltMin, DPGlobalModel, LocalOnly, KnownEmbedding,
    # task-level meta-learning
    MetaNSGD, MetaSGD, PrivateMetaCluster, MetaCluster, DPFTMRL, FTMRL, MetaLocal, MetaOracle,
    # exponential-mechanism constructions
    AExp, AExpBest, JLExp, JLExpBest,
    # deep personalization on real data (torch body, personal linear heads): declared here,
    # loaded (with torch) when one is asked for (fedpriv.registry.get_algorithm)
    *stand_ins(),
)
