"""Deep personalization on real data: sources, partitions, the vectorized local work against
per-user loops, the deep algorithms' privacy (clipping, noise, Poisson accounting) and bad
input."""

import gzip
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpriv.algorithms.base import Step
from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.deep_algorithm import disjoint_batches
from fedpriv.algorithms.deep.problem import problem_of, user_block
from fedpriv.configure import parse_config
from fedpriv.data.partition import PartitionError, partition
from fedpriv.data.sources import DatasetError, load_source, read_idx
from fedpriv.engine import run_in_process
from fedpriv.params import ConfigError
from fedpriv.privacy.mechanisms import clipped_sum
from fedpriv.registry import get_algorithm
from fedpriv.server.report import summary_lines

SMALL = {"dataset": "digits", "num-users": 60, "hidden-sizes": "32", "rounds": 2,
         "checkpoint": False, "epsilon": 2.0, "delta": 1e-5,
         # the tests' own hyperparameters, not the algorithms' (tuned) defaults
         "learning-rate": 1.0, "clip-quantile": 0.0, "cross-fit": 0}
ROUND_KEYS = ("rounds", "learning-rate", "clip-quantile")  # deep-local-only has no rounds
DEEP = ("deep-private-fedrep", "deep-fedrep", "deep-dp-fedavg", "deep-dp-fedavg-ft",
        "deep-fedavg-ft", "deep-local-only")


def config(algorithm="deep-private-fedrep", **keys):
    mapping = {"algorithm": algorithm, **SMALL, **{k.replace("_", "-"): v for k, v in keys.items()}}
    if algorithm == "deep-local-only":
        for key in ROUND_KEYS:
            mapping.pop(key)
    return parse_config(mapping, strict=True)


def run(tmp_path, algorithm="deep-private-fedrep", **keys):
    cfg = config(algorithm, results_path=str(tmp_path / "r.json"), **keys)
    return run_in_process(cfg, num_partitions=2, log=lambda _: None)


# ----- data ----------------------------------------------------------------------------------
def test_the_partition_is_a_pure_function_and_label_skew_gives_each_user_its_classes():
    source = load_source("digits")
    a = partition(source, "label-skew", 50, 3, 4)
    from fedpriv.data.partition import _partition
    fresh = _partition.__wrapped__(source, "label-skew", 50, 3, 4, 0.5)  # not the cache
    assert np.array_equal(a.train.rows, fresh.train.rows)
    assert np.array_equal(a.test.rows, fresh.test.rows)
    assert len(np.unique(a.train.rows)) == len(a.train.rows)  # disjoint training rows
    for u in range(50):
        train = source.y_train[a.train.rows[a.train.offsets[u]:a.train.offsets[u + 1]]]
        test = source.y_test[a.test.rows[a.test.offsets[u]:a.test.offsets[u + 1]]]
        assert len(set(train)) <= 4 and len(test) > 0
        assert set(test) <= set(train)  # the test split follows the user's classes
    other = partition(source, "label-skew", 50, 4, 4)
    assert not np.array_equal(a.train.rows, other.train.rows)


@pytest.mark.parametrize("scheme", ["label-skew", "dirichlet"])
@pytest.mark.parametrize("seed", [0, 7])
def test_the_numpy_partitions_are_flwr_datasets_rows(scheme, seed):
    """The core recomputes flwr-datasets' partitioners draw for draw (it never imports Flower's
    packages); here they are compared with flwr-datasets itself."""
    pytest.importorskip("flwr_datasets")
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, PathologicalPartitioner

    from fedpriv.data.partition import _skewed_rows

    labels = load_source("digits").y_train
    users = 40
    if scheme == "label-skew":
        theirs = PathologicalPartitioner(users, "label", 3, class_assignment_mode="random",
                                         seed=seed)
    else:
        theirs = DirichletPartitioner(users, "label", 0.5, min_partition_size=10, seed=seed)
    theirs.dataset = Dataset.from_dict({"label": labels})
    ours = _skewed_rows(labels, scheme, users, seed, 3, 0.5)
    for user in range(users):
        rows = np.asarray(theirs.load_partition(user)["label"])
        assert np.array_equal(labels[ours[user]], rows), user
    mapping = theirs._partition_id_to_indices
    assert all(np.array_equal(ours[u], np.asarray(mapping[u])) for u in range(users))


def test_iid_dirichlet_and_natural_partitions(tmp_path):
    source = load_source("digits")
    iid = partition(source, "iid", 40, 0)
    assert iid.train.counts.sum() == len(source.y_train)
    assert iid.train.counts.max() - iid.train.counts.min() <= 1
    dirichlet = partition(source, "dirichlet", 20, 0, alpha=0.3)
    assert dirichlet.train.counts.min() >= 10
    rng = np.random.default_rng(0)
    path = tmp_path / "own.npz"
    np.savez(path, x_train=rng.normal(size=(30, 5)), y_train=rng.integers(0, 3, 30),
             x_test=rng.normal(size=(12, 5)), y_test=rng.integers(0, 3, 12),
             user_train=np.repeat([7, 3, 9], 10), user_test=np.repeat([3, 7, 9], 4))
    own = load_source("npz", data_file=str(path))
    natural = partition(own, "natural", 3, 0)
    assert np.array_equal(own.user_train[natural.train.rows[:10]], np.full(10, 3))
    assert np.array_equal(own.user_test[natural.test.rows[natural.test.offsets[1]:
                                                          natural.test.offsets[2]]],
                          np.full(4, 7))
    # every user of the file, whatever num-users (there the public population n only)
    assert len(partition(own, "natural", 1, 0).train.counts) == 3
    with pytest.raises(PartitionError, match="user column"):
        partition(source, "natural", 4, 0)


def test_idx_files_are_read_and_a_missing_fashion_mnist_names_the_package(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    header = bytes([0, 0, 0x08, 3]) + b"".join(int(s).to_bytes(4, "big") for s in images.shape)
    with gzip.open(tmp_path / "a.gz", "wb") as fh:
        fh.write(header + images.tobytes())
    assert np.array_equal(read_idx(tmp_path / "a.gz"), images)
    (tmp_path / "bad").write_bytes(header + images.tobytes()[:-1])
    with pytest.raises(DatasetError, match="header"):
        read_idx(tmp_path / "bad")
    with pytest.raises(ConfigError, match="dataset-fashion-mnist"):
        config(dataset="fashion-mnist", data_dir=str(tmp_path))


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(s).to_bytes(4, "big") for s in array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_the_servers_checks_read_fashion_mnist_labels_and_image_headers_only(tmp_path):
    """A deployment's server validates a Fashion-MNIST config from the label files and the
    image files' headers: with the images' pixels cut off after their headers it still builds
    the same partition and model, while a node's full load names the broken file."""
    rng = np.random.default_rng(0)
    full, cut = tmp_path / "full", tmp_path / "cut"
    for folder in (full, cut):
        folder.mkdir()
    for stem, n in (("train", 600), ("t10k", 100)):
        images = rng.integers(0, 256, (n, 28, 28))
        labels = np.repeat(np.arange(10), n // 10)
        _write_idx(full / f"{stem}-images-idx3-ubyte.gz", images)
        _write_idx(full / f"{stem}-labels-idx1-ubyte.gz", labels)
        _write_idx(cut / f"{stem}-labels-idx1-ubyte.gz", labels)
        header = bytes([0, 0, 0x08, 3]) + b"".join(int(v).to_bytes(4, "big")
                                                    for v in images.shape)
        with gzip.open(cut / f"{stem}-images-idx3-ubyte.gz", "wb") as fh:
            fh.write(header)  # no pixels at all
    keys = {"dataset": "fashion-mnist", "num-users": 20}
    server = problem_of(config(**keys, data_dir=str(cut)), features=False)
    node = problem_of(config(**keys, data_dir=str(full)))
    assert server.source.x_train.shape == (0, 1, 28, 28)
    assert server.spec.input_shape == node.spec.input_shape == (1, 28, 28)
    assert np.array_equal(server.users.train.rows, node.users.train.rows)
    assert np.array_equal(server.users.test.rows, node.users.test.rows)
    get_algorithm("deep-private-fedrep").validate(config(**keys, data_dir=str(cut)))
    with pytest.raises(ConfigError, match="header says"):
        problem_of(config(**keys, data_dir=str(cut)))


# ----- vectorized == per-user loop -------------------------------------------------------------
@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("steps", [1, 3])
def test_vectorized_local_work_equals_the_per_user_loop(model, steps):
    cfg = config(model=model, body_steps=steps)
    problem = problem_of(cfg)
    spec = problem.spec
    flat = torch.from_numpy(spec.initial(0))
    body = flat[:spec.body_size]
    block = user_block(problem, np.arange(8))
    n, r = block.y.shape
    feats = dm.features(spec, body, block.x.reshape(n * r, *spec.input_shape)).reshape(n, r, -1)
    heads = dm.fit_heads(feats, block.y, block.mask, 10, 10, 1.0)
    assert torch.allclose(heads, dm.loop_fit_heads(feats, block.y, block.counts, 10, 10, 1.0),
                          atol=1e-5)
    for start, h in ((body, heads), (flat, None)):  # FedRep's body update; FedAvg's model
        fast = dm.local_updates(spec, start, h, block.x, block.y, block.mask, steps, 0.1)
        slow = dm.loop_local_updates(spec, start, h, block.x, block.y, block.counts, steps, 0.1)
        assert fast.abs().max() > 1e-4
        assert torch.allclose(fast, slow, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(("rows", "width"), [(6, 40), (40, 6)])  # row space; feature space
@pytest.mark.parametrize("start", [False, True])
def test_head_fits_in_either_space_equal_a_per_user_sgd_loop(rows, width, start):
    """fit_heads descends in the users' row space where they have fewer rows than features
    (W = W0 + A f): the same iterates as torch.optim.SGD per user from the same start, with
    padded rows ignored."""
    gen = torch.Generator().manual_seed(rows)
    n, c = 5, 4
    feats = torch.randn(n, rows, width, generator=gen)
    y = torch.randint(0, c, (n, rows), generator=gen)
    counts = np.array([rows, rows - 2, 3, rows, 1])
    mask = torch.from_numpy((np.arange(rows)[None] < counts[:, None]).astype(np.float32))
    init = 0.3 * torch.randn(n, c * width + c, generator=gen) if start else None
    fast = dm.fit_heads(feats, y, mask, c, 25, 1.0, init=init)
    slow = []
    for i, count in enumerate(counts):
        head = torch.nn.Linear(width, c)
        with torch.no_grad():
            head.weight.copy_(init[i, :c * width].reshape(c, width) if start else 0.0)
            head.bias.copy_(init[i, c * width:] if start else 0.0)
        sq = float(feats[i, :count].pow(2).sum(-1).mean())
        opt = torch.optim.SGD(head.parameters(), lr=1.0 / (0.5 * sq + 0.5))
        for _ in range(25):
            opt.zero_grad()
            F.cross_entropy(head(feats[i, :count]), y[i, :count]).backward()
            opt.step()
        slow.append(torch.cat([head.weight.detach().reshape(-1), head.bias.detach()]))
    moved = fast - (init if start else 0.0)
    assert moved.abs().max() > 0.05
    assert torch.allclose(fast, torch.stack(slow), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("algorithm", "cross_fit"),
                         [(a, 0) for a in DEEP if a != "deep-local-only"]
                         + [("deep-private-fedrep", 2), ("deep-fedrep", 4)])  # 4: 16 of 18 rows
def test_each_algorithms_round_equals_a_per_user_loop(algorithm, cross_fit):
    """The vectorized round against a per-user loop; cross-fit = k: each user's k heads fitted
    one at a time on the other folds' rows, its body trained through model copies that share
    the body, copy j on fold j."""
    cfg = config(algorithm, body_steps=2, cross_fit=cross_fit)
    cls, problem = get_algorithm(algorithm), problem_of(config(algorithm))
    spec, b = problem.spec, problem.batch_size
    model = torch.from_numpy(spec.initial(0))
    ids = np.arange(10, 16)
    block = user_block(problem, ids)
    first, second, mask = disjoint_batches(0, 1, ids, block.counts, block.y.shape[1], b)
    assert mask.all()  # every user has 2b rows here
    assert not (set(first[0]) & set(second[0]))
    assert (first < block.counts[:, None]).all() and (second < block.counts[:, None]).all()
    fast = cls.local_work(cfg, problem, model, block, first, second, mask)
    rows = np.arange(len(ids))[:, None]
    x1, y1 = block.x[rows, first], block.y[rows, first]
    x2, y2 = block.x[rows, second], block.y[rows, second]
    full = np.full(len(ids), b)
    if cls.released_part == "body":
        body = model[:spec.body_size]

        def head_fit(xs, ys):
            feats = dm.features(spec, body, xs.reshape(-1, *spec.input_shape))
            return dm.loop_fit_heads(feats.reshape(len(ids), ys.shape[1], -1), ys,
                                     np.full(len(ids), ys.shape[1]), 10, cfg.head_steps,
                                     cfg.head_lr)

        if cross_fit:
            x, y = torch.cat([x1, x2], 1), torch.cat([y1, y2], 1)
            g = 2 * b // cross_fit
            fold = [slice(j * g, (j + 1) * g) for j in range(cross_fit)]
            heads = torch.stack([
                head_fit(torch.cat([x[:, f] for f in fold if f != fj], 1),
                         torch.cat([y[:, f] for f in fold if f != fj], 1)) for fj in fold], 1)
            used = cross_fit * g
            slow = dm.loop_local_updates(spec, body, heads, x[:, :used], y[:, :used],
                                         np.full(len(ids), used), 2, cfg.local_lr)
            plain = dm.loop_local_updates(spec, body, heads[:, 0], x[:, :used], y[:, :used],
                                          np.full(len(ids), used), 2, cfg.local_lr)
            assert not torch.allclose(slow, plain, atol=1e-4)  # each fold's own head matters
        else:
            slow = dm.loop_local_updates(spec, body, head_fit(x1, y1), x2, y2, full, 2,
                                         cfg.local_lr)
    else:
        slow = dm.loop_local_updates(spec, model, None, torch.cat([x1, x2], 1),
                                     torch.cat([y1, y2], 1), 2 * full, 2, cfg.local_lr)
    assert torch.allclose(fast, slow, atol=1e-6, rtol=1e-4)


def test_the_alignment_of_clipped_updates_is_one_when_users_agree_and_small_when_not():
    assert dm.clipped_mean_alignment(torch.ones(6, 5)) == pytest.approx(1.0)
    # one direction, norms k sqrt(5) for k = 1..6: clipped at the median (k = 3)
    same_way = torch.ones(6, 5) * torch.arange(1.0, 7.0)[:, None]
    assert dm.clipped_mean_alignment(same_way) == pytest.approx((1 + 2 + 3 * 4) / 6 / 3)
    orthogonal = torch.eye(16) * 3.0
    assert dm.clipped_mean_alignment(orthogonal) == pytest.approx(0.25)  # 1 / sqrt(16)
    opposed = torch.cat([torch.eye(4), -torch.eye(4)])
    assert dm.clipped_mean_alignment(opposed) == pytest.approx(0.0, abs=1e-12)


def test_the_alignment_benchmark_runs_and_prints_each_algorithm():
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_update_alignment.py", "--users", "40", "--set",
         "dataset=digits", "--set", "num-users=100", "--set", "epsilon=4"],
        capture_output=True, text=True, timeout=300, check=True,
        cwd=Path(__file__).resolve().parents[1]).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == {"deep-private-fedrep", "deep-dp-fedavg"}
    for row in rows.values():
        assert 0 < float(row[2]) <= 1 and float(row[3]) > 0  # alignment, z


def test_the_vectorization_benchmark_prints_both_paths_and_the_ceiling():
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_deep_vectorized.py", "--dataset", "digits",
         "--num-users", "100", "--users", "20", "--loop-users", "4", "--repeats", "1",
         "--allocator", "default"],
        capture_output=True, text=True, timeout=300, check=True,
        cwd=Path(__file__).resolve().parents[1]).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith("deep-")}
    assert set(rows) == {"deep-private-fedrep", "deep-dp-fedavg"}
    for row in rows.values():  # chunk, vectorized users/s, loop users/s, ratio
        vectorized, loop = float(row[2]), float(row[3])
        assert vectorized > 0 and loop > 0
        ratio = float(row[4].rstrip("x"))  # of the unrounded rates, printed rounded
        assert (vectorized - 0.5) / (loop + 0.5) - 0.05 <= ratio
        assert ratio <= (vectorized + 0.5) / max(loop - 0.5, 1e-9) + 0.05
    (ceiling,) = [line for line in out.splitlines() if line.startswith("ceiling for")]
    assert "deep-dp-fedavg" in ceiling and "x its loop" in ceiling


def test_the_benchmark_ceiling_is_the_mean_of_the_users_gradients():
    """The ceiling times real work: its one-batch gradient is the mean of the per-user loop's
    one-step gradients (every user has the same 2b rows)."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_deep_vectorized.py"
    module_spec = importlib.util.spec_from_file_location("bench_deep_vectorized", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    cfg = parse_config({"algorithm": "deep-dp-fedavg", "dataset": "digits",
                        "num-users": 100, "body-steps": 1}, strict=True)  # one step: -lr grad
    problem = problem_of(cfg)
    model = torch.from_numpy(problem.spec.initial(0))
    ids = np.arange(6)
    block = user_block(problem, ids)
    first, second, _ = disjoint_batches(0, 1, ids, block.counts, block.y.shape[1],
                                        problem.batch_size)
    grad = bench.batch_step(problem, model, block, first, second)
    updates = bench.loop_round(cfg, problem, model, block, first, second, "model")
    assert torch.allclose(grad, -updates.mean(0) / cfg.local_lr, rtol=1e-4, atol=1e-6)
    assert grad.abs().sum() > 0


def test_the_torch_clipped_sum_bounds_every_user_like_the_numpy_one():
    rng = np.random.default_rng(1)
    updates = rng.normal(size=(20, 300)) * rng.choice([1e-3, 1.0, 1e6], size=(20, 1))
    total, clipped = dm.clipped_sum(torch.from_numpy(updates.astype(np.float32)), 0.5)
    expect, expect_clipped = clipped_sum(updates.astype(np.float32).astype(np.float64), 0.5)
    assert clipped == expect_clipped and clipped > 0
    assert np.allclose(total, expect, rtol=1e-12, atol=1e-12)
    one, _ = dm.clipped_sum(torch.from_numpy(updates[:1].astype(np.float32) * 1e30), 0.5)
    assert np.linalg.norm(one) <= 0.5 * (1 + 1e-12)


@pytest.mark.parametrize("block", [300, 900, 1 << 19])  # one row a block, 3 rows, all at once
def test_the_torch_clipped_sum_is_the_same_in_blocks_and_drops_a_bad_row_in_any(monkeypatch,
                                                                                block):
    rng = np.random.default_rng(2)
    updates = rng.normal(size=(20, 300)) * rng.choice([1e-3, 1.0, 1e6], size=(20, 1))
    updates[13] = np.nan  # in a later block than the first
    monkeypatch.setattr(dm, "BLOCK_ELEMENTS", block)
    total, clipped = dm.clipped_sum(torch.from_numpy(updates.astype(np.float32)), 0.5)
    kept = np.delete(updates, 13, axis=0).astype(np.float32).astype(np.float64)
    expect, expect_clipped = clipped_sum(kept, 0.5)
    assert clipped == expect_clipped + 1  # the dropped row counts as clipped
    np.testing.assert_allclose(total, expect, rtol=1e-12, atol=1e-12)


# ----- runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", DEEP)
def test_every_deep_algorithm_runs_and_learns(tmp_path, algorithm):
    results = run(tmp_path, algorithm, rounds=4, epsilon=50.0)  # 60 users: learnable at large eps
    metrics = results["metrics"]
    assert metrics["users_evaluated"] == 60
    assert 0.2 < metrics["accuracy"] <= 1.0  # chance is 0.1 (and 0.2 within 5 classes)
    assert 0 <= metrics["accuracy_p10"] <= metrics["accuracy"] + 0.01
    private = get_algorithm(algorithm).private
    assert (results["privacy"]["epsilon"] <= 50.0 + 1e-9) if private else True
    quality = summary_lines(results)[1]  # the run's summary shows accuracy, not MSE
    assert f"mean per-user test accuracy {metrics['accuracy']:.4f}" in quality


def test_privacy_noise_is_applied_with_the_planned_std(tmp_path):
    """One round, no momentum, step 1: the released body minus the non-private one is exactly
    the noise, whose std must be the ledger's clip * z / n."""
    keys = dict(rounds=1, server_momentum=0.0, learning_rate=1.0, clip_norm=0.05)
    private = run(tmp_path, "deep-private-fedrep", **keys)
    plain = run(tmp_path, "deep-fedrep", **keys)
    diff = (np.array(private["server_state"]["parameters"])
            - np.array(plain["server_state"]["parameters"]))
    std = private["privacy"]["ledger"][0]["noise_std"]
    assert std == pytest.approx(0.05 * private["privacy"]["noise_multipliers"]["round"] / 60)
    assert diff.std() == pytest.approx(std, rel=0.03)
    assert abs(diff.mean()) < 5 * std / np.sqrt(diff.size)


def test_poisson_cohorts_are_accounted_with_sampling_amplification(tmp_path):
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    results = run(tmp_path, "deep-private-fedrep", users_per_round=15, rounds=3)
    rounds = [r for r in results["rounds"] if r["step"].startswith("round")]
    assert all(r["users_contributing"] < 60 for r in rounds)
    z = results["privacy"]["noise_multipliers"]["round"]
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(15 / 60, dp_accounting.GaussianDpEvent(z)), 3)
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(event)
    assert results["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)
    assert results["privacy"]["epsilon"] <= 2.0 + 1e-9
    unsampled = run(tmp_path, "deep-private-fedrep", rounds=3)
    assert z < unsampled["privacy"]["noise_multipliers"]["round"]  # amplification: less noise


# ----- bad input -------------------------------------------------------------------------------
def _factories(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "from torch import nn\n"
        "def wrong_classes(shape, classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3))\n"
        "def head_only(shape, classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, classes))\n"
        "def good(shape, classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(),\n"
        "                         nn.Linear(16, classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_bad_models_and_too_small_users_fail_before_the_run(tmp_path, monkeypatch):
    _factories(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match="model: .*3 classes|model: .*outputs shape"):
        config(model="my_models:wrong_classes")
    with pytest.raises(ConfigError, match="model: .*no body"):
        config(model="my_models:head_only")
    with pytest.raises(ConfigError, match="model: cannot import"):
        config(model="my_models:nothing")
    # a user with fewer than 2b rows is not refused: its own batches shrink (test_neighbours)
    config(num_users=200, local_batch_size="3")  # the smallest user has 5 rows
    with pytest.raises(ConfigError, match="hidden-sizes"):
        config(hidden_sizes="32,x")
    with pytest.raises(ConfigError, match="cross-fit: 19 folds .*at most 18"):
        config(cross_fit=19)  # two batches of 9 rows a user
    with pytest.raises(ConfigError, match="cross-fit.*0 or an integer >= 2"):
        config(cross_fit=1)
    # digits at the core default of 2,000 users: the key to change and a size that fits
    with pytest.raises(ConfigError, match=r"num-users: 2000 users .* use num-users below "
                                          r"\d+ \(somewhat below"):
        config(num_users=2000)
    with pytest.raises(ConfigError, match="model: cnn needs image inputs .*input-shape"):
        config(model="cnn", input_shape="64")
    results = run(tmp_path, "deep-fedrep", model="my_models:good")
    assert results["metrics"]["accuracy"] > 0.2


def test_a_user_step_answers_for_an_empty_cohort():
    cfg = config()
    cls = get_algorithm("deep-private-fedrep")
    problem = problem_of(cfg)
    model = problem.spec.initial(0)
    final = cls.user_step(cfg, Step("final"), {"model": model}, np.zeros(0, dtype=np.int64))
    assert final.num_users == 0 and final.metrics["acc_users"] == 0


# ----- device ------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA path is "
                    "tested where torch sees one")
def test_the_cuda_path_gives_the_cpu_runs_results(tmp_path):
    """Nodes compute on the GPU when asked; the release and metrics match the CPU run (float
    tolerance: the kernels differ)."""
    on_cpu = run(tmp_path, device="cpu", rounds=3)
    on_gpu = run(tmp_path, device="cuda", rounds=3)
    assert problem_of(config(device="cuda")).device.type == "cuda"
    assert on_gpu["privacy"]["ledger"] == on_cpu["privacy"]["ledger"]
    assert np.allclose(on_gpu["server_state"]["parameters"], on_cpu["server_state"]["parameters"],
                       atol=1e-4)
    assert on_gpu["metrics"]["accuracy"] == pytest.approx(on_cpu["metrics"]["accuracy"], abs=0.02)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_asking_for_cuda_without_a_gpu_fails_before_the_run():
    with pytest.raises(ConfigError, match="device: 'cuda'"):
        config(device="cuda")
    assert problem_of(config(device="auto")).device.type == "cpu"
