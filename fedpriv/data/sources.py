"""Real datasets for the deep personalization algorithms, read from local files only.

Nothing is downloaded at run time (the machines this runs on have no internet):

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), cut
  once into a fixed 80/20 train/test split (a pure function of nothing: every node agrees).
* ``fashion-mnist``: the 70,000 28x28 images of Xiao et al. (2017) as IDX files (gzipped or
  not), from Debian's ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``)
  or a ``data-dir``. A missing file is a ``DatasetError`` naming the package to install.
* ``npz``: your own data, a NumPy ``.npz`` file with ``x_train, y_train, x_test, y_test`` and,
  for natural users, ``user_train, user_test`` (one user id per row).

Pixels are scaled to [0, 1] and standardized with constants of the dataset (not statistics of
the users' data, which would be a release). Images keep a channel axis: (N, 1, H, W).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
SOURCES = ("digits", "fashion-mnist", "npz")
_DIGITS_SPLIT_SEED = 0xD161


class DatasetError(ValueError):
    """A dataset cannot be read; the message names the file and how to get it."""


@dataclass(frozen=True, eq=False)
class Source:
    """A dataset's arrays: features (N, *input_shape) float32, labels (N,) int64, and for data
    with natural users their user column (else None)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    user_train: np.ndarray | None = None
    user_test: np.ndarray | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load_source(name: str, data_dir: str = "", data_file: str = "") -> Source:
    """The named dataset (cached per process: every step of a run reads the same arrays)."""
    if name not in SOURCES:
        raise DatasetError(f"dataset: {name!r} is not one of {', '.join(SOURCES)}")
    return _load(name, data_dir, data_file)


@lru_cache(maxsize=4)
def _load(name: str, data_dir: str, data_file: str) -> Source:
    if name == "digits":
        return _digits()
    if name == "fashion-mnist":
        return _fashion_mnist(Path(data_dir or FASHION_MNIST_DIR))
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


def read_idx(path: Path) -> np.ndarray:
    """An IDX array (LeCun's format: magic, dimensions, big-endian data), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetError(f"{path}: not an IDX file")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4",
              0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise DatasetError(f"{path}: unknown IDX element type {raw[2]:#x}")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=dtypes[raw[2]], offset=4 + 4 * ndim)
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


def _fashion_mnist(directory: Path) -> Source:
    arrays = {stem: read_idx(_idx_file(directory, stem)) for stem in (
        "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

    def images(a: np.ndarray) -> np.ndarray:
        return ((a.astype(np.float32) / 255.0 - 0.2860) / 0.3530)[:, None]

    return Source("fashion-mnist", images(arrays["train-images-idx3-ubyte"]),
                  arrays["train-labels-idx1-ubyte"].astype(np.int64),
                  images(arrays["t10k-images-idx3-ubyte"]),
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
    ys = np.concatenate([arrays["y_train"], arrays["y_test"]])
    if ys.size and (ys.min() < 0 or not np.issubdtype(ys.dtype, np.integer)):
        raise DatasetError(f"data-file: {path}: labels must be integers >= 0")
    users = [arrays.get("user_train"), arrays.get("user_test")]
    if (users[0] is None) != (users[1] is None):
        raise DatasetError(f"data-file: {path}: give both user_train and user_test, or neither")
    return Source("npz", arrays["x_train"].astype(np.float32),
                  arrays["y_train"].astype(np.int64), arrays["x_test"].astype(np.float32),
                  arrays["y_test"].astype(np.int64), int(ys.max()) + 1 if ys.size else 0,
                  None if users[0] is None else np.asarray(users[0]),
                  None if users[1] is None else np.asarray(users[1]))
