"""The accountant's answers, remembered (fedpriv.privacy.memo): the same numbers as a fresh
computation, read back across processes, never under other inputs, code or library version,
never from a damaged file, and never an error."""

import json
import subprocess
import sys

import pytest

from fedpriv.privacy import accounting, memo
from fedpriv.privacy.accounting import PlannedRelease, calibrate_gaussian_plan, epsilon_of

SAMPLED = [PlannedRelease("init", 2.0), PlannedRelease("round", 1.0, count=5,
                                                        sampling_rate=0.05)]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(memo.MEMO_ENV, str(tmp_path / "memo"))
    memo.forget()
    yield tmp_path / "memo"
    memo.forget()


def _files(where):
    return sorted(where.rglob("*.json")) if where.exists() else []


def _counting(monkeypatch):
    calls = []
    real = accounting._calibrate

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(accounting, "_calibrate", spy)
    return calls


def test_a_remembered_answer_is_the_fresh_computation(folder, monkeypatch):
    first = calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    eps = epsilon_of({(1.3, 1.0): 4, (0.9, 0.1): 3}, 1e-6)
    assert len(_files(folder)) >= 2
    monkeypatch.setenv(memo.MEMO_ENV, "off")  # a fresh computation, nothing read or written
    memo.forget()
    assert calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6) == first
    assert epsilon_of({(1.3, 1.0): 4, (0.9, 0.1): 3}, 1e-6) == eps
    # and the accountant confirms the remembered multipliers meet the target
    assert accounting.plan_epsilon(SAMPLED, first, 1e-6) <= 2.0


def test_another_process_reads_the_answer_back_without_computing(folder, monkeypatch):
    z = calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    code = ("import sys; from fedpriv.privacy import accounting\n"
            "from fedpriv.privacy.accounting import PlannedRelease as P\n"
            "def fail(*a): raise SystemExit('computed again')\n"
            "accounting._calibrate = fail\n"
            "z = accounting.calibrate_gaussian_plan([P('init', 2.0), P('round', 1.0, count=5, "
            "sampling_rate=0.05)], 2.0, 1e-6)\n"
            "print(repr(z)); print('dp_accounting' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    assert out[0] == repr(z)
    assert out[1] == "False"  # read back: dp-accounting (a second of imports) never loaded


def test_other_inputs_code_or_library_compute_afresh(folder, monkeypatch):
    calls = _counting(monkeypatch)
    calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    assert len(calls) == 1
    calibrate_gaussian_plan(SAMPLED, 2.0 + 1e-12, 1e-6)  # inputs by their exact repr
    calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6, relation="replace-one")
    assert len(calls) == 3
    memo.forget()
    monkeypatch.setattr(memo, "_identity", lambda: "another dp-accounting or fedpriv source")
    calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    assert len(calls) == 4


def test_the_identity_follows_the_source_and_the_library_version(tmp_path):
    here = memo.Path(memo.__file__).parent
    for name in memo._SOURCES:
        (tmp_path / name).write_text((here / name).read_text())
    same = memo.source_digest("0.4.4", tmp_path)
    assert same == memo.source_digest("0.4.4", here)
    assert memo.source_digest("0.4.5", here) != same
    (tmp_path / "accounting.py").write_text("# an edited accountant\n")
    assert memo.source_digest("0.4.4", tmp_path) != same


@pytest.mark.parametrize("damage", ["not json", json.dumps({"kind": "calibrate",
                                                             "answer": [-1.0, 2.0]}),
                                    json.dumps({"kind": "epsilon", "answer": [1.0, 2.0]}),
                                    json.dumps({"kind": "calibrate", "answer": []})])
def test_a_damaged_file_is_ignored_and_replaced(folder, monkeypatch, damage):
    z = calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    (path,) = [p for p in _files(folder) if json.loads(p.read_text())["kind"] == "calibrate"]
    path.write_text(damage)
    memo.forget()
    calls = _counting(monkeypatch)
    assert calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6) == z
    assert len(calls) == 1
    assert json.loads(path.read_text())["answer"] == z


def test_errors_are_never_remembered_and_off_writes_nothing(folder, monkeypatch):
    calls = _counting(monkeypatch)
    for _ in range(2):
        with pytest.raises(accounting.InfeasiblePlanError):
            calibrate_gaussian_plan([PlannedRelease("x", 1.0)], 1e6, 1e-6)
    assert len(calls) == 2 and _files(folder) == []
    monkeypatch.setenv(memo.MEMO_ENV, "off")
    calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    assert _files(folder) == [] and memo.folder() is None


def test_a_folder_that_cannot_be_written_keeps_answers_in_memory(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    monkeypatch.setenv(memo.MEMO_ENV, str(blocked / "memo"))
    memo.forget()
    calls = _counting(monkeypatch)
    z = calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    assert calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6) == z and len(calls) == 1
    memo.forget()


def test_the_default_folder_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(memo.MEMO_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert memo.folder() == tmp_path / "fedpriv" / "accounting"
