"""The same results to the last digit: a small run of every built-in algorithm (and a few paths
the defaults do not take) against the figures stored before the code was restructured
(``tests/golden/make_golden.py`` wrote them and says when to regenerate). The float results
(metrics, rounds, released state) may match instead one of the variants recorded for machines
whose float kernels differ (tests/golden/alternates.json); a deep run's (torch, float32) may
also be within float32 rounding of one (``make_golden.close``); config never varies, and
privacy only in the last bits of the accountant's floats (``make_golden.PRIVACY_RTOL``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
sys.path.insert(0, str(GOLDEN))

from make_golden import (  # noqa: E402
    FLOAT_PARTS,
    close,
    configs,
    float32,
    run,
    same_privacy,
)

STORED = json.loads((GOLDEN / "results.json").read_text())
ALTERNATES = json.loads((GOLDEN / "alternates.json").read_text()) if (
    GOLDEN / "alternates.json").exists() else {}


def test_every_builtin_algorithm_has_a_golden_run():
    from fedpriv.algorithms.catalogue import BUILTIN

    assert {cls.name for cls in BUILTIN} <= set(STORED)
    assert set(configs()) == set(STORED)


@pytest.mark.parametrize("name", sorted(STORED))
def test_same_results_as_stored(name, tmp_path):
    stored = STORED[name]
    assert configs()[name] == stored["values"]
    now = json.loads(json.dumps(run(stored["values"], tmp_path)))
    assert now["config"] == stored["config"], f"{name}: config changed"
    if not same_privacy(now["privacy"], stored["privacy"]):  # the last bits of an epsilon
        assert now["privacy"] == stored["privacy"], f"{name}: privacy changed"
    # the float results, to the last digit, of one of the machine classes they were stored for
    variants = [stored, *ALTERNATES.get(name, [])]
    if any(all(now[p] == v.get(p) for p in FLOAT_PARTS) for v in variants):
        return
    # a deep run: within float32 rounding of a variant (the state by its fingerprint)
    rounded = [p for p in FLOAT_PARTS if p != "state"]
    if float32(stored["values"]) and any(
            all(close(now[p], v[p]) for p in rounded) for v in variants if "fingerprint" in v):
        return
    for part in FLOAT_PARTS:
        assert now[part] == stored[part], f"{name}: {part} changed"


def test_a_deep_runs_tolerance_is_float32_rounding_not_a_change_of_results():
    from make_golden import DEEP_RTOL, fingerprint

    # the tolerance is the deep family's alone (by the algorithm's module, not its name)
    assert {n for n, v in STORED.items() if float32(v["values"])} == {
        n for n in STORED if n.startswith(("deep-", "fewshot-"))}

    stored = STORED["deep-fedrep"]
    # the machine-class differences seen (about 2e-7 relative) pass; a change of 1e-4 does not
    assert DEEP_RTOL == 1e-5
    nudged = {k: v * (1 + 2e-7) if isinstance(v, float) else v
              for k, v in stored["metrics"].items()}
    assert close(nudged, stored["metrics"])
    assert not close({**nudged, "accuracy": stored["metrics"]["accuracy"] + 1e-4},
                     stored["metrics"])
    assert not close({**stored["metrics"], "users_evaluated": 59.0}, stored["metrics"])
    # the released state by its fingerprint: float32 rounding passes, a shuffle or a shift not
    rng = __import__("numpy").random.default_rng(0)
    params = rng.normal(size=5000)
    base = fingerprint({"model": "mlp", "parameters": params.tolist()})
    rounded = params.astype("float32").astype("float64")
    assert close(fingerprint({"model": "mlp", "parameters": rounded.tolist()}), base)
    assert not close(fingerprint({"model": "mlp", "parameters": params[::-1].tolist()}), base)
    assert not close(fingerprint({"model": "mlp", "parameters": (params + 1e-3).tolist()}), base)
    assert not close(fingerprint({"model": "cnn", "parameters": params.tolist()}), base)
    assert not close(fingerprint({"model": "mlp", "parameters": params[:-1].tolist()}), base)
    moved = params.copy()
    moved[1234] += 0.02  # one parameter of 5,000: its block's sums show it
    assert not close(fingerprint({"model": "mlp", "parameters": moved.tolist()}), base)
    assert not close(fingerprint({"model": "mlp", "parameters": params.reshape(50, 100).tolist()}),
                     base)  # the shape is compared
    # non-finite floats, ints and lists that are not float arrays are compared exactly
    inf = float("inf")
    assert not close(inf, 0.5) and not close(-inf, -2.0) and close(inf, inf)
    assert not close({"loss": inf}, {"loss": 0.3}) and not close(float("nan"), 0.3)
    assert not close(fingerprint([1000000, 3]), fingerprint([1000005, 3]))
    assert not close(True, 1) and not close(1, 1.0)
    for odd in ([[1.0, 2.0], [3.0]], [{"a": 1.0}], [1, "a"], [None, 1.0], []):
        assert fingerprint(odd) == odd  # kept as they are
    assert close(fingerprint([[1.0, 2.0], [3.0]]), [[1.0, 2.0], [3.0 + 1e-9]])


def test_privacy_records_may_differ_in_the_last_bits_of_a_float_only():
    from make_golden import PRIVACY_RTOL

    stored = STORED["deep-dp-fedavg"]["privacy"]
    assert PRIVACY_RTOL == 1e-9
    for seen in (4e-16, 4e-12):  # the AMD EPYC's differences
        nudged = json.loads(json.dumps(stored), parse_float=lambda v, r=seen: float(v) * (1 + r))
        assert nudged != stored and same_privacy(nudged, stored)
    # relative for small floats too (no absolute tolerance): a delta moved by 1e-6 of itself
    assert not same_privacy({**stored, "delta": stored["delta"] * (1 + 1e-6)}, stored)
    assert not same_privacy(json.loads(json.dumps(stored), parse_float=lambda v: float(v) * (
        1 + 1e-7)), stored)
    assert not same_privacy({**stored, "epsilon": stored["epsilon"] * (1 + 1e-7)}, stored)
    assert not same_privacy({**stored, "accountant": "other"}, stored)
