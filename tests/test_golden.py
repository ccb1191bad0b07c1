"""The same results to the last digit: a small run of every built-in algorithm (and a few paths
the defaults do not take) against the figures stored before the code was restructured
(``tests/golden/make_golden.py`` wrote them and says when to regenerate). The float results
(metrics, rounds, released state) may match instead one of the variants recorded for machines
whose float kernels differ (tests/golden/alternates.json); config and privacy never vary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
sys.path.insert(0, str(GOLDEN))

from make_golden import FLOAT_PARTS, configs, run  # noqa: E402

STORED = json.loads((GOLDEN / "results.json").read_text())
ALTERNATES = json.loads((GOLDEN / "alternates.json").read_text()) if (
    GOLDEN / "alternates.json").exists() else {}


def test_every_builtin_algorithm_has_a_golden_run():
    from fedpriv.algorithms.catalogue import BUILTIN

    assert {cls.name for cls in BUILTIN} <= set(STORED)
    assert set(configs()) == set(STORED)


@pytest.mark.parametrize("name", sorted(STORED))
def test_same_results_to_the_last_digit(name, tmp_path):
    stored = STORED[name]
    assert configs()[name] == stored["values"]
    now = json.loads(json.dumps(run(stored["values"], tmp_path)))
    for part in ("config", "privacy"):
        assert now[part] == stored[part], f"{name}: {part} changed"
    # the float results, to the last digit, of one of the machine classes they were stored for
    variants = [stored, *ALTERNATES.get(name, [])]
    if not any(all(now[p] == v[p] for p in FLOAT_PARTS) for v in variants):
        for part in FLOAT_PARTS:
            assert now[part] == stored[part], f"{name}: {part} changed"
