"""Your own data as a table, CSV or Parquet, with one row per example: a ``user`` column (the
natural user id), a ``split`` column (``train`` or ``test``), a ``label`` column (integers in
0..C-1, C = ``num-classes``) and every other column a numeric feature, in file order.

Three reads, so that the server reads no user's row and a SuperNode never holds the whole file:

* ``feature_names``: the header (CSV) or schema (Parquet) alone: the shape of a row, all the
  server needs to build the model.
* ``table_columns``: a node's read of the ``user``, ``split`` and ``label`` columns of every
  row, which its partition needs (a label that is not an integer reads as -1: its user is
  isolated on the node).
* ``table_rows``: the features of the given rows only. A node asks for its own users' rows.
  Parquet is read by row group, only the groups that hold one of those rows, and only the
  feature columns; CSV has no index, so the file is streamed once and only the wanted rows are
  parsed and kept (a cell that is not a number reads as nan: its user is isolated).

And one check, ``check_table`` (with ``check_features``), that every split is train or test,
every label an integer in the declared classes and every feature a finite number, naming the
first row that is not: the CLI runs it before a run on the file it was given, from the
operator's copy, so that a bad row stops the run before it starts. Neither the server nor a
node runs it.

Parquet needs ``pyarrow`` (``pip install pyarrow``; it comes with ``flwr-datasets``). CSV needs
nothing but the standard library.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

TABLE_FORMATS = ("csv", "parquet")
USER, SPLIT, LABEL = "user", "split", "label"
SPLITS = ("train", "test")


class TableError(ValueError):
    """A table cannot be read as a dataset; the message names the file and the problem."""


@dataclass(frozen=True, eq=False)
class TableColumns:
    """Every row's user id, split ("train"/"test") and label; the feature columns' names."""

    path: Path
    fmt: str
    users: np.ndarray
    splits: np.ndarray
    labels: np.ndarray
    features: tuple[str, ...]

    def split_rows(self, split: str) -> np.ndarray:
        """File rows (0-based, header excluded) of one split, in file order."""
        return np.flatnonzero(self.splits == split)


def _check_file(path: Path, fmt: str) -> None:
    if fmt not in TABLE_FORMATS:
        raise TableError(f"dataset: {fmt!r} is not a table format ({', '.join(TABLE_FORMATS)})")
    if not str(path) or not path.is_file():
        raise TableError(f"data-file: {str(path)!r} is not a file (dataset = {fmt!r} reads a "
                         f"table with columns {USER}, {SPLIT}, {LABEL} and numeric features)")


def _pyarrow() -> Any:
    """``pyarrow.parquet`` (typed Any: pyarrow ships no type information)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - pyarrow comes with the test extra
        raise TableError("dataset: 'parquet' needs pyarrow (pip install pyarrow)") from err
    return pq


def _user_ids(values: list[str] | np.ndarray) -> np.ndarray:
    """User ids as int64 when every id is an integer (so that 9 < 10), else as strings."""
    array = np.asarray(values)
    if array.dtype.kind in "iu":
        return array.astype(np.int64)
    try:
        return np.asarray([int(v) for v in array], dtype=np.int64)
    except (TypeError, ValueError):
        return array.astype(str)


def feature_names(path: Path, fmt: str) -> tuple[str, ...]:
    """The feature columns' names from the header (CSV) or schema (Parquet) alone: the shape
    of every row, which is all a server needs of a table (it reads no row)."""
    _check_file(path, fmt)
    if fmt == "csv":
        with open(path, newline="") as fh:
            header = next(csv.reader(fh), None)
        if header is None:
            raise TableError(f"data-file: {path} is empty (a header row is needed)")
    else:
        header = _pyarrow().ParquetFile(path).schema_arrow.names
    _locate(path, header)
    return tuple(name for name in header if name not in (USER, SPLIT, LABEL))


@lru_cache(maxsize=4)
def table_columns(path: Path, fmt: str) -> TableColumns:
    """The id, split and label columns (cached per process): a node's read. The values are
    not judged here (``check_table`` does, before a run)."""
    _check_file(path, fmt)
    if fmt == "csv":
        with open(path, newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise TableError(f"data-file: {path} is empty (a header row is needed)")
            where = _locate(path, header)
            users, splits, labels = [], [], []
            for line, row in _records(reader):
                if len(row) != len(header):
                    raise TableError(f"data-file: {path} line {line} has {len(row)} fields, "
                                     f"the header {len(header)}")
                users.append(row[where[USER]])
                splits.append(row[where[SPLIT]].strip())
                labels.append(row[where[LABEL]])
    else:
        pq = _pyarrow()
        header = pq.ParquetFile(path).schema_arrow.names
        _locate(path, header)
        table = pq.read_table(path, columns=[USER, SPLIT, LABEL])
        users = table.column(USER).to_numpy(zero_copy_only=False)
        splits = [str(s) for s in table.column(SPLIT).to_pylist()]
        labels = table.column(LABEL).to_pylist()
    split_array = np.asarray(splits, dtype=str)
    features = tuple(name for name in header if name not in (USER, SPLIT, LABEL))
    return TableColumns(path, fmt, _user_ids(users), split_array, _labels(labels), features)


def _labels(values: list[Any]) -> np.ndarray:
    """Labels as int64, -1 for a cell that is not an integer (``check_table`` refuses such a
    file before a run; a node that meets one isolates that cell's user)."""
    out = np.full(len(values), -1, dtype=np.int64)
    for i, v in enumerate(values):
        try:
            number = float(v)
        except (TypeError, ValueError):
            continue
        if number.is_integer():
            out[i] = int(number)
    return out


def check_table(path: Path, fmt: str, num_classes: int) -> None:
    """Every row's split ``train``/``test`` and label an integer in ``[0, num_classes)``, and
    every feature a finite number (``check_features``), or a ``TableError`` naming the first
    row (and file line) that is not."""
    columns = table_columns(path, fmt)
    wrong = np.flatnonzero(~np.isin(columns.splits, SPLITS))
    if wrong.size:
        raise TableError(f"data-file: {path}: row {int(wrong[0])}{_line(columns, wrong[0])} "
                         f"has {SPLIT} = {str(columns.splits[wrong[0]])!r}; it must be 'train' "
                         "or 'test'")
    bad = np.flatnonzero((columns.labels < 0) | (columns.labels >= num_classes))
    if bad.size:
        raise TableError(f"data-file: {path}: row {int(bad[0])}{_line(columns, bad[0])} has a "
                         f"{LABEL} outside the declared classes 0..{num_classes - 1} "
                         f"(num-classes = {num_classes}; labels are integers, shared by "
                         "every user, so they cannot be counted from the rows)")
    check_features(path, fmt)


def _line(columns: TableColumns, row: int) -> str:
    """`` (file line L)`` for a CSV row (records may span lines: counted again here)."""
    if columns.fmt != "csv":
        return ""
    with open(columns.path, newline="") as fh:
        reader = csv.reader(fh)
        next(reader)
        for number, (line, _) in enumerate(_records(reader)):
            if number == row:
                return f" (line {line})"
    return ""


# the smallest magnitude that float32 rounds to infinity, (2 - 2^-24) 2^127: features are held
# as float32, so a value at or above it (1e39, say) is as unusable as inf
F32_OVERFLOW = float.fromhex("0x1.ffffffp+127")


def _parse_features(row: list[str], keep: list[int], path: Path, line: int,
                    strict: bool = True) -> list[float]:
    """The features of one CSV row as floats, or a ``TableError`` naming the line and column
    of the first cell that is not a finite number in float32. ``strict = False`` (a node
    reading its users' rows): such a cell is nan instead, which isolates its user (its
    contribution becomes zero on the node; ``fedpriv run`` refuses the file before a run)."""
    try:
        values = list(map(float, [row[j] for j in keep]))
    except ValueError:
        values = None
    if not strict:
        return values if values is not None else [
            float(row[j]) if _finite(row[j]) else float("nan") for j in keep]
    # ``F32_OVERFLOW > v`` is False for nan as for too large a value
    if values is None or not all(map(F32_OVERFLOW.__gt__, map(abs, values))):
        bad = next(j for j in keep if not _finite(row[j]))
        raise TableError(f"data-file: {path} line {line}, column {bad + 1}: {row[bad]!r} is "
                         "not a finite number in float32 (a magnitude below 3.4e38; every "
                         "column but user, split and label is a numeric feature)")
    return values


def _arrow_finds_all_finite(path: Path, features: tuple[str, ...]) -> bool:
    """True if pyarrow's CSV reader (C++, streamed in 16 MiB blocks) parses every feature as a
    number finite in float32: the fast path of ``check_features`` (several times faster than
    the row-by-row scan on a large CSV). False where pyarrow is missing, refuses
    a cell or finds a missing or non-finite value; the row-by-row scan with Python's ``float``
    (what a node parses with) then decides."""
    try:
        import pyarrow as pa
        import pyarrow.csv as pacsv
    except ImportError:  # pragma: no cover - pyarrow comes with the test extra
        return False
    if len(set(features)) != len(features):
        return False
    try:
        reader = pacsv.open_csv(
            path, read_options=pacsv.ReadOptions(block_size=1 << 24),
            convert_options=pacsv.ConvertOptions(
                column_types={name: pa.float64() for name in features},
                include_columns=list(features)))
        for batch in reader:
            for column in batch.columns:
                if column.null_count or not _finite32(column.to_numpy(zero_copy_only=False)):
                    return False
    except (pa.ArrowException, ValueError, OSError):
        return False
    return True


def _finite(text: str) -> bool:
    """Whether a cell parses as a number that is finite in float32."""
    try:
        return abs(float(text)) < F32_OVERFLOW
    except ValueError:
        return False


def _finite32(values: np.ndarray) -> bool:
    """Whether every value is finite once held as float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.asarray(values).astype(np.float32)).all())


def check_features(path: Path, fmt: str) -> None:
    """Raise a ``TableError`` naming the place of the first feature that is not a finite
    number in float32, reading the whole file once and keeping none of it (a pass is cached
    per process, while the file keeps its size and modification time)."""
    _check_file(path, fmt)
    state = path.stat()
    _checked_features(path, fmt, state.st_size, state.st_mtime_ns)


@lru_cache(maxsize=4)
def _checked_features(path: Path, fmt: str, _size: int, _mtime_ns: int) -> None:
    columns = table_columns(path, fmt)
    if fmt == "csv":
        if _arrow_finds_all_finite(path, columns.features):
            return  # else the scan below is the judge, and names the cell
        with open(path, newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader)
            keep = [header.index(name) for name in columns.features]
            for line, row in _records(reader):
                _parse_features(row, keep, path, line)
        return
    import pyarrow as pa

    names = list(columns.features)
    source = _pyarrow().ParquetFile(path)
    schema = source.schema_arrow
    for name in names:
        kind = schema.field(name).type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                or pa.types.is_boolean(kind)):
            raise TableError(f"data-file: {path}: feature column {name!r} has type {kind}; "
                             "every column but user, split and label must be numeric")
    for group in range(source.num_row_groups):
        table = source.read_row_group(group, columns=names)
        for name in names:
            column = table.column(name)
            if column.null_count or not _finite32(column.to_numpy(zero_copy_only=False)):
                raise TableError(f"data-file: {path}: feature column {name!r} holds a missing "
                                 "or non-finite value (row group "
                                 f"{group}); every feature must be a finite number in float32 "
                                 "(magnitude below 3.4e38)")


class _CsvReader(Protocol):
    """What ``_records`` uses of a ``csv.reader``."""

    line_num: int

    def __iter__(self) -> Iterator[list[str]]: ...


def _records(reader: _CsvReader) -> Iterator[tuple[int, list[str]]]:
    """(the file line a record starts on, the record) after the header: a quoted field may hold
    line breaks, so records and lines differ."""
    start = reader.line_num + 1
    for row in reader:
        yield start, row
        start = reader.line_num + 1


def _locate(path: Path, header: list[str]) -> dict[str, int]:
    missing = [name for name in (USER, SPLIT, LABEL) if name not in header]
    if missing:
        raise TableError(f"data-file: {path} lacks the column(s) {', '.join(missing)} (a table "
                         f"dataset has {USER}, {SPLIT}, {LABEL} and feature columns)")
    if len(header) == 3:
        raise TableError(f"data-file: {path} has no feature columns")
    return {name: header.index(name) for name in (USER, SPLIT, LABEL)}


def table_rows(columns: TableColumns, rows: np.ndarray) -> np.ndarray:
    """The features (len(rows), F) float32 of the given file rows, in the order given; nothing
    else of the file is parsed (CSV) or read (Parquet: only the row groups holding them)."""
    rows = np.asarray(rows, dtype=np.int64)
    wanted = np.unique(rows)
    if wanted.size and (wanted[0] < 0 or wanted[-1] >= len(columns.users)):
        raise TableError(f"data-file: {columns.path} has no row {int(wanted[-1])}")
    width = len(columns.features)
    out = np.empty((len(wanted), width), dtype=np.float32)
    if columns.fmt == "csv":
        _csv_rows(columns, wanted, out)
    else:
        _parquet_rows(columns, wanted, out)
    return out[np.searchsorted(wanted, rows)]


def _csv_rows(columns: TableColumns, wanted: np.ndarray, out: np.ndarray) -> None:
    with open(columns.path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        keep = [header.index(name) for name in columns.features]
        k = 0
        for row_number, (line, row) in enumerate(_records(reader)):
            if k == len(wanted):
                break
            if row_number != wanted[k]:
                continue
            out[k] = _parse_features(row, keep, columns.path, line, strict=False)
            k += 1


def _parquet_rows(columns: TableColumns, wanted: np.ndarray, out: np.ndarray) -> None:
    pq = _pyarrow()
    source = pq.ParquetFile(columns.path)
    sizes = [source.metadata.row_group(g).num_rows for g in range(source.num_row_groups)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    group_of = np.searchsorted(starts, wanted, side="right") - 1
    for group in np.unique(group_of):
        table = source.read_row_group(int(group), columns=list(columns.features))
        try:  # a missing or non-finite value stays nan or inf: it isolates its user
            with np.errstate(over="ignore", invalid="ignore"):
                block = np.column_stack([
                    table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
                    for name in columns.features]).astype(np.float32)
        except (TypeError, ValueError):
            raise TableError(f"data-file: {columns.path}: feature columns must be "
                             "numeric") from None
        mine = group_of == group
        out[mine] = block[wanted[mine] - starts[group]]
