"""What ``PrivateStrategy`` refuses before round 1: strategies whose aggregate is not a mean,
strategies already wrapped for DP, and personal-layer patterns that match nothing or everything."""

from __future__ import annotations

from collections.abc import Sequence

from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.dp_adaptive_clipping import DifferentialPrivacyAdaptiveBase
from flwr.serverapp.strategy.dp_fixed_clipping import DifferentialPrivacyFixedClippingBase

# Aggregates that are not a mean of the updates: wrapping them would silently turn them into one.
ROBUST = ("Krum", "MultiKrum", "FedMedian", "FedTrimmedAvg", "Bulyan", "QFedAvg",
          "FedXgbBagging", "FedXgbCyclic")
DP_WRAPPERS = (DifferentialPrivacyFixedClippingBase, DifferentialPrivacyAdaptiveBase)


def _chain(strategy: Strategy) -> list[Strategy]:
    """The strategy and every strategy it wraps (``.strategy`` attributes)."""
    chain, seen = [strategy], {id(strategy)}
    while isinstance(getattr(chain[-1], "strategy", None), Strategy):
        inner = chain[-1].strategy  # type: ignore[attr-defined]
        if id(inner) in seen:
            break
        chain.append(inner)
        seen.add(id(inner))
    return chain


def check_inner_strategy(strategy: object) -> None:
    """Raise ``ValueError`` naming the problem if ``strategy`` cannot be made private here."""
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy: expected a flwr.serverapp.strategy.Strategy, got "
                         f"{type(strategy).__name__}")
    for s in _chain(strategy):
        if isinstance(s, DP_WRAPPERS) or type(s).__name__ == "PrivateStrategy":
            raise ValueError(
                f"strategy: {type(s).__name__} already adds differential privacy; wrap the "
                "plain strategy (e.g. FedAvg()) in PrivateStrategy instead of stacking DP "
                "wrappers (the noise and the accounting would be counted twice or wrongly)")
    robust = [c.__name__ for c in type(strategy).__mro__ if c.__name__ in ROBUST]
    if robust:
        raise ValueError(
            f"strategy: {robust[0]} is a robust (non-mean) aggregator; PrivateStrategy releases "
            "a noisy mean of clipped updates and would silently replace its aggregation. "
            "Supported: FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, FedAdagrad (mean-based)")
    if not isinstance(strategy, FedAvg):
        raise ValueError(
            f"strategy: {type(strategy).__name__} is not a FedAvg-family strategy; "
            "PrivateStrategy hands the inner strategy one noisy mean as its only reply, which "
            "needs FedAvg's reply format (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, FedAdagrad)")


def personal_of(pattern: str | None, keys: Sequence[str]) -> frozenset[str]:
    """The model keys matched by the personal-layer ``pattern`` (none without one)."""
    if pattern is None:
        return frozenset()
    from fedpriv_flwr.personal import personal_keys

    return frozenset(personal_keys(pattern, keys))


def check_options(multi_user_nodes: bool, personal_layers: str | None, private_metrics: bool,
                  exact_metrics: str | None) -> str:
    """Refuse ``PrivateStrategy`` options that do not go together; returns where the exact
    metrics go (``exact_metrics``, its default resolved)."""
    if multi_user_nodes and personal_layers is not None:
        raise ValueError("personal_layers: not supported with multi_user_nodes (the "
                         "personalization mod keeps one user's layers per node)")
    if multi_user_nodes and private_metrics:
        raise ValueError("private_metrics: not supported with multi_user_nodes (a node "
                         "would have to clip each of its users' values; nothing does yet)")
    exact_metrics = exact_metrics or ("report" if private_metrics else "flower")
    if exact_metrics not in ("flower", "report", "operator-only"):
        raise ValueError("exact_metrics: 'flower' (the inner strategy's aggregate in Flower's "
                         "result, as Flower's DP wrappers do), 'report' (operator report "
                         "only) or 'operator-only' (also in Flower's result, prefixed), got "
                         f"{exact_metrics!r}")
    if exact_metrics == "flower" and private_metrics:
        raise ValueError("exact_metrics='flower' with private_metrics: Flower's result would "
                         "hold the exact and the noisy value under one name; use "
                         "'operator-only' (the exact ones prefixed) or 'report'")
    return exact_metrics
