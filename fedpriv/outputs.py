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
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpriv.checkpoint import SUFFIX as CHECKPOINT_SUFFIX
from fedpriv.learning_curve import curve_path, curve_points, plot_curve, run_stem
from fedpriv.stopping import TOKEN_ENV

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
    """Where the release of a run whose operator report is at ``results_path`` goes:
    ``<name>.release.json`` beside ``<name>.operator.json`` (or ``<name>.json``)."""
    stem = run_stem(results_path)
    return stem.with_name(stem.name + RELEASE_SUFFIX)


def run_files(results_path: str | os.PathLike[str]) -> tuple[Path, Path, Path]:
    """Every file a run writes: its operator report at ``results_path``, and beside it its
    release and (with ``eval-every``) its learning curve."""
    p = Path(results_path)
    return p, release_path(p), curve_path(p)


def publishable(report: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the release of this run may be published, and if not, why."""
    privacy = report["privacy"]
    if privacy["epsilon"] is None and privacy.get("record_level"):
        return False, ("record-level DP only: each record of a task is protected, a task's "
                       "whole data (the user) is not")
    if privacy["epsilon"] is None:
        return False, ("non-private baseline: its sums were released without noise, so its "
                       "model is not private")
    if privacy["ledger"] and privacy["noise"] != "os-entropy":
        return False, ("seeded noise — rerun with secure-noise = true to publish: the privacy "
                       "noise is drawn from seed / noise-seed, which the operator report "
                       "records, so anyone with the seed can regenerate the noise and subtract "
                       "it")
    if any(e.get("sampling_rate", 1.0) < 1.0 for e in privacy["ledger"]):
        return False, ("seeded Poisson sample: the sample of users is drawn from the run seed "
                       "(which the operator report records), and the accounted epsilon assumes "
                       "the sample is secret; a release of a Poisson-sampled run is not "
                       "publishable yet")
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
    only).

    Never over another run's files: where ``path`` holds a run's files already, or another
    live run claimed it (``claim``), the outputs go to the first free numbered name
    (``<name>-2.operator.json``, ...), and a line on stderr says so."""
    target = Path(path).expanduser().resolve()
    try:
        mine = claim(target)
    except OutputTaken:
        target, mine = claim_free(target), True
        print(f"fedpriv: {path} holds another run's results; this run's go to {target}",
              file=sys.stderr, flush=True)
    try:
        return _write_outputs(report, target)
    finally:
        if mine:
            unclaim(target)


def _write_outputs(report: Mapping[str, Any], target: Path) -> tuple[Path, Path]:
    released = release_path(target)
    operator = {"document": OPERATOR_DOCUMENT.format(release=released.name),
                **{k: v for k, v in report.items() if k != "document"}}
    _write_json(released, release_document(report))
    _write_json(target, operator)
    if plot_curve(report, curve_path(target)) is None:
        curve_path(target).unlink(missing_ok=True)  # never an older run's curve beside it
    return target, released


def output_lines(report_path: Path, release: Path, report: Mapping[str, Any]) -> list[str]:
    """What ``fedpriv run`` prints at the end: which file is which. A release that is not
    publishable says why in a few words (the head of ``publishable``'s reason, before its first
    colon); the whole reason is in the release's ``not_publishable_because``."""
    ok, why = publishable(report)
    state = "publishable" if ok else f"NOT publishable: {why.split(':', 1)[0]}"
    lines = [f"fedpriv: operator report (exact, not private; do not publish): {report_path}",
             f"fedpriv: release (public config, ledger, model; {state}): {release}"]
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


# ----- claims: no run writes over another run's results ---------------------------------------
class OutputTaken(ValueError):
    """A run's output names are taken: its files exist, or a live run claimed them."""


def _claim_file(path: Path) -> Path:
    stem = run_stem(path)
    return stem.with_name(f".{stem.name}.claim")


def _claimant(path: Path) -> tuple[int, str] | None:
    """(pid, token) of the live run that claimed ``path``'s names, or None."""
    try:
        pid, token = _claim_file(path).read_text().split()
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return None  # no claim, an unreadable one, or its run is gone: a stale claim
    return int(pid), token


def claim(path: str | os.PathLike[str], replace: bool = False) -> bool:
    """Claim the output names of the run whose operator report is ``path``, atomically
    (``O_EXCL``): True if this call made the claim, False if this command's run (its
    ``FEDPRIV_RUN_TOKEN``: ``fedpriv run`` claims before Flower's ServerApp writes) holds it.
    Raises ``OutputTaken`` where a run's files are there already (unless ``replace``) or
    another live run holds the claim. A claim whose run is gone (killed) is taken over."""
    target = Path(path)
    token = os.environ.get(TOKEN_ENV, "-")
    holder = _claimant(target)
    if holder is not None and (holder[0] == os.getpid() or holder[1] == token != "-"):
        return False
    if holder is not None:
        raise OutputTaken(f"{target}: another run (pid {holder[0]}) is writing these results")
    existing = [f for f in run_files(target) if f.exists()]
    if existing and not replace:
        raise OutputTaken(f"{existing[0]} holds an earlier run's results")
    marker = _claim_file(target)
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{os.getpid()} {token}\n")
    try:
        for _ in range(2):
            try:
                os.link(tmp, marker)  # created with its content, or not at all
                break
            except FileExistsError:
                if _claimant(target) is not None:
                    raise OutputTaken(f"{target}: another run is writing these results"
                                      ) from None
                marker.unlink(missing_ok=True)  # a claim whose run is gone: stale
        else:
            raise OutputTaken(f"{target}: another run is writing these results")
    finally:
        tmp.unlink(missing_ok=True)
    return True


def claim_free(path: str | os.PathLike[str]) -> Path:
    """Claim ``path``, or the first of ``<name>-2``, ``<name>-3``, ... that no run has written
    or claimed; returns the claimed operator report path."""
    p = Path(path)
    stem = run_stem(p)
    suffix = p.name[len(stem.name):]
    for n in range(1, 10_000):
        candidate = p if n == 1 else stem.with_name(f"{stem.name}-{n}{suffix}")
        if candidate.with_suffix(CHECKPOINT_SUFFIX).exists():
            continue  # an interrupted run's: it resumes to its own name
        try:
            if claim(candidate):
                return candidate
        except OutputTaken:
            continue
    raise OutputTaken(f"{p} and 9,999 numbered variants are taken; name the results")


def unclaim(path: str | os.PathLike[str]) -> None:
    """Give up this process's claim on ``path``'s names (its files, if written, stay)."""
    holder = _claimant(Path(path))
    if holder is None or holder[0] == os.getpid():
        _claim_file(Path(path)).unlink(missing_ok=True)


def claim_folder(folder: Path, finished: str | None, named: bool, replace: bool = False) -> Path:
    """Claim an output folder (a sweep's, a tuning's) for this command, atomically; returns
    the folder claimed (``unclaim(folder / FOLDER_CLAIM)`` gives it up). A folder another live
    command claimed is refused where the user ``named`` it, else the next of ``<folder>-2``,
    ``-3``, ... is taken; so is one holding an earlier command's ``finished`` file (None: the
    folder's files are reused, never rewritten: a sweep's runs), unless ``replace``."""
    for n in range(1, 10_000):
        candidate = folder if n == 1 else folder.with_name(f"{folder.name}-{n}")
        try:
            if finished is not None and (candidate / finished).exists() and not replace:
                raise OutputTaken(f"{candidate} holds an earlier run's results "
                                  f"({finished})")
            claim(candidate / FOLDER_CLAIM)
            return candidate
        except OutputTaken:
            if named:
                raise
    raise OutputTaken(f"{folder} and 9,999 numbered variants are taken; name the folder")


FOLDER_CLAIM = "folder.json"
"""The name a folder's claim is made for (``claim``): ``.folder.claim`` in the folder."""
