"""Few-shot tasks as users (``fedpriv.data.fewshot``): N-way K-shot draws over an image pool,
each task a pure function of (seed, part, task id), and Omniglot's folder layout read from a
fixture the test writes (nothing can be downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedpriv.data.fewshot import FewShotPool, draw_tasks, omniglot_pool, source_pool
from fedpriv.data.sources import FASHION_MNIST_DIR, DatasetError, Source, load_source

PER_CHARACTER = 20


def _write_omniglot(root: Path, alphabets: dict[str, dict[str, int]]) -> None:
    """Omniglot's layout: part/alphabet/character/NNNN_MM.png, 105 x 105 white paper with a
    black square whose place encodes the character (its index c: column 10 + 15 c)."""
    from PIL import Image

    c = 0
    for part, letters in alphabets.items():
        for alphabet, characters in letters.items():
            for k in range(characters):
                folder = root / part / alphabet / f"character{k + 1:02d}"
                folder.mkdir(parents=True)
                image = np.full((105, 105), 255, dtype=np.uint8)
                left = 10 + 15 * (c % 6)
                image[30:75, left:left + 15] = 0
                for i in range(PER_CHARACTER):
                    Image.fromarray(image).save(folder / f"{c:04d}_{i + 1:02d}.png")
                c += 1


@pytest.fixture(scope="module")
def omniglot(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("omniglot")
    _write_omniglot(root, {"images_background": {"Alpha": 3, "Beta": 3},
                           "images_evaluation": {"Gamma": 6}})
    return root


def _pool(classes: int = 10, per_class: int = 40, seed: int = 0) -> FewShotPool:
    g = np.random.default_rng(seed)
    y_train = np.repeat(np.arange(classes), per_class)
    y_test = np.repeat(np.arange(classes), per_class // 2)
    source = Source("toy", g.random((len(y_train), 1, 4, 4), dtype=np.float32), y_train,
                    g.random((len(y_test), 1, 4, 4), dtype=np.float32), y_test, classes)
    return source_pool(source)


def test_omniglot_is_read_with_disjoint_characters_for_meta_training_and_testing(omniglot):
    pool = omniglot_pool(omniglot)
    assert pool.x.shape == (12 * PER_CHARACTER, 1, 28, 28) and pool.x.dtype == np.float32
    assert pool.classes("train").tolist() == list(range(6))
    assert pool.classes("test").tolist() == list(range(6, 12))
    assert not set(pool.train_rows) & set(pool.test_rows)
    assert pool.class_names[0] == "Alpha/character01" and pool.class_names[6] == "Gamma/character01"
    # inverted: paper 0, strokes 1; character 1's square is 15 pixels right of character 0's
    first, second = pool.x[pool.y == 0][0, 0], pool.x[pool.y == 1][0, 0]
    assert first[0, 0] == 0.0 and first[12, 4] == pytest.approx(1.0)
    assert second[12, 4] == 0.0 and second[12, 8] == pytest.approx(1.0)
    assert omniglot_pool(omniglot, size=14).x.shape[2:] == (14, 14)


def test_a_broken_omniglot_folder_names_what_is_wrong(tmp_path, omniglot):
    _write_omniglot(tmp_path, {"images_background": {"Alpha": 1}})
    with pytest.raises(DatasetError, match="images_evaluation"):
        omniglot_pool(tmp_path)
    (tmp_path / "images_evaluation" / "Beta" / "character01").mkdir(parents=True)
    with pytest.raises(DatasetError, match="character01 holds no .png"):
        omniglot_pool(tmp_path)
    bad = tmp_path / "images_evaluation" / "Beta" / "character01" / "0001_01.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(DatasetError, match="0001_01.png"):
        omniglot_pool(tmp_path)


@pytest.mark.parametrize("ways,shots,queries", [(5, 1, 5), (5, 5, 15), (3, 2, 2)])
def test_a_task_holds_distinct_classes_and_distinct_rows_of_its_labels(ways, shots, queries):
    pool = _pool()
    tasks = draw_tasks(pool, "train", np.arange(300), ways, shots, queries, seed=4)
    assert tasks.classes.shape == (300, ways)
    assert tasks.support.shape == (300, ways, shots)
    assert tasks.query.shape == (300, ways, queries)
    assert all(len(set(c)) == ways for c in tasks.classes)
    for part in ("support", "query"):
        rows, labels = tasks.rows(part), tasks.labels(part)
        # each row is of its label's class, and from the meta-training rows
        assert np.array_equal(pool.y[rows], np.take_along_axis(tasks.classes, labels, 1))
        assert np.isin(rows, pool.train_rows).all()
    both = np.concatenate([tasks.rows("support"), tasks.rows("query")], 1)
    assert all(len(set(r)) == both.shape[1] for r in both)  # no row twice, support or query
    # labels are permuted: the classes of a task come in a random order
    assert 0 < np.mean([list(c) == sorted(c) for c in tasks.classes]) < 0.5


def test_a_tasks_draw_is_a_function_of_the_seed_and_its_own_id():
    pool = _pool()
    every = draw_tasks(pool, "train", np.arange(100), 5, 2, 3, seed=7)
    some = draw_tasks(pool, "train", np.array([57, 3, 57]), 5, 2, 3, seed=7)
    for field in ("classes", "support", "query"):
        assert np.array_equal(getattr(some, field), getattr(every, field)[[57, 3, 57]])
    other = draw_tasks(pool, "train", np.arange(100), 5, 2, 3, seed=8)
    assert not np.array_equal(other.support, every.support)
    # each class of a task has its own stream: the places drawn within two classes differ
    place = {int(r): i for c in pool.classes("train")
             for i, r in enumerate(pool.train_rows[pool.y[pool.train_rows] == c])}
    places = np.vectorize(place.get)(every.support)  # (tasks, ways, shots)
    assert np.mean([np.array_equal(p[0], p[1]) for p in places]) < 0.1
    test = draw_tasks(pool, "test", np.arange(100), 5, 2, 3, seed=7)
    assert np.isin(test.rows("query"), pool.test_rows).all()  # disjoint images
    assert not np.array_equal(test.classes, every.classes)  # an independent draw


def test_large_classes_draw_distinct_rows_covering_the_class():
    pool = _pool(classes=5, per_class=400)  # above the full-permutation size: redraws
    tasks = draw_tasks(pool, "train", np.arange(2000), 5, 10, 30, seed=1)
    both = np.concatenate([tasks.rows("support"), tasks.rows("query")], 1)
    assert all(len(set(r)) == 200 for r in both)
    counts = np.bincount(both.ravel(), minlength=2000)
    # each of the 2,000 rows is drawn 200 times on average; uniform draws stay near it
    assert counts.min() > 120 and counts.max() < 290


def test_tasks_too_wide_or_too_deep_for_the_pool_fail_naming_the_limit(omniglot):
    with pytest.raises(DatasetError, match="11-way task needs 11 classes; the meta-train part "
                                           "has 10"):
        draw_tasks(_pool(), "train", np.arange(3), 11, 1, 1, seed=0)
    pool = omniglot_pool(omniglot)
    with pytest.raises(DatasetError, match=r"need 21 images a class; class 'Gamma/character01'"):
        draw_tasks(pool, "test", np.arange(3), 5, 6, 15, seed=0)
    with pytest.raises(ValueError, match="at least 1"):
        draw_tasks(pool, "test", np.arange(3), 5, 0, 15, seed=0)
    tasks = draw_tasks(pool, "test", np.arange(50), 5, 5, 15, seed=0)  # all 20 of a character
    assert (tasks.classes >= 6).all()  # evaluation characters only


@pytest.mark.skipif(not Path(FASHION_MNIST_DIR).is_dir(),
                    reason="apt-get install dataset-fashion-mnist")
def test_fashion_mnist_tasks_draw_train_images_for_training_and_test_images_for_testing():
    pool = source_pool(load_source("fashion-mnist"))
    train = draw_tasks(pool, "train", np.arange(1000), 5, 5, 15, seed=0)
    test = draw_tasks(pool, "test", np.arange(1000), 5, 5, 15, seed=0)
    assert train.rows("support").max() < 60_000 <= test.rows("query").min()
    assert pool.classes("train").tolist() == pool.classes("test").tolist() == list(range(10))


def test_the_meta_pages_example_runs():
    page = (Path(__file__).resolve().parents[1] / "docs" / "algorithms" / "meta.md").read_text()
    block = page.split("## Few-shot image tasks")[1].split("```python\n")[1].split("```")[0]
    scope: dict[str, object] = {}
    exec(compile(block, "meta.md", "exec"), scope)
    tasks = scope["tasks"]
    assert scope["x"].shape == (1000, 25, 1, 8, 8) and tasks.classes.shape == (1000, 5)


def test_the_validation_split_holds_out_images_or_whole_classes(omniglot):
    """``validation_pool``: a fixed public split of the meta-training part; validation tasks
    share no image with training tasks. A built-in dataset (the same classes at meta-test):
    a sixth of each class's training images; Omniglot (new classes at meta-test): a sixth of
    the background characters, whole."""
    from fedpriv.data.fewshot import validation_pool

    pool = _pool(classes=6, per_class=60)
    split = validation_pool(pool)
    assert not set(split.train_rows) & set(split.test_rows)
    assert sorted([*split.train_rows, *split.test_rows]) == sorted(pool.train_rows)
    assert split.classes("test").tolist() == pool.classes("train").tolist()
    for c in range(6):
        assert np.sum(pool.y[split.test_rows] == c) == 10  # a sixth of 60
    again = validation_pool(pool)  # fixed: the same split every time
    assert np.array_equal(again.test_rows, split.test_rows)
    chars = validation_pool(omniglot_pool(omniglot))
    held, kept = chars.classes("test"), chars.classes("train")
    assert len(held) == 1 and not set(held) & set(kept) and set(held) <= set(range(6))
    tasks = draw_tasks(split, "test", np.arange(20), 3, 2, 3, seed=0)
    assert set(tasks.support.ravel()) | set(tasks.query.ravel()) <= set(split.test_rows)
