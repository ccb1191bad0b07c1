"""The accountant's answers, remembered (fedpriv.privacy.memo): a calibration read back from a
file is the fresh computation's, confirmed by the accountant; never used under other inputs,
code or library versions, never from a damaged or forged file (too little noise or too much),
never an error; a composition's epsilon is never read from a file. A tuning's budget is
searched once and confirmed when read back; a forged one is searched again."""

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


def _calibrate_fails(monkeypatch):
    def fail(*args):
        raise AssertionError("calibrated again instead of reading the file")

    monkeypatch.setattr(accounting, "_calibrate", fail)


def test_a_calibration_read_back_is_the_fresh_computation(folder, monkeypatch):
    first = calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    (path,) = _files(folder)
    assert json.loads(path.read_text())["answer"] == first
    memo.forget()
    with monkeypatch.context() as patch:
        _calibrate_fails(patch)
        assert calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6) == first  # from the file
    monkeypatch.setenv(memo.MEMO_ENV, "off")  # a fresh computation, nothing read or written
    memo.forget()
    assert calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6) == first
    assert 0.99 * 2.0 <= accounting.plan_epsilon(SAMPLED, first, 1e-6) <= 2.0


def test_another_process_reads_the_calibration_back_without_calibrating(folder):
    z = calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    code = ("from fedpriv.privacy import accounting\n"
            "from fedpriv.privacy.accounting import PlannedRelease as P\n"
            "def fail(*a): raise SystemExit('calibrated again')\n"
            "accounting._calibrate = fail\n"
            "print(repr(accounting.calibrate_gaussian_plan([P('init', 2.0), P('round', 1.0, "
            "count=5, sampling_rate=0.05)], 2.0, 1e-6)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(z)


def test_a_compositions_epsilon_is_never_read_from_a_file(folder, monkeypatch):
    eps = epsilon_of({(1.3, 1.0): 4, (0.9, 0.1): 3}, 1e-6)
    assert _files(folder) == []  # memory only: every process computes what it reports
    calls = []
    real = accounting.make_accountant
    monkeypatch.setattr(accounting, "make_accountant",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    assert epsilon_of({(1.3, 1.0): 4, (0.9, 0.1): 3}, 1e-6) == eps and calls == []  # memory
    accounting._epsilon_cached.cache_clear()
    assert epsilon_of({(1.3, 1.0): 4, (0.9, 0.1): 3}, 1e-6) == eps and len(calls) == 1


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


def test_the_identity_follows_the_source_and_the_library_versions(tmp_path):
    here = memo.Path(memo.__file__).parent
    for name in memo._SOURCES:
        (tmp_path / name).write_text((here / name).read_text())
    same = memo.source_digest("0.4.4;2.2.0;1.14.0", tmp_path)
    assert same == memo.source_digest("0.4.4;2.2.0;1.14.0", here)
    assert memo.source_digest("0.4.4;2.3.0;1.14.0", here) != same
    (tmp_path / "accounting.py").write_text("# an edited accountant\n")
    assert memo.source_digest("0.4.4;2.2.0;1.14.0", tmp_path) != same



def test_the_installed_numpy_version_is_part_of_the_identity(monkeypatch):
    import importlib.metadata

    memo._identity.cache_clear()
    before = memo._identity()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.0-other" if name == "numpy" else real(name))
    memo._identity.cache_clear()
    assert memo._identity() != before
    monkeypatch.undo()
    memo._identity.cache_clear()
    assert memo._identity() == before


def _forged(path, z, answer=None, inputs=None):
    record = json.loads(path.read_text())
    if answer is not None:
        record["answer"] = answer
    if inputs is not None:
        record["inputs"] = inputs
    return json.dumps(record)


@pytest.mark.parametrize("damage", [
    "not json", "too little noise", "too much noise", "one multiplier short", "other inputs",
    "a negative multiplier", "an epsilon's shape"])
def test_a_damaged_or_forged_file_is_refused_and_replaced(folder, monkeypatch, damage):
    z = calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    (path,) = _files(folder)
    path.write_text({
        "not json": "not json",
        "too little noise": _forged(path, z, answer=[v / 3 for v in z]),
        "too much noise": _forged(path, z, answer=[v * 3 for v in z]),
        "one multiplier short": _forged(path, z, answer=z[:1]),
        "other inputs": _forged(path, z, inputs="(another plan)"),
        "a negative multiplier": _forged(path, z, answer=[-z[0], z[1]]),
        "an epsilon's shape": _forged(path, z, answer=1.0),
    }[damage])
    memo.forget()
    calls = _counting(monkeypatch)
    assert calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6) == z
    assert len(calls) == 1  # computed afresh
    assert json.loads(path.read_text())["answer"] == z  # and the file rewritten


def test_errors_are_never_remembered_and_off_writes_nothing(folder, monkeypatch):
    calls = _counting(monkeypatch)
    for _ in range(2):
        with pytest.raises(accounting.InfeasiblePlanError):
            calibrate_gaussian_plan([PlannedRelease("x", 1.0)], 1e6, 1e-6)
    assert len(calls) == 2 and _files(folder) == []
    monkeypatch.setenv(memo.MEMO_ENV, "off")
    calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6)
    assert _files(folder) == [] and memo.folder() is None
    monkeypatch.setenv(memo.MEMO_ENV, str(folder))
    calibrate_gaussian_plan(SAMPLED, 2.0, 1e-6, confirm=False)  # unconfirmed: never kept
    assert _files(folder) == []


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


# ----- a tuning's budget ----------------------------------------------------------------------
def _tuning_evaluations(monkeypatch):
    """The confirmed and unconfirmed evaluations of the whole tuning a budget makes."""
    from fedpriv.tuning import budget

    calls = []
    real = budget.total_epsilon

    def spy(spec, epsilon, composed=(), confirm=True):
        calls.append((epsilon, confirm))
        return real(spec, epsilon, composed, confirm)

    monkeypatch.setattr(budget, "total_epsilon", spy)
    return calls


def test_a_tunings_budget_is_searched_once_and_confirmed_when_read_back(folder, tmp_path,
                                                                         monkeypatch):
    """The search (dozens of evaluations of the whole tuning) runs once; a later process reads
    its answer back and confirms it with two: within the target, and maximal to the search's
    precision. The budget is the same to the last digit."""
    from fedpriv.tuning.budget import calibrate_tuning
    from fedpriv.tuning.spec import load_tune
    from tests.test_tuning import write

    spec = load_tune(write(tmp_path, eps=2.0))
    calls = _tuning_evaluations(monkeypatch)
    first = calibrate_tuning(spec)
    searched = len(calls)
    assert searched > 10 and 0.3 < first.candidate_epsilon < 2.0 >= first.total_epsilon
    assert [json.loads(p.read_text())["answer"] for p in _files(folder)
            if json.loads(p.read_text())["kind"] == "tuning-budget"] == [first.candidate_epsilon]
    memo.forget()  # a new process
    calls.clear()
    again = calibrate_tuning(spec)
    assert (again.candidate_epsilon, again.total_epsilon, again.order, again.counts) == (
        first.candidate_epsilon, first.total_epsilon, first.order, first.counts)
    assert calls == [(first.candidate_epsilon, True),
                     (first.candidate_epsilon * (1 + 1e-4), False)]


@pytest.mark.parametrize("forged", [1.5, 0.5, "list"],
                         ids=["over the target", "needlessly small", "the wrong shape"])
def test_a_forged_tuning_budget_is_searched_again(folder, tmp_path, monkeypatch, forged):
    """An answer that would overspend the total target, one that would give every candidate
    less than it may spend, or a damaged one (a list, as a plan's answer is) fails the
    confirmation: the budget is searched again and is the honest one."""
    from fedpriv.tuning.budget import calibrate_tuning
    from fedpriv.tuning.spec import load_tune
    from tests.test_tuning import write

    spec = load_tune(write(tmp_path, eps=2.0))
    honest = calibrate_tuning(spec)
    (path,) = [p for p in _files(folder) if json.loads(p.read_text())["kind"] == "tuning-budget"]
    record = json.loads(path.read_text())
    answer = ([honest.candidate_epsilon] if forged == "list"
              else honest.candidate_epsilon * forged)
    path.write_text(json.dumps({**record, "answer": answer}))
    memo.forget()
    calls = _tuning_evaluations(monkeypatch)
    again = calibrate_tuning(spec)
    assert again.candidate_epsilon == honest.candidate_epsilon and len(calls) > 10
    assert again.total_epsilon <= 2.0
    assert json.loads(path.read_text())["answer"] == honest.candidate_epsilon  # rewritten
