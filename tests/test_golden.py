"""The same results to the last digit: a small run of every built-in algorithm (and a few paths
the defaults do not take) against the figures stored before the code was restructured
(``tests/golden/make_golden.py`` wrote them and says when to regenerate)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
sys.path.insert(0, str(GOLDEN))

from make_golden import configs, run  # noqa: E402

STORED = json.loads((GOLDEN / "results.json").read_text())


def test_every_builtin_algorithm_has_a_golden_run():
    from fedpriv.algorithms.catalogue import BUILTIN

    assert {cls.name for cls in BUILTIN} <= set(STORED)
    assert set(configs()) == set(STORED)


@pytest.mark.parametrize("name", sorted(STORED))
def test_same_results_to_the_last_digit(name, tmp_path):
    stored = STORED[name]
    assert configs()[name] == stored["values"]
    now = json.loads(json.dumps(run(stored["values"], tmp_path)))
    for part in ("config", "privacy", "metrics", "rounds", "state"):
        assert now[part] == stored[part], f"{name}: {part} changed"
