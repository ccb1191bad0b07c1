"""Writes tests/golden/results.json: a small run of every built-in algorithm (in-process), its
metrics and its released state, to the last digit. ``tests/test_golden.py`` reruns the same
configs and compares; regenerate only when a change of results is intended (and say why).

    python tests/golden/make_golden.py
"""

from __future__ import annotations

import hashlib
import json
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
}


EXTRA = {  # paths the defaults do not take
    "private-fedrep+metrics": {"algorithm": "private-fedrep", "private-metrics": True,
                               "init": "pairs"},
    "deep-private-fedrep+no-cross-fit": {"algorithm": "deep-private-fedrep", "cross-fit": 0,
                                         "body-steps": 2, "clip-quantile": 0.0},
    "deep-dp-fedavg-ft+sampled": {"algorithm": "deep-dp-fedavg-ft", "users-per-round": 30,
                                  "eval-every": 1},
    "meta-nsgd+replace-one": {"algorithm": "meta-nsgd", "neighbouring-relation": "replace-one"},
}


def family(module: str) -> str:
    for name, part in (("deep", ".deep."), ("meta", ".meta."), ("exp-mech", ".exp_mech."),
                       ("personalization", ".personalization.")):
        if part in module:
            return name
    raise ValueError(module)


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


if __name__ == "__main__":
    import tempfile

    golden = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, values in configs().items():
            golden[name] = {"values": values, **run(values, Path(tmp))}
            print(name, golden[name]["metrics"])
    (HERE / "results.json").write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
