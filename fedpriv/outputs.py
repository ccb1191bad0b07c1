"""The two outputs of a run: the release, and the operator report.

The **operator report** (the results file at ``results-path``) is everything the operator of a
research simulation wants: exact metrics computed from the users' data, per-round counts (users
clipped, the secret size of a Poisson sample, rejected nodes), timings, the full config with its
seeds. It is not private and must not be published.

The **release** (``<results stem>.release.json``) is what may leave the server, built from the
operator report by a whitelist: the public config (without seeds or paths), the privacy ledger
and (epsilon, delta), the released model(s) (``server_state``: by the Algorithm contract a
post-processing of the noisy releases), the noisy private metrics when ``private-metrics`` is on,
and the epsilon spent after each step (a function of the public plan). Nothing else: no exact
metric, no count computed from user data, no seed.

A release is marked publishable only when its noise cannot be reproduced from anything the
operator keeps next to it: ``secure-noise = true`` draws it from OS entropy. A seeded run (the
default, for reproducible research) can regenerate its noise from the seed in the operator
report, so its release says it is not publishable, and why.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpriv.learning_curve import curve_path, curve_points, plot_curve

RELEASE_SUFFIX = ".release.json"
OPERATOR_DOCUMENT = ("fedpriv OPERATOR REPORT: exact metrics, per-round counts, timings and seeds "
                     "computed from the users' data. NOT private; do not publish. What may leave "
                     "the server is the release file next to it ({release}).")
RELEASE_DOCUMENT = ("fedpriv RELEASE: what may leave the server (public config, privacy ledger, "
                    "released model(s), noisy private metrics); see `publishable`.")



def public_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a config whose declaration says they may be published (``Param.public``):
    not the seeds (they regenerate seeded noise and, in a synthetic problem, the users' data)
    nor the paths of the operator's machine."""
    from fedpriv.config import CORE
    from fedpriv.configure import algorithm_params

    declared = {p.key: p for p in CORE.params}
    declared.update(algorithm_params(config["algorithm"]))
    return {k: v for k, v in config.items() if k in declared and declared[k].public}


def release_path(results_path: str | os.PathLike[str]) -> Path:
    """Where the release of a run whose operator report is at ``results_path`` goes."""
    p = Path(results_path)
    return p.with_name(p.stem + RELEASE_SUFFIX)


def run_files(results_path: str | os.PathLike[str]) -> tuple[Path, Path, Path]:
    """Every file a run writes: its operator report at ``results_path``, and beside it its
    release and (with ``eval-every``) its learning curve."""
    p = Path(results_path)
    return p, release_path(p), curve_path(p)


def publishable(report: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the release of this run may be published, and if not, why."""
    privacy = report["privacy"]
    if privacy["epsilon"] is None:
        return False, ("a non-private baseline: its sums were released without noise, so its "
                       "model is not private")
    if privacy["ledger"] and privacy["noise"] != "os-entropy":
        return False, ("the privacy noise is seeded (from seed / noise-seed, which the operator "
                       "report records): anyone with the seed can regenerate the noise and "
                       "subtract it. Rerun with secure-noise = true to publish")
    if any(e.get("sampling_rate", 1.0) < 1.0 for e in privacy["ledger"]):
        return False, ("the Poisson sample of users is drawn from the run seed (which the "
                       "operator report records), and the accounted epsilon assumes the sample "
                       "is secret; a release of a Poisson-sampled run is not publishable yet")
    return True, ""


def release_document(report: Mapping[str, Any]) -> dict[str, Any]:
    """The release of a run, from its operator report (a whitelist: see the module docstring)."""
    ok, why = publishable(report)
    doc: dict[str, Any] = {"document": RELEASE_DOCUMENT, "publishable": ok}
    if not ok:
        doc["not_publishable_because"] = why
    doc.update({
        "algorithm": report["algorithm"],
        "num_users": report["num_users"],
        "config": public_config(report["config"]),
        "privacy": report["privacy"],
        "released": report["server_state"],
        "private_metrics": {name: {k: m[k] for k in ("value", "clip", "noise_std", "users")}
                            for name, m in report.get("private_metrics", {}).items()},
        "steps": [{"step": r["step"], "epsilon_spent": r["epsilon_spent"]}
                  for r in report["rounds"] if "epsilon_spent" in r],
    })
    return doc


def write_outputs(report: Mapping[str, Any],
                  path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write the operator report to ``path`` and the release beside it, atomically; returns
    (operator report, release) as absolute paths. A run with ``eval-every`` also gets its
    learning curve beside the operator report (``fedpriv.learning_curve``: exact, operator
    only)."""
    target = Path(path).expanduser().resolve()
    released = release_path(target)
    operator = {"document": OPERATOR_DOCUMENT.format(release=released.name),
                **{k: v for k, v in report.items() if k != "document"}}
    _write_json(released, release_document(report))
    _write_json(target, operator)
    if plot_curve(report, curve_path(target)) is None:
        curve_path(target).unlink(missing_ok=True)  # never an older run's curve beside it
    return target, released


def output_lines(report_path: Path, release: Path, report: Mapping[str, Any]) -> list[str]:
    """What ``fedpriv run`` prints at the end: which file is which."""
    ok, why = publishable(report)
    state = "publishable" if ok else f"NOT publishable: {why}"
    lines = [f"fedpriv: operator report (exact, not private; do not publish): {report_path}",
             f"fedpriv: release (what may leave the server; {state}): {release}"]
    if curve_points(report):
        lines.append("fedpriv: learning curve (exact metrics, not private; do not publish): "
                     f"{curve_path(report_path)}")
    return lines


def _write_json(target: Path, data: Mapping[str, Any]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    text = json.dumps(data, indent=2, default=float)
    # the first line says what the file is: {"document": "...",
    tmp.write_text("{" + text[1:].lstrip() if text.startswith("{\n") else text)
    os.replace(tmp, target)
