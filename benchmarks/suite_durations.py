"""Where the test suite's time goes: a table per file and per kind of work, from pytest's JUnit
XML (one line per test with its seconds).

    python3 -m pytest -q --junitxml=results/suite.xml          # or with -n 2, -m slow ...
    python3 benchmarks/suite_durations.py results/suite.xml [--top 15]

The kinds are read from the tests' own words (their file and name): the documentation's
commands, deployments (a SuperLink and SuperNodes as real processes), Flower simulation runs
(``flwr run``, its SuperLink and Ray), deep runs (torch), and the rest (in-process units and
runs). Under pytest-xdist a test's seconds are its own; the sum over tests exceeds the wall
time by about the number of workers.
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("documentation commands", re.compile(r"^test_docs\b")),
    ("deployments (SuperLink + SuperNodes as processes)",
     re.compile(r"^test_deployment::|_deployment_with_|restarted_supernode", re.I)),
    ("Flower simulation runs", re.compile(
        r"^test_flower_|flower|flwr|simulation|superlink|ray_|resum|ctrl_c|secure_run", re.I)),
    ("deep runs (torch)", re.compile(r"^test_deep|deep|fashion|fmnist|torch", re.I)),
)
OTHER = "in-process units and runs"


def kind_of(file: str, name: str) -> str:
    text = f"{file}::{name}"
    for kind, pattern in KINDS:
        if pattern.search(text):
            return kind
    return OTHER


def read(path: Path) -> list[tuple[str, str, float, str]]:
    """(file, test, seconds, outcome) of every test case in the JUnit XML at ``path``."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "").split(".")[-1] or "?"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        rows.append((file, case.get("name", "?"), float(case.get("time", 0.0)), outcome))
    return rows


def table(title: str, totals: dict[str, list[float]], grand: float) -> list[str]:
    lines = [f"| {title} | tests | seconds | share |", "|---|---:|---:|---:|"]
    for key, times in sorted(totals.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {key} | {len(times)} | {sum(times):.0f} | "
                     f"{100 * sum(times) / max(grand, 1e-9):.1f}% |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("junit", type=Path, help="pytest --junitxml output")
    parser.add_argument("--top", type=int, default=15, help="the slowest tests to list")
    args = parser.parse_args(argv)
    rows = read(args.junit)
    grand = sum(r[2] for r in rows)
    by_file: dict[str, list[float]] = defaultdict(list)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for file, name, seconds, _ in rows:
        by_file[file].append(seconds)
        by_kind[kind_of(file, name)].append(seconds)
    outcomes: dict[str, int] = defaultdict(int)
    for row in rows:
        outcomes[row[3]] += 1
    print(f"{len(rows)} tests ({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}), "
          f"{grand:.0f} s in tests\n")
    print("\n".join(table("kind", by_kind, grand)) + "\n")
    print("\n".join(table("file", by_file, grand)) + "\n")
    print("| slowest tests | seconds | kind |\n|---|---:|---|")
    for file, name, seconds, _ in sorted(rows, key=lambda r: -r[2])[:args.top]:
        print(f"| {file}::{name} | {seconds:.1f} | {kind_of(file, name)} |")


if __name__ == "__main__":
    main()
