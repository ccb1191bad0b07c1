"""Plans of pure epsilon-DP releases (the exponential mechanism): epsilon split by weights."""

from __future__ import annotations

from collections.abc import Sequence

from fedpriv.privacy.accounting import PURE, InfeasiblePlanError, PlannedRelease, epsilon_of


def pure_plan_epsilons(releases: Sequence[PlannedRelease], epsilon: float) -> list[float]:
    """Per-release epsilons of a pure plan: ``epsilon * w_j / sum(count * w)`` (pure DP composes
    additively at delta = 0), confirmed by the accountant."""
    if not releases or any(r.mechanism != "exponential" for r in releases):
        raise InfeasiblePlanError("a pure plan holds exponential-mechanism releases only")
    if epsilon <= 0 or any(r.weight <= 0 or r.count < 1 for r in releases):
        raise InfeasiblePlanError("a pure plan needs epsilon > 0 and weights > 0")
    total = sum(r.count * r.weight for r in releases)
    split = [epsilon * r.weight / total for r in releases]
    spent = epsilon_of({(e, PURE): r.count for r, e in zip(releases, split, strict=True)}, 0.0)
    if spent > epsilon * (1 + 1e-9):
        raise InfeasiblePlanError(f"the pure plan spends {spent} > epsilon={epsilon}")
    return split
