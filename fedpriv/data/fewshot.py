"""Few-shot image tasks as users (Zhou & Bassily 2022, Appendix C; issue 50's data layer).

An N-way K-shot task draws N classes of an image pool in a random order (label j of the task is
its j-th class: every task permutes the labels) and, for each, K **support** rows to adapt on
and Q **query** rows to score, all distinct. One task is one user under task-level DP: the
whole task (its support and query rows) is what a neighbouring dataset changes.

Every draw of task t is a pure function of (seed, purpose, t) (``fedpriv.randomness``'s
counter-based hash, vectorized over tasks): a node draws exactly the tasks it hosts, in any
order or subset, and no task's draw depends on another task.

Pools (``FewShotPool``): the images, their classes, and which classes meta-training and
meta-testing draw from, with the rows each may use.

* ``omniglot_pool(root)``: Omniglot in its standard folder layout (``images_background/`` and
  ``images_evaluation/``, each ``alphabet/character/*.png``; Lake et al. 2015), read from disk
  only (nothing is downloaded). Each character is a class; meta-training draws from the
  background characters, meta-testing from the evaluation ones: **disjoint characters**, as in
  the few-shot literature. Images are resized to ``size`` (28 by default) and inverted so that
  strokes are 1 and paper 0.
* ``source_pool(source)``: a built-in dataset (Fashion-MNIST's 10 classes). Meta-training
  draws rows of the train split, meta-testing rows of the test split: **the same 10 classes,
  disjoint images and independent task draws**. With only 10 classes a 5-way meta-test task
  shares its classes with meta-training tasks; the generalization measured is to new images
  and new label orders, not to new classes (stated wherever its figures are).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedpriv.data.sources import DatasetError, Source
from fedpriv.randomness import uniforms_at, user_permutations

OMNIGLOT_PARTS = ("images_background", "images_evaluation")  # meta-train, meta-test
_CLASS_PURPOSE = 0xFE5C  # the task's classes and their order
_ROW_PURPOSE = 0xFE5E  # the task's rows of each class
_SMALL_POOL = 256  # classes with at most this many rows: a full seeded permutation
_MAX_REDRAWS = 64
VALIDATION_SHARE = 1 / 6  # of the meta-training images (or classes) held out for validation
_VALIDATION_SPLIT = 0xFE5A  # a fixed, public split (no run seed): the same for every run


@dataclass(frozen=True, eq=False)
class FewShotPool:
    """Images x (M, 1, H, W) float32 and their classes y (M,) int64; ``train_rows`` /
    ``test_rows``: the rows meta-training / meta-testing tasks draw from (sorted, disjoint);
    ``class_names``: one name a class (e.g. ``alphabet/character``)."""

    name: str
    x: np.ndarray
    y: np.ndarray
    train_rows: np.ndarray
    test_rows: np.ndarray
    class_names: tuple[str, ...]

    def classes(self, part: str) -> np.ndarray:
        """The classes a part ("train": meta-training, "test": meta-testing) draws from."""
        return np.unique(self.y[self._rows(part)])

    def _rows(self, part: str) -> np.ndarray:
        if part not in ("train", "test"):
            raise ValueError(f"part: 'train' or 'test', got {part!r}")
        return self.train_rows if part == "train" else self.test_rows


@dataclass(frozen=True, eq=False)
class Tasks:
    """Tasks' draws: ``classes`` (T, N) the pool classes of each task (label j is
    ``classes[t, j]``), ``support`` (T, N, K) and ``query`` (T, N, Q) pool rows, the rows of
    label j in ``[:, j]``."""

    task_ids: np.ndarray
    classes: np.ndarray
    support: np.ndarray
    query: np.ndarray

    def labels(self, part: str) -> np.ndarray:
        """Labels (T, N * per-class) of ``support`` or ``query`` flattened row-major."""
        rows = self.support if part == "support" else self.query
        t, n, k = rows.shape
        return np.broadcast_to(np.repeat(np.arange(n), k), (t, n * k)).copy()

    def rows(self, part: str) -> np.ndarray:
        """Pool rows (T, N * per-class) of ``support`` or ``query``, as ``labels`` orders them."""
        rows = self.support if part == "support" else self.query
        return rows.reshape(len(rows), -1)


def draw_tasks(pool: FewShotPool, part: str, task_ids: np.ndarray, ways: int, shots: int,
               queries: int, seed: int) -> Tasks:
    """The tasks ``task_ids`` of ``part`` ("train" or "test"): ``ways`` distinct classes of the
    part in a seeded random order, and for each ``shots`` support and ``queries`` query rows
    of that class, all distinct (module docstring). A pure function of (seed, part, task id)
    per task."""
    ids = np.asarray(task_ids, dtype=np.int64).reshape(-1)
    classes, by_class = _part_index(pool, part)
    if ways < 1 or shots < 1 or queries < 1:
        raise ValueError(f"ways, shots and queries are at least 1, got {ways}, {shots}, "
                         f"{queries}")
    if ways > len(classes):
        raise DatasetError(f"{pool.name}: a {ways}-way task needs {ways} classes; the "
                           f"meta-{part} part has {len(classes)}")
    per_class = shots + queries
    small = [c for c, r in zip(classes, by_class, strict=True) if len(r) < per_class]
    if small:
        name = pool.class_names[int(small[0])]
        raise DatasetError(f"{pool.name}: {shots} shots + {queries} queries need {per_class} "
                           f"images a class; class {name!r} of the meta-{part} part has "
                           f"{len(by_class[int(np.searchsorted(classes, small[0]))])} "
                           f"({len(small)} such classes)")
    stream = 0 if part == "train" else 1
    # the classes (T, N), as positions in `classes`: the first `ways` of a seeded permutation
    chosen = user_permutations(seed, _CLASS_PURPOSE, stream, ids, len(classes))[:, :ways]
    picked = np.empty((len(ids), ways, per_class), dtype=np.int64)
    for j in range(ways):  # label j: its class's rows, distinct within the task
        for k in np.unique(chosen[:, j]):
            mine = np.flatnonzero(chosen[:, j] == k)
            place = _distinct_places(seed, stream, ids[mine], int(k), len(by_class[k]),
                                     per_class)
            picked[mine, j] = by_class[k][place]
    return Tasks(ids, classes[chosen], picked[..., :shots], picked[..., shots:])


@lru_cache(maxsize=16)
def _part_index(pool: FewShotPool, part: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """A part's classes and each one's rows: computed once per pool (a node draws its tasks
    chunk by chunk, every round)."""
    rows = pool._rows(part)
    classes = pool.classes(part)
    return classes, _rows_by_class(pool.y, rows, classes)


def _rows_by_class(y: np.ndarray, rows: np.ndarray, classes: np.ndarray) -> list[np.ndarray]:
    labels = y[rows]
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.append(classes, classes[-1] + 1))
    return [rows[order[bounds[i]:bounds[i + 1]]] for i in range(len(classes))]


def _distinct_places(seed: int, stream: int, ids: np.ndarray, cls: int, size: int,
                     count: int) -> np.ndarray:
    """For each task id, ``count`` distinct places in range(size), a function of (seed,
    stream, task id, class) alone: a seeded permutation's first ``count`` for a small class;
    for a large one, uniform places whose repeats are drawn again (a task's redraw counter
    moves on only where it repeats, so other tasks are untouched)."""
    key = ids * np.int64(1 << 20) + cls  # (task, class): a task never reuses a class's stream
    if size <= _SMALL_POOL:
        return user_permutations(seed, _ROW_PURPOSE, stream, key, size)[:, :count]
    place = np.arange(count)[None, :]
    drawn: np.ndarray = np.floor(uniforms_at(seed, _ROW_PURPOSE, stream, key[:, None], place)
                                 * size).astype(np.int64)
    for attempt in range(1, _MAX_REDRAWS + 1):
        again = _repeats(drawn)
        if not again.any():
            return drawn
        fresh = np.floor(uniforms_at(seed, _ROW_PURPOSE, stream, key[:, None],
                                     place + attempt * count) * size).astype(np.int64)
        drawn = np.where(again, fresh, drawn)
    raise RuntimeError("few-shot rows: repeated draws did not resolve")  # p < 1e-100


def _repeats(drawn: np.ndarray) -> np.ndarray:
    """Where a row's value already occurred earlier in the row (the later copies)."""
    order = np.argsort(drawn, axis=1, kind="stable")
    ranked = np.take_along_axis(drawn, order, 1)
    dup = np.zeros(drawn.shape, dtype=bool)
    later = np.zeros_like(ranked, dtype=bool)
    later[:, 1:] = ranked[:, 1:] == ranked[:, :-1]
    np.put_along_axis(dup, order, later, 1)
    return dup


def validation_pool(pool: FewShotPool, share: float = VALIDATION_SHARE) -> FewShotPool:
    """The pool for choosing settings: its meta-training part split in two, a fixed public
    split. The returned pool's "train" part is what is left for meta-training, its "test"
    part the held-out **validation** part, so that validation tasks share no image with the
    training tasks. Where meta-test classes are disjoint from meta-training ones (Omniglot),
    ``share`` of the training classes are held out (new classes, as at meta-test); else (a
    built-in dataset's same classes) ``share`` of each class's training images."""
    rng = np.random.default_rng(_VALIDATION_SPLIT)
    rows = pool.train_rows
    classes = pool.classes("train")
    labels = pool.y[rows]
    if not np.intersect1d(classes, pool.classes("test")).size:
        held_classes = rng.permutation(classes)[:max(1, round(share * len(classes)))]
        held = np.isin(labels, held_classes)
    else:
        held = np.zeros(len(rows), dtype=bool)
        for c in classes:
            mine = np.flatnonzero(labels == c)
            held[rng.permutation(mine)[:round(share * len(mine))]] = True
    return FewShotPool(f"{pool.name} (validation split)", pool.x, pool.y, rows[~held],
                       rows[held], pool.class_names)


def source_pool(source: Source) -> FewShotPool:
    """A built-in dataset's pool: meta-training draws from its train split, meta-testing from
    its test split (the same classes, disjoint images)."""
    x = np.concatenate([source.x_train, source.x_test])
    y = np.concatenate([source.y_train, source.y_test]).astype(np.int64)
    train = np.arange(len(source.y_train))
    test = np.arange(len(source.y_train), len(y))
    names = tuple(str(c) for c in range(int(y.max()) + 1))
    return FewShotPool(source.name, x, y, train, test, names)


def omniglot_pool(root: str | Path, size: int = 28) -> FewShotPool:
    """Omniglot from ``root`` (module docstring): every ``alphabet/character`` folder of
    ``images_background`` (meta-training) and ``images_evaluation`` (meta-testing) is a class.
    A missing folder or an unreadable image is a ``DatasetError`` naming it."""
    from PIL import Image, UnidentifiedImageError

    root = Path(root)
    images: list[np.ndarray] = []
    labels: list[int] = []
    names: list[str] = []
    parts: list[np.ndarray] = []
    for part in OMNIGLOT_PARTS:
        folder = root / part
        if not folder.is_dir():
            raise DatasetError(f"omniglot: {folder} is not a folder; expected {root}/"
                               f"{{{','.join(OMNIGLOT_PARTS)}}}/<alphabet>/<character>/*.png "
                               "(Omniglot's python/ folder, unzipped)")
        start = len(labels)
        characters = sorted(c for a in sorted(folder.iterdir()) if a.is_dir()
                            for c in sorted(a.iterdir()) if c.is_dir())
        if not characters:
            raise DatasetError(f"omniglot: {folder} holds no <alphabet>/<character> folders")
        for character in characters:
            files = sorted(character.glob("*.png"))
            if not files:
                raise DatasetError(f"omniglot: {character} holds no .png image")
            for file in files:
                try:
                    with Image.open(file) as image:
                        gray = image.convert("L").resize((size, size), Image.Resampling.BOX)
                except (OSError, UnidentifiedImageError) as err:
                    raise DatasetError(f"omniglot: cannot read {file}: {err}") from err
                images.append(1.0 - np.asarray(gray, dtype=np.float32) / 255.0)
                labels.append(len(names))
            names.append(f"{character.parent.name}/{character.name}")
        parts.append(np.arange(start, len(labels)))
    x = np.stack(images)[:, None, :, :]
    return FewShotPool("omniglot", x, np.asarray(labels, dtype=np.int64), parts[0], parts[1],
                       tuple(names))
