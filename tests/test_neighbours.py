"""The guarantee for any input, tested from the outside: D and D' differ in one user, the same
seeds and noise, and each release of D' is at most the stated sensitivity from D's (D' on its
own server, on D's history, every release; and nothing else the server sees or publishes
differs: ``fedpriv.neighbours``), for every private algorithm and every data path; or the run
is refused before it starts, naming the cause. The adversarial neighbours are generated
systematically (hypothesis) as well as listed. The harness's own failure modes (state kept
from exact replies, the ledger, the release document, repeatable noise):
``tests/test_neighbour_history.py``."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpriv.config import ConfigError, RunConfig
from fedpriv.configure import parse_config
from fedpriv.data.partition import partition
from fedpriv.data.sources import load_source
from fedpriv.neighbour_data import Rows, file_neighbours, read_rows, with_file, write_rows
from fedpriv.neighbours import Neighbour, check_neighbour, check_neighbours, table
from fedpriv.server import PrivateServer

sys.path.insert(0, str(Path(__file__).parent))
from neighbour_worlds import builtin_rows, fewshot_task, neighbour, synthetic  # noqa: E402
from test_reliability import PRIVATE, make_config  # noqa: E402


def assert_within(checks, at_least: int = 1):
    assert len(checks) >= at_least, "no release was compared"
    bad = [c for c in checks if not c.ok]
    assert not bad, "\n".join(table(checks))


# ----- data: a digits file with natural users --------------------------------------------------
USERS = 30
FILE_KEYS = {"algorithm": "deep-private-fedrep", "num-users": USERS, "hidden-sizes": "16",
             "rounds": 2, "epsilon": 2.0, "delta": 1e-5, "partition": "natural",
             "num-classes": 10, "checkpoint": False, "head-steps": 20,
             "final-head-steps": 20}


def natural_rows() -> Rows:
    """Digits as USERS label-skewed users with scattered integer ids (natural users)."""
    source = load_source("digits")
    users = partition(source, "label-skew", USERS, 3, 3)
    ids = 500 - 17 * np.arange(USERS)
    parts = []
    for split, x, y, rows in (("train", source.x_train, source.y_train, users.train),
                              ("test", source.x_test, source.y_test, users.test)):
        owner = np.repeat(ids, rows.counts)
        parts.append(Rows(owner, np.full(len(rows.rows), split), y[rows.rows], x[rows.rows]))
    return parts[0].join(parts[1])


def file_config(path: Path, fmt: str, **keys) -> RunConfig:
    return parse_config({**FILE_KEYS, "dataset": fmt, "data-file": str(path),
                                   **{k.replace("_", "-"): v for k, v in keys.items()}})


@pytest.fixture(scope="module")
def natural_csv(tmp_path_factory) -> Path:
    return write_rows(natural_rows(), tmp_path_factory.mktemp("d") / "d.csv", "csv")


# ----- the review's table, as regression tests through `fedpriv run` ---------------------------
def released_model(path: Path) -> np.ndarray:
    import json

    return np.array(json.loads(path.read_text())["released"]["parameters"])


def run_args(engine: str, out: Path, **keys) -> list[str]:
    """`fedpriv run` arguments: FILE_KEYS with ``keys`` (snake_case) set."""
    args = ["run", "--engine", engine, "--out", str(out)]
    for key, value in {**FILE_KEYS, **{k.replace("_", "-"): v for k, v in keys.items()}}.items():
        args += ["--set", f"{key}={value}"]
    return args


def cli_release(tmp_path: Path, name: str, data: Path, engine: str, **keys) -> np.ndarray:
    """One round of `fedpriv run` on ``data``; the released model's parameters."""
    from fedpriv.cli import main as cli_main

    out = tmp_path / f"{name}.json"
    assert cli_main(run_args(engine, out, dataset=data.suffix[1:], data_file=data, rounds=1,
                             users_per_node=10, **keys)) == 0
    return released_model(out.with_name(out.name.replace(".json", ".release.json")))


def table_rows_case(case: str, rows: Rows) -> tuple[str, Rows]:
    """The review's cases on user 'u' (the middle id): (relation, D')."""
    ids = np.unique(rows.users)
    user = ids[len(ids) // 2]
    mine = rows.users == user
    own, others = rows.take(mine), rows.take(~mine)
    if case == "huge features":
        x = rows.x.copy()
        x[mine] = x[mine] * 1e37 + 1e37  # finite in float32; the forward pass overflows
        return "replace", Rows(rows.users, rows.splits, rows.labels, x)
    if case == "two training rows":
        train = np.flatnonzero(own.splits == "train")
        return "replace", others.join(own.take(np.setdiff1d(np.arange(len(own.users)),
                                                            train[2:])))
    if case == "another id":
        return "replace", others.join(Rows(np.full(len(own.users), ids.max() + 1),
                                           own.splits, own.labels, own.x))
    if case == "a smaller id added":
        return "add", rows.join(Rows(np.full(len(own.users), ids.min() - 1), own.splits,
                                     own.labels, own.x))
    raise ValueError(case)


@pytest.mark.parametrize("case", ["huge features", "two training rows", "another id",
                                  "a smaller id added"])
def test_the_reviews_cases_move_a_fedpriv_run_release_at_most_the_sensitivity(tmp_path, case):
    """Each row of the review's table that a run accepts, through `fedpriv run` in-process:
    one round, the same seeds, so the released model differs by learning-rate times the
    difference of the noisy means (velocity = mean after one round): at most lr times the
    stated sensitivity (2 clip / n for a replaced user, clip / n for an added one). Before
    the fix these moved this release by 111x, 8.4x, 1.02x and 2.7x the bound (measured on
    the previous commit; the review saw ~470x, 11x, 5.5x and 11x on its data)."""
    rows = natural_rows()
    relation, changed = table_rows_case(case, rows)
    d = write_rows(rows, tmp_path / "D.csv", "csv")
    d2 = write_rows(changed, tmp_path / "D2.csv", "csv")
    wide = {"hidden_sizes": "256,128"}  # the default model: 1e37 overflows its forward pass
    a = cli_release(tmp_path, "d", d, "inprocess", **wide)
    b = cli_release(tmp_path, "d2", d2, "inprocess", **wide)
    config = file_config(d, "csv")
    bound = config.learning_rate * config.clip_norm / config.num_users * (
        2.0 if relation == "replace" else 1.0)
    distance = float(np.linalg.norm(a - b))
    assert 0 < distance <= bound * (1 + 1e-3), (distance, bound)


@pytest.mark.integration
@pytest.mark.parametrize("case", ["huge features"])
def test_the_reviews_cases_through_flower_move_the_release_at_most_the_sensitivity(
        tmp_path, case, shared_flower_env, monkeypatch):
    """The review's worst case through the real Flower runtime (natural users hosted by a
    hash of their ids; the server knows no node's count): the same bound, and the in-process
    run's release. (An added user through real processes: test_deployment's own-rows test.)"""
    for key, value in shared_flower_env.items():  # both runs on this test process's SuperLink
        monkeypatch.setenv(key, value)
    rows = natural_rows()
    relation, changed = table_rows_case(case, rows)
    d = write_rows(rows, tmp_path / "D.csv", "csv")
    d2 = write_rows(changed, tmp_path / "D2.csv", "csv")
    wide = {"hidden_sizes": "256,128"}
    a = cli_release(tmp_path, "d", d, "flower", **wide)
    b = cli_release(tmp_path, "d2", d2, "flower", **wide)
    config = file_config(d, "csv")
    bound = config.learning_rate * config.clip_norm / config.num_users * (
        2.0 if relation == "replace" else 1.0)
    assert 0 < float(np.linalg.norm(a - b)) <= bound * (1 + 1e-3)
    np.testing.assert_allclose(a, cli_release(tmp_path, "local", d, "inprocess", **wide),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("engine", ["inprocess", "flower"])
def test_a_label_outside_the_declared_classes_is_refused_before_the_run(tmp_path, capsys,
                                                                         engine):
    """The review's third row (a label of 19 changed everybody's head): refused by `fedpriv
    run` before any user is touched, naming the row and line; a node that meets one anyway
    isolates that user (``test_every_file_neighbour_...``)."""
    from fedpriv.cli import main as cli_main

    rows = natural_rows()
    labels = rows.labels.copy()
    labels[5] = 19
    bad = write_rows(Rows(rows.users, rows.splits, labels, rows.x), tmp_path / "bad.csv", "csv")
    out = tmp_path / "r.json"
    assert cli_main(run_args(engine, out, dataset="csv", data_file=bad)) == 2
    err = capsys.readouterr().err
    assert "row 5 (line 7) has a label outside the declared classes 0..9" in err
    assert not out.exists()


MIXERS = """from torch import nn
def batch_norm(shape, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16),
                         nn.BatchNorm1d(16, track_running_stats=False), nn.ReLU(),
                         nn.Linear(16, classes))
def centred(shape, classes):
    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(64, 16), nn.Linear(16, classes)
        def forward(self, x):
            h = self.body(x.flatten(1))
            return self.head(h - h.mean(0))
    return Centred()
"""


@pytest.fixture
def mixers(tmp_path, monkeypatch):
    """Models that mix the rows of a batch, importable as ``mixers:batch_norm`` and
    ``mixers:centred``."""
    (tmp_path / "mixers.py").write_text(MIXERS)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_model_that_mixes_rows_is_refused_naming_the_layer(tmp_path, mixers):
    """The review's sixth row: BatchNorm1d(track_running_stats=False) has no buffers, so the
    old "stateless" check passed it; the functional probe names it before the run."""
    from fedpriv.params import ConfigError

    data = write_rows(natural_rows(), tmp_path / "d.npz", "npz")
    with pytest.raises(ConfigError, match=r"model: 'mixers:batch_norm' mixes the rows of a "
                                          r"batch: 2 \(BatchNorm1d\)"):
        file_config(data, "npz", model="mixers:batch_norm")
    with pytest.raises(ConfigError, match=r"the forward of the model \(Centred\) mixes rows "
                                          r"before calling head"):
        file_config(data, "npz", model="mixers:centred")


def test_a_model_that_mixes_rows_is_refused_by_fedpriv_run_before_anything_starts(tmp_path,
                                                                                  mixers,
                                                                                  capsys):
    from fedpriv.cli import main as cli_main

    data = write_rows(natural_rows(), tmp_path / "d.csv", "csv")
    assert cli_main(run_args("flower", tmp_path / "r.json", dataset="csv", data_file=data,
                             model="mixers:batch_norm")) == 2
    assert "mixes the rows of a batch: 2 (BatchNorm1d)" in capsys.readouterr().err


# ----- the harness over every private algorithm and data path ---------------------------------
def test_the_harness_covers_every_registered_private_algorithm_that_releases():
    """Every built-in private algorithm is in the harness's lists below, or releases nothing
    (a plug-in's own algorithm is its author's to test: ``fedpriv audit --neighbours``)."""
    from fedpriv.registry import available, get_algorithm

    covered = (set(SYNTHETIC) | {"deep-private-fedrep", "deep-dp-fedavg", "deep-dp-fedavg-ft"}
               | set(FEWSHOT))
    for name in available():
        cls = get_algorithm(name)
        if cls.private and name not in covered and cls.__module__.startswith("fedpriv."):
            config = parse_config({"algorithm": name, "num-users": 100})
            assert cls(config).privacy_plan() == [], f"{name} releases: add it to the harness"



HUGE = (lambda x: x * 1e200 + 1e200, "features x 1e200")
NAN = (lambda x: np.where(np.arange(x.size).reshape(x.shape) == 0, np.nan, x), "a nan")
INF = (lambda x: np.full_like(x, np.inf), "all inf")
ZERO = (lambda x: np.zeros_like(x), "all zero")

SYNTHETIC = sorted(a for a in PRIVATE if not a.startswith("deep-"))


@pytest.mark.parametrize("algorithm", SYNTHETIC)
@pytest.mark.parametrize("change", [HUGE, NAN, INF, ZERO], ids=lambda c: c[1])
@pytest.mark.parametrize("where", ["features", "labels"])
def test_every_synthetic_algorithm_holds_its_bound_whatever_one_users_data(algorithm, change,
                                                                          where):
    """The linear, meta-learning and exponential-mechanism families on their synthetic
    problems: one user's generated features or labels replaced by huge, non-finite or zero
    values; its first two releases move at most the stated sensitivity (twice the add/remove
    one: a replaced user)."""
    config = make_config(algorithm)
    fn, name = change
    world = synthetic(7, **{where: fn})
    checks = check_neighbour(config, neighbour(f"user 7: {where} {name}", config, world),
                             num_partitions=3)
    assert_within(checks)


@pytest.mark.parametrize("mode", [{"aggregation": "distributed"}, {"secure-noise": True}],
                         ids=["distributed", "secure-noise"])
@pytest.mark.parametrize("change", [HUGE, NAN, ZERO], ids=lambda c: c[1])
def test_discrete_noise_holds_its_bound_whatever_one_users_data(mode, change):
    """Distributed shares and publishable grid noise: with the nodes' and the server's streams
    repeated by the harness (``fedpriv.neighbour_noise``), one user's data moves each release
    at most the ledger's sensitivity (the grid's slack included), for every synthetic
    algorithm that takes the mode; a distributed run's server receives nothing else that
    differs (this relies on nodes that send no exact counts or metrics in that mode)."""
    fn, name = change
    checked = []
    for algorithm in SYNTHETIC:
        config = make_config(algorithm, accountant="rdp", **mode)
        try:
            PrivateServer(config, 3, log=lambda _: None).close()
        except ConfigError:
            continue  # not a sum, correlated noise, or sampled by the server: refused
        world = synthetic(7, features=fn)
        # priv-altmin's distributed run stops at its third release (a known bug:
        # test_neighbour_history.py's xfail): its first two only
        releases = 2 if algorithm == "priv-altmin" and "aggregation" in mode else None
        checks = check_neighbour(config, neighbour(f"user 7: {name}", config, world),
                                 num_partitions=3, max_releases=releases)
        assert_within(checks)
        checked.append(algorithm)
    assert {"private-fedrep", "priv-altmin", "dp-global-model"} <= set(checked)


@pytest.mark.parametrize("algorithm,keys", [
    ("deep-private-fedrep", {}),  # ghost clipping of the body
    ("deep-dp-fedavg", {}),  # its default: 5 local steps, per-user updates (torch.func)
    ("deep-dp-fedavg-ft", {"body-steps": 1}),  # ghost clipping of the whole model
], ids=["deep-private-fedrep", "deep-dp-fedavg", "deep-dp-fedavg-ft-one-step"])
@pytest.mark.parametrize("change", [HUGE, NAN, ZERO], ids=lambda c: c[1])
def test_deep_algorithms_on_digits_hold_their_bound(algorithm, keys, change):
    """A built-in dataset: one partition user's pixel values replaced (the labels stay: the
    label-skew partition is a function of every row's label and is public)."""
    config = parse_config({**PRIVATE["deep-private-fedrep"], "algorithm": algorithm,
                           "clip-quantile": 0.0, **keys})
    fn, name = change
    checks = check_neighbour(config, neighbour(name, config, builtin_rows(config, 11, fn)),
                             num_partitions=3, dtype="float32")
    assert_within(checks)


FEWSHOT = ["fewshot-meta-nsgd", "fewshot-private-meta-cluster", "fewshot-dp-ftmrl"]
FEWSHOT_KEYS = {"num-users": 40, "hidden-sizes": "16", "queries": 3, "rounds": 2,
                "tasks-per-round": 40, "epsilon": 4.0, "delta": 1e-5, "clip-norm": 0.5}


@pytest.mark.parametrize("algorithm, keys", [
    ("fewshot-meta-nsgd", {}),
    ("fewshot-meta-nsgd", {"adapt-steps": 2, "private-metrics": True}),
    ("fewshot-meta-nsgd", {"meta-gradient": "first-order"}),
    ("fewshot-private-meta-cluster", {"meta-models": 2}),
    ("fewshot-dp-ftmrl", {}),
    ("fewshot-meta-nsgd", {"model": "cnn", "eval-tasks": "validation"}),  # conv ghost path
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{a}={b}" for a, b in v.items()))
@pytest.mark.parametrize("change", [HUGE, NAN, ZERO], ids=lambda c: c[1])
def test_fewshot_meta_learning_holds_its_bound_whatever_one_tasks_data(algorithm, keys, change):
    """Task-level DP: one task's whole data (its meta-training task and its fresh meta-test
    task) replaced by huge, non-finite or zero pixels moves each release, the private
    evaluation's included, at most the stated sensitivity (a replaced task: twice the
    add/remove bound), and nothing else the server sees differs."""
    if algorithm == "fewshot-dp-ftmrl":
        keys = {**keys, "tasks-per-round": 0}
    config = parse_config({**FEWSHOT_KEYS, **keys, "algorithm": algorithm})
    fn, name = change
    checks = check_neighbour(config, neighbour(f"task 7: {name}", config, fewshot_task(7, fn)),
                             num_partitions=3, dtype="float32")
    assert_within(checks, at_least=2)


def test_fewshot_per_task_gradients_hold_the_bound(monkeypatch):
    """The torch.func path (a body ghost clipping cannot take) on the harness too."""
    from fedpriv.algorithms.fewshot import fewshot_math

    monkeypatch.setattr(fewshot_math, "ghost_gradient_sum", lambda *a, **k: None)
    config = parse_config({**FEWSHOT_KEYS, "algorithm": "fewshot-meta-nsgd", "adapt-steps": 1})
    for fn, name in (HUGE, NAN):
        checks = check_neighbour(config, neighbour(f"task 7: {name}", config,
                                                   fewshot_task(7, fn)),
                                 num_partitions=3, dtype="float32")
        assert_within(checks, at_least=2)


@pytest.mark.parametrize("keys", [
    {},  # the default: ghost clipping, Private FedRep
    {"algorithm": "deep-dp-fedavg", "body-steps": 2},  # per-user updates (torch.func)
    {"cross-fit": 2},
    {"users-per-round": 12},  # Poisson cohorts keyed by the user's id
    {"clip-quantile": 0.5},  # adaptive clipping: the count of unclipped users too
    {"private-metrics": True, "rounds": 1},  # the private evaluation release
    {"model": "cnn", "input-shape": "1,8,8", "rounds": 1},
    {"metrics-split": "validation", "private-metrics": True, "rounds": 1,
     "validation-samples-per-user": 4},
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_every_file_neighbour_holds_the_bound(tmp_path, natural_csv, keys):
    """Every neighbour ``fedpriv audit --neighbours`` builds of a natural-user CSV (removed,
    added below and above the other ids, renamed, one or two rows, more rows than the cap, a
    label outside the classes, huge, tiny and nan features), over the deep family's paths."""
    config = file_config(natural_csv, "csv", **keys)
    base, neighbours = file_neighbours(config, tmp_path / "n")
    assert len(neighbours) == 11
    assert_within(check_neighbours(base, neighbours, num_partitions=3, dtype="float32"),
                  at_least=11)


@pytest.mark.parametrize("fmt", ["npz", "parquet"])
def test_the_npz_and_parquet_paths_hold_the_bound(tmp_path, fmt):
    pytest.importorskip("pyarrow")
    data = write_rows(natural_rows(), tmp_path / f"d.{fmt}", fmt)
    base, neighbours = file_neighbours(file_config(data, fmt, rounds=1), tmp_path / "n")
    assert_within(check_neighbours(base, neighbours, num_partitions=2, dtype="float32"),
                  at_least=11)


def test_an_npz_without_a_user_column_and_a_custom_model_hold_the_bound(tmp_path,
                                                                        monkeypatch):
    """Users as a simulated label-skew partition of a file (no user column): one user's
    features changed; a custom model factory."""
    (tmp_path / "mine.py").write_text(
        "from torch import nn\n"
        "def model(shape, classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 24), nn.Tanh(),\n"
        "                         nn.LayerNorm(24), nn.Linear(24, classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = natural_rows()
    data = write_rows(Rows(None, rows.splits, rows.labels, rows.x), tmp_path / "d.npz", "npz")
    config = file_config(data, "npz", partition="label-skew", num_users=40,
                         model="mine:model", rounds=1)
    base, neighbours = file_neighbours(config, tmp_path / "n")
    assert len(neighbours) == 3
    assert_within(check_neighbours(base, neighbours, num_partitions=2, dtype="float32"),
                  at_least=3)


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_fashion_mnist_holds_the_bound():
    config = parse_config({"algorithm": "deep-private-fedrep",
                                     "dataset": "fashion-mnist", "num-users": 200,
                                     "hidden-sizes": "32", "rounds": 1, "epsilon": 1.0,
                                     "delta": 1e-5, "head-steps": 10, "max-rows-per-user": 60})
    checks = check_neighbour(config, neighbour(HUGE[1], config, builtin_rows(config, 5,
                                                                             HUGE[0])),
                             num_partitions=2, dtype="float32")
    assert_within(checks)


# ----- property-based: adversarial neighbours generated -----------------------------------------
@st.composite
def adversarial_users(draw):
    """One user's rows as a careful adversary might write them."""
    rows = draw(st.integers(1, 40))
    magnitude = draw(st.sampled_from([0.0, 1e-30, 1.0, 1e6, 1e30, 1e37]))
    special = draw(st.sampled_from([None, np.nan, np.inf, -np.inf]))
    cancel = draw(st.booleans())  # rows that nearly cancel: x and -x
    label_shift = draw(st.sampled_from([0, 0, 10, 1000]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 64)).astype(np.float64) * magnitude
    if cancel and rows > 1:
        x[1::2] = -x[0::2][:len(x[1::2])] * (1 + 1e-7)
    if special is not None:
        x[rng.integers(rows), rng.integers(64)] = special
    labels = rng.integers(0, 10, rows) + (label_shift if rng.random() < 0.5 else 0)
    splits = np.where(np.arange(rows) < max(1, rows * 3 // 4), "train", "test")
    where = draw(st.sampled_from(["replace", "add-below", "add-above"]))
    return where, x.astype(np.float32), labels, splits


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(adversarial_users())
def test_generated_adversarial_users_never_move_a_release_past_the_bound(natural_csv, tmp_path,
                                                                         user):
    where, x, labels, splits = user
    rows = read_rows(file_config(natural_csv, "csv"))
    ids = np.unique(rows.users)
    target = {"replace": ids[3], "add-below": ids.min() - 1, "add-above": ids.max() + 1}[where]
    others = rows.take(rows.users != target)
    changed = others.join(Rows(np.full(len(labels), target), splits, labels, x))
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # hypothesis may replay an example
    config = file_config(natural_csv, "csv", rounds=1)
    d = with_file(config, write_rows(rows, folder / "D.csv", "csv"))
    d2 = with_file(config, write_rows(changed, folder / "D2.csv", "csv"))
    relation = "replace" if where == "replace" else "add"
    assert_within(check_neighbour(d, Neighbour(where, relation, d2), num_partitions=2,
                                  dtype="float32"))


# ----- the harness can fail ----------------------------------------------------------------------
def test_the_harness_catches_an_unclipped_user(monkeypatch, natural_csv, tmp_path):
    """With the clipping factor of a nan norm back at 1 (the old rule) and the node's own
    check of non-finite sums off (``fedpriv.nodes.finite``: it zeroes such a user alone), a
    user whose features overflow the model makes its node's sum non-finite: the harness
    reports it."""
    import fedpriv.nodes
    from fedpriv.algorithms.deep import ghost_clipping


    def old_rule(norms, clip):
        factors = np.ones_like(norms)
        np.divide(clip, norms, out=factors, where=norms > clip)
        return factors

    monkeypatch.setattr(ghost_clipping, "factors_from_norms", old_rule)
    config = file_config(natural_csv, "csv", rounds=1)
    base, neighbours = file_neighbours(config, tmp_path / "n")
    huge = [n for n in neighbours if "1e37" in n.name]
    # the node's check alone keeps the bound: it finds the user and zeroes it
    assert_within(check_neighbours(base, huge, num_partitions=2, dtype="float32"))
    monkeypatch.setattr(fedpriv.nodes, "finite", lambda contrib: True)
    checks = check_neighbours(base, huge, num_partitions=2, dtype="float32")
    released = [c for c in checks if not c.compared]
    assert released and not any(c.ok for c in released), "\n".join(table(checks))
    assert all(c.rejected == {"non-finite": 1} for c in released)
    # and the server saw a node rejected on D' alone (central mode: no user's data may)
    (view,) = [c for c in checks if c.part == "server view"]
    assert not view.ok and "rejections () on D and (('non-finite', 1),) on D'" in view.problem


# ----- the full grid: the slow tier (python3 -m pytest -m slow; -m full_grid: these alone) -------
FULL_GRID = pytest.mark.slow


@pytest.mark.full_grid
@FULL_GRID
@pytest.mark.parametrize("algorithm", ["deep-private-fedrep", "deep-dp-fedavg",
                                       "deep-dp-fedavg-ft"])
@pytest.mark.parametrize("fmt", ["csv", "npz", "parquet"])
@pytest.mark.parametrize("keys", [{"body-steps": 1}, {"body-steps": 2},
                                  {"users-per-round": 12, "clip-quantile": 0.5}],
                         ids=["ghost", "per-user", "poisson-adaptive"])
def test_the_full_grid_of_file_neighbours(tmp_path, algorithm, fmt, keys):
    pytest.importorskip("pyarrow")
    data = write_rows(natural_rows(), tmp_path / f"d.{fmt}", fmt)
    config = file_config(data, fmt, algorithm=algorithm, **keys)
    for user in np.unique(natural_rows().users)[::7]:
        base, neighbours = file_neighbours(config, tmp_path / f"n{user}", user)
        assert_within(check_neighbours(base, neighbours, num_partitions=3, dtype="float32"),
                      at_least=len(neighbours))


@pytest.mark.full_grid
@FULL_GRID
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(adversarial_users())
def test_many_generated_adversarial_users(natural_csv, tmp_path, user):
    test_generated_adversarial_users_never_move_a_release_past_the_bound.hypothesis.inner_test(
        natural_csv, tmp_path, user)


# ----- the command a user runs on their own data ------------------------------------------------
def test_fedpriv_audit_neighbours_checks_a_users_own_file(tmp_path, natural_csv, capsys):
    from fedpriv.cli import main

    keys = {**FILE_KEYS, "dataset": "csv", "data-file": str(natural_csv), "rounds": 1}
    args = ["audit", "--neighbours", "--releases", "1"]
    for key, value in keys.items():
        args += ["--set", f"{key}={value}"]
    assert main([*args, "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # one round of the default adaptive clipping releases two arrays: the update and the count
    assert "[11/11]" in out and "22 of 22 releases within the stated sensitivity" in out
    assert ("44 of 44 comparisons of the server's view, broadcast, ledger and release "
            "document identical") in out
    assert list(tmp_path.iterdir()) == []  # its neighbour files are removed after
    assert main(["audit", "--neighbours", "--set", "algorithm=private-fedrep"]) == 2
    assert "builds neighbours of your data file" in capsys.readouterr().err


def test_text_ids_get_neighbours_added_below_and_above_every_id(tmp_path):
    """Users named by text (``user007``): the added copies get new ids sorting below and above
    every id, whole (not cut to the width of the file's ids)."""
    from fedpriv.neighbour_data import _natural_cases

    rows = natural_rows()
    named = replace(rows, users=np.array([f"user{u:03d}" for u in rows.users]))
    ids = set(np.unique(named.users).tolist())
    cases = _natural_cases(named, "user483", 1000, 10)
    for case, low in (("a copy added with the smallest id", True),
                      ("a copy added with the largest id", False)):
        new = set(cases[case][1].users.tolist()) - ids
        assert len(new) == 1, case
        (added,) = new
        assert (added < min(ids)) if low else (added > max(ids)), (case, added)
