"""``fedpriv sweep``: a grid of algorithms x epsilon (x another key) x seeds from one TOML file.

    [sweep]
    name = "figure_snedeker2025"           # names the output folder
    title = "Private FedRep vs Priv-AltMin"  # figure title
    epsilons = [1, 2, 4, 6, 8]
    seeds = [0, 1, 2]
    metric = "population_mse"               # the metric tabulated and plotted (the default)
    # x = "num-users"                       # optional: plot against this run-config key ...
    # x-values = [500, 2000, 10000]         # ... at these values, one curve per (series, eps)
    # x-label = "number of tasks K"         # optional axis label (default: the key)
    # log-y = false                         # linear metric axis (default: log scale, but
                                            #   linear for an accuracy, bounded in [0, 1])
    # subtitle = "d=30, ..."                # optional second title line

    [base]                                  # run-config keys shared by every run
    num-users = 20000
    dim = 50

    [[series]]                              # one curve (or line) per series
    label = "Private FedRep"
    algorithm = "private-fedrep"
    set = { rounds = 5 }                    # run-config keys of this series only

A series whose algorithm spends no privacy budget (non-private baselines, local-only, the
known-U* reference; not a record-level baseline, whose noise epsilon sets) does not depend on
epsilon: it runs once per seed (and x value) and is
drawn as a horizontal line against epsilon, or as one curve against x. Every run config is
validated (and every privacy plan calibrated) before the first run starts. Outputs, under
``--out`` (default ``results/sweeps/<name>``): one results JSON per run in ``runs/`` (reused
when a sweep is re-run with the same configs), ``table.csv`` and ``table.json`` (the metric's mean
and spread over seeds, the means of the other metrics), and ``figure.png`` (the metric against
epsilon or x, log scale).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpriv import allocator
from fedpriv.config import ConfigError, RunConfig, default_mapping
from fedpriv.config_files import toml_error
from fedpriv.configure import algorithm_params, declared_keys, parse_config, select_keys
from fedpriv.evaluation import algorithm_for
from fedpriv.privacy.accounting import InfeasiblePlanError
from fedpriv.server.report import measured_metrics
from fedpriv.sweep_cache import reusable, set_aside

if TYPE_CHECKING:
    from fedpriv.launcher import FlowerSession

METRIC = "population_mse"  # the default metric
_SWEEP_KEYS = ("name", "title", "subtitle", "epsilons", "seeds", "metric", "x", "x-values",
               "x-label", "log-y")
_SET_BY_SWEEP = ("epsilon", "seed", "algorithm")


@dataclass(frozen=True)
class Run:
    series: str
    algorithm: str
    epsilon: float | None  # None: the series does not depend on epsilon
    seed: int
    values: dict[str, Any] = field(hash=False, compare=False)
    x: float | None = None  # the value of the sweep's x key (None: x is epsilon)

    @property
    def slug(self) -> str:
        eps = "none" if self.epsilon is None else f"{self.epsilon:g}"
        at = "" if self.x is None else f"__x-{self.x:g}"
        return f"{_slug(self.series)}__eps-{eps}{at}__seed-{self.seed}"


@dataclass
class SweepSpec:
    name: str
    title: str
    epsilons: list[float]
    seeds: list[int]
    base: dict[str, Any]
    series: list[dict[str, Any]]
    runs: list[Run]
    source: Path | None
    metric: str = METRIC
    x: str = "epsilon"  # the horizontal axis: epsilon or a run-config key
    x_values: list[float] = field(default_factory=list)
    subtitle: str | None = None
    x_label: str | None = None
    log_y: bool = True


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def load_sweep(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None,
               plans: bool = True) -> SweepSpec:
    """Parse and validate a sweep file: every run's config, size (``fedpriv.cost``) and privacy
    plan, before any run. ``plans = False``: the plans are not calibrated (each is a second or
    more of accounting; a sweep that runs calibrates them anyway)."""
    from fedpriv.cost import check_size
    from fedpriv.registry import get_algorithm
    from fedpriv.server import check_plan

    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"sweep file {path} does not exist")
    with source.open("rb") as fh:
        try:
            raw = tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(toml_error(path, err)) from None
    unknown = sorted(set(raw) - {"sweep", "base", "series"})
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {unknown}; expected [sweep], [base], "
                          "[[series]]")
    sweep = raw.get("sweep", {})
    bad = sorted(set(sweep) - set(_SWEEP_KEYS))
    if bad:
        raise ConfigError(f"[sweep]: unknown key(s) {bad}; known: {', '.join(_SWEEP_KEYS)}")
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
    metric = sweep.get("metric", METRIC)
    if not isinstance(metric, str) or not metric:
        raise ConfigError("[sweep] metric: expected a metric name such as \"population_mse\"")
    x_key, x_values = _x_axis(sweep)
    set_by_sweep = _SET_BY_SWEEP + (() if x_key == "epsilon" else (x_key,))
    base = {**raw.get("base", {}), **(overrides or {})}
    _check_base_keys(base, [entry.get("algorithm") for entry in raw.get("series") or []
                            if isinstance(entry, dict)], set(overrides or {}))
    for key in set_by_sweep:
        if key in (overrides or {}):
            raise ConfigError(f"--set {key}: set by the sweep itself ([sweep] epsilons and "
                              "seeds, each [[series]]'s algorithm, the x-axis key); change it "
                              "in the file")
        if key in base:
            raise ConfigError(f"[base] {key}: set by the sweep itself; remove it from [base]")
    series = raw.get("series")
    if not isinstance(series, list) or not series:
        raise ConfigError(f"{path}: needs at least one [[series]] with label and algorithm")
    runs: list[Run] = []
    labels: dict[str, str] = {}  # slug -> label
    for i, entry in enumerate(series):
        where = f"[[series]] #{i + 1}"
        bad = sorted(set(entry) - {"label", "algorithm", "set"})
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {bad}; known: label, algorithm, set")
        if "algorithm" not in entry:
            raise ConfigError(f"{where}: missing 'algorithm'")
        label = str(entry.get("label", entry["algorithm"]))
        if _slug(label) in labels:
            same = labels[_slug(label)]
            raise ConfigError(f"{where}: duplicate label {label!r}" if same == label else
                              f"{where}: label {label!r} names the same run files as "
                              f"{same!r} ({_slug(label)}); make them differ in a letter or "
                              "digit")
        labels[_slug(label)] = label
        extra = entry.get("set", {})
        if not isinstance(extra, dict):
            raise ConfigError(f"{where} set: expected a table of run-config keys")
        for key in set_by_sweep:
            if key in extra:
                raise ConfigError(f"{where} set: {key} is set by the sweep itself")
        try:
            algorithm = get_algorithm(entry["algorithm"])
        except KeyError as err:
            raise ConfigError(f"{where} algorithm: {err.args[0]}") from None
        # [base] is shared: each series takes the keys its algorithm reads
        values = {**default_mapping(), **select_keys(base, entry["algorithm"]), **extra,
                  "algorithm": entry["algorithm"]}
        xs: list[Any] = x_values or [None]
        # a series whose algorithm does not read the x key (a reference such as local-only)
        # runs at every x without it: a flat line, as before keys were algorithm-owned
        reads_x = x_key in default_mapping() or x_key in algorithm.declared_params()
        first = {} if xs[0] is None or not reads_x else {x_key: xs[0]}
        probe = _config(where, {**values, **first, "epsilon": float(epsilons[0]),
                                "seed": seeds[0]})
        probed = algorithm_for(probe)(probe)
        # a record-level baseline's noise is calibrated to epsilon too (per record)
        depends = bool(probed.privacy_plan()) or probed.record_level_privacy() is not None
        for x in xs:
            at = {} if x is None or not reads_x else {x_key: x}
            where_x = where if x is None else f"{where} at {x_key}={x}"
            for eps in (epsilons if depends else [None]):
                for seed in seeds:
                    run_values = {**values, **at, "seed": seed}
                    if eps is not None:
                        run_values["epsilon"] = float(eps)
                    config = _config(where_x, run_values)
                    try:  # its size; every value of a data file, read once (cached)
                        check_size(config)
                        algorithm.check_inputs(config)
                    except ConfigError as err:
                        raise ConfigError(f"{where_x}: {err}") from None
                    if plans and eps is not None and seed == seeds[0]:
                        try:
                            check_plan(config)
                        except InfeasiblePlanError as err:
                            raise ConfigError(f"{where_x} at epsilon={eps}: {err}") from None
                    runs.append(Run(label, entry["algorithm"],
                                    None if eps is None else float(eps), seed, run_values,
                                    None if x is None else float(x)))
    name = str(sweep.get("name", source.stem))
    subtitle = sweep.get("subtitle")
    return SweepSpec(name, str(sweep.get("title", name)), [float(e) for e in epsilons], seeds,
                     base, series, runs, source, metric, x_key,
                     [float(v) for v in x_values], None if subtitle is None else str(subtitle),
                     str(sweep["x-label"]) if "x-label" in sweep else None,
                     _flag(sweep, "log-y", "accuracy" not in metric))


def _flag(sweep: dict[str, Any], key: str, default: bool) -> bool:
    value = sweep.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"[sweep] {key}: expected true or false, got {value!r}")
    return value


def _x_axis(sweep: dict[str, Any]) -> tuple[str, list[Any]]:
    """The horizontal axis: ``epsilon`` (the default) or a run-config key with its values."""
    x_key = sweep.get("x", "epsilon")
    x_values = sweep.get("x-values")
    if x_key == "epsilon":
        if x_values is not None:
            raise ConfigError("[sweep] x-values: only with x set to a run-config key (the "
                              "epsilon values are [sweep] epsilons)")
        return "epsilon", []
    if not isinstance(x_key, str) or x_key not in {**default_mapping(), **declared_keys()}:
        raise ConfigError(f"[sweep] x: {x_key!r} is not a run-config key")
    if x_key in _SET_BY_SWEEP:
        raise ConfigError(f"[sweep] x: {x_key} cannot be the x axis")
    if not isinstance(x_values, list) or not x_values or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in x_values):
        raise ConfigError(f"[sweep] x-values: expected a non-empty list of numbers for x = "
                          f"{x_key!r}")
    if len(set(x_values)) != len(x_values):
        raise ConfigError("[sweep] x-values: duplicate values")
    return x_key, sorted(x_values)


def _check_base_keys(base: dict[str, Any], algorithms: list[Any],
                     overridden: set[str] | frozenset[str] = frozenset()) -> None:
    """A [base] (or ``--set``) key must be read by the algorithm of at least one series (or be
    a core key): a key nobody reads is a typo."""
    read = set(default_mapping())
    for name in algorithms:
        if isinstance(name, str):
            try:
                read |= set(algorithm_params(name))
            except ConfigError:
                pass  # the unknown algorithm is reported with its series
    unread = sorted(set(base) - read)
    if unread:
        where = "--set" if set(unread) <= set(overridden) else "[base]"
        raise ConfigError(f"{where}: key(s) {unread} are read by none of the series' "
                          "algorithms (`fedpriv algorithms` lists each algorithm's keys)")


def _config(where: str, values: dict[str, Any]) -> RunConfig:
    try:
        return parse_config(values, strict=True)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


# ----- running -----------------------------------------------------------------------------
def _run_one(values: dict[str, Any], path: str) -> dict[str, Any]:
    """Worker: one in-process run, its operator report written atomically to ``path`` and its
    release beside it (as a Flower run's ServerApp writes them)."""
    from fedpriv.engine import run_in_process
    from fedpriv.outputs import write_outputs

    results = run_in_process(parse_config(values), log=lambda _: None)
    write_outputs(results, path)
    return results


def _run_flower(values: dict[str, Any], path: str,
                session: FlowerSession | None = None) -> dict[str, Any]:
    from fedpriv.launcher import run_flower

    config = parse_config(values)
    if run_flower(config, values, Path(path), keep_superlink=False, quiet=True,
                  session=session) != 0:
        raise RuntimeError(f"the Flower run for {path} failed")
    results: dict[str, Any] = json.loads(Path(path).read_text())
    return results


def run_sweep(spec: SweepSpec, out: Path, jobs: int = 1, engine: str = "inprocess",
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every run of the sweep (reusing finished ones); returns the table rows."""
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    results: dict[Run, dict[str, Any]] = {}
    todo: list[tuple[Run, Path]] = []
    for run in spec.runs:
        path = runs_dir / f"{run.slug}.json"
        previous = reusable(path, run.values)
        if previous is not None:
            results[run] = previous
        else:
            todo.append((run, path))
    aside = [path for _, path in todo if set_aside(path)]
    if aside:
        log(f"fedpriv sweep {spec.name}: {len(aside)} runs of an earlier config moved to "
            f"{runs_dir / 'replaced'} (never overwritten)")
    shares = sorted({run.series for run, _ in todo if parse_config(run.values).noise_shares})
    if engine == "flower" and shares:
        raise ConfigError(f"[sweep] engine: series {shares} run distributed or secure noise, "
                          "whose servers receive no exact metrics; run the sweep with --engine "
                          "inprocess (its simulator measures them on the nodes)")
    total = len(spec.runs)
    grid = "" if not spec.x_values else f"{len(spec.x_values)} values of {spec.x} x "
    log(f"fedpriv sweep {spec.name}: {total} runs ({len(spec.series)} series x {grid}"
        f"{len(spec.epsilons)} epsilons x {len(spec.seeds)} seeds; epsilon-free series run "
        f"once per seed), {len(results)} reused, {len(todo)} to run, engine {engine}, "
        f"{jobs} job(s)")
    started = time.perf_counter()
    done = len(results)

    def report(run: Run, res: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        elapsed = time.perf_counter() - started
        ran = done - (total - len(todo))
        eta = elapsed / ran * (total - done) if ran else 0.0
        eps = "   -  " if run.epsilon is None else f"{run.epsilon:6g}"
        at = "" if run.x is None else f" {spec.x}={run.x:g}"
        value = measured_metrics(res).get(spec.metric)
        shown = "missing" if value is None else f"{value:.4g}"
        log(f"[{done:>{len(str(total))}}/{total}] {run.series:<28} eps={eps}{at} "
            f"seed={run.seed}  {spec.metric} {shown}  ({res['wall_time_s']:.1f}s; elapsed "
            f"{_clock(elapsed)}, ETA {_clock(eta)})")
        if value is None:  # the table needs it from every run: stop now, not at the end
            raise ConfigError(f"[sweep] metric: {spec.metric!r} is not reported by "
                              f"{run.series!r}, which reports {sorted(measured_metrics(res))}; the "
                              "runs finished so far are kept and reused by the next sweep")

    if engine == "flower" and todo:
        from fedpriv.launcher import FlowerSession

        # one SuperLink and one Ray head for every run, stopped at the end (errors included)
        with FlowerSession() as session:
            for run, path in todo:
                results[run] = _run_flower(run.values, str(path), session)
                report(run, results[run])
    elif jobs <= 1 or len(todo) <= 1:
        for run, path in todo:
            results[run] = _run_one(run.values, str(path))
            report(run, results[run])
    else:
        # one BLAS thread per worker: the workers already use every core
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
        if allocator.wanted():  # fedpriv.allocator's settings, read by glibc as a worker starts
            os.environ.update(allocator.ENV)
        import multiprocessing

        with ProcessPoolExecutor(max_workers=jobs, initializer=signal.signal,
                                 initargs=(signal.SIGINT, signal.SIG_IGN),  # Ctrl-C: ours
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_run_one, run.values, str(path)): run for run, path in todo}
            try:
                for future in as_completed(futures):
                    run = futures[future]
                    results[run] = future.result()
                    report(run, results[run])
            except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the running runs stopped, not awaited
                from fedpriv.stopping import stop_started

                stop_started()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # the runs not started: dropped
                raise
    log(f"fedpriv sweep {spec.name}: finished in {_clock(time.perf_counter() - started)}")
    return summarize(spec, results)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


# ----- the table ---------------------------------------------------------------------------
_Group = tuple[str, float | None, float | None]  # a table row: (series, epsilon, x)


def _stats(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def summarize(spec: SweepSpec, results: dict[Run, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (series, epsilon[, x]): the metric's mean, sample std, min and max over seeds,
    then the mean of every other metric all the seeds report."""
    metric = spec.metric
    rows: list[dict[str, Any]] = []
    order = {s.get("label", s["algorithm"]): i for i, s in enumerate(spec.series)}
    groups: dict[_Group, list[tuple[Run, dict[str, Any]]]] = {}
    for run, res in results.items():
        groups.setdefault((run.series, run.epsilon, run.x), []).append((run, res))

    def key(item: tuple[_Group, list[tuple[Run, dict[str, Any]]]]) -> tuple[int, float, float]:
        (series, eps, x), _ = item
        return (order[series], -1.0 if eps is None else eps, -1.0 if x is None else x)

    for (series, eps, x), members in sorted(groups.items(), key=key):
        measured = [(run, measured_metrics(r)) for run, r in members]
        missing = [run.slug for run, m in measured if metric not in m]
        if missing:
            raise KeyError(f"metric {metric!r} is not reported by run(s) {missing}; they report "
                           f"{sorted(measured[0][1])}")
        stats = _stats([m[metric] for _, m in measured])
        spent = [r["privacy"]["epsilon"] for _, r in members]
        row: dict[str, Any] = {"series": series, "algorithm": members[0][0].algorithm,
                               "epsilon": eps}
        if x is not None:
            row[spec.x] = x
        row["seeds"] = len(members)
        row.update({f"{metric}_{k}": stats[k] for k in ("mean", "std", "min", "max")})
        others = set.intersection(*(set(m) for _, m in measured)) - {metric}
        for name in sorted(others):
            row[f"{name}_mean"] = sum(m[name] for _, m in measured) / len(members)
        # None: released without noise (not private); otherwise the accountant's epsilon
        row["epsilon_spent_max"] = None if any(s is None for s in spent) else max(spent)
        record = [r["privacy"].get("record_level") for _, r in members]
        if all(record):  # a record-level baseline: its epsilon per record
            row["record_epsilon_spent_max"] = max(r["epsilon"] for r in record if r)
        row["wall_time_s_mean"] = sum(r["wall_time_s"] for _, r in members) / len(members)
        rows.append(row)
    return rows


def write_table(rows: list[dict[str, Any]], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "table.csv", out / "table.json"
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in fields})
    json_path.write_text(json.dumps(rows, indent=2))
    return csv_path, json_path


def metric_label(metric: str) -> str:
    return {"population_mse": "population MSE", "transfer_risk": "transfer risk",
            "population_transfer_risk": "population transfer risk"}.get(
                metric, metric.replace("_", " "))


def markdown_table(rows: list[dict[str, Any]], spec: SweepSpec | None = None) -> str:
    metric = spec.metric if spec else METRIC
    x = spec.x if spec and spec.x != "epsilon" else None
    head = "| series | epsilon |" + (f" {x} |" if x else "")
    lines = [f"{head} {metric_label(metric)} (mean ± std) | min–max | seeds |",
             "|---|---|" + ("---|" if x else "") + "---|---|---|"]
    for r in rows:
        eps = "–" if r["epsilon"] is None else f"{r['epsilon']:g}"
        at = f" {r[x]:g} |" if x else ""
        lines.append(f"| {r['series']} | {eps} |{at} {r[f'{metric}_mean']:.3g} ± "
                     f"{r[f'{metric}_std']:.2g} | {r[f'{metric}_min']:.3g}–"
                     f"{r[f'{metric}_max']:.3g} | {r['seeds']} |")
    return "\n".join(lines)
