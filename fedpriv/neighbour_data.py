"""Neighbours of a user's own data file: copies that differ from it in one user, written in the
file's own format (npz, csv or parquet), for ``fedpriv.neighbours`` (``fedpriv audit
--neighbours``).

With natural users (a user column) a neighbour adds, removes or replaces one user: the user
removed; a copy of it added under an id below every other id (and one above); the same user
under another id; its features made huge but finite (1e37), tiny, or nan; its rows cut to one
or two, or repeated past ``max-rows-per-user``; one of its labels outside the declared classes.
Where users are a simulated partition of the rows (label skew, Dirichlet, iid), which rows
belong to whom is a function of every row's label, so only the values of one user's features
change (huge, tiny, nan) and the rows and labels stay.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import numpy as np

from fedpriv.algorithms.deep.params import DataKeys, DeepLocalConfig
from fedpriv.algorithms.deep.problem import problem_of
from fedpriv.configure import parse_config
from fedpriv.data.sources import load_source
from fedpriv.data.tables import USER, table_columns, table_rows
from fedpriv.neighbours import Neighbour


@dataclass(frozen=True)
class Rows:
    """A data file's rows: user ids (None: no user column), split, label, features (N, *x)."""

    users: np.ndarray | None
    splits: np.ndarray
    labels: np.ndarray
    x: np.ndarray

    def take(self, keep: np.ndarray) -> Rows:
        return Rows(None if self.users is None else self.users[keep], self.splits[keep],
                    self.labels[keep], self.x[keep])

    def join(self, other: Rows) -> Rows:
        assert self.users is not None and other.users is not None
        return Rows(np.concatenate([self.users, other.users]),
                    np.concatenate([self.splits, other.splits]),
                    np.concatenate([self.labels, other.labels]),
                    np.concatenate([self.x, other.x]))


def read_rows(config: DataKeys) -> Rows:
    """Every row of the run's data file (the operator's own copy)."""
    if config.dataset == "npz":
        source = load_source("npz", data_file=config.data_file)
        users = (None if source.user_train is None
                 else np.concatenate([source.user_train, source.user_test]))
        return Rows(users, np.array(["train"] * len(source.y_train) + ["test"] *
                                    len(source.y_test)),
                    np.concatenate([source.y_train, source.y_test]),
                    np.concatenate([source.x_train, source.x_test]))
    columns = table_columns(Path(config.data_file), config.dataset)
    return Rows(columns.users, columns.splits, columns.labels,
                table_rows(columns, np.arange(len(columns.users))))


def write_rows(rows: Rows, path: Path, fmt: str) -> Path:
    """``rows`` as a data file of format ``fmt`` (feature columns ``f0, f1, ...``)."""
    flat = rows.x.reshape(len(rows.x), -1)
    if fmt == "npz":
        arrays = {}
        for split in ("train", "test"):
            mine = rows.splits == split
            arrays[f"x_{split}"], arrays[f"y_{split}"] = rows.x[mine], rows.labels[mine]
            if rows.users is not None:
                arrays[f"user_{split}"] = rows.users[mine]
        np.savez(path, **arrays)
        return path
    names = [f"f{j}" for j in range(flat.shape[1])]
    users = rows.users
    if users is None:  # only an npz file may lack the user column
        raise ValueError(f"a {fmt} data file needs a user id per row")
    if fmt == "csv":
        with open(path, "w", newline="") as fh:
            out = csv.writer(fh)
            out.writerow([USER, "split", "label", *names])
            for i in range(len(flat)):
                out.writerow([users[i], rows.splits[i], int(rows.labels[i]),
                              *(repr(float(v)) for v in flat[i])])
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {USER: pa.array(users.tolist()), "split": pa.array(rows.splits.tolist()),
               "label": pa.array(rows.labels.astype(np.int64)),
               **{name: pa.array(flat[:, j].astype(np.float64)) for j, name in
                  enumerate(names)}}
    pq.write_table(pa.table(columns), path)
    return path


def _scaled(factor: float) -> Callable[[np.ndarray], np.ndarray]:
    def change(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            return (x.astype(np.float64) * factor + (factor if factor > 1 else 0.0)).astype(
                np.float32)
    return change


def _nan(x: np.ndarray) -> np.ndarray:
    out = x.astype(np.float32).copy()
    out.reshape(len(out), -1)[:, 0] = np.nan
    return out


VALUE_CHANGES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "features x 1e37 (finite)": _scaled(1e37),
    "features x 1e-30": _scaled(1e-30),
    "a feature nan": _nan,
}


def _changed(rows: Rows, mine: np.ndarray, change: Callable[[np.ndarray], np.ndarray]) -> Rows:
    x = rows.x.astype(np.float32).copy()
    x[mine] = change(x[mine])
    return replace(rows, x=x)


def _natural_cases(rows: Rows, user: object, cap: int,
                   classes: int) -> dict[str, tuple[str, Rows]]:
    """(relation, rows of D') of each natural-user neighbour of ``rows`` about ``user``."""
    assert rows.users is not None
    ids = np.unique(rows.users)
    mine = rows.users == user
    others = rows.take(~mine)
    own = rows.take(mine)
    if ids.dtype.kind in "iu":
        low, high = ids[0] - 1, ids[-1] + 1  # np.unique sorts
    else:  # text ids: below and above every id (numpy has no min of strings)
        low, high = "!" + str(ids[0]), str(ids[-1]) + "~"

    def renamed(new: object) -> Rows:  # the user's rows under id ``new`` (dtype wide enough)
        return replace(own, users=np.full(
            len(own.labels), new, dtype=np.result_type(ids.dtype, np.asarray(new).dtype)))

    train = np.flatnonzero(own.splits == "train")
    label = own.labels.copy()
    label[train[0]] = classes + 9
    repeat = -(-(cap + 1) // max(len(train), 1))
    many = own.take(np.concatenate([np.repeat(train, repeat),
                                    np.flatnonzero(own.splits == "test")]))
    cases = {
        "user removed": ("remove", others),
        "a copy added with the smallest id": ("add", rows.join(renamed(low))),
        "a copy added with the largest id": ("add", rows.join(renamed(high))),
        "the user under another id": ("replace", others.join(renamed(high))),
        "one training row": ("replace", others.join(own.take(np.setdiff1d(
            np.arange(len(own.labels)), train[1:])))),
        "two training rows": ("replace", others.join(own.take(np.setdiff1d(
            np.arange(len(own.labels)), train[2:])))),
        f"more than max-rows-per-user ({cap}) rows": ("replace", others.join(many)),
        f"a label outside 0..{classes - 1}": ("replace", others.join(replace(own,
                                                                            labels=label))),
    }
    for name, change in VALUE_CHANGES.items():
        cases[name] = ("replace", _changed(rows, mine, change))
    return cases


def with_file(config: DataKeys, path: Path) -> DataKeys:
    """``config`` reading the data file at ``path``."""
    # the same algorithm's keys, so parse_config makes the same config class as ``config``'s
    return cast(DataKeys, parse_config({**config.to_mapping(), "data-file": str(path)}))


def file_neighbours(config: DataKeys, folder: Path, user: str | int | None = None,
                    ) -> tuple[DataKeys, list[Neighbour]]:
    """D and its neighbours about one user (``user``: its id with natural users, its position
    otherwise; default: the middle one), every one written under ``folder`` by the same
    writer (so that D and D' differ in that user's rows alone): (D's config, neighbours)."""
    rows = read_rows(config)
    folder.mkdir(parents=True, exist_ok=True)
    suffix = config.dataset
    base = with_file(config, write_rows(rows, folder / f"D.{suffix}", suffix))
    if config.partition == "natural":
        if rows.users is None:
            raise ValueError(f"partition = \"natural\": {config.data_file} has no user ids")
        ids = np.unique(rows.users)
        target = ids[len(ids) // 2] if user is None else np.asarray(
            [user]).astype(ids.dtype)[0]
        if target not in ids:
            raise ValueError(f"user {user!r} is not in {config.data_file}")
        cases = _natural_cases(rows, target, config.max_rows_per_user, config.num_classes)
    else:
        if not isinstance(config, DeepLocalConfig):  # the partition is the deep problem's
            raise ValueError(f"{config.algorithm}: its users are not a deep algorithm's "
                             "partition of the rows")
        problem = problem_of(config, features=False)
        position = len(problem.users.train.counts) // 2 if user is None else int(user)
        train_rows = np.flatnonzero(rows.splits == "train")
        test_rows = np.flatnonzero(rows.splits == "test")
        users = problem.users
        mine = np.zeros(len(rows.labels), dtype=bool)
        mine[train_rows[users.train.rows[users.train.offsets[position]:
                                         users.train.offsets[position + 1]]]] = True
        mine[test_rows[users.test.rows[users.test.offsets[position]:
                                       users.test.offsets[position + 1]]]] = True
        target = position
        cases = {name: ("replace", _changed(rows, mine, change))
                 for name, change in VALUE_CHANGES.items()}
    out: list[Neighbour] = []
    for i, (name, (relation, changed)) in enumerate(cases.items()):
        path = write_rows(changed, folder / f"neighbour-{i}.{suffix}", suffix)
        out.append(Neighbour(f"user {target}: {name}", relation, with_file(config, path)))
    return base, out
