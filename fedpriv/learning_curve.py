"""The learning curve of a run with ``eval-every`` (deep family): its exact metrics before the
first round and after every k-th round, drawn beside the operator report.

An ``eval`` step (``fedpriv.algorithms.base.EXACT_EVAL``) is the final step's work with the
model of an earlier round: each user fits its personal model and scores its test rows, the
nodes send metric sums, and the server records them in that step's entry of the operator
report's ``rounds`` (with ``after_round``). Nothing is released and nothing is accounted, so the
curve is exact and **not private**: it belongs with the operator report
(``<results stem>.curve.png``), never with the release. Choosing the number of rounds by
looking at it is tuning on the users' test data; ``fedpriv tune`` is the private way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CURVE_SUFFIX = ".curve.png"
OPERATOR_SUFFIX = ".operator.json"
"""How a run's operator report is named by default: ``<name>.operator.json``."""


def run_stem(results_path: str | os.PathLike[str]) -> Path:
    """A run's name, from the path of its operator report: ``results/run.operator.json`` and
    ``results/run.json`` are both the run ``results/run``; its other files are named from it
    (``<name>.release.json``, ``<name>.curve.png``)."""
    p = Path(results_path)
    for suffix in (OPERATOR_SUFFIX, ".json"):
        if p.name.endswith(suffix) and len(p.name) > len(suffix):
            return p.with_name(p.name[:-len(suffix)])
    return p.with_name(p.stem)
CURVE_METRICS = ("accuracy", "accuracy_p10", "test_loss")  # what a point carries
# the two panels: (axis title, its lines as (metric, label))
_PANELS = (("per-user test accuracy", (("accuracy", "mean user"),
                                       ("accuracy_p10", "10th-percentile user"))),
           ("test loss (mean per user)", (("test_loss", "mean user"),)))


def curve_path(results_path: str | os.PathLike[str]) -> Path:
    """Where the learning curve of a run whose operator report is at ``results_path`` goes."""
    stem = run_stem(results_path)
    return stem.with_name(stem.name + CURVE_SUFFIX)


def curve_points(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The curve's points, in round order: each ``eval`` step's metrics (``round`` = the round
    whose model it scored) and the final step's (the last round's model), each with the epsilon
    spent by then: the accountant's value in the report of the round before it, or None where
    that round has none (a Poisson-sampled run's accountant is evaluated at some rounds only).
    Empty for a run without ``eval`` steps (a curve of one point is the final metrics, which
    the summary prints)."""
    steps = report.get("rounds") or []
    if not any("after_round" in s for s in steps):
        return []
    points, rounds = [], 0
    spent: float | None = 0.0
    for s in steps:
        if str(s["step"]).startswith("round-"):
            rounds += 1
            spent = s.get("epsilon_spent")
        elif ("after_round" in s or s["step"] == "final") and "accuracy" in s:
            points.append({"round": s.get("after_round", rounds), "epsilon_spent": spent,
                           **{k: s[k] for k in CURVE_METRICS if k in s}})
    return points


def plot_curve(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path | None:
    """Draw the curve (accuracy of the mean and the 10th-percentile user, and the test loss,
    against the round; the epsilon spent by each point on the top axis, where the accountant
    gave it at every point) to ``path``; None,
    and nothing written, when the run has no ``eval`` steps."""
    points = curve_points(report)
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xs = [p["round"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.2), dpi=110)
    for ax, (title, lines) in zip(axes, _PANELS, strict=True):
        for (key, label), style, face in zip(lines, ("-", "--"), ("C0", "white"), strict=False):
            ax.plot(xs, [p.get(key, float("nan")) for p in points], linestyle=style,
                    marker="o", color="C0", markerfacecolor=face, label=label)
        ax.set_ylabel(title)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax is axes[0]:
            ax.legend(loc="best", fontsize=8)
        known = all(p["epsilon_spent"] is not None for p in points)
        if report["privacy"].get("epsilon") is not None and known:
            top = ax.secondary_xaxis("top")
            top.set_xticks(xs)
            top.set_xticklabels([f"{p['epsilon_spent']:.2g}" for p in points], fontsize=7)
            top.set_xlabel("epsilon spent", fontsize=8)
    privacy = report["privacy"]
    target = ("non-private" if privacy.get("epsilon") is None
              else f"target epsilon {privacy['target_epsilon']:g}, delta {privacy['delta']:g}")
    fig.suptitle(f"{report['algorithm']}, {report['num_users']} users, {target}: exact "
                 "metrics, operator only (not private)", fontsize=10)
    fig.tight_layout()
    target_path = Path(path)
    target_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target_path)
    plt.close(fig)
    return target_path
