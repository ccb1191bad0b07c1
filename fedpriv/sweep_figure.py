"""The figure of a sweep (``fedpriv sweep``): the metric against epsilon or another run-config
key, one curve per series, from the table ``fedpriv.sweep.summarize`` builds."""

from __future__ import annotations

import textwrap
from pathlib import Path

from fedpriv.config import RunConfig
from fedpriv.sweep import SweepSpec, metric_label


# ----- the figure --------------------------------------------------------------------------
def _subtitle(spec: SweepSpec) -> str:
    if spec.subtitle:
        return spec.subtitle
    b = RunConfig.from_mapping(spec.runs[0].values).to_mapping() if spec.runs else {}
    shown = [("n", "num-users"), ("d", "dim"), ("k", "rank"), ("m", "samples-per-user")]
    parts = [f"{sym}={b[key]}" for sym, key in shown if key != spec.x and key in b]
    if "label-noise" in b:
        parts.append(f"R={b['label-noise']:g}")
    return ", ".join(parts + [f"$\\delta$={b['delta']:g}"])


def plot(spec: SweepSpec, rows: list[dict], path: Path) -> Path:
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
