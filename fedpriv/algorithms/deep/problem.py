"""How a deep run's config becomes data, users and a model, checked before the run starts.

The server builds the model from public values only (``model_of``: the input shape from the
dataset's metadata or the file's header, the classes from the dataset or ``num-classes``) and
reads no user's row. A node builds the ``DeepProblem``: the dataset (``fedpriv.data.sources``),
its partition into users (``fedpriv.data.partition``, a pure function of the seed and keys:
every node computes the same one; natural users: every user of the file, each keyed by its own
id, hosted by a hash of it), at most ``max-rows-per-user`` rows a user (``capped``), and the
model (``models.ModelSpec``). ``user_block`` gathers a set of users' rows as padded tensors
with a mask, which is what the vectorized math (``deep_math``) reads; a user holding a label
outside the classes gets nan data there (isolated: its contribution becomes zero).

Privacy for any input: every per-user draw (batches, Poisson inclusion, held-back and capped
rows) is a function of the seed and the user's own key, never of its rank among other users,
and every setting shared by users (b, the classes, the input shape) is public.

With ``metrics-split = "validation"`` (what ``fedpriv tune`` runs its candidates with) each
user's training rows lose ``validation-samples-per-user`` rows, held back for validation
(``held_back``: a seeded choice within each user, so every node holds back the same rows): the
run never trains on them, and its private evaluation scores the users' error on them. A run
with the default ``"test"`` split holds nothing back, so the figures' runs are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from fedpriv.algorithms.base import partition_users
from fedpriv.algorithms.deep.models import ModelSpec, model_spec
from fedpriv.algorithms.deep.params import (
    FILE_SOURCES,
    DataKeys,
    DeepLocalConfig,
    data_part,
    sizes,
)
from fedpriv.data.partition import (
    Partition,
    PartitionError,
    Rows,
    natural_ids,
    partition,
    user_keys,
)
from fedpriv.data.sources import (
    BUILTIN_CLASSES,
    DatasetError,
    Source,
    data_shape,
    load_source,
    table_source,
)
from fedpriv.data.tables import TABLE_FORMATS
from fedpriv.params import ConfigError
from fedpriv.randomness import uniforms_at, user_uniforms

MAX_AUTO_BATCH = 32


@dataclass(frozen=True, eq=False)
class DeepProblem:
    source: Source
    users: Partition  # capped at max-rows-per-user; with metrics-split = "validation":
    # training rows less those held back
    spec: ModelSpec
    batch_size: int  # the public b; user i's batches hold min(b, its training rows // 2)
    device: torch.device
    keys: np.ndarray  # each user's randomness key: its index, or its own id (natural users)
    invalid: np.ndarray  # users holding a label outside the declared classes (isolated)
    validation: Rows | None = None  # rows of the train split held back, never trained on


_VALIDATION_PURPOSE = 0x56414C  # "VAL": the hold-back's own stream, apart from the partition's
_CAP_PURPOSE = 0xCA9  # which rows a user over max-rows-per-user keeps
_NODE_PURPOSE = 0x40DE  # which node hosts a natural user


def _user_of(rows: Rows) -> np.ndarray:
    """The user (position) of each of ``rows.rows``."""
    return np.repeat(np.arange(len(rows.counts)), rows.counts)


def _ranked(rows: Rows, keys: np.ndarray, seed: int, purpose: int) -> np.ndarray:
    """Each row's rank among its user's rows in a seeded order that is a function of (seed,
    the user's key, the row's place among that user's rows) alone: a user's draws never
    depend on another user (0 = first drawn)."""
    user_of = _user_of(rows)
    place = np.arange(len(rows.rows)) - rows.offsets[user_of]
    order = np.lexsort((uniforms_at(seed, purpose, 0, keys[user_of], place), user_of))
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order)) - rows.offsets[user_of[order]]
    return rank


def _split_rows(rows: Rows, keep: np.ndarray) -> Rows:
    """The rows where ``keep`` holds, each user's in their order."""
    counts = np.bincount(_user_of(rows)[keep], minlength=len(rows.counts))
    return Rows(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), rows.rows[keep])


def capped(rows: Rows, cap: int, keys: np.ndarray, seed: int) -> Rows:
    """Each user's rows, at most ``cap`` of them: a user over the cap keeps a seeded choice of
    its own (a function of the seed and its key), in their order. A public maximum of rows
    per user bounds what one user adds to its node's work and memory."""
    if not len(rows.rows) or int(rows.counts.max()) <= cap:
        return rows
    return _split_rows(rows, _ranked(rows, keys, seed, _CAP_PURPOSE) < cap)


def held_back(train: Rows, per_user: int, seed: int, keys: np.ndarray) -> tuple[Rows, Rows]:
    """Each user's training rows split into (rows trained on, rows held back for validation):
    ``per_user`` rows, or fewer for a user with fewer than ``per_user + 2`` (it keeps two to
    train on), a seeded choice within each user (a function of the seed and the user's key,
    so nodes agree and no user moves another's choice); both kept in their order."""
    if not len(train.rows):
        return train, train
    rank = _ranked(train, keys, seed, _VALIDATION_PURPOSE)
    counts = train.counts
    limit = np.minimum(per_user, np.maximum(counts - 2, 0))
    held = rank < np.repeat(limit, counts)
    return _split_rows(train, ~held), _split_rows(train, held)


@dataclass(frozen=True, eq=False)
class UserBlock:
    """Some users' rows of one split: x (n, width, *input), y (n, width), mask (n, width)."""

    user_ids: np.ndarray
    keys: np.ndarray
    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor
    counts: np.ndarray

    def part(self, users: slice) -> UserBlock:
        """The block of a slice of its users (views, no copy)."""
        return UserBlock(self.user_ids[users], self.keys[users], self.x[users], self.y[users],
                         self.mask[users], self.counts[users])


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for and torch sees no CUDA device")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def num_classes(config: DataKeys) -> int:
    """The classes every user's head scores: the built-in dataset's, or ``num-classes`` (a
    data file's labels are not counted: one user's label must not change everybody's
    model)."""
    return BUILTIN_CLASSES.get(config.dataset) or config.num_classes


def input_shape(config: DataKeys) -> tuple[int, ...]:
    """One input's shape, from the dataset's metadata or the file's header (no row read), as
    ``input-shape`` gives it where set, or a ``ConfigError`` naming the key."""
    try:
        shape = data_shape(config.dataset, config.data_dir, config.data_file)
    except DatasetError as err:
        raise ConfigError(str(err)) from None
    wanted = sizes(config.input_shape)
    if not wanted or wanted == shape:
        return shape
    if int(np.prod(wanted)) != int(np.prod(shape)):
        raise ConfigError(f"input-shape: {config.input_shape!r} holds {int(np.prod(wanted))} "
                          f"values; the data's inputs have shape {shape} "
                          f"({int(np.prod(shape))} values)")
    return wanted


def model_of(config: DeepLocalConfig) -> ModelSpec:
    """The config's model, built from public values only (the input shape, the classes): what
    the server builds, without reading any user's rows."""
    return model_spec(config.model, config.hidden_sizes, input_shape(config),
                      num_classes(config))


def public_batch_size(config: DeepLocalConfig) -> int:
    """The public b: ``local-batch-size``, or for ``max`` 32 on a data file and, on a built-in
    dataset, half its smallest user's training rows, at most 32 (its partition is a function
    of the published dataset and the keys). Reads no row of a data file."""
    return _batch_size(config.local_batch_size, config.dataset,
                       lambda: problem_of(config, features=False).users.train.counts)


def _batch_size(batch: str, dataset: str, counts: Callable[[], np.ndarray]) -> int:
    """``public_batch_size`` with the built-in partition's training row counts (asked for only
    there)."""
    if batch != "max":
        return int(batch)
    if dataset in FILE_SOURCES:
        return MAX_AUTO_BATCH
    rows = counts()  # a built-in dataset's partition is public: every user gets the same b
    b = min(MAX_AUTO_BATCH, int(rows.min()) // 2)
    if b < 1:
        raise ConfigError(f"local-batch-size: user {int(np.argmin(rows))} of the {dataset} "
                          f"partition has {int(rows.min())} training rows; two disjoint "
                          "batches need 2 (fewer users or another partition)")
    return b


def problem_of(config: DeepLocalConfig, features: bool = True) -> DeepProblem:
    """The config's problem as a node builds it (cached per process), or a ``ConfigError``
    naming the key.

    ``features = False`` reads the labels, user ids and shapes only where the format allows
    (Fashion-MNIST, csv/parquet; ``load_source``). Of a csv/parquet table, ``data-part =
    "i/N"`` reads only the features of the rows of node partition i's users."""
    part = "none" if not features else (
        config.data_part if config.dataset in TABLE_FORMATS else "")
    hold = config.validation_samples_per_user if config.metrics_split == "validation" else 0
    key = _ProblemKey(config.dataset, config.data_dir, config.data_file, config.partition,
                      config.num_users, config.seed, config.classes_per_user,
                      config.dirichlet_alpha, config.model, config.hidden_sizes,
                      config.local_batch_size, config.device, part, config.input_shape, hold,
                      num_classes(config), config.max_rows_per_user)
    return _problem(key)


class _ProblemKey(NamedTuple):
    """What a problem is built from (``problem_of``'s cache key)."""

    dataset: str
    data_dir: str
    data_file: str
    scheme: str
    num_users: int
    seed: int
    classes_per_user: int
    alpha: float
    model: str
    hidden: str
    batch: str
    device: str
    part: str
    shape: str
    hold: int
    classes: int
    cap: int


def node_of(keys: np.ndarray, num_partitions: int) -> np.ndarray:
    """The node partition of each natural user: a hash of its own key (no other user moves
    it), so nodes agree on who hosts whom and the server needs no user data."""
    u = user_uniforms(0, _NODE_PURPOSE, 0, keys, 1)[:, 0]
    return np.minimum((u * num_partitions).astype(np.int64), num_partitions - 1)


def hosted_positions(scheme: str, keys: np.ndarray, num_users: int, partition_id: int,
                     num_partitions: int) -> np.ndarray:
    """The users (positions) node ``partition_id`` hosts: natural users by ``node_of``, the
    users of a simulated partition in contiguous, near-equal slices of ``range(num_users)``."""
    if scheme == "natural":
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition-id {partition_id} outside [0, {num_partitions})")
        return np.flatnonzero(node_of(keys, num_partitions) == partition_id)
    return partition_users(num_users, partition_id, num_partitions)


def _source(dataset: str, data_dir: str, data_file: str, part: str, users: Partition,
            scheme: str, keys: np.ndarray) -> Source:
    if part in ("", "none"):
        return load_source(dataset, data_dir, data_file, features=part == "")
    node = data_part(part)
    assert node is not None  # "i/N" here ("" and "none" read every user's rows above)
    own = hosted_positions(scheme, keys, len(users.train.counts), *node)
    need = {s: np.concatenate([rows.rows[rows.offsets[u]:rows.offsets[u + 1]] for u in own]
                              or [np.zeros(0, dtype=np.int64)])
            for s, rows in (("train", users.train), ("test", users.test))}
    return table_source(dataset, data_file, need["train"], need["test"])


def _invalid_users(source: Source, users: Partition, classes: int) -> np.ndarray:
    """Users with a row whose label is outside ``[0, classes)``: isolated (``user_block``)."""
    bad = np.zeros(len(users.train.counts), dtype=bool)
    for rows, labels in ((users.train, source.y_train), (users.test, source.y_test)):
        wrong = (labels[rows.rows] < 0) | (labels[rows.rows] >= classes)
        bad[_user_of(rows)[wrong]] = True
    return bad


@lru_cache(maxsize=4)
def _problem(key: _ProblemKey) -> DeepProblem:
    (dataset, data_dir, data_file, scheme, num_users, seed, classes_per_user, alpha, model,
     hidden, batch, device, part, shape, hold, classes, cap) = key
    try:
        # the partition needs the labels and user ids only: read those first
        labels = load_source(dataset, data_dir, data_file, features=False)
        users = partition(labels, scheme, num_users, seed, classes_per_user, alpha)
        keys = (user_keys(natural_ids(labels)) if scheme == "natural"
                else np.arange(len(users.train.counts), dtype=np.int64))
        source = _source(dataset, data_dir, data_file, part, users, scheme, keys)
    except (DatasetError, PartitionError) as err:
        raise ConfigError(str(err)) from None
    wanted = sizes(shape)
    if wanted and wanted != source.input_shape:
        source = replace(source, x_train=source.x_train.reshape(len(source.x_train), *wanted),
                         x_test=source.x_test.reshape(len(source.x_test), *wanted))
    spec = model_spec(model, hidden, source.input_shape, classes)
    users = Partition(capped(users.train, cap, keys, seed), capped(users.test, cap, keys, seed))
    validation = None
    if hold:  # after the source: a node has read every training row of its users
        train, validation = held_back(users.train, hold, seed, keys)
        users = Partition(train, users.test)
    b = _batch_size(batch, dataset, lambda: users.train.counts)
    return DeepProblem(source, users, spec, b, resolve_device(device), keys,
                       _invalid_users(source, users, classes), validation)


def user_block(problem: DeepProblem, user_ids: np.ndarray, split: str = "train") -> UserBlock:
    """The users' rows of ``split`` (``train``, ``test``, or ``validation``: the training rows
    held back with metrics-split = "validation") as padded tensors on the problem's device."""
    if split == "validation":
        if problem.validation is None:
            raise ValueError("validation rows are held back only with metrics-split = "
                             "\"validation\"")
        rows_of, split = problem.validation, "train"  # they are rows of the train split
    else:
        rows_of = problem.users.train if split == "train" else problem.users.test
    y_all = problem.source.y_train if split == "train" else problem.source.y_test
    ids = np.asarray(user_ids, dtype=np.int64)
    rows, counts = rows_of.padded(ids)
    mask = np.arange(rows.shape[1])[None, :] < counts[:, None]
    # padding is zeros (never another user's row: a user without rows of the split would
    # otherwise be padded with its neighbour's), and only the users' own rows are read
    x = np.zeros((*rows.shape, *problem.source.input_shape), dtype=np.float32)
    x[mask] = problem.source.features(split, rows[mask])
    y = np.where(mask, y_all[rows], 0)
    bad = problem.invalid[ids]
    if bad.any():  # isolated: a label outside the classes makes the user's data nan
        x[bad] = np.nan
        y[bad] = 0
    dev = problem.device
    return UserBlock(ids, problem.keys[ids], torch.from_numpy(x).to(dev),
                     torch.from_numpy(y).to(dev),
                     torch.from_numpy(mask.astype(np.float32)).to(dev), counts)


def chunk_users(problem: DeepProblem, rows_per_user: int, per_user_params: int,
                budget_mb: float) -> int:
    """Users per vectorized chunk whose estimated working set fits ``budget_mb``: each user's
    rows through the network (inputs and every layer's output, kept for the backward pass,
    and their gradients) plus ``per_user_params`` floats of its own parameters, gradients and
    update (three copies)."""
    per_user = 4 * (2 * rows_per_user * problem.spec.row_floats + 3 * per_user_params)
    return max(1, int(budget_mb * 2**20 // max(per_user, 1)))
