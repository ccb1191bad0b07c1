"""Real datasets for the deep personalization algorithms, read from local files only.

Nothing is downloaded at run time (the machines this runs on have no internet):

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), cut
  once into a fixed 80/20 train/test split (a pure function of nothing: every node agrees).
* ``fashion-mnist``: the 70,000 28x28 images of Xiao et al. (2017) as IDX files (gzipped or
  not), from Debian's ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``)
  or a ``data-dir``. A missing file is a ``DatasetError`` naming the package to install.
* ``npz``: your own data, a NumPy ``.npz`` file with ``x_train, y_train, x_test, y_test`` and,
  for natural users, ``user_train, user_test`` (one user id per row).
* ``csv`` / ``parquet``: your own data as a table with ``user``, ``split``, ``label`` and feature
  columns (``fedpriv.data.tables``). These can be read in part: ``table_source`` with the rows a
  node needs loads only those rows' features (``Source.train_rows``/``test_rows`` say which);
  with ``features=False`` only the id, split and label columns (all a node's partition needs).

A server reads none of a file's rows: ``data_shape`` gives one input's shape from the dataset's
metadata or the file's header, and the classes are the built-in dataset's or the config's
``num-classes``. ``check_npz`` (and ``fedpriv.data.tables.check_table``) refuse a bad file
before a run; a node that meets a bad value anyway keeps it (nan), which isolates its user.

Pixels are scaled to [0, 1] and standardized with constants of the dataset (not statistics of
the users' data, which would be a release). Images keep a channel axis: (N, 1, H, W).
"""

from __future__ import annotations

import gzip
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedpriv.data.tables import (
    TABLE_FORMATS,
    TableError,
    feature_names,
    table_columns,
    table_rows,
)

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
SOURCES = ("digits", "fashion-mnist", "npz", *TABLE_FORMATS)
_DIGITS_SPLIT_SEED = 0xD161


class DatasetError(ValueError):
    """A dataset cannot be read; the message names the file and how to get it."""


@dataclass(frozen=True, eq=False)
class Source:
    """A dataset's arrays: features (N, *input_shape) float32, labels (N,) int64, and for data
    with natural users their user column (else None). A table read in part holds the features
    of some rows only: ``train_rows`` (``test_rows``) are then the sorted indices, in the split,
    of the rows in ``x_train`` (``x_test``); None = every row."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int  # the built-in datasets' (published); 0 for a file: num-classes declares it
    user_train: np.ndarray | None = None
    user_test: np.ndarray | None = None
    train_rows: np.ndarray | None = None
    test_rows: np.ndarray | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def features(self, split: str, rows: np.ndarray) -> np.ndarray:
        """x of the split's ``rows`` (indices in the split), or a ``DatasetError`` where some
        were not loaded (a node asked about users that are not its own)."""
        x = self.x_train if split == "train" else self.x_test
        held = self.train_rows if split == "train" else self.test_rows
        if held is None:
            picked: np.ndarray = x[rows]
            return picked
        local = np.minimum(np.searchsorted(held, rows), max(len(held) - 1, 0))
        if len(held) == 0 or not np.array_equal(held[local], rows):
            raise DatasetError(f"dataset: {self.name}: rows of the {split} split were asked "
                               "for that this process did not load (data-part: a node reads "
                               "only its own users' rows)")
        return x[local]


def load_source(name: str, data_dir: str = "", data_file: str = "",
                features: bool = True) -> Source:
    """The named dataset (cached per process: every step of a run reads the same arrays).
    ``features = False``: labels, user ids and shapes only, where the format allows reading
    them alone (Fashion-MNIST: the label files and the image files' headers; csv/parquet: the
    id, split and label columns): what a node's partition needs."""
    if name not in SOURCES:
        raise DatasetError(f"dataset: {name!r} is not one of {', '.join(SOURCES)}")
    return _load(name, data_dir, data_file, features or name in ("digits", "npz"))


@lru_cache(maxsize=4)
def _load(name: str, data_dir: str, data_file: str, features: bool) -> Source:
    if name in TABLE_FORMATS:
        return table_source(name, data_file, features=features)
    if name == "digits":
        return _digits()
    if name == "fashion-mnist":
        return _fashion_mnist(Path(data_dir or FASHION_MNIST_DIR), features)
    return _npz(Path(data_file))


def _digits() -> Source:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - scikit-learn is a dependency
        raise DatasetError("dataset: 'digits' needs scikit-learn (pip install scikit-learn)") \
            from err
    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0 - 0.3) / 0.4
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return Source("digits", x[train, None], y[train], x[test, None], y[test], 10)


_IDX_TYPES: dict[int, np.dtype] = {
    code: np.dtype(kind) for code, kind in ((0x08, np.uint8), (0x09, np.int8), (0x0B, ">i2"),
                                           (0x0C, ">i4"), (0x0D, ">f4"), (0x0E, ">f8"))}


def _idx_header(path: Path, raw: bytes) -> tuple[np.dtype, tuple[int, ...]]:
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetError(f"{path}: not an IDX file")
    if raw[2] not in _IDX_TYPES:
        raise DatasetError(f"{path}: unknown IDX element type {raw[2]:#x}")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DatasetError(f"{path}: truncated IDX header")
    return _IDX_TYPES[raw[2]], tuple(
        int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))


def read_idx_shape(path: Path) -> tuple[int, ...]:
    """The shape of an IDX array from its header alone."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        head = fh.read(4)
        head += fh.read(4 * head[3]) if len(head) == 4 else b""
    return _idx_header(path, head)[1]


def read_idx(path: Path) -> np.ndarray:
    """An IDX array (LeCun's format: magic, dimensions, big-endian data), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    dtype, shape = _idx_header(path, raw)
    data = np.frombuffer(raw, dtype=dtype, offset=4 + 4 * len(shape))
    if data.size != int(np.prod(shape)):
        raise DatasetError(f"{path}: holds {data.size} values, its header says {shape}")
    return data.reshape(shape)


def _idx_file(directory: Path, stem: str) -> Path:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    raise DatasetError(
        f"dataset: Fashion-MNIST file {stem}[.gz] not found in {directory}; install Debian's "
        f"{FASHION_MNIST_PACKAGE} package (apt-get install {FASHION_MNIST_PACKAGE}) or set "
        "data-dir to a folder with the four IDX files")


def _fashion_mnist(directory: Path, features: bool = True) -> Source:
    labels = ("train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte")
    arrays: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}  # the header's shape only: no rows
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        if features or stem in labels:
            arrays[stem] = read_idx(_idx_file(directory, stem))
        else:
            shapes[stem] = read_idx_shape(_idx_file(directory, stem))

    def images(stem: str) -> np.ndarray:
        if stem in shapes:
            return np.zeros((0, 1, *shapes[stem][1:]), dtype=np.float32)
        return ((arrays[stem].astype(np.float32) / 255.0 - 0.2860) / 0.3530)[:, None]

    return Source("fashion-mnist", images("train-images-idx3-ubyte"),
                  arrays["train-labels-idx1-ubyte"].astype(np.int64),
                  images("t10k-images-idx3-ubyte"),
                  arrays["t10k-labels-idx1-ubyte"].astype(np.int64), 10)


def _npz(path: Path) -> Source:
    if not str(path) or not path.is_file():
        raise DatasetError(f"data-file: {str(path)!r} is not a file (dataset = \"npz\" reads "
                           "x_train, y_train, x_test, y_test [, user_train, user_test])")
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in z]
        if missing:
            raise DatasetError(f"data-file: {path} lacks {', '.join(missing)}")
        arrays = {k: z[k] for k in z.files}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if len(x) != len(y) or y.ndim != 1:
            raise DatasetError(f"data-file: {path}: x_{split} and y_{split} must have one "
                               "label per row")
        if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
            raise DatasetError(f"data-file: {path}: x_{split} must hold numbers (it has dtype "
                               f"{x.dtype})")
        # as the features are held; a non-finite value (``check_npz`` refuses it before a
        # run) isolates its user on the node
        with np.errstate(over="ignore", invalid="ignore"):
            arrays[f"x_{split}"] = x.astype(np.float32)
        if not np.issubdtype(y.dtype, np.integer):
            raise DatasetError(f"data-file: {path}: y_{split} must hold integers (it has dtype "
                               f"{y.dtype})")
        users = arrays.get(f"user_{split}")
        if users is not None and len(users) != len(y):
            raise DatasetError(f"data-file: {path}: user_{split} must have one user id per "
                               "row")
    users = [arrays.get("user_train"), arrays.get("user_test")]
    if (users[0] is None) != (users[1] is None):
        raise DatasetError(f"data-file: {path}: give both user_train and user_test, or neither")
    return Source("npz", arrays["x_train"], arrays["y_train"].astype(np.int64),
                  arrays["x_test"], arrays["y_test"].astype(np.int64), 0,
                  None if users[0] is None else np.asarray(users[0]),
                  None if users[1] is None else np.asarray(users[1]))


def check_npz(path: Path, num_classes: int) -> None:
    """Refuse, before a run, an npz whose features are not all finite in float32 or whose
    labels are not all in ``[0, num_classes)``, naming the array and the first bad row."""
    source = _load("npz", "", str(path), True)
    for split in ("train", "test"):
        x = getattr(source, f"x_{split}")
        finite = np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        if not finite.all():
            raise DatasetError(f"data-file: {path}: x_{split} row {int(np.argmin(finite))} "
                               "holds a value that is not a finite number in float32 (nan, "
                               "inf, or a magnitude of 3.4e38 or more)")
        y = getattr(source, f"y_{split}")
        bad = np.flatnonzero((y < 0) | (y >= num_classes))
        if bad.size:
            raise DatasetError(f"data-file: {path}: y_{split} row {int(bad[0])} is "
                               f"{int(y[bad[0]])}, outside the declared classes "
                               f"0..{num_classes - 1} (num-classes = {num_classes}; the classes "
                               "are shared by every user, so they cannot be counted from the "
                               "rows)")


BUILTIN_CLASSES = {"digits": 10, "fashion-mnist": 10}


def data_shape(name: str, data_dir: str = "", data_file: str = "") -> tuple[int, ...]:
    """The shape of one input, from the dataset's metadata or the file's header (npz: the
    array header; csv/parquet: the number of feature columns), reading no row: all a server
    needs to build the model."""
    if name not in SOURCES:
        raise DatasetError(f"dataset: {name!r} is not one of {', '.join(SOURCES)}")
    if name == "digits":
        return (1, 8, 8)
    if name == "fashion-mnist":
        return (1, *read_idx_shape(_idx_file(Path(data_dir or FASHION_MNIST_DIR),
                                             "train-images-idx3-ubyte"))[1:])
    if name in TABLE_FORMATS:
        try:
            return (len(feature_names(Path(data_file), name)),)
        except TableError as err:
            raise DatasetError(str(err)) from None
    return _npz_shape(Path(data_file))


def _npz_shape(path: Path) -> tuple[int, ...]:
    """One row's shape of an npz's ``x_train``, from its array header."""
    if not str(path) or not path.is_file():
        raise DatasetError(f"data-file: {str(path)!r} is not a file (dataset = \"npz\" reads "
                           "x_train, y_train, x_test, y_test [, user_train, user_test])")
    try:
        with zipfile.ZipFile(path) as archive, archive.open("x_train.npy") as member:
            version = np.lib.format.read_magic(member)
            shape, _, _ = (np.lib.format.read_array_header_1_0(member) if version == (1, 0)
                           else np.lib.format.read_array_header_2_0(member))
    except KeyError:
        raise DatasetError(f"data-file: {path} lacks x_train") from None
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise DatasetError(f"data-file: {path} is not a readable npz: {err}") from None
    return tuple(int(v) for v in shape[1:])


def table_source(fmt: str, data_file: str, train_rows: np.ndarray | None = None,
                 test_rows: np.ndarray | None = None, features: bool = True) -> Source:
    """A csv/parquet table as a Source with natural users: every row's label and user id, and
    the features of every row, of the given rows only (indices in their split), or of none
    (``features = False``)."""
    try:
        cols = table_columns(Path(data_file), fmt)
    except TableError as err:
        raise DatasetError(str(err)) from None
    split = {s: cols.split_rows(s) for s in ("train", "test")}
    wanted = {"train": train_rows, "test": test_rows}
    wanted = {s: None if w is None else np.unique(np.asarray(w, dtype=np.int64))
              for s, w in wanted.items()}
    if not features:
        wanted = {s: np.zeros(0, dtype=np.int64) for s in split}
    x = {}
    for s, rows in split.items():
        chosen = rows if wanted[s] is None else rows[wanted[s]]
        try:
            x[s] = table_rows(cols, chosen)
        except TableError as err:
            raise DatasetError(str(err)) from None
    held = wanted
    labels = cols.labels
    return Source(fmt, x["train"], labels[split["train"]], x["test"], labels[split["test"]],
                  0, cols.users[split["train"]],
                  cols.users[split["test"]], held["train"], held["test"])
