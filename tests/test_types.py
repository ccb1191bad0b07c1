"""The type checker over the package: ``mypy --strict`` (pyproject's ``[tool.mypy]``) is clean
on ``fedpriv/``, ``clients/`` and ``strategies/``, and it catches a misspelled key in an
algorithm's code before anything runs (typed keys: each algorithm reads its own config class)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]


def _mypy(*args: str, cache: Path) -> tuple[str, int]:
    out, err, status = mypy_api.run([*args, "--cache-dir", str(cache)])
    return out + err, status


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mypy-cache")


def test_mypy_strict_is_clean_on_the_package_the_client_and_the_strategies(cache, monkeypatch):
    monkeypatch.chdir(ROOT)  # pyproject's [tool.mypy]: strict, files = the three packages
    out, status = _mypy("--config-file", str(ROOT / "pyproject.toml"), cache=cache)
    assert status == 0, out
    assert "Success: no issues found" in out


MISSPELLED = '''
    from collections.abc import Mapping

    import numpy as np

    from fedpriv.algorithms.base import Step, UserContribution
    from fedpriv.algorithms.personalization.params import FedRepConfig
    from fedpriv.algorithms.personalization.private_fedrep import PrivateFedRep
    from fedpriv.config import RunConfig


    class Mine(PrivateFedRep):
        def bound(self) -> float:
            return self.config.clip_norm * self.config.num_users  # both spelled right

        def typo(self) -> float:
            return self.config.clip_nrom  # the algorithm's own key, misspelled

        @classmethod
        def user_step(cls, config: FedRepConfig, step: Step, arrays: Mapping[str, np.ndarray],
                      user_ids: np.ndarray) -> UserContribution:
            rows = config.samples_per_usr  # misspelled on the node side too
            return UserContribution({}, len(user_ids) * rows)


    def core(config: RunConfig) -> float:
        return config.epsilon + config.dim  # dim is a family key, not a core one
'''


def test_the_type_checker_rejects_a_misspelled_key(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    source = tmp_path / "mine.py"
    source.write_text(textwrap.dedent(MISSPELLED))
    out, status = _mypy("--strict", "--follow-imports=silent", "--ignore-missing-imports",
                        "--config-file", "/dev/null", str(source), cache=cache)
    errors = [line for line in out.splitlines() if "[attr-defined]" in line]
    assert status == 1
    assert any('"FedRepConfig" has no attribute "clip_nrom"' in e for e in errors), out
    assert any('"FedRepConfig" has no attribute "samples_per_usr"' in e for e in errors), out
    assert any('"RunConfig" has no attribute "dim"' in e for e in errors), out
    assert len(errors) == 3, out  # the keys spelled right pass
    assert "maybe \"clip_norm\"?" in out  # and mypy names the key meant


def test_packages_mypy_skips_are_never_imported_by_the_checked_code():
    """pyproject's mypy overrides skip packages only reached through flwr's, ray's, torch's and
    matplotlib's imports (their names are Any); the checked code importing one of them directly
    would go unchecked, so it must not."""
    import re
    import tomllib

    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    skipped = {m.removesuffix(".*") for o in overrides if o.get("follow_imports") == "skip"
               for m in o["module"]}
    assert {"sqlalchemy", "pydantic", "IPython"} <= skipped
    imports = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_][\w]*)", re.M)
    for package in ("fedpriv", "clients", "strategies", "fedpriv_flwr"):
        for source in (ROOT / package).rglob("*.py"):
            named = set(imports.findall(source.read_text())) & skipped
            assert not named, f"{source.relative_to(ROOT)} imports {named}, which mypy skips"
