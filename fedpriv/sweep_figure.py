"""The figure of a sweep (``fedpriv sweep``): the metric against epsilon or another run-config
key, one curve per series, from the table ``fedpriv.sweep.summarize`` builds; and, where the
runs have ``eval-every`` (deep family), their learning curves, one panel per epsilon, from the
runs' operator reports (exact metrics: operator only, like the rest of a sweep's output)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

from fedpriv.configure import parse_config
from fedpriv.server.report import measured_metrics
from fedpriv.sweep import SweepSpec, metric_label


# ----- the figure --------------------------------------------------------------------------
def _subtitle(spec: SweepSpec) -> str:
    if spec.subtitle:
        return spec.subtitle
    b = parse_config(spec.runs[0].values).to_mapping() if spec.runs else {}
    shown = [("n", "num-users"), ("d", "dim"), ("k", "rank"), ("m", "samples-per-user")]
    parts = [f"{sym}={b[key]}" for sym, key in shown if key != spec.x and key in b]
    if "label-noise" in b:
        parts.append(f"R={b['label-noise']:g}")
    return ", ".join(parts + [f"$\\delta$={b['delta']:g}"])


def plot(spec: SweepSpec, rows: list[dict[str, Any]], path: Path) -> Path:
    """The metric against epsilon (epsilon-free series as horizontal lines) or against the x key
    (one curve per series and epsilon: colour per series, line style per epsilon); log scales;
    shaded bands span min to max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    metric = spec.metric
    fig, ax = plt.subplots(figsize=(9.0, 4.8), dpi=120)
    markers = iter("osD^v<>ph*")
    dashes = iter(["--", ":", "-.", (0, (5, 2, 1, 2)), (0, (1, 3)), (0, (8, 3))] * 4)
    line_styles = ["-", "--", ":", "-.", (0, (5, 2, 1, 2))] * 4
    eps_styles = dict(zip(spec.epsilons, line_styles, strict=False))  # more styles than needed
    for i, series in enumerate(dict.fromkeys(r["series"] for r in rows)):
        color = f"C{i % 10}"
        pts = [r for r in rows if r["series"] == series]
        if spec.x != "epsilon":
            marker = next(markers, "o")
            for eps in dict.fromkeys(r["epsilon"] for r in pts):
                curve = [r for r in pts if r["epsilon"] == eps]
                xs = [r[spec.x] for r in curve]
                label = series if eps is None else f"{series}, $\\varepsilon$={eps:g}"
                ax.plot(xs, [r[f"{metric}_mean"] for r in curve], marker=marker, color=color,
                        linewidth=1.8, linestyle="-" if eps is None else eps_styles[eps],
                        label=label)
                ax.fill_between(xs, [r[f"{metric}_min"] for r in curve],
                                [r[f"{metric}_max"] for r in curve], color=color, alpha=0.12,
                                linewidth=0)
            continue
        mean = [r[f"{metric}_mean"] for r in pts]
        low = [r[f"{metric}_min"] for r in pts]
        high = [r[f"{metric}_max"] for r in pts]
        if pts[0]["epsilon"] is None:  # epsilon-free: a horizontal line, value in the legend
            ax.axhline(mean[0], linestyle=next(dashes), linewidth=1.5, color=color,
                       label=f"{series} ({mean[0]:.3g})")
            ax.axhspan(low[0], high[0], color=color, alpha=0.10, linewidth=0)
        else:
            eps = [r["epsilon"] for r in pts]
            ax.plot(eps, mean, marker=next(markers, "o"), linewidth=1.8, color=color,
                    label=series)
            ax.fill_between(eps, low, high, color=color, alpha=0.18, linewidth=0)
    if spec.log_y:
        ax.set_yscale("log")
    # plain numbers on the log axis (not 4x10^0), minor ticks labelled only on a narrow range
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    lows = [r[f"{metric}_min"] for r in rows if r[f"{metric}_min"] > 0]
    narrow = bool(lows) and max(r[f"{metric}_max"] for r in rows) / min(lows) < 20
    ax.yaxis.set_minor_formatter(plain if narrow else matplotlib.ticker.NullFormatter())
    if spec.x == "epsilon":
        lo, hi = min(spec.epsilons), max(spec.epsilons)
        if hi >= 10 * lo:  # a wide range of epsilons: log scale, plain tick labels
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlim(lo / 1.25, hi * 1.25)
        else:
            ax.set_xlim(lo - 0.03 * (hi - lo + 1), hi + 0.03 * (hi - lo + 1))
        ax.set_xticks(spec.epsilons, [f"{e:g}" for e in spec.epsilons])
        ax.set_xlabel(r"user-level $\varepsilon$")
    else:
        if min(spec.x_values) > 0:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(spec.x_values, [f"{v:g}" for v in spec.x_values])
        ax.set_xlabel(spec.x_label or spec.x)
    ax.set_ylabel(f"{metric_label(metric)}{' (log scale)' if spec.log_y else ''}")
    subtitle = textwrap.fill(f"{_subtitle(spec)}, {len(spec.seeds)} seeds (band: min–max)", 80)
    ax.set_title(f"{spec.title}\n{subtitle}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), framealpha=0.9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# ----- the learning curves of a sweep (runs with eval-every) -------------------------------
# {(series, epsilon): {round: [the metric of each seed]}}; round None: a run without rounds
CurveTable = dict[tuple[str, float | None], dict[int | None, list[float]]]


def curve_table(spec: SweepSpec, runs_dir: Path) -> CurveTable:
    """{(series, epsilon): {round: [the metric of each seed]}} from the runs' operator reports
    (``fedpriv.learning_curve.curve_points``); a series whose runs have no eval steps (local
    only) maps to {None: [each seed's final metric]}. Empty when no run has eval steps, when
    the sweep's axis is not epsilon, or when the metric is not one a curve carries."""
    from fedpriv.learning_curve import CURVE_METRICS, curve_points

    if spec.x != "epsilon" or spec.metric not in CURVE_METRICS:
        return {}
    table: CurveTable = {}
    for run in spec.runs:
        path = runs_dir / f"{run.slug}.json"
        if not path.is_file():
            continue
        results = json.loads(path.read_text())
        cell = table.setdefault((run.series, run.epsilon), {})
        points = curve_points(results)
        for point in points:
            if spec.metric in point:
                cell.setdefault(point["round"], []).append(point[spec.metric])
        measured = measured_metrics(results)
        if not points and spec.metric in measured:
            cell.setdefault(None, []).append(measured[spec.metric])
    if not any(r is not None for cell in table.values() for r in cell):
        return {}
    return table


def plot_curves(spec: SweepSpec, runs_dir: Path, path: Path) -> Path | None:
    """The metric against the round, one panel per epsilon, one line per series (the mean over
    seeds, the band min to max); an epsilon-free series (non-private) in every panel, dashed; a
    series without rounds (local only) as a horizontal line at its final value. None, and
    nothing drawn, where ``curve_table`` is empty."""
    table = curve_table(spec, runs_dir)
    if not table:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cols = min(3, len(spec.epsilons))
    rows = math.ceil(len(spec.epsilons) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows + 0.8), dpi=110,
                             squeeze=False, sharey=True)
    series = list(dict.fromkeys(run.series for run in spec.runs))
    for ax, eps in zip(axes.flat, spec.epsilons, strict=False):
        for i, name in enumerate(series):
            free = (name, eps) not in table  # epsilon-free (or this epsilon not run)
            cell = table.get((name, None), {}) if free else table[(name, eps)]
            color = f"C{i % 10}"
            if None in cell:  # no rounds: its final value
                ax.axhline(sum(cell[None]) / len(cell[None]), color=color, linestyle=":",
                           linewidth=1.4, label=name)
                continue
            xs = sorted(r for r in cell if r is not None)  # (None is not in it here)
            if not xs:
                continue
            ax.plot(xs, [sum(cell[x]) / len(cell[x]) for x in xs], color=color,
                    linestyle="--" if free else "-", marker="o", markersize=3, label=name)
            ax.fill_between(xs, [min(cell[x]) for x in xs], [max(cell[x]) for x in xs],
                            color=color, alpha=0.15, linewidth=0)
        ax.set_title(rf"$\varepsilon$ = {eps:g}", fontsize=10)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(spec.epsilons):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(metric_label(spec.metric))
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8)
    fig.suptitle(f"{spec.title}: learning curves (exact metrics, operator only)\n"
                 f"{_subtitle(spec)}, {len(spec.seeds)} seeds (band: min–max)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08 + 0.04 * (len(labels) > 4), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
