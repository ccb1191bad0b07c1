"""Discrete noise: the grid, the parameters and the checks of publishable and distributed runs.

Two modes draw integer noise on a power-of-two grid instead of floating-point Gaussians.

* **Publishable central noise** (``secure-noise = true``). The server rounds each part's exact
  sum to the grid of granularity ``g`` (to nearest), adds discrete Gaussian noise
  ``N_Z(0, s^2)`` (Canonne, Kamath & Steinke 2020, sampled exactly from a ChaCha20 stream
  seeded by the OS) and only then divides by the population (post-processing). Rounding moves
  one user's effect by less than ``g`` per coordinate, so the rounded sum's L2 sensitivity is at
  most ``Delta + g sqrt(d)`` (the grid's slack; ``Delta`` with a ``2^-20`` allowance for the
  float sum). ``s = ceil(z (Delta / g + sqrt(d)))``: the
  multivariate discrete Gaussian is ``Delta_g^2 / (2 s^2)``-zCDP for integer shifts of L2 norm
  ``Delta_g`` (CKS, Theorem 14), at most ``1 / (2 z^2)``: the RDP curve of the Gaussian with the
  planned multiplier ``z``, which is what the accountant records.
* **Distributed noise** (``aggregation = "distributed"``). Each node divides its sum by ``g``,
  rotates it with public random signs and a Walsh-Hadamard transform, rounds it randomly
  (conditionally: re-drawn while its norm exceeds the bound of Kairouz, Liu & Steinke 2021),
  adds its share of Skellam noise from its own CSPRNG and reduces modulo ``2^b``; the server
  sums the vectors modulo ``2^b``, lifts, un-rotates and multiplies by ``g``. With the same
  rounding uniforms, one user moves a node's rounded vector by less than ``D + 1`` per
  coordinate where its exact sum moved by ``D``, so the sensitivities in grid units are
  ``l2 = Delta / g + sqrt(d)`` and ``l1 = sqrt(d) Delta / g + d`` (``d``: the padded
  dimension; both with a ``2^-20`` relative allowance for the floating-point sum and rotation);
  Rényi divergence is jointly quasi-convex, so the bound holds for the mixture over the
  uniforms. The honest nodes' Skellam shares sum to one Skellam of variance
  ``mu = h * mu_node``, accounted by ``skellam_rho``. The conditional re-draw happens with
  probability at most ``BETA`` per node and release; the transcript is then within total
  variation ``R K BETA`` of the unconditioned one (R part releases, K nodes), which adds
  ``(1 + e^eps) R K BETA`` to delta: the accountant works at ``delta`` minus that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedpriv.algorithms.base import Algorithm, Part, Step
from fedpriv.config import ConfigError, RunConfig
from fedpriv.privacy.accounting import DISCRETE_ACCOUNTANT, PlannedRelease
from fedpriv.privacy.bounds import skellam_rho
from fedpriv.privacy.grid import FLOAT_SLACK, SLACK_FACTOR, granularity
from fedpriv.privacy.quantize import modulus_bits_needed, padded_dim, wrap_probability
from fedpriv.secagg.graph import plan
from fedpriv.shares import BETA

WRAP_TARGET = 1e-9
# distributed: the share of delta kept for the conditional-rounding slack
DELTA_RESERVE = 1e-6


def discrete(config: RunConfig) -> bool:
    """Whether the run draws discrete noise (and is accounted by ``DISCRETE_ACCOUNTANT``)."""
    return config.secure_noise or config.noise_shares


def accountant_kind(config: RunConfig) -> str:
    return DISCRETE_ACCOUNTANT if discrete(config) else config.accountant


def sampling_key(config: RunConfig) -> tuple[str, str]:
    """The key that turns on the server's Poisson sampling, and how to turn it off."""
    if hasattr(config, "users_per_round"):
        return "users-per-round", "set users-per-round = 0"
    if hasattr(config, "tasks_per_round"):
        return "tasks-per-round", (f"set tasks-per-round = {config.num_users} (num-users: "
                                   "every task every round; 0 is the paper's sampled default)")
    return "the algorithm's sampling", "run every user every round"


def check_discrete(config: RunConfig, algorithm: Algorithm[Any],
                   plan: Sequence[PlannedRelease]) -> None:
    """Refuse, before round 1, what discrete noise cannot do, naming the key."""
    if config.noise_shares and not plan:
        raise ConfigError(f"aggregation: {config.algorithm} releases nothing with noise, so "
                          f"{config.aggregation} noise shares have nothing to protect; use "
                          "aggregation = "
                          '"central"')
    if not discrete(config) or not plan:
        return
    mode = (f'aggregation = "{config.aggregation}"' if config.noise_shares
            else "secure-noise = true")
    sampled = [r for r in plan if r.sampling_rate < 1.0]
    if sampled:
        key, fix = sampling_key(config)
        raise ConfigError(
            f"{key}: {mode} cannot use Poisson sampling by the server (release "
            f"{sampled[0].name!r} samples users at rate {sampled[0].sampling_rate:.4g}): "
            + ("a server that knows who was sampled gets no amplification; "
               if config.noise_shares else
               "the discrete Gaussian's zCDP bound is accounted without amplification; ")
            + fix)
    if not config.noise_shares:
        return
    if any(r.mechanism == "exponential" for r in plan):
        raise ConfigError(f"aggregation: {config.algorithm} releases a choice by the exponential "
                          "mechanism, not a sum: distributed noise cannot make it private; use "
                          'aggregation = "central"')
    own = [k for k in type(algorithm).__mro__ if "noise" in vars(k)
           and k.__module__ not in ("fedpriv.algorithms.base", "fedpriv.evaluation")]
    if own:
        raise ConfigError(f"aggregation: {config.algorithm} draws its own noise ({own[0].__name__}"
                          ".noise, e.g. tree-aggregated noise correlated across rounds), not an "
                          "independent share per release; use aggregation = \"central\"")


# ----- distributed parameters ----------------------------------------------------------------
@dataclass(frozen=True)
class SharePlan:
    """One part of a distributed step: grid, padded dimension, sensitivities in grid units,
    the planned total Skellam variance, each node's share and the modulus bits."""

    granularity: float
    dim: int
    l2: float
    l1: float
    variance: float
    node_variance: float
    bits: int
    wrap_probability: float = 0.0  # bound on any coordinate wrapping around, all nodes in

    def rho(self, honest: int) -> float:
        """The zCDP rho of this part when ``honest`` nodes' shares are in the sum."""
        return skellam_rho(self.l2, self.l1, self.node_variance * max(honest, 1))


def honest_minimum(config: RunConfig, nodes: int) -> int:
    """Nodes whose shares are always in the sum: all but ``floor(threshold * nodes)``."""
    return nodes - math.floor(config.collusion_threshold * nodes)


def _graph_entry(config: RunConfig, nodes: int) -> dict[str, Any]:
    """The secure rounds' neighbourhoods, threshold and the failure bounds they were sized for."""
    p = plan(config, nodes)
    return {"secure_threshold": p.t, "secure_neighbours": p.k,
            "secure_graph": "complete" if p.complete(nodes) else "ring (SecAgg+)",
            "secure_privacy_failure_per_round": p.privacy_failure,
            "secure_completion_failure_per_round": p.completion_failure}


def honest_count(config: RunConfig, nodes: int, answered: int) -> int:
    """The honest nodes in a round's sum: those that answered, less the colluders the declared
    threshold still allows (``floor(threshold K)`` minus the nodes that dropped out)."""
    allowance = max(0, math.floor(config.collusion_threshold * nodes) - (nodes - answered))
    return answered - allowance


def share_plan(config: RunConfig, part: Part, multiplier: float, population: int,
               nodes: int) -> SharePlan:
    """The distributed parameters of ``part`` released with noise multiplier ``multiplier``
    (the part's own: ``z / sqrt(share)``): Skellam variance with ``skellam_rho <= 1/(2 z^2)``,
    split over the guaranteed honest nodes; the modulus from the wrap-around bound (or the
    configured ``modulus-bits``, refused if smaller than needed)."""
    factor = 1.0 if config.neighbouring_relation == "add-remove" else 2.0
    sensitivity = factor * part.clip_norm
    dim = padded_dim(int(np.prod(part.shape)))
    g = granularity(sensitivity, dim)
    l2 = sensitivity / g * (1.0 + FLOAT_SLACK) + math.sqrt(dim)
    l1 = math.sqrt(dim) * sensitivity / g * (1.0 + FLOAT_SLACK) + dim
    target = 1.0 / (2.0 * multiplier ** 2)
    variance = (multiplier * l2) ** 2
    for _ in range(100):
        rho = skellam_rho(l2, l1, variance)
        if rho <= target:
            break
        variance *= rho / target * (1.0 + 1e-12)
    else:  # pragma: no cover - the ratio converges in two or three steps
        raise RuntimeError("could not size the Skellam noise")
    node_variance = variance / honest_minimum(config, nodes)
    # sized for the worst grid: Delta / g lies in [F sqrt(d), 2 F sqrt(d)) whatever the clip,
    # so a clip that moves (adaptive clipping) never needs more bits than checked at start
    worst = 2.0 * SLACK_FACTOR * math.sqrt(dim) * g / sensitivity
    signal = population * part.clip_norm / g
    needed = modulus_bits_needed(signal * worst, node_variance * nodes * worst ** 2, dim,
                                 rounding_slack=nodes, target=WRAP_TARGET)
    bits = config.modulus_bits or needed
    if bits < needed:
        raise ConfigError(f"modulus-bits: {bits} bits cannot hold the quantized sum of part "
                          f"{part.name!r} ({needed} needed for a wrap-around probability "
                          f"<= {WRAP_TARGET:g}); use modulus-bits = 0 (automatic) or >= {needed}")
    wrap = wrap_probability(signal, node_variance * nodes, dim, bits, rounding_slack=nodes)
    return SharePlan(g, dim, l2, l1, variance, node_variance, bits, wrap)


def payload(plans: Sequence[SharePlan]) -> np.ndarray:
    """The parameters each node needs, one row per part: granularity, node variance, bits."""
    return np.array([[p.granularity, p.node_variance, p.bits] for p in plans], dtype=np.float64)


def ring_layout(step: Step, plans: Sequence[SharePlan]) -> dict[str, tuple[int, int]]:
    """{part: (padded dimension, bits)}: what a node's reply must hold in a distributed step."""
    return {part.name: (p.dim, p.bits) for part, p in zip(step.parts, plans, strict=True)}


def ledger_parts(step: Step, plans: Sequence[SharePlan], honest: int,
                 population: int) -> list[dict[str, Any]]:
    """Each part's ledger entry of a distributed release (mean scale for std and
    sensitivity)."""
    out = []
    for part, p in zip(step.parts, plans, strict=True):
        out.append({"name": part.name, "l2_sensitivity": p.l2 * p.granularity / population,
                    "granularity": p.granularity, "padded_dim": p.dim,
                    "l2_sensitivity_grid": p.l2, "l1_sensitivity_grid": p.l1,
                    "skellam_variance": p.node_variance * honest,
                    "noise_std": math.sqrt(p.node_variance * honest) * p.granularity
                    / population,
                    "modulus_bits": p.bits, "wrap_probability_bound": p.wrap_probability,
                    # how far one node that breaks the protocol can move the released mean:
                    # its ring vector can make the lifted sum any value, so the diameter
                    # sqrt(padded dim) 2^bits g / n (the server never sees a node's exact sum)
                    "hostile_node_l2_bound": math.sqrt(p.dim) * 2.0 ** p.bits
                    * p.granularity / population,
                    "rho": p.rho(honest)})
    return out


def delta_slack(config: RunConfig, plan: Sequence[PlannedRelease], nodes: int) -> float:
    """What conditional rounding adds to delta over the run: ``(1 + e^eps) R K BETA`` (R
    part releases, K nodes)."""
    if not config.noise_shares:
        return 0.0
    releases = sum(r.count for r in plan) * 4  # parts per release: at most 4 (generous)
    return (1.0 + math.exp(min(config.ceiling, 700.0))) * releases * nodes * BETA


def accounting_delta(config: RunConfig) -> float:
    """The delta the accountant works at: distributed runs keep ``DELTA_RESERVE`` of the target
    for the conditional-rounding slack (``check_delta_slack``)."""
    return config.delta * (1.0 - DELTA_RESERVE) if config.noise_shares else (
        config.delta)


def check_delta_slack(config: RunConfig, plan: Sequence[PlannedRelease], nodes: int) -> None:
    """Refuse a distributed run whose conditional-rounding slack exceeds the reserve."""
    slack = delta_slack(config, plan, nodes)
    if slack > DELTA_RESERVE * config.delta:
        raise ConfigError(f"delta: {config.delta:g} is too small for conditional rounding over "
                          f"{nodes} nodes (its slack {slack:.3g} exceeds {DELTA_RESERVE:g} of "
                          "delta); raise delta")


# What the server receives in each mode (docs/concepts/trust.md has the same table).
SERVER_VIEW: dict[str, dict[str, str]] = {
    "central": {
        "update": "each node's exact clipped sum (the server adds the noise)",
        "counts": "each node's users taking part and users clipped",
        "metrics": "each node's exact final metric sums",
        "timing": "each node's compute and decode seconds, and when its reply arrives",
        "errors": "a failing node's error text; which nodes answered"},
    "distributed": {
        "update": "each node's noisy share modulo 2^bits (its noise share added on the node)",
        "counts": "only the public count of the node's users taking part (0 where hosting is "
                  "not public); no clipped count",
        "metrics": "none: metrics steps are not sent; private-metrics = true releases them "
                   "with noise",
        "timing": "when each node's reply arrives (no timings in the reply)",
        "errors": "a failing node's error text; which nodes answered (one user's failure "
                  "zeroes that user on the node and fails no node)"},
    "secure": {
        "update": "masked vectors and their sum: the sum of the nodes' noisy shares",
        "counts": "only the public counts, inside the masked sum; no clipped count",
        "metrics": "none: metrics steps are not sent; private-metrics = true releases them "
                   "with noise",
        "timing": "when each node's reply arrives, per protocol stage",
        "errors": "which nodes answered each stage, and a failing node's error text"},
}
HOSTILE_NODE = ("not bounded by the server: a node that breaks the protocol can set each "
                "coordinate of a part's lifted sum to any value modulo 2^bits, moving the "
                "released mean by up to the ledger part's hostile_node_l2_bound "
                "(sqrt(padded_dim) 2^modulus_bits granularity / n); its own users' privacy "
                "is the node's to keep")
HOSTILE_NODE_CENTRAL = ("bounded by the server: each node's sum is clipped to (its users) x "
                        "clip before the noise, so a hostile node moves the released mean by "
                        "at most 2 x its users x clip / n (its users: the public count, or "
                        "its own claim where hosting is not public; norm_bounded_nodes counts "
                        "the nodes it bounded)")


def trust(config: RunConfig, nodes: int) -> dict[str, Any]:
    """Who the release's guarantee trusts, and the noise it was drawn with."""
    if config.noise_shares:
        secure = config.aggregation == "secure"
        return {"aggregation": config.aggregation, "trusted": (
            "each node with its own users (a node that colludes with the server exposes them); "
            "the server is not trusted with the noise of the honest nodes' users, up to the "
            "declared collusion threshold: "
            + ("secure aggregation hides each node's vector, the server sees only the masked "
               "vectors and their sum (threat model: an honest-but-curious server that follows "
               "the protocol, no Sybil nodes)" if secure else
               "a simulated modular sum: the server sees each node's noisy share")),
            "collusion_threshold": config.collusion_threshold,
            "honest_nodes_guaranteed": honest_minimum(config, nodes),
            **(_graph_entry(config, nodes) if secure else {}),
            "server_receives": SERVER_VIEW[config.aggregation],
            "hostile_node": HOSTILE_NODE,
            "noise": ("skellam shares from each node's ChaCha20 stream keyed by the OS (numpy's "
                      "floating-point Poisson sampler on it: integer-valued, its approximation "
                      "is not in the accounting)")}
    return {"aggregation": "central", "trusted": "the server (it adds the noise)",
            "server_receives": SERVER_VIEW["central"], "hostile_node": HOSTILE_NODE_CENTRAL,
            "noise": ("discrete gaussian on a power-of-two grid, exact sampler, ChaCha20 seeded "
                      "by the OS" if config.secure_noise else
                      "floating-point gaussian from numpy's seeded PCG64 (research runs)")}


def check_ring_totals(totals: Mapping[str, Any], layout: Mapping[str, tuple[int, int]]
                      ) -> tuple[str, str] | None:
    """(kind, detail) of the first problem with a distributed reply's vectors, or None."""
    extra = sorted(str(k) for k in totals if k not in layout)
    if extra:
        return "unexpected-part", f"arrays {extra} are not released"
    for name, (dim, bits) in layout.items():
        if name not in totals:
            return "missing-part", f"no array {name!r}"
        value = np.asarray(totals[name])
        if value.dtype != np.int64:
            return "dtype", f"{name!r} has dtype {value.dtype}, expected int64 (mod 2^{bits})"
        if value.shape != (dim,):
            return "shape", f"{name!r} has shape {value.shape}, expected ({dim},)"
        if value.size and (value.min() < 0 or value.max() >= 2 ** bits):
            return "range", f"{name!r} has values outside [0, 2^{bits})"
    return None
