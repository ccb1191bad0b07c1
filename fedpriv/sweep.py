"""``fedpriv sweep``: a grid of algorithms x epsilon x seeds from one TOML file.

    [sweep]
    name = "figure_snedeker2025"           # names the output folder
    title = "Private FedRep vs Priv-AltMin"  # figure title
    epsilons = [1, 2, 4, 6, 8]
    seeds = [0, 1, 2]

    [base]                                  # run-config keys shared by every run
    num-users = 20000
    dim = 50

    [[series]]                              # one curve (or line) per series
    label = "Private FedRep"
    algorithm = "private-fedrep"
    set = { rounds = 5 }                    # run-config keys of this series only

A series whose algorithm spends no privacy budget (non-private baselines, local-only, the
known-U* reference) does not depend on epsilon: it runs once per seed and is drawn as a
horizontal line. Every run config is validated (and every privacy plan calibrated) before the
first run starts. Outputs, under ``--out`` (default ``results/sweeps/<name>``): one results JSON
per run in ``runs/`` (reused when a sweep is re-run with the same configs), ``table.csv`` and
``table.json`` (mean and spread over seeds), and ``figure.png`` (population MSE against epsilon,
log scale).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedpriv.config import ConfigError, RunConfig, default_mapping
from fedpriv.privacy.accounting import InfeasiblePlanError

METRIC = "population_mse"


@dataclass(frozen=True)
class Run:
    series: str
    algorithm: str
    epsilon: float | None  # None: the series does not depend on epsilon
    seed: int
    values: dict[str, Any] = field(hash=False, compare=False)

    @property
    def slug(self) -> str:
        eps = "none" if self.epsilon is None else f"{self.epsilon:g}"
        return f"{_slug(self.series)}__eps-{eps}__seed-{self.seed}"


@dataclass
class SweepSpec:
    name: str
    title: str
    epsilons: list[float]
    seeds: list[int]
    base: dict[str, Any]
    series: list[dict[str, Any]]
    runs: list[Run]
    source: Path


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def load_sweep(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> SweepSpec:
    """Parse and validate a sweep file: every run's config and privacy plan, before any run."""
    from fedpriv.registry import get_algorithm
    from fedpriv.server import check_plan

    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"sweep file {path} does not exist")
    with source.open("rb") as fh:
        try:
            raw = tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    unknown = sorted(set(raw) - {"sweep", "base", "series"})
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {unknown}; expected [sweep], [base], "
                          "[[series]]")
    sweep = raw.get("sweep", {})
    bad = sorted(set(sweep) - {"name", "title", "epsilons", "seeds"})
    if bad:
        raise ConfigError(f"[sweep]: unknown key(s) {bad}; known: name, title, epsilons, seeds")
    epsilons = sweep.get("epsilons")
    if not isinstance(epsilons, list) or not epsilons or not all(
            isinstance(e, (int, float)) and not isinstance(e, bool) and e > 0 for e in epsilons):
        raise ConfigError("[sweep] epsilons: expected a non-empty list of numbers > 0")
    seeds = sweep.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise ConfigError("[sweep] seeds: expected a non-empty list of integers >= 0")
    if len(set(seeds)) != len(seeds):
        raise ConfigError("[sweep] seeds: duplicate seeds")
    base = {**raw.get("base", {}), **(overrides or {})}
    for key in ("epsilon", "seed", "algorithm"):
        if key in base:
            raise ConfigError(f"[base] {key}: set by the sweep itself; remove it from [base]")
    series = raw.get("series")
    if not isinstance(series, list) or not series:
        raise ConfigError(f"{path}: needs at least one [[series]] with label and algorithm")
    runs: list[Run] = []
    labels: set[str] = set()
    for i, entry in enumerate(series):
        where = f"[[series]] #{i + 1}"
        bad = sorted(set(entry) - {"label", "algorithm", "set"})
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {bad}; known: label, algorithm, set")
        if "algorithm" not in entry:
            raise ConfigError(f"{where}: missing 'algorithm'")
        label = str(entry.get("label", entry["algorithm"]))
        if _slug(label) in labels:
            raise ConfigError(f"{where}: duplicate label {label!r}")
        labels.add(_slug(label))
        extra = entry.get("set", {})
        if not isinstance(extra, dict):
            raise ConfigError(f"{where} set: expected a table of run-config keys")
        for key in ("epsilon", "seed", "algorithm"):
            if key in extra:
                raise ConfigError(f"{where} set: {key} is set by the sweep itself")
        try:
            algorithm = get_algorithm(entry["algorithm"])
        except KeyError as err:
            raise ConfigError(f"{where} algorithm: {err.args[0]}") from None
        values = {**default_mapping(), **base, **extra, "algorithm": entry["algorithm"]}
        probe = _config(where, {**values, "epsilon": float(epsilons[0]), "seed": seeds[0]})
        depends = bool(algorithm(probe).privacy_plan())
        for eps in (epsilons if depends else [None]):
            for seed in seeds:
                run_values = {**values, "seed": seed}
                if eps is not None:
                    run_values["epsilon"] = float(eps)
                config = _config(where, run_values)
                if eps is not None and seed == seeds[0]:
                    try:
                        check_plan(config)
                    except InfeasiblePlanError as err:
                        raise ConfigError(f"{where} at epsilon={eps}: {err}") from None
                runs.append(Run(label, entry["algorithm"], None if eps is None else float(eps),
                                seed, run_values))
    name = str(sweep.get("name", source.stem))
    return SweepSpec(name, str(sweep.get("title", name)), [float(e) for e in epsilons], seeds,
                     base, series, runs, source)


def _config(where: str, values: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.from_mapping(values, strict=True)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


# ----- running -----------------------------------------------------------------------------
def _run_one(values: dict[str, Any], path: str) -> dict:
    """Worker: one in-process run, written atomically to ``path``."""
    from fedpriv.engine import run_in_process, write_results

    results = run_in_process(RunConfig.from_mapping(values), log=lambda _: None)
    write_results(results, path)
    return results


def _run_flower(values: dict[str, Any], path: str) -> dict:
    from fedpriv.cli import run_flower

    config = RunConfig.from_mapping(values)
    if run_flower(config, values, Path(path), keep_superlink=False, quiet=True) != 0:
        raise RuntimeError(f"the Flower run for {path} failed")
    return json.loads(Path(path).read_text())


def _reusable(path: Path, values: dict[str, Any]) -> dict | None:
    """A finished run from an earlier invocation with exactly this config, if any."""
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    wanted = RunConfig.from_mapping(values).to_mapping()
    stored = dict(results.get("config", {}))
    wanted.pop("results-path"), stored.pop("results-path", None)
    return results if stored == wanted else None


def run_sweep(spec: SweepSpec, out: Path, jobs: int = 1, engine: str = "inprocess",
              log: Callable[[str], None] = print) -> list[dict]:
    """Run every run of the sweep (reusing finished ones); returns the table rows."""
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    results: dict[Run, dict] = {}
    todo = []
    for run in spec.runs:
        path = runs_dir / f"{run.slug}.json"
        previous = _reusable(path, run.values)
        if previous is not None:
            results[run] = previous
        else:
            todo.append((run, path))
    total = len(spec.runs)
    log(f"fedpriv sweep {spec.name}: {total} runs ({len(spec.series)} series x "
        f"{len(spec.epsilons)} epsilons x {len(spec.seeds)} seeds; epsilon-free series run "
        f"once per seed), {len(results)} reused, {len(todo)} to run, engine {engine}, "
        f"{jobs} job(s)")
    started = time.perf_counter()
    done = len(results)

    def report(run: Run, res: dict) -> None:
        nonlocal done
        done += 1
        elapsed = time.perf_counter() - started
        ran = done - (total - len(todo))
        eta = elapsed / ran * (total - done) if ran else 0.0
        eps = "   -  " if run.epsilon is None else f"{run.epsilon:6g}"
        log(f"[{done:>{len(str(total))}}/{total}] {run.series:<28} eps={eps} seed={run.seed}  "
            f"{METRIC} {res['metrics'][METRIC]:.4g}  ({res['wall_time_s']:.1f}s; elapsed "
            f"{_clock(elapsed)}, ETA {_clock(eta)})")

    if engine == "flower":
        for run, path in todo:
            results[run] = _run_flower(run.values, str(path))
            report(run, results[run])
    elif jobs <= 1 or len(todo) <= 1:
        for run, path in todo:
            results[run] = _run_one(run.values, str(path))
            report(run, results[run])
    else:
        # one BLAS thread per worker: the workers already use every core
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
        import multiprocessing

        with ProcessPoolExecutor(max_workers=jobs,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_run_one, run.values, str(path)): run for run, path in todo}
            for future in as_completed(futures):
                run = futures[future]
                results[run] = future.result()
                report(run, results[run])
    log(f"fedpriv sweep {spec.name}: finished in {_clock(time.perf_counter() - started)}")
    return summarize(spec, results)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


# ----- the table ---------------------------------------------------------------------------
def _stats(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def summarize(spec: SweepSpec, results: dict[Run, dict]) -> list[dict]:
    """One row per (series, epsilon): mean, sample std, min and max over seeds."""
    rows = []
    order = {s.get("label", s["algorithm"]): i for i, s in enumerate(spec.series)}
    groups: dict[tuple[str, float | None], list[tuple[Run, dict]]] = {}
    for run, res in results.items():
        groups.setdefault((run.series, run.epsilon), []).append((run, res))
    for (series, eps), members in sorted(groups.items(), key=lambda kv: (
            order[kv[0][0]], -1.0 if kv[0][1] is None else kv[0][1])):
        metric = _stats([r["metrics"][METRIC] for _, r in members])
        test = _stats([r["metrics"]["test_mse"] for _, r in members])
        spent = [r["privacy"]["epsilon"] for _, r in members]
        rows.append({
            "series": series,
            "algorithm": members[0][0].algorithm,
            "epsilon": eps,
            "seeds": len(members),
            f"{METRIC}_mean": metric["mean"],
            f"{METRIC}_std": metric["std"],
            f"{METRIC}_min": metric["min"],
            f"{METRIC}_max": metric["max"],
            "test_mse_mean": test["mean"],
            # None: released without noise (not private); otherwise the accountant's epsilon
            "epsilon_spent_max": None if any(s is None for s in spent) else max(spent),
            "wall_time_s_mean": sum(r["wall_time_s"] for _, r in members) / len(members),
        })
    return rows


def write_table(rows: list[dict], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "table.csv", out / "table.json"
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    json_path.write_text(json.dumps(rows, indent=2))
    return csv_path, json_path


def markdown_table(rows: list[dict]) -> str:
    lines = ["| series | epsilon | population MSE (mean ± std) | min–max | seeds |",
             "|---|---|---|---|---|"]
    for r in rows:
        eps = "–" if r["epsilon"] is None else f"{r['epsilon']:g}"
        lines.append(f"| {r['series']} | {eps} | {r[f'{METRIC}_mean']:.3g} ± "
                     f"{r[f'{METRIC}_std']:.2g} | {r[f'{METRIC}_min']:.3g}–"
                     f"{r[f'{METRIC}_max']:.3g} | {r['seeds']} |")
    return "\n".join(lines)


# ----- the figure --------------------------------------------------------------------------
def plot(spec: SweepSpec, rows: list[dict], path: Path) -> Path:
    """Population MSE against epsilon on a log scale; epsilon-free series as horizontal lines;
    shaded bands span min to max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.0, 4.8), dpi=120)
    lo, hi = min(spec.epsilons), max(spec.epsilons)
    markers = iter("osD^v<>ph*")
    dashes = iter(["--", ":", "-.", (0, (5, 2, 1, 2)), (0, (1, 3)), (0, (8, 3))] * 4)
    for i, series in enumerate(dict.fromkeys(r["series"] for r in rows)):
        color = f"C{i % 10}"
        pts = [r for r in rows if r["series"] == series]
        mean = [r[f"{METRIC}_mean"] for r in pts]
        low = [r[f"{METRIC}_min"] for r in pts]
        high = [r[f"{METRIC}_max"] for r in pts]
        if pts[0]["epsilon"] is None:  # epsilon-free: a horizontal line, value in the legend
            ax.axhline(mean[0], linestyle=next(dashes), linewidth=1.5, color=color,
                       label=f"{series} ({mean[0]:.3g})")
            ax.axhspan(low[0], high[0], color=color, alpha=0.10, linewidth=0)
        else:
            eps = [r["epsilon"] for r in pts]
            ax.plot(eps, mean, marker=next(markers, "o"), linewidth=1.8, color=color,
                    label=series)
            ax.fill_between(eps, low, high, color=color, alpha=0.18, linewidth=0)
    ax.set_yscale("log")
    ax.set_xlim(lo - 0.03 * (hi - lo + 1), hi + 0.03 * (hi - lo + 1))
    ax.set_xticks(spec.epsilons)
    ax.set_xlabel(r"user-level $\varepsilon$")
    ax.set_ylabel("population MSE (log scale)")
    b = {**default_mapping(), **spec.base}
    ax.set_title(f"{spec.title}\nn={b['num-users']}, d={b['dim']}, k={b['rank']}, "
                 f"m={b['samples-per-user']}, R={b['label-noise']:g}, "
                 f"$\\delta$={b['delta']:g}, {len(spec.seeds)} seeds (band: min–max)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), framealpha=0.9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
