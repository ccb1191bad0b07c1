"""Writes tests/golden/results.json: a small run of every built-in algorithm (in-process), its
metrics and its released state, to the last digit. ``tests/test_golden.py`` reruns the same
configs and compares; regenerate only when a change of results is intended (and say why).
Machines whose float kernels differ (torch's CPU dispatch: the deep runs differ in the 7th
digit) reproduce their own results to the last digit: ``--alternate`` records this machine's
where only those differ (tests/golden/alternates.json, with the CPU they came from). A deep run
(torch, float32) also passes on a machine never recorded when every float of its metrics and
rounds, and its released state's ``fingerprint``, is within ``DEEP_RTOL`` of a stored variant
(``close``); the other families (numpy, float64) must match to the last digit.

    python tests/golden/make_golden.py               # rewrites results.json
    python tests/golden/make_golden.py --alternate   # adds this machine's float variants
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

# small settings per family; every other key is the algorithm's default
FAMILY = {
    "personalization": {"num-users": 300, "dim": 8, "rank": 2, "samples-per-user": 10,
                        "epsilon": 2.0, "rounds": 3, "test-samples-per-user": 5},
    "meta": {"num-users": 300, "rounds": 3, "epsilon": 2.0},
    "exp-mech": {"num-users": 300, "epsilon": 2.0},
    "deep": {"num-users": 60, "rounds": 2, "epsilon": 2.0},
}
SPECIAL = {  # algorithms whose small run needs more than the family's settings
    "priv-altmin": {"rounds": 2, "user-groups": 2},
    "altmin": {"rounds": 2, "user-groups": 2},
    **{name: {"dim": 6, "rank": 1, "samples-per-user": 4, "jl-dim": 4, "cover-radius": 0.6}
       for name in ("jl-exp", "jl-exp-nonprivate")},
    **{name: {"hidden-sizes": "16", "queries": 3}  # few-shot tasks of digits' images
       for name in ("fewshot-meta-nsgd", "fewshot-meta-sgd", "fewshot-private-meta-cluster",
                    "fewshot-meta-cluster", "fewshot-dp-ftmrl", "fewshot-ftmrl",
                    "fewshot-local", "fewshot-dp-reptile")},
    "fewshot-private-meta-cluster": {"hidden-sizes": "16", "queries": 3, "meta-models": 2},
}


EXTRA = {  # paths the defaults do not take
    "private-fedrep+metrics": {"algorithm": "private-fedrep", "private-metrics": True,
                               "init": "pairs"},
    "deep-private-fedrep+no-cross-fit": {"algorithm": "deep-private-fedrep", "cross-fit": 0,
                                         "body-steps": 2, "clip-quantile": 0.0},
    "deep-dp-fedavg-ft+sampled": {"algorithm": "deep-dp-fedavg-ft", "users-per-round": 30,
                                  "eval-every": 1},
    # one local step (the default before 2026-11-28: 5 steps of 0.05): ghost clipping of the
    # whole model
    "deep-dp-fedavg-ft+one-step": {"algorithm": "deep-dp-fedavg-ft", "body-steps": 1,
                                   "local-lr": 0.1},
    "meta-nsgd+replace-one": {"algorithm": "meta-nsgd", "neighbouring-relation": "replace-one"},
    "fewshot-meta-nsgd+protomaml": {"algorithm": "fewshot-meta-nsgd", "adapt-steps": 2,
                                    "meta-gradient": "first-order"},
}


def family(module: str) -> str:
    for name, part in (("deep", ".deep."), ("meta", ".meta."), ("exp-mech", ".exp_mech."),
                       ("personalization", ".personalization.")):
        if part in module:
            return name
    raise ValueError(module)


def float32(values: dict) -> bool:
    """Whether ``values``' algorithm is of the deep family (torch, float32: ``close`` applies)."""
    from fedpriv.algorithms.catalogue import BUILTIN

    return any(cls.name == values["algorithm"] and family(cls.__module__) == "deep"
               for cls in BUILTIN)


def configs() -> dict[str, dict]:
    from fedpriv.algorithms.catalogue import BUILTIN

    out = {}
    for cls in BUILTIN:
        values = {"algorithm": cls.name, "seed": 3, "checkpoint": False,
                  **FAMILY[family(cls.__module__)], **SPECIAL.get(cls.name, {})}
        out[cls.name] = values
    for name, extra in EXTRA.items():
        base = dict(out[extra["algorithm"]])
        out[name] = {**base, **extra}
    return out


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def run(values: dict, tmp: Path) -> dict:
    from fedpriv.configure import parse_config
    from fedpriv.engine import run_in_process

    config = parse_config({**values, "results-path": str(tmp / "r.json")})
    results = run_in_process(config, log=lambda _: None)
    return {"metrics": results["metrics"], "privacy": results["privacy"],
            "rounds": untimed(results["rounds"]), "state": digest(results["server_state"]),
            "fingerprint": fingerprint(results["server_state"]),
            "config": {k: v for k, v in results["config"].items()
                       if not k.endswith("-path")}}


def untimed(value):
    """``value`` without wall-clock figures (the only part of a run that may differ)."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items()
                if "time" not in k and k not in ("seconds", "wall_s")}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


FLOAT_PARTS = ("metrics", "rounds", "state", "fingerprint")  # what float kernels may change
PRIVACY_RTOL = 1e-9
"""The privacy record's floats (the accountant's epsilons) may differ in their last bits between
CPU classes (libm and the FFT of the accountant's numpy and scipy: 4e-16 to 4e-12 relative seen
between the Intel machines results.json was written on and an AMD EPYC); every other entry, and any
change of a noise multiplier or a composition, is compared far tighter than a change would
move it."""


def same_privacy(now, stored) -> bool:
    """Whether two runs' privacy records agree: ints, strings and structure exactly, floats
    within ``PRIVACY_RTOL``."""
    return close(now, stored, rtol=PRIVACY_RTOL, abs_tol=0.0)

DEEP_RTOL = 1e-5
"""How far a deep run's floats may be from a stored variant's, relative: torch's float32
kernels differ between machine classes by about 2e-7 relative (measured: the recorded
alternates), a change of results by far more."""


BLOCK = 1000  # a state's floats summed in blocks of this many: a local change shows


def _floats(value) -> bool:
    """Whether ``value`` is a rectangular nest of lists of numbers (not bools) holding at least
    one float: the arrays of a released state."""
    import numpy as np

    leaves = []

    def walk(v) -> bool:
        if isinstance(v, list):
            return all(walk(x) for x in v)
        leaves.append(v)
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not walk(value) or not any(isinstance(v, float) for v in leaves):
        return False
    try:
        np.asarray(value, dtype=np.float64)
    except ValueError:  # ragged
        return False
    return True


def fingerprint(value):
    """``value`` (a released state) with each array of floats replaced by its shape and, per
    block of ``BLOCK`` entries, its sum, sum of absolute values, sum of squares and a sum
    weighted by ``i mod 7 - 3`` (a shuffle within a block changes it): what ``close`` compares
    where the digest differs by float rounding. Everything else (strings, ints, lists of them)
    is kept as it is, and compared exactly."""
    if isinstance(value, dict):
        return {k: fingerprint(v) for k, v in value.items()}
    if isinstance(value, list) and _floats(value):
        import numpy as np

        array = np.asarray(value, dtype=np.float64)
        flat = array.ravel()
        blocks = [flat[i:i + BLOCK] for i in range(0, flat.size, BLOCK)]
        weights = np.arange(BLOCK) % 7 - 3.0
        return {"shape": list(array.shape),
                "blocks": [{"sum": float(b.sum()), "l1": float(np.abs(b).sum()),
                            "sumsq": float(b @ b), "weighted": float(b @ weights[:b.size])}
                           for b in blocks]}
    return value


def _block_close(now, stored, rtol: float) -> bool:
    if not isinstance(now, dict) or set(now) != set(stored):
        return False
    if not all(isinstance(now[k], float) and math.isfinite(now[k]) for k in now):
        return False
    scale = max(stored["l1"], 1e-300)
    return (abs(now["sum"] - stored["sum"]) <= rtol * scale
            and abs(now["l1"] - stored["l1"]) <= rtol * scale
            and abs(now["weighted"] - stored["weighted"]) <= 3 * rtol * scale
            and abs(now["sumsq"] - stored["sumsq"]) <= 2 * rtol * max(stored["sumsq"], 1e-300))


def close(now, stored, rtol: float = DEEP_RTOL, abs_tol: float = 1e-12) -> bool:
    """Whether ``now`` equals ``stored`` but for floats within ``rtol`` (relative; a state's
    block sums relative to the block's sum of absolute values) or ``abs_tol``. Ints, bools,
    strings, shapes and non-finite floats must be equal."""
    if isinstance(stored, dict) and set(stored) == {"shape", "blocks"}:
        return (isinstance(now, dict) and set(now) == set(stored)
                and now["shape"] == stored["shape"]
                and len(now["blocks"]) == len(stored["blocks"])
                and all(_block_close(a, b, rtol) for a, b in zip(now["blocks"],
                                                                  stored["blocks"], strict=True)))
    if isinstance(stored, dict):
        return isinstance(now, dict) and now.keys() == stored.keys() and all(
            close(now[k], stored[k], rtol, abs_tol) for k in stored)
    if isinstance(stored, list):
        return isinstance(now, list) and len(now) == len(stored) and all(
            close(a, b, rtol, abs_tol) for a, b in zip(now, stored, strict=True))
    if isinstance(stored, float) and isinstance(now, float):
        if not (math.isfinite(now) and math.isfinite(stored)):
            return now == stored or (math.isnan(now) and math.isnan(stored))
        return math.isclose(now, stored, rel_tol=rtol, abs_tol=abs_tol)
    return type(now) is type(stored) and now == stored


def machine() -> str:
    """The CPU and torch's kernel dispatch of this machine (recorded with an alternate)."""
    import platform

    try:
        import torch

        kernels = f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"
    except ImportError:
        kernels = "no torch"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                  .splitlines() if line.startswith("model name")), platform.processor())
    return f"{model}; {kernels}"


if __name__ == "__main__":
    import tempfile

    golden = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, values in configs().items():
            golden[name] = {"values": values, **run(values, Path(tmp))}
            print(name, golden[name]["metrics"])
    if "--alternate" not in sys.argv:
        (HERE / "results.json").write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        sys.exit(0)
    # --alternate: keep results.json; record this machine's float results where only they
    # differ (same values and config, privacy within PRIVACY_RTOL: a code change is never an
    # alternate)
    stored = json.loads((HERE / "results.json").read_text())
    path = HERE / "alternates.json"
    alternates = json.loads(path.read_text()) if path.exists() else {}
    for name, now in golden.items():
        old = stored[name]
        if any(now[p] != old[p] for p in ("values", "config")) or not same_privacy(
                now["privacy"], old["privacy"]):
            sys.exit(f"{name}: not a machine's float difference (values, config or privacy "
                     "changed): regenerate results.json instead, and say why")
        known = [old] + alternates.get(name, [])
        if not any(all(now[p] == k.get(p) for p in FLOAT_PARTS) for k in known):
            alternates.setdefault(name, []).append(
                {"machine": machine(), **{p: now[p] for p in FLOAT_PARTS}})
            print(f"{name}: alternate recorded")
    path.write_text(json.dumps(alternates, indent=1, sort_keys=True) + "\n")
