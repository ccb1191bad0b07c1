"""``fedpriv tune``: run the candidates, select the best by its private validation score, and
write what the operator keeps and what may be released.

Order of work: the budget is calibrated (``fedpriv.tuning.budget``) and every point of the space
parsed before the first candidate runs. Random stopping then draws K from its law and K
candidates from the space (uniformly, with replacement: each candidate is an independent run of
"draw a configuration, train, release the validation score"); compose-all runs every grid point
once, or ``candidates`` draws. Every candidate gets its own noise seed from the tuning's
generator (or OS entropy with ``secure-noise``), trains on the same users (the run ``seed``
fixes the data), and runs in-process or through Flower (one SuperLink and one Ray instance for
all of them). After each run its ledger is checked against the releases the budget accounted.

Outputs, under ``--out`` (default ``results/tune/<name>``):

* ``tuning-report.json`` and ``candidates.csv`` (operator only): K, every candidate with its
  noisy score, exact clipped score and exact metrics, every candidate's ledger, the budget.
  Under random stopping the bound needs the other candidates and K to stay secret.
* ``winner.json``: the selected candidate's results file, its ``privacy`` saying that tuning is
  included, how, and the tuning's total (epsilon, delta); ``winner.release.json`` beside it is
  its release (``fedpriv.outputs``), which holds the winner alone.
* ``winner.toml`` (operator only: it holds the seeds): the winner's run config; ``fedpriv run
  winner.toml`` reruns it. A seeded tuning's rerun reproduces the same release; with
  ``secure-noise`` (or any fresh noise) a rerun is a new release that spends its own
  per-candidate budget on top of the tuning's.

Files of an earlier tuning in the same folder are removed first, so no stale winner is left next
to a new report. With a Poisson number of candidates K may be 0: nothing runs, nothing is
released, and ``winner`` is null in the report.
"""

from __future__ import annotations

import csv
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpriv.config_files import toml_value
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process, write_results
from fedpriv.outputs import run_files, write_outputs
from fedpriv.privacy.accounting import EventKey
from fedpriv.tuning.budget import Budget, calibrate_tuning
from fedpriv.tuning.spec import TuneSpec

if TYPE_CHECKING:
    from fedpriv.launcher import FlowerSession

_NOISE_SEEDS = 2**31 - 1


def draw_candidates(spec: TuneSpec) -> tuple[list[int], list[int]]:
    """(point index, noise seed) of every candidate, from the tuning seed: K and the draws for
    random stopping, the grid (or ``candidates`` draws) for compose-all."""
    rng = spec.draws()
    if spec.method == "random-stopping":
        count = spec.law.sample(rng)
    else:
        count = spec.candidates
    if spec.method == "compose-all" and spec.search == "grid":
        points = list(range(len(spec.points)))
    else:
        points = [int(i) for i in rng.integers(len(spec.points), size=count)]
    seeds = [int(s) for s in rng.integers(_NOISE_SEEDS, size=len(points))]
    return points, seeds


def run_tuning(spec: TuneSpec, out: Path, engine: str = "inprocess",
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the whole tuning; returns the operator report (also written under ``out``)."""
    points, seeds = draw_candidates(spec)
    composed = points if spec.method == "compose-all" else ()
    budget = calibrate_tuning(spec, composed)
    log(plan_line(spec, budget))
    _clear(out)
    cand_dir = out / "candidates"
    cand_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    ledgers: list[dict[str, Any]] = []
    started = time.perf_counter()

    def one(index: int, point_index: int, seed: int,
            session: FlowerSession | None = None) -> None:
        point = spec.points[point_index]
        values = spec.candidate_values(point, budget.candidate_epsilon, seed)
        path = cand_dir / f"candidate-{index:03d}.json"
        values["results-path"] = str(path)
        results = _run(values, path, engine, session)
        _check_ledger(results, budget.counts[point_index], index)
        score = results["private_metrics"][spec.score]
        rows.append({"candidate": index, **point, "score": score["value"],
                     "exact_clipped_score": score["exact_clipped"],
                     **{k: v for k, v in results["metrics"].items()},
                     "wall_time_s": results["wall_time_s"]})
        ledgers.extend({"candidate": index, **e} for e in results["privacy"]["ledger"])
        best = select(rows, spec.maximize)
        where = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in point.items())
        log(f"[{index + 1}/{len(points)}] {where}: private {spec.score} {score['value']:.4g} "
            f"({results['wall_time_s']:.1f}s; elapsed {time.perf_counter() - started:.0f}s; "
            f"best so far #{best['candidate']})")

    if engine == "flower" and points:
        from fedpriv.launcher import FlowerSession

        with FlowerSession() as session:  # one SuperLink and one Ray head for every candidate
            for index, (p, s) in enumerate(zip(points, seeds, strict=True)):
                one(index, p, s, session)
    else:
        for index, (p, s) in enumerate(zip(points, seeds, strict=True)):
            one(index, p, s)
    return _write(spec, out, budget, rows, ledgers, points, seeds,
                  time.perf_counter() - started, log)


def plan_line(spec: TuneSpec, budget: Budget) -> str:
    how = (f"random stopping (Papernot & Steinke 2022), K ~ {spec.law.describe()}"
           if spec.method == "random-stopping" else
           f"every candidate run once and composed ({budget.composed} candidates)")
    return (f"fedpriv tune {spec.name}: {len(spec.points)} points over {list(spec.space)}; "
            f"{how}; each candidate at (epsilon {budget.candidate_epsilon:.4g}, delta "
            f"{spec.delta:g}); the whole tuning (epsilon {budget.total_epsilon:.4g} <= "
            f"{spec.epsilon:g}, delta {spec.delta:g})")


def ranking(maximize: bool) -> Callable[[dict[str, Any]], float]:
    """Sort key of candidate rows, best first, by the noisy score."""
    return (lambda r: -r["score"]) if maximize else (lambda r: r["score"])


def select(rows: list[dict[str, Any]], maximize: bool) -> dict[str, Any]:
    """The best row by its noisy score (the first of equals)."""
    return min(rows, key=ranking(maximize))


_OUTPUTS = ("tuning-report.json", "candidates.csv", "winner.toml")
_RUNS = ("winner.json", "rerun.json")  # with each, the files ``outputs.run_files`` names


def _clear(out: Path) -> None:
    """Remove what an earlier tuning left in ``out`` (never anything else)."""
    for name in _OUTPUTS:
        (out / name).unlink(missing_ok=True)
    for name in _RUNS:
        for path in run_files(out / name):
            path.unlink(missing_ok=True)
    for pattern in ("candidate-*.json", "candidate-*.png"):
        for old in (out / "candidates").glob(pattern):
            old.unlink()


def _run(values: dict[str, Any], path: Path, engine: str,
         session: FlowerSession | None) -> dict[str, Any]:
    config = parse_config(values, strict=True)
    if engine != "flower":
        results = run_in_process(config, log=lambda _: None)
        write_results(results, path)
        return results
    from fedpriv.launcher import run_flower

    if run_flower(config, values, path, keep_superlink=False, quiet=True,
                  session=session) != 0:
        raise RuntimeError(f"the Flower run of {path.name} failed")
    for beside in run_files(path)[1:]:  # a candidate's own release (and curve) is not kept:
        beside.unlink(missing_ok=True)  # the in-process candidates write the report alone
    flower_results: dict[str, Any] = json.loads(path.read_text())
    return flower_results


def _check_ledger(results: dict[str, Any], accounted: dict[EventKey, int], index: int) -> None:
    """The candidate released exactly what the tuning's budget accounted for, per user: the
    releases every user is in, plus those of each disjoint user group (as the accountant
    composes them)."""
    common: Counter[EventKey] = Counter()
    groups: dict[int | None, Counter[EventKey]] = {}  # None: no groups (every user)
    for e in results["privacy"]["ledger"]:
        key = (float(e["noise_multiplier"]), float(e.get("sampling_rate", 1.0)))
        members = e.get("user_groups") or ([] if e.get("user_group") is None
                                           else [e["user_group"]])
        if not members:
            common[key] += 1
        for g in members:
            groups.setdefault(int(g), Counter())[key] += 1
    for g, own in (groups or {None: Counter()}).items():
        ran = dict(common + own)
        if ran != dict(accounted):
            where = "" if g is None else f" (a user of group {g})"
            raise RuntimeError(f"candidate {index}: its releases{where} {ran} differ from the "
                               f"plan the tuning accounted {accounted}")


def _write(spec: TuneSpec, out: Path, budget: Budget, rows: list[dict[str, Any]],
           ledgers: list[dict[str, Any]], points: list[int], seeds: list[int],
           wall: float, log: Callable[[str], None]) -> dict[str, Any]:
    tuning = privacy_of_tuning(spec, budget)
    report: dict[str, Any] = {
        "document": "fedpriv TUNING OPERATOR REPORT: every candidate, its exact metrics and "
                    "the number of candidates. NOT private; do not publish (the selection's "
                    "privacy assumes the candidates that were not selected, and their number, "
                    "stay secret). What may leave is winner.release.json.",
        "name": spec.name, "tuning": tuning, "space": {k: list(v) for k, v in spec.space.items()},
        "candidates_run": len(rows), "candidates": rows, "wall_time_s": wall,
        "ledger": ledgers + [{"release": "selection", "epsilon": budget.total_epsilon,
                              "delta": spec.delta, "mechanism": tuning["method"],
                              "rdp_order": budget.order}],
        "winner": None,
    }
    if rows:
        best = select(rows, spec.maximize)
        index = best["candidate"]
        winner = json.loads((out / "candidates" / f"candidate-{index:03d}.json").read_text())
        winner.pop("document", None)
        # the whole tuning's (epsilon, delta); the winner's own run spent candidate_epsilon
        winner["privacy"] = {**winner["privacy"], "epsilon": budget.total_epsilon,
                             "delta": spec.delta, "target_epsilon": spec.epsilon,
                             "max_epsilon": spec.epsilon, "tuning": tuning,
                             "candidate_epsilon": winner["privacy"]["epsilon"]}
        report_path, release = write_outputs(winner, out / "winner.json")
        values = {**spec.candidate_values(spec.points[points[index]],
                                          budget.candidate_epsilon, seeds[index]),
                  "results-path": str(out / "rerun.json")}
        (out / "winner.toml").write_text(
            f"# fedpriv tune {spec.name}: the selected candidate (by its private {spec.score}).\n"
            "# OPERATOR ONLY: it holds the seeds. A rerun with fresh noise is a new release.\n"
            + "".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
        report["winner"] = {"candidate": index, "point": spec.points[points[index]],
                            "report": str(report_path), "release": str(release),
                            "rerun": f"fedpriv run {out / 'winner.toml'}"}
    _write_csv(rows, out / "candidates.csv")
    (out / "tuning-report.json").write_text(json.dumps(report, indent=2, default=float))
    return report


def privacy_of_tuning(spec: TuneSpec, budget: Budget) -> dict[str, Any]:
    """What a tuned run's ``privacy`` says about the tuning (public: fixed before it ran)."""
    doc: dict[str, Any] = {
        "included": True,
        "epsilon": budget.total_epsilon, "delta": spec.delta, "target_epsilon": spec.epsilon,
        "candidate_target_epsilon": budget.candidate_epsilon,
        "score": f"private_{spec.score} (noisy mean of the users' clipped validation losses, "
                 "one more release in each candidate's plan)",
        "search_space": {k: list(v) for k, v in spec.space.items()},
    }
    if spec.method == "random-stopping":
        doc.update({
            "method": "random stopping (Papernot & Steinke, ICLR 2022): K candidates drawn "
                      "from the space, only the best released; K and the others stay secret",
            "candidates": spec.law.describe(),
            "accounting": "each candidate's RDP curve from dp-accounting's RDP accountant (the "
                          "maximum over the space's plans), Papernot & Steinke's bound, "
                          "converted to (epsilon, delta)",
            "rdp_order": budget.order,
        })
    else:
        doc.update({
            "method": "every candidate run once, all releases composed",
            "candidates": budget.composed,
            "accounting": "dp-accounting's PLD accountant over every candidate's releases",
        })
    return doc


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    fields: list[str] = []
    for r in rows:
        fields.extend(k for k in r if k not in fields)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


# the family's headline metric, exact (operator only), shown in the table: the linear MSE, a deep
# model's test accuracy, a classifier's, a meta-learner's transfer risk
HEADLINE_METRICS = ("population_mse", "accuracy", "test_accuracy", "transfer_risk")


def table_lines(report: dict[str, Any], score: str, maximize: bool = False,
                limit: int = 40) -> list[str]:
    """The candidates as a Markdown table (best first)."""
    rows = sorted(report["candidates"], key=ranking(maximize))
    keys = list(report["space"])
    shown = [m for m in HEADLINE_METRICS if any(m in r for r in rows)][:1]
    head = ["#", *keys, f"private {score}", *(f"{m} (exact)" for m in shown)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows[:limit]:
        cells = [str(r["candidate"]), *(f"{r[k]:g}" if isinstance(r[k], float) else str(r[k])
                                        for k in keys),
                 f"{r['score']:.4g}", *(f"{r.get(m, float('nan')):.4g}" for m in shown)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines

