"""Your own data as a CSV or Parquet table: the same arrays as the npz of the same data, a node
that reads only its own users' rows (and a server that reads no row at all: the header is all
it needs), the same run as the npz, and every malformed table named before the run."""

import csv

import numpy as np
import pytest

from fedpriv.algorithms.deep.problem import hosted_positions, model_of, problem_of, user_block
from fedpriv.configure import parse_config
from fedpriv.data import tables
from fedpriv.data.partition import partition
from fedpriv.data.sources import DatasetError, load_source, table_source
from fedpriv.engine import run_in_process
from fedpriv.params import ConfigError

USERS = 24
KEYS = {"algorithm": "deep-private-fedrep", "num-users": USERS, "hidden-sizes": "16",
        "rounds": 2, "checkpoint": False, "epsilon": 2.0, "delta": 1e-5,
        "partition": "natural", "num-classes": 10}


def _digits_by_user():
    """Digits cut into USERS label-skewed users with scattered, non-contiguous integer ids, as
    (user, split, label, features) rows in a shuffled order."""
    source = load_source("digits")
    users = partition(source, "label-skew", USERS, 5, 3)
    ids = 1000 - 37 * np.arange(USERS)  # decreasing: the natural order is not the file order
    rows = []
    for split, x, y, part in (("train", source.x_train, source.y_train, users.train),
                              ("test", source.x_test, source.y_test, users.test)):
        for u in range(USERS):
            for r in part.rows[part.offsets[u]:part.offsets[u + 1]]:
                rows.append((int(ids[u]), split, int(y[r]), x[r].reshape(-1)))
    order = np.random.default_rng(1).permutation(len(rows))
    return [rows[i] for i in order]


ROWS = _digits_by_user()
FEATURES = [f"px{i}" for i in range(64)]


def write_csv(path, rows=ROWS, header=None, junk=lambda i: False):
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(header or ["label", "user", *FEATURES, "split"])
        for i, (user, split, label, x) in enumerate(rows):
            values = ["junk"] * len(x) if junk(i) else [repr(float(v)) for v in x]
            out.writerow([label, user, *values, split])
    return path


def write_parquet(path, rows=ROWS, row_group_size=100):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    x = np.stack([r[3] for r in rows]).astype(np.float32)
    columns = {"user": pa.array([r[0] for r in rows], pa.int64()),
               "split": pa.array([r[1] for r in rows]),
               "label": pa.array([r[2] for r in rows], pa.int64()),
               **{name: pa.array(x[:, j]) for j, name in enumerate(FEATURES)}}
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def write_npz(path, rows=ROWS):
    arrays = {}
    for split in ("train", "test"):
        mine = [r for r in rows if r[1] == split]
        arrays[f"x_{split}"] = np.stack([r[3] for r in mine]).astype(np.float32)
        arrays[f"y_{split}"] = np.array([r[2] for r in mine], dtype=np.int64)
        arrays[f"user_{split}"] = np.array([r[0] for r in mine], dtype=np.int64)
    np.savez(path, **arrays)
    return path


def cfg(dataset, path, strict=None, **keys):
    """A user's run config (strict: the CLI's), or with ``data_part`` a node's (not strict, as
    the ClientApp parses it: a run config may not set data-part)."""
    return parse_config({**KEYS, "dataset": dataset, "data-file": str(path),
                                   **{k.replace("_", "-"): v for k, v in keys.items()}},
                                  strict="data_part" not in keys if strict is None else strict)


def checked(config):
    """The CLI's check before a run whose nodes read this file: every value of it."""
    from fedpriv.registry import get_algorithm

    get_algorithm(config.algorithm).check_inputs(config)
    return config


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_table_is_the_same_data_as_the_npz_of_its_rows(tmp_path, fmt):
    writer = write_csv if fmt == "csv" else write_parquet
    table = load_source(fmt, data_file=str(writer(tmp_path / f"d.{fmt}")))
    npz = load_source("npz", data_file=str(write_npz(tmp_path / "d.npz")))
    for name in ("x_train", "y_train", "x_test", "y_test", "user_train", "user_test"):
        ours, theirs = getattr(table, name), getattr(npz, name)
        assert np.array_equal(ours.reshape(len(ours), -1), theirs.reshape(len(theirs), -1)), name
    assert table.num_classes == npz.num_classes == 0  # a file's classes are declared
    assert table.user_train.dtype == np.int64  # integer ids sort as integers (9 < 10)


def test_a_node_reads_only_the_row_groups_of_its_own_users(tmp_path, monkeypatch):
    """Parquet sorted by user, small row groups: node 1 of 4 reads the feature columns of the
    groups holding its users' rows and no other group; its blocks equal the full load's."""
    path = write_parquet(tmp_path / "d.parquet", sorted(ROWS, key=lambda r: r[0]), 60)
    full = problem_of(cfg("parquet", path))
    pq = pytest.importorskip("pyarrow.parquet")
    read = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kw):
        read.append((i, tuple(columns or ())))
        return original(self, i, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    node = problem_of(cfg("parquet", path, data_part="1/4"))
    own = hosted_positions("natural", full.keys, USERS, 1, 4)
    assert 0 < len(own) < USERS / 2
    own_rows = sum(int(full.users.train.counts[u]) for u in own)
    assert node.source.x_train.shape[0] == own_rows < full.source.x_train.shape[0] / 3
    ordered = sorted(ROWS, key=lambda r: r[0])
    own_ids = set(np.unique([r[0] for r in ROWS])[own].tolist())
    expected = {i // 60 for i, r in enumerate(ordered) if r[0] in own_ids}
    total = pq.ParquetFile(path).num_row_groups
    assert {i for i, _ in read} == expected and len(expected) < total / 2, (read, total)
    assert all(set(cols) == set(FEATURES) for _, cols in read)  # features only, not ids
    for split in ("train", "test"):
        mine, theirs = user_block(node, own, split), user_block(full, own, split)
        assert np.array_equal(mine.x.numpy(), theirs.x.numpy())
        assert np.array_equal(mine.y.numpy(), theirs.y.numpy())
    other = np.setdiff1d(np.arange(USERS), own)[0]
    with pytest.raises(DatasetError, match="did not load"):
        user_block(node, np.array([other]), "train")  # another node's user


def test_a_csv_node_parses_only_its_own_rows_and_the_server_reads_no_row(tmp_path):
    """Features of every row but node 2's are not numbers: node 2 still reads the file,
    because it never parses them; a load of every row isolates the junk rows' users (nan);
    the server builds the model from the header alone (its copy may hold nothing else)."""
    ids = np.unique([r[0] for r in ROWS])
    full = problem_of(cfg("csv", write_csv(tmp_path / "clean.csv")), features=False)
    own = hosted_positions("natural", full.keys, USERS, 2, 3)
    own_ids = set(ids[own].tolist())
    path = write_csv(tmp_path / "d.csv", junk=lambda i: ROWS[i][0] not in own_ids)
    node = problem_of(cfg("csv", path, data_part="2/3"))
    assert np.isfinite(node.source.x_train).all() and len(node.source.x_train) > 0
    header_only = tmp_path / "server.csv"
    header_only.write_text(path.read_text().splitlines()[0] + "\n")
    get_validated(cfg("csv", header_only))
    assert model_of(cfg("csv", header_only)).input_shape == (64,)
    everything = problem_of(cfg("csv", path))
    for u in range(USERS):
        x = user_block(everything, np.array([u])).x[0, :everything.users.train.counts[u]]
        assert bool(x.isnan().all()) == (int(ids[u]) not in own_ids)
    # the CLI's check before a run of this file reads every feature: the first junk cell
    first_junk = next(i for i in range(len(ROWS)) if ROWS[i][0] not in own_ids)
    with pytest.raises(ConfigError, match=f"line {first_junk + 2}, column 3: 'junk' is not a "
                                          "finite number"):
        checked(cfg("csv", path))


def test_a_run_on_a_table_equals_the_run_on_the_npz(tmp_path):
    runs = {}
    for fmt, writer in (("csv", write_csv), ("npz", write_npz)):
        path = writer(tmp_path / f"d.{fmt}")
        runs[fmt] = run_in_process(cfg(fmt, path, results_path=str(tmp_path / f"{fmt}.json")),
                                   num_partitions=3, log=lambda _: None)
    assert runs["csv"]["metrics"] == runs["npz"]["metrics"]
    assert runs["csv"]["metrics"]["accuracy"] > 0.5
    assert runs["csv"]["privacy"]["ledger"] == runs["npz"]["privacy"]["ledger"]


@pytest.mark.parametrize(("header", "rows", "match"), [
    (["user", "label", "px0"], None, "lacks the column.*split"),
    (["user", "split", "label"], None, "no feature columns"),
    (None, [(1, "validation", 0, np.zeros(64))], "row 0 \\(line 2\\) has split = "
                                                 "'validation'; it must be 'train' or 'test'"),
    (None, [(1, "train", -1, np.zeros(64))], "row 0 \\(line 2\\) has a label outside the "
                                             "declared classes 0..9 \\(num-classes = 10"),
    (None, [(1, "train", 0, np.zeros(64)), (2, "test", 10, np.zeros(64))],
     "row 1 \\(line 3\\) has a label outside the declared classes"),
    (None, [(1, "train", "one", np.zeros(64))], "row 0 \\(line 2\\) has a label outside"),
])
def test_a_malformed_table_fails_before_the_run_naming_the_problem(tmp_path, header, rows,
                                                                     match):
    path = tmp_path / "bad.csv"
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(header or ["user", "split", "label", *FEATURES])
        for user, split, label, x in rows or [(1, "train", 0, np.zeros(64))]:
            out.writerow([user, split, label, *x][:len(header or [0] * 67)])
    with pytest.raises(ConfigError, match=match):
        checked(get_validated(cfg("csv", path)))


def test_missing_files_and_keys_fail_before_the_run(tmp_path):
    with pytest.raises(ConfigError, match="data-file: dataset = \"parquet\" needs data-file"):
        parse_config({**KEYS, "dataset": "parquet"})
    with pytest.raises(ConfigError, match="is not a file"):
        get_validated(cfg("csv", tmp_path / "nowhere.csv"))
    with pytest.raises(ConfigError, match="data-part"):
        cfg("csv", tmp_path / "d.csv", data_part="3/2")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("user,split,label,px0\n1,train,0,0.5\n2,train,1\n")
    with pytest.raises(ConfigError, match="line 3 has 3 fields"):
        checked(cfg("csv", ragged))
    with pytest.raises(ConfigError, match="num-classes: dataset = \"csv\" needs num-classes"):
        cfg("csv", ragged, num_classes=0)


def get_validated(config):
    from fedpriv.registry import get_algorithm

    get_algorithm(config.algorithm).validate(config)
    return config


def test_table_source_of_no_rows_holds_shapes_and_labels_only(tmp_path):
    path = write_csv(tmp_path / "d.csv")
    meta = table_source("csv", str(path), features=False)
    assert meta.x_train.shape == (0, 64) and meta.x_test.shape == (0, 64)
    assert len(meta.y_train) == sum(r[1] == "train" for r in ROWS)
    assert tables.table_columns.cache_info().currsize >= 1  # the columns are read once


def test_a_table_of_images_runs_a_cnn_as_the_npz_of_the_images_does(tmp_path):
    """input-shape = "1,8,8": a table's 64 feature columns become one-channel 8 x 8 images
    (row-major, as numpy reshapes), the cnn runs on them, and the run equals the run on an npz
    holding the images as (N, 1, 8, 8) arrays; a shape of another size fails before the run,
    naming the key, on the server's columns-only read too."""
    path = write_csv(tmp_path / "d.csv")
    images = tmp_path / "images.npz"
    flat = np.load(write_npz(tmp_path / "flat.npz"))
    np.savez(images, **{k: (flat[k].reshape(len(flat[k]), 1, 8, 8) if k.startswith("x_")
                            else flat[k]) for k in flat.files})
    keys = {"model": "cnn", "rounds": 1, "head_steps": 5, "final_head_steps": 5}
    table = problem_of(cfg("csv", path, input_shape="1,8,8", **keys))
    assert table.spec.input_shape == (1, 8, 8)
    assert problem_of(cfg("csv", path, input_shape="1,8,8", **keys),
                      features=False).spec.input_shape == (1, 8, 8)
    block = user_block(table, np.arange(3))
    assert block.x.shape[2:] == (1, 8, 8)
    runs = {}
    for name, config in (("csv", cfg("csv", path, input_shape="1,8,8", **keys)),
                         ("npz", cfg("npz", images, **keys))):
        runs[name] = run_in_process(config, num_partitions=2, log=lambda _: None)
    assert runs["csv"]["metrics"] == runs["npz"]["metrics"]
    for bad in ("1,9,9", "64,2"):
        with pytest.raises(ConfigError, match=r"input-shape: .* holds \d+ values.*\(64,\)"):
            get_validated(cfg("csv", path, input_shape=bad, **keys))
    with pytest.raises(ConfigError, match="input-shape"):
        cfg("csv", path, input_shape="1,x")


@pytest.mark.parametrize("cell", ["abc", "nan", "inf", "", "1e39"])  # 1e39: inf in float32
def test_a_feature_that_is_not_a_finite_number_fails_before_the_run_naming_its_place(
        tmp_path, cell):
    """The CLI's strict parse reads every feature once (a node later reads only its own rows:
    a bad cell found there would stop that node in every round, and a Flower run would go on
    without it)."""
    path = write_csv(tmp_path / "d.csv")
    lines = path.read_text().splitlines()
    fields = lines[5].split(",")
    fields[7] = cell  # line 6 of the file, column 8: a feature (label, user, px0.. first)
    lines[5] = ",".join(fields)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=f"line 6, column 8: '{cell}' is not a finite number"):
        checked(cfg("csv", path))
    problem_of(cfg("csv", path), features=False)  # the server's read: columns only


def test_a_bad_cell_is_named_by_the_line_its_record_starts_on(tmp_path):
    """A quoted field may span lines: the error names the file's line, not the record's
    number, in the full check and in a node's read."""
    path = tmp_path / "d.csv"
    path.write_text('user,split,label,px0,px1\n"user\none",train,0,0.5,1\n'
                    'two,train,1,3,x\n')
    with pytest.raises(tables.TableError, match="line 4, column 5: 'x'"):
        tables.check_features(path, "csv")
    columns = tables.table_columns(path, "csv")
    # a node reads it as nan: the user of that row is isolated (zero contribution)
    assert np.isnan(tables.table_rows(columns, np.array([1]))[0, 1])
    path.write_text('user,split,label,px0,px1\n"user\none",train,0,0.5,1\n'
                    'two,train,1,3,4.0\n')  # mended: a new size and time, checked again
    tables.check_features(path, "csv")


def test_the_full_csv_check_passes_a_clean_file_with_or_without_its_fast_path(tmp_path,
                                                                              monkeypatch):
    path = write_csv(tmp_path / "d.csv")
    assert tables._arrow_finds_all_finite(path, tuple(FEATURES))
    checked(cfg("csv", path))
    tables._checked_features.cache_clear()
    monkeypatch.setattr(tables, "_arrow_finds_all_finite", lambda *a: False)  # no pyarrow
    checked(cfg("csv", path))  # the row-by-row scan agrees


def test_a_parquet_feature_that_is_missing_or_not_finite_fails_before_the_run(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = write_parquet(tmp_path / "good.parquet")
    table = pq.read_table(good)
    column = table.column("px3").to_numpy().copy()
    column[50] = np.nan
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("px3"), "px3",
                                    pa.array(column)), bad, row_group_size=100)
    with pytest.raises(ConfigError, match="'px3' holds a missing or non-finite value"):
        checked(cfg("parquet", bad))
    texts = tmp_path / "text.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("px3"), "px3",
                                    pa.array([str(v) for v in column])), texts)
    with pytest.raises(ConfigError, match="'px3' has type string"):
        checked(cfg("parquet", texts))
    # a node reading its rows (no full check) keeps the value: its user is isolated
    source = problem_of(cfg("parquet", bad)).source
    assert np.isnan(source.x_train).sum() + np.isnan(source.x_test).sum() == 1


@pytest.mark.parametrize("value", [np.inf, 1e39])
def test_an_npz_with_non_finite_features_is_refused(tmp_path, value):
    path = write_npz(tmp_path / "d.npz")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["x_test"] = arrays["x_test"].astype(np.float64)
    arrays["x_test"][3, 5] = value
    np.savez(path, **arrays)
    with pytest.raises(ConfigError, match="x_test row 3 holds a value that is not a finite "
                                          "number in float32"):
        checked(cfg("npz", path))
    get_validated(cfg("npz", path))  # the server reads the array header only


def test_an_npz_of_boolean_features_is_numbers(tmp_path):
    path = write_npz(tmp_path / "d.npz")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    for split in ("train", "test"):
        arrays[f"x_{split}"] = arrays[f"x_{split}"] > 0
    np.savez(path, **arrays)
    assert problem_of(cfg("npz", path)).source.x_train.dtype == np.float32


def test_a_run_config_may_not_set_what_a_node_sets_for_itself(tmp_path):
    path = write_csv(tmp_path / "d.csv")
    with pytest.raises(ConfigError, match="data-part: set by the ClientApp"):
        cfg("csv", path, data_part="0/2", strict=True)


def test_natural_users_are_every_user_of_the_file_in_id_order(tmp_path):
    """num-users is the public population the releases divide by: it cuts no user out (a cut
    at the smallest ids would let an added user push another one out)."""
    path = write_csv(tmp_path / "d.csv")
    problem = problem_of(cfg("csv", path, num_users=5))
    ids = np.unique([r[0] for r in ROWS])  # integers, in numeric order
    assert len(problem.users.train.counts) == USERS
    assert np.array_equal(problem.keys, ids)  # each user's randomness key is its own id
    for u in range(USERS):
        block = user_block(problem, np.array([u]))
        expected = [r for r in ROWS if r[0] == ids[u] and r[1] == "train"]
        assert block.counts[0] == len(expected)
        assert sorted(block.y[0, :len(expected)].tolist()) == sorted(r[2] for r in expected)


def test_a_data_file_with_a_dataset_that_does_not_read_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="data-file: read only with dataset = npz, csv or "
                                          "parquet; dataset = 'digits' would ignore"):
        parse_config({**KEYS, "partition": "label-skew", "num-users": 50,
                                "dataset": "digits", "data-file": str(tmp_path / "x.csv")})


def test_the_cli_refuses_a_bad_cell_before_the_run_and_keeps_the_run_config_parse_light(
        tmp_path, capsys):
    from fedpriv.cli import main as cli_main

    path = write_csv(tmp_path / "d.csv", junk=lambda i: i == 30)
    out = tmp_path / "r.json"
    args = ["run", "--engine", "inprocess", "--out", str(out), "--set", "dataset=csv",
            "--set", f"data-file={path}", *[f"--set={k}={v}" for k, v in KEYS.items()
                                             if k not in ("checkpoint",)]]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "invalid config: data-file:" in err and "line 32, column 3: 'junk'" in err
    assert not out.exists()


def test_a_node_config_data_file_is_used_only_by_a_run_that_reads_a_file(tmp_path):
    """A SuperNode started with its own data-file (``fedpriv deploy commands --node-data``)
    can still serve a run on a built-in dataset: the ClientApp passes the file on only where
    the run reads one."""
    from flwr.app import Context, RecordDict

    from clients.app import _run_config
    from fedpriv import protocol as P

    path = write_csv(tmp_path / "d.csv")

    def node(dataset, **extra):
        run = parse_config({**KEYS, "dataset": dataset, **extra}).to_mapping()
        context = Context(run_id=1, node_id=7, state=RecordDict(), run_config=run,
                          node_config={P.KEY_PARTITION: 1, P.KEY_NUM_PARTITIONS: 2,
                                       P.KEY_DATA_FILE: str(path)})
        return _run_config(context, 1, 2)

    digits = node("digits", partition="label-skew", num_users=100)
    assert digits.data_file == "" and digits.data_part == ""
    server_copy = write_csv(tmp_path / "server.csv")
    table = node("csv", **{"data-file": str(server_copy)})
    assert table.data_file == str(path) and table.data_part == "1/2"
