"""The two files of a private Flower run: the release, and the operator report.

As with ``fedpriv run`` (docs/concepts/release-and-report.md): the **operator report** (at
``results_path``) holds everything the operator wants, exact and not private: per-round counts
(nodes sampled, answered, failed, rejected and why, users clipped), exact client metrics, timings,
the seed. The **release** (``<stem>.release.json`` beside it) holds what may leave the server:
the public plan, the privacy ledger and the epsilon after each release, the adaptive clip (a
post-processing of noisy counts) and the noisy private metrics. No exact metric, no count
computed from the users' data, no seed. The released model is what the strategy returns
(``Result.arrays``), a post-processing of the noisy means.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RELEASE_SUFFIX = ".release.json"
OPERATOR = ("fedpriv OPERATOR REPORT (Flower app): exact counts, exact client metrics, timings "
            "and the seed. NOT private; do not publish. What may leave the server is the "
            "release file beside it ({release}).")
RELEASE = ("fedpriv RELEASE (Flower app): what may leave the server: the public plan, the "
           "privacy ledger, the adaptive clip and the noisy private metrics; see `publishable`.")
DISCRETE = "discrete gaussian on a power-of-two grid (ChaCha20 keyed by the OS)"
RELEASE_ROW_KEYS = ("round", "epsilon_spent", "clip_norm", "private_metrics")


def release_path(results_path: str | os.PathLike[str]) -> Path:
    p = Path(results_path)
    return p.with_name(p.stem + RELEASE_SUFFIX)


def publishable(secure_noise: bool, ledger: list[dict[str, Any]]) -> tuple[bool, str]:
    """Whether the release may be published, and if not, why: only ``secure_noise`` draws
    publishable noise (exact discrete Gaussian noise on a grid from an OS-keyed ChaCha20 stream,
    ``fedpriv_flwr.grid``); seeded float64 noise can be regenerated from the seed the operator
    report keeps, and floating-point Gaussian samples leak through their gaps."""
    if ledger and not secure_noise:
        return False, ("seeded floating-point noise: the noise and the Poisson sample are drawn "
                       "from the seed the operator report records (anyone with it can "
                       "regenerate the noise), as float64 Gaussians. Rerun with "
                       "secure_noise=True (exact discrete Gaussian noise on a grid) to publish")
    return True, ""


def release_document(plan: Mapping[str, Any], strategy: str, secure_noise: bool,
                     ledger: list[dict[str, Any]], epsilon: float,
                     rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The release: a whitelist of the public plan, the ledger and each row's public keys."""
    ok, why = publishable(secure_noise, ledger)
    doc: dict[str, Any] = {"document": RELEASE, "publishable": ok}
    if not ok:
        doc["not_publishable_because"] = why
    doc.update({
        "strategy": strategy,
        "trusted": "the server (central DP: it sees each node's clipped update)",
        "plan": dict(plan),
        "privacy": {"epsilon": epsilon, "delta": plan["delta"],
                    "accountant": "rdp-int" if secure_noise else "pld",
                    "noise": "os-entropy" if secure_noise else "seeded",
                    "mechanism": (DISCRETE if secure_noise else "float64 gaussian"),
                    "ledger": ledger},
        "rounds": [{k: r[k] for k in RELEASE_ROW_KEYS if k in r} for r in rows],
    })
    return doc


def write_json(target: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` atomically (temporary file, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=float))
    os.replace(tmp, target)


def write_outputs(results_path: str | os.PathLike[str], operator: Mapping[str, Any],
                  release: Mapping[str, Any]) -> tuple[Path, Path]:
    """The operator report at ``results_path`` and the release beside it (absolute paths)."""
    target = Path(results_path).expanduser().resolve()
    released = release_path(target)
    write_json(released, release)
    write_json(target, {"document": OPERATOR.format(release=released.name), **operator})
    return target, released
