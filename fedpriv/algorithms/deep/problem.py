"""How a deep run's config becomes data, users and a model, checked before the run starts.

``DeepProblem`` holds the dataset (``fedpriv.data.sources``), its partition into users
(``fedpriv.data.partition``, a pure function of the seed and keys: every node computes the same
one) and the model (``models.ModelSpec``). ``user_block`` gathers a set of users' rows as padded
tensors with a mask, which is what the vectorized math (``deep_math``) reads.

With ``metrics-split = "validation"`` (what ``fedpriv tune`` runs its candidates with) each
user's training rows lose ``validation-samples-per-user`` rows, held back for validation
(``held_back``: a seeded choice within each user, so every node holds back the same rows): the
run never trains on them, and its private evaluation scores the users' error on them. A run
with the default ``"test"`` split holds nothing back, so the figures' runs are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from fedpriv.algorithms.deep.models import ModelSpec, model_spec
from fedpriv.algorithms.deep.params import data_part, sizes
from fedpriv.cohorts import partition_users
from fedpriv.data.partition import Partition, PartitionError, Rows, partition
from fedpriv.data.sources import DatasetError, Source, load_source, table_source
from fedpriv.data.tables import TABLE_FORMATS
from fedpriv.params import ConfigError

MAX_AUTO_BATCH = 32


@dataclass(frozen=True, eq=False)
class DeepProblem:
    source: Source
    users: Partition  # with metrics-split = "validation": training rows less those held back
    spec: ModelSpec
    batch_size: int
    device: torch.device
    validation: Rows | None = None  # rows of the train split held back, never trained on


_VALIDATION_PURPOSE = 0x56414C  # "VAL": the hold-back's own stream, apart from the partition's


def held_back(train: Rows, per_user: int, seed: int) -> tuple[Rows, Rows]:
    """Each user's training rows split into (rows trained on, ``per_user`` rows held back for
    validation): a seeded random choice within each user (a pure function of the seed and
    the partition, so nodes agree), the rest kept in their order."""
    counts = train.counts
    user_of = np.repeat(np.arange(len(counts)), counts)
    keys = np.random.default_rng([seed, _VALIDATION_PURPOSE]).random(len(train.rows))
    order = np.lexsort((keys, user_of))  # each user's rows by key, users in turn
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order)) - train.offsets[user_of[order]]
    held = rank < per_user
    kept_counts = counts - np.minimum(counts, per_user)
    held_rows = train.rows[order[held[order]]]  # grouped by user, in key order
    return (Rows(np.concatenate([[0], np.cumsum(kept_counts)]).astype(np.int64),
                 train.rows[~held]),
            Rows(np.concatenate([[0], np.cumsum(counts - kept_counts)]).astype(np.int64),
                 held_rows))


@dataclass(frozen=True, eq=False)
class UserBlock:
    """Some users' rows of one split: x (n, width, *input), y (n, width), mask (n, width)."""

    user_ids: np.ndarray
    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor
    counts: np.ndarray

    def part(self, users: slice) -> UserBlock:
        """The block of a slice of its users (views, no copy)."""
        return UserBlock(self.user_ids[users], self.x[users], self.y[users], self.mask[users],
                         self.counts[users])


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for and torch sees no CUDA device")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def problem_of(config: Any, features: bool = True) -> DeepProblem:
    """The config's problem (cached per process), or a ``ConfigError`` naming the key.

    ``features = False`` reads the labels, user ids and shapes only where the format allows
    (Fashion-MNIST, csv/parquet; ``load_source``): the partition, the model's shapes and every
    check, all the server needs. Of a csv/parquet table, ``data-part = "i/N"`` reads only the
    features of the rows of node partition i's users."""
    part = "none" if not features else (
        config.data_part if config.dataset in TABLE_FORMATS else "")
    hold = config.validation_samples_per_user if config.metrics_split == "validation" else 0
    key = (config.dataset, config.data_dir, config.data_file, config.partition,
           config.num_users, config.seed, config.classes_per_user, config.dirichlet_alpha,
           config.model, config.hidden_sizes, config.local_batch_size, config.device, part,
           config.input_shape, hold)
    return _problem(key)


def reshaped(source: Source, text: str) -> Source:
    """The source with every input reshaped to ``input-shape`` (``""``: unchanged), or a
    ``ConfigError`` naming the key where the sizes differ."""
    shape = sizes(text)
    if not shape or shape == source.input_shape:
        return source
    if int(np.prod(shape)) != int(np.prod(source.input_shape)):
        raise ConfigError(f"input-shape: {text!r} holds {int(np.prod(shape))} values; the "
                          f"data's inputs have shape {source.input_shape} "
                          f"({int(np.prod(source.input_shape))} values)")
    return replace(source, x_train=source.x_train.reshape(len(source.x_train), *shape),
                   x_test=source.x_test.reshape(len(source.x_test), *shape))


def _source(dataset: str, data_dir: str, data_file: str, part: str,
            users: Partition) -> Source:
    if part in ("", "none"):
        return load_source(dataset, data_dir, data_file, features=part == "")
    num_users = len(users.train.counts)
    own = partition_users(num_users, *data_part(part))
    need = {s: np.concatenate([rows.rows[rows.offsets[u]:rows.offsets[u + 1]] for u in own]
                              or [np.zeros(0, dtype=np.int64)])
            for s, rows in (("train", users.train), ("test", users.test))}
    return table_source(dataset, data_file, need["train"], need["test"])


@lru_cache(maxsize=4)
def _problem(key: tuple) -> DeepProblem:
    (dataset, data_dir, data_file, scheme, num_users, seed, classes, alpha, model, hidden,
     batch, device, part, shape, hold) = key
    try:
        # the partition needs the labels and user ids only: read those first
        labels = load_source(dataset, data_dir, data_file, features=False)
        users = partition(labels, scheme, num_users, seed, classes, alpha)
        source = reshaped(_source(dataset, data_dir, data_file, part, users), shape)
    except (DatasetError, PartitionError) as err:
        raise ConfigError(str(err)) from None
    spec = model_spec(model, hidden, source.input_shape, source.num_classes)
    validation = None
    if hold:  # after the source: a node has read every training row of its users
        counts = users.train.counts
        if int(counts.min()) < hold + 2:
            user = int(np.argmin(counts))
            raise ConfigError(f"validation-samples-per-user: user {user} has {int(counts.min())}"
                              f" training rows; holding back {hold} for validation must leave "
                              "at least 2 (two disjoint batches)")
        train, validation = held_back(users.train, hold, seed)
        users = Partition(train, users.test)
    counts = users.train.counts
    smallest = int(counts.min())
    b = min(MAX_AUTO_BATCH, smallest // 2) if batch == "max" else int(batch)
    if b < 1 or 2 * b > smallest:
        user = int(np.argmin(counts))
        raise ConfigError(f"local-batch-size: user {user} has {smallest} training rows; two "
                          f"disjoint batches of {max(b, 1)} need {2 * max(b, 1)} (fewer users, "
                          "another partition or a smaller local-batch-size)")
    return DeepProblem(source, users, spec, b, resolve_device(device), validation)


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
    dev = problem.device
    return UserBlock(ids, torch.from_numpy(problem.source.features(split, rows)).to(dev),
                     torch.from_numpy(y_all[rows]).to(dev),
                     torch.from_numpy(mask.astype(np.float32)).to(dev), counts)


def chunk_users(problem: DeepProblem, rows_per_user: int, per_user_params: int,
                budget_mb: float) -> int:
    """Users per vectorized chunk whose estimated working set fits ``budget_mb``: each user's
    rows through the network (inputs and every layer's output, kept for the backward pass,
    and their gradients) plus ``per_user_params`` floats of its own parameters, gradients and
    update (three copies)."""
    per_user = 4 * (2 * rows_per_user * problem.spec.row_floats + 3 * per_user_params)
    return max(1, int(budget_mb * 2**20 // max(per_user, 1)))
