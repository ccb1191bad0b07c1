"""Cutting a dataset into users: which rows of the train and test splits are user i's.

A partition is a pure function of (seed, dataset, scheme, keys), so every node computes it alone
and reads only its own users' rows: nothing is exchanged. Schemes:

* ``label-skew``: each user gets S classes and an equal shard of each (the pathological split of
  McMahan et al., FedRep and CENTAUR): the rows of ``flwr-datasets``' ``PathologicalPartitioner``
  (random class assignment).
* ``dirichlet``: class proportions drawn from Dirichlet(alpha) per class (Hsu et al. 2019): the
  rows of ``flwr-datasets``' ``DirichletPartitioner`` (min 10 training rows per user).

Both are recomputed here in NumPy, draw for draw (the core never imports Flower's packages, and
``datasets``/``pyarrow`` stay out of the runtime); a test compares them with flwr-datasets.
* ``iid``: a seeded permutation cut into near-equal shares. (``IidPartitioner.load_partition``
  builds one ``datasets.Dataset`` per user, far slower than the permutation, so the permutation
  is computed directly.)
* ``natural``: the data's own user column (``Source.user_train``): every user of the file, user i
  the i-th smallest id, each with a randomness key of its own id (``user_keys``).

Test rows follow each user's training distribution: for every class, the test rows of that class
are shared among the users holding it in proportion to their training rows of the class (the
same class assignment). Where a class has fewer test rows than holders, rows are dealt
round-robin and reused (test rows are never trained on, so sharing them costs nothing).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fedpriv.data.sources import Source

SCHEMES = ("label-skew", "dirichlet", "iid", "natural")
_TEST_PURPOSE = 0x7E57
_IID_PURPOSE = 0x11D
_DIRICHLET_MIN_ROWS = 10  # flwr-datasets' default min_partition_size


class PartitionError(ValueError):
    """A partition cannot be made; the message names the key."""


@dataclass(frozen=True, eq=False)
class Rows:
    """Each user's rows of one split, as CSR: user i holds ``rows[offsets[i]:offsets[i+1]]``."""

    offsets: np.ndarray
    rows: np.ndarray

    @classmethod
    def from_lists(cls, lists: list[np.ndarray]) -> Rows:
        counts = np.array([len(x) for x in lists], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        rows = (np.concatenate(lists) if lists else np.zeros(0)).astype(np.int64)
        return cls(offsets, rows)

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    def padded(self, user_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows (n, max count) padded with each user's first row, counts (n,))."""
        counts = self.counts[user_ids]
        width = max(int(counts.max(initial=0)), 1)
        pos = np.minimum(np.arange(width)[None, :], np.maximum(counts[:, None] - 1, 0))
        index = np.minimum(self.offsets[user_ids][:, None] + pos, max(len(self.rows) - 1, 0))
        return self.rows[index], counts


@dataclass(frozen=True, eq=False)
class Partition:
    train: Rows
    test: Rows


def partition(source: Source, scheme: str, num_users: int, seed: int,
              classes_per_user: int = 2, alpha: float = 0.5) -> Partition:
    """The users' rows (cached per process: the nodes of a simulation share it)."""
    return _partition(source, scheme, num_users, seed, classes_per_user, alpha)


@lru_cache(maxsize=8)
def _partition(source: Source, scheme: str, num_users: int, seed: int, classes_per_user: int,
               alpha: float) -> Partition:
    if scheme not in SCHEMES:
        raise PartitionError(f"partition: {scheme!r} is not one of {', '.join(SCHEMES)}")
    if scheme == "natural":
        return _natural(source)  # every user of the file
    labels = source.y_train
    if scheme == "iid":
        order = np.random.default_rng([seed, _IID_PURPOSE]).permutation(len(labels))
        train = np.array_split(order, num_users)
    else:
        train = _skewed_rows(labels, scheme, num_users, seed, classes_per_user, alpha)
    classes = max(source.num_classes, int(labels.max(initial=-1)) + 1, 1)
    counts = np.zeros((num_users, classes), dtype=np.int64)
    for user, rows in enumerate(train):
        kept = labels[rows]
        np.add.at(counts[user], kept[kept >= 0], 1)  # -1: a cell that was not a label
    test = _cut_test(counts, source.y_test, seed)
    return Partition(Rows.from_lists(train), Rows.from_lists(test))


def _skewed_rows(labels: np.ndarray, scheme: str, num_users: int, seed: int,
                    classes_per_user: int, alpha: float) -> list[np.ndarray]:
    """flwr-datasets' split of the training rows, computed here in NumPy so that the core stays
    Flower-free: the same generator calls in the same order as its ``PathologicalPartitioner``
    (random class assignment, shuffled) and ``DirichletPartitioner`` (min 10 rows, no
    self-balancing, shuffled), so the rows are identical (``tests/test_deep.py`` compares with
    flwr-datasets 0.6 itself)."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_users)]
    if scheme == "label-skew":
        if classes_per_user > len(classes):
            raise PartitionError(f"classes-per-user: {classes_per_user} exceeds the "
                                 f"{len(classes)} classes of the data")
        held = np.array([rng.choice(classes, size=classes_per_user, replace=False)
                         for _ in range(num_users)]).reshape(num_users, classes_per_user)
        for c, rows in zip(classes, by_class, strict=True):
            holders = np.flatnonzero((held == c).any(axis=1))
            if not len(holders):
                continue
            if len(holders) > len(rows):
                fewest = min(len(r) for r in by_class)
                raise PartitionError(
                    f"num-users: {num_users} users with classes-per-user = {classes_per_user} "
                    f"of {len(classes)} classes leave class {c} ({len(rows)} training rows) "
                    f"to {len(holders)} users, fewer than one row each. Each class goes to "
                    f"about num-users x {classes_per_user} / {len(classes)} users and the "
                    f"smallest has {fewest} rows: use num-users below "
                    f"{fewest * len(classes) // classes_per_user} (somewhat below: the classes "
                    "are drawn at random, and users need two batches of rows), fewer classes "
                    "per user, or a larger dataset")
            for user, chunk in zip(holders, np.array_split(rows, len(holders)), strict=False):
                pieces[user].append(chunk)
    else:
        for attempt in range(11):
            pieces = [[] for _ in range(num_users)]
            for rows in by_class:
                shares = np.cumsum(rng.dirichlet(np.full(num_users, alpha))) * len(rows)
                for i, chunk in enumerate(np.split(rows, shares.astype(int)[:-1])):
                    pieces[i].append(chunk)
            if min(sum(len(c) for c in p) for p in pieces) >= _DIRICHLET_MIN_ROWS:
                break
            if attempt == 10:
                raise PartitionError(
                    f"dirichlet-alpha: 11 Dirichlet draws left a user with fewer than "
                    f"{_DIRICHLET_MIN_ROWS} training rows; raise dirichlet-alpha or use fewer "
                    "users")
    users = []
    for chunks in pieces:
        mine = list(np.concatenate(chunks)) if chunks else []
        rng.shuffle(mine)  # a list, as flwr-datasets shuffles it
        users.append(np.asarray(mine, dtype=np.int64))
    return users


def _cut_test(counts: np.ndarray, test_labels: np.ndarray, seed: int) -> list[np.ndarray]:
    """Each user's test rows, class by class in proportion to its training rows."""
    num_users = counts.shape[0]
    rng = np.random.default_rng([seed, _TEST_PURPOSE])
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_users)]
    for cls in range(counts.shape[1]):
        holders = np.flatnonzero(counts[:, cls])
        rows = rng.permutation(np.flatnonzero(test_labels == cls))
        if not len(holders) or not len(rows):
            continue
        if len(rows) < len(holders):  # deal round-robin; rows are reused
            for j, user in enumerate(holders):
                pieces[user].append(rows[j % len(rows): j % len(rows) + 1])
            continue
        weights = counts[holders, cls] / counts[holders, cls].sum()
        share = np.floor(weights * len(rows)).astype(np.int64)
        rest = len(rows) - share.sum()
        share[np.argsort(-(weights * len(rows) - share), kind="stable")[:rest]] += 1
        for user, chunk in zip(holders, np.split(rows, np.cumsum(share)[:-1]), strict=True):
            pieces[user].append(chunk)
    return [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in pieces]


def natural_ids(source: Source) -> np.ndarray:
    """The users of data with a user column: every distinct id of its training rows, sorted
    (integers in numeric order). Which users take part never depends on anything but each
    user's own rows: there is no cut at num-users (which, under the natural partition, is only
    the public population the releases divide by)."""
    if source.user_train is None or source.user_test is None:
        raise PartitionError(f"partition: 'natural' needs a user column; dataset "
                             f"{source.name!r} has none (an npz with user_train, user_test)")
    return np.unique(source.user_train)


def user_keys(ids: np.ndarray) -> np.ndarray:
    """Each natural user's randomness key, a function of its own id alone: the id itself for
    integer ids, else the first 8 bytes of the BLAKE2b hash of its text. Batches, Poisson
    inclusion, held-back and truncated rows are drawn from (seed, key), so one user's presence
    or id never moves another user's draws (as a rank among the ids would)."""
    ids = np.asarray(ids)
    if ids.dtype.kind in "iu":
        return ids.astype(np.int64)
    return np.array([int.from_bytes(hashlib.blake2b(str(v).encode(), digest_size=8).digest(),
                                    "little", signed=True) for v in ids], dtype=np.int64)


def _natural(source: Source) -> Partition:
    ids = natural_ids(source)
    # natural_ids refuses a source without user columns
    assert source.user_train is not None and source.user_test is not None

    def rows(column: np.ndarray) -> Rows:
        order = np.argsort(column, kind="stable")
        sorted_ids = column[order]
        lo = np.searchsorted(sorted_ids, ids, "left")
        hi = np.searchsorted(sorted_ids, ids, "right")
        return Rows.from_lists([order[a:b] for a, b in zip(lo, hi, strict=True)])

    return Partition(rows(source.user_train), rows(source.user_test))
