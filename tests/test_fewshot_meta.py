"""Task-level private meta-learning of a network on few-shot tasks (``fedpriv.algorithms.fewshot``):
the adaptation and its meta-gradient against independent computations, the clipped sums
(ghost and per-task paths) against a per-task loop, isolation of a task with non-finite
pixels, the noise really applied at the ledger's scale, small runs that learn, and bad
settings refused before the run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpriv.algorithms.deep.models import model_spec
from fedpriv.algorithms.fewshot import fewshot_math as fm
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.params import ConfigError

sys.path.insert(0, str(Path(__file__).parent))

WAYS, SHOTS, QUERIES = 3, 2, 3
TINY = {"num-users": 60, "hidden-sizes": "16", "queries": 3, "rounds": 2,
        "tasks-per-round": 30, "epsilon": 4.0, "delta": 1e-5}


def tasks(n: int, seed: int = 0, shape=(1, 8, 8)):
    """n random tasks: rows (n, N(K+Q), *shape), support and query labels."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.arange(WAYS).repeat_interleave(SHOTS).repeat(n, 1)
    yq = torch.arange(WAYS).repeat_interleave(QUERIES).repeat(n, 1)
    x = torch.randn(n, WAYS * (SHOTS + QUERIES), *shape, generator=g)
    x[:, :WAYS * SHOTS] += ys[..., None, None, None]  # separable-ish classes
    x[:, WAYS * SHOTS:] += yq[..., None, None, None]
    return x, ys, yq


def spec_and_body(hidden: str = "16"):
    spec = model_spec("mlp", hidden, (1, 8, 8), WAYS)
    return spec, torch.from_numpy(spec.initial(3)[:spec.body_size])


def test_prototypes_score_minus_squared_distances_and_head_steps_are_gradient_steps():
    g = torch.Generator().manual_seed(1)
    fs, fq = torch.randn(WAYS * SHOTS, 4, generator=g), torch.randn(5, 4, generator=g)
    ys = torch.arange(WAYS).repeat_interleave(SHOTS)
    logits = fm.adapted_logits(fs, ys, fq, WAYS, 0, 0.0, False)
    distances = torch.stack([((fq - fs[ys == j].mean(0)) ** 2).sum(1) for j in range(WAYS)], 1)
    # minus the squared distances, up to a constant per query: the same softmax
    assert torch.allclose(torch.softmax(logits, 1), torch.softmax(-distances, 1), atol=1e-6)
    assert torch.allclose(logits + distances, (logits + distances)[:, :1].expand(-1, WAYS),
                          atol=1e-4)
    # two steps of the head from the prototype classifier, by autograd on the support loss
    protos = torch.stack([fs[ys == j].mean(0) for j in range(WAYS)])
    w = (2 * protos).clone().requires_grad_(True)
    b = (-(protos ** 2).sum(1)).clone().requires_grad_(True)
    for _ in range(2):
        loss = F.cross_entropy(fs @ w.T + b, ys)
        gw, gb = torch.autograd.grad(loss, (w, b))
        w = (w - 0.3 * gw).detach().requires_grad_(True)
        b = (b - 0.3 * gb).detach().requires_grad_(True)
    stepped = fm.adapted_logits(fs, ys, fq, WAYS, 2, 0.3, False)
    assert torch.allclose(stepped, fq @ w.T + b, atol=1e-5)


def per_task_gradients(spec, body, x, ys, yq, steps, first_order):
    """Each task's meta-gradient by autograd, one task at a time (no vectorization)."""
    out = []
    for i in range(len(x)):
        leaf = body.clone().requires_grad_(True)
        loss = fm.task_losses(spec, leaf, x[i:i + 1], ys[i:i + 1], yq[i:i + 1], WAYS, steps,
                              0.2, first_order)[0]
        out.append(torch.autograd.grad(loss, leaf)[0].double().numpy())
    return np.stack(out)


def clipped_reference(grads: np.ndarray, clip: float) -> np.ndarray:
    norms = np.linalg.norm(grads, axis=1)
    keep = np.isfinite(norms)
    factors = np.where(keep, np.minimum(1.0, clip / np.where(keep, norms, 1.0)), 0.0)
    return (np.where(keep[:, None], grads, 0.0) * factors[:, None]).sum(0)


@pytest.mark.parametrize("steps, first_order", [(0, False), (0, True), (2, False), (2, True)])
@pytest.mark.parametrize("path", ["ghost", "per-task"])
def test_the_clipped_meta_gradient_sum_is_each_tasks_gradient_clipped(steps, first_order, path,
                                                                      monkeypatch):
    spec, body = spec_and_body()
    x, ys, yq = tasks(6)
    grads = per_task_gradients(spec, body, x, ys, yq, steps, first_order)
    clip = float(np.median(np.linalg.norm(grads, axis=1)))  # some clipped, some not
    if path == "per-task":
        monkeypatch.setattr(fm, "ghost_gradient_sum", lambda *a, **k: None)
    total, clipped = fm.clipped_meta_gradients(spec, body, x, ys, yq, WAYS, steps, 0.2,
                                               first_order, clip)
    assert np.allclose(total, clipped_reference(grads, clip), rtol=1e-4, atol=1e-6)
    assert clipped == int((np.linalg.norm(grads, axis=1) > clip).sum())


def test_first_order_holds_the_head_steps_fixed():
    """With head steps, the first-order meta-gradient differs from the unrolled one and
    equals autograd through the prototypes the head starts from, the steps' change of the
    head detached; without steps the two are the same."""
    spec, body = spec_and_body()
    x, ys, yq = tasks(2)
    assert np.array_equal(per_task_gradients(spec, body, x, ys, yq, 0, False),
                          per_task_gradients(spec, body, x, ys, yq, 0, True))
    unrolled = per_task_gradients(spec, body, x, ys, yq, 2, False)
    first = per_task_gradients(spec, body, x, ys, yq, 2, True)
    assert np.abs(unrolled - first).max() > 1e-3 * np.abs(unrolled).max()
    # the reference: the head stepped on detached embeddings, added as a constant change
    leaf = body.clone().requires_grad_(True)
    feats = fm.dm.features(spec, leaf, x[0].reshape(-1, 1, 8, 8))
    fs, fq = feats[:WAYS * SHOTS], feats[WAYS * SHOTS:]
    protos = torch.stack([fs[ys[0] == j].mean(0) for j in range(WAYS)])
    w0, b0 = 2 * protos, -(protos ** 2).sum(1)
    w, b = w0.detach(), b0.detach()
    for _ in range(2):
        probs = torch.softmax(fs.detach() @ w.T + b, -1)
        err = (probs - F.one_hot(ys[0], WAYS).float()) / len(fs)
        w, b = w - 0.2 * err.T @ fs.detach(), b - 0.2 * err.sum(0)
    logits = fq @ (w0 + (w - w0.detach())).T + (b0 + (b - b0.detach()))
    loss = F.cross_entropy(logits, yq[0])
    reference = torch.autograd.grad(loss, leaf)[0].double().numpy()
    assert np.allclose(first[0], reference, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
@pytest.mark.parametrize("model, steps, first_order", [("mlp", 0, False), ("mlp", 2, False),
                                                       ("mlp", 2, True), ("cnn", 1, False)])
@pytest.mark.parametrize("path", ["ghost", "per-task"])
def test_a_task_with_extreme_pixels_adds_at_most_the_clip_and_nan_or_inf_nothing(
        path, model, steps, first_order, value, monkeypatch):
    """One task's pixels made nan, inf or huge: the sum with it is the sum without it plus at
    most clip-norm (exactly nothing where its meta-gradient is not finite), every other
    task's share untouched, on both paths and a conv body."""
    if path == "per-task":
        monkeypatch.setattr(fm, "ghost_gradient_sum", lambda *a, **k: None)
    spec = model_spec(model, "16", (1, 8, 8), WAYS)
    body = torch.from_numpy(spec.initial(3)[:spec.body_size])
    x, ys, yq = tasks(5)
    bad = x.clone()
    bad[2, :3] = value
    clip = 0.5
    keep = [0, 1, 3, 4]
    without = fm.clipped_meta_gradients(spec, body, x[keep], ys[keep], yq[keep], WAYS, steps,
                                        0.1, first_order, clip)[0]
    with np.errstate(all="ignore"):
        total = fm.clipped_meta_gradients(spec, body, bad, ys, yq, WAYS, steps, 0.1,
                                          first_order, clip)[0]
    assert np.isfinite(total).all()
    moved = float(np.linalg.norm(total - without))
    assert moved <= clip * (1 + 1e-5) + 1e-6
    if not np.isfinite(value):
        assert moved <= 1e-5 * max(1.0, float(np.linalg.norm(without)))


def test_training_alone_in_the_support_span_equals_gradient_descent_on_the_pixels():
    x, ys, yq = tasks(4, seed=2)
    n, s = ys.shape
    f = torch.cat([x.reshape(n, x.shape[1], -1).double(),
                   torch.ones(n, x.shape[1], 1, dtype=torch.float64)], -1)
    fs, fq = f[:, :s], f[:, s:]
    lip = fs.pow(2).sum(-1).max(-1).values / 2
    w = torch.zeros(n, WAYS, f.shape[-1], dtype=torch.float64)
    target = F.one_hot(ys, WAYS).double()
    for _ in range(50):
        p = torch.softmax(torch.einsum("bsh,bwh->bsw", fs, w), -1)
        w = w - torch.einsum("bsw,bsh->bwh", p - target, fs) / s / lip[:, None, None]
    primal = (torch.einsum("bqh,bwh->bqw", fq, w).argmax(-1) == yq).double().mean(1)
    assert torch.equal(fm.scratch_accuracy(x, ys, yq, WAYS, steps=50), primal)


# ----- runs ----------------------------------------------------------------------------------
def config(**keys):
    values = {**TINY, **{k.replace("_", "-"): v for k, v in keys.items()}}
    if values.get("algorithm") == "fewshot-local":  # no rounds: nothing sampled
        values.pop("tasks-per-round")
    return parse_config(values)


def quiet(cfg, parts: int = 2):
    return run_in_process(cfg, num_partitions=parts, log=lambda _: None)


def test_the_noise_is_applied_at_the_scale_the_ledger_states():
    """One round of Meta-NSGD minus the same round without noise (the same sample, the same
    clipped sums) is the learning rate times the noise: its spread is the ledger's noise
    standard deviation of the mean."""
    keys = dict(algorithm="fewshot-meta-nsgd", rounds=1, learning_rate=1.0, meta_radius=1e6)
    private = quiet(config(**keys))
    exact = quiet(config(**{**keys, "algorithm": "fewshot-meta-sgd"}))
    diff = (np.asarray(private["server_state"]["meta_models"])
            - np.asarray(exact["server_state"]["meta_models"])).ravel()
    entry = next(e for e in private["privacy"]["ledger"] if e["release"] == "round-1")
    std = entry["noise_std"]
    assert std > 0 and diff.size > 1000
    assert np.std(diff) == pytest.approx(std, rel=0.05)
    assert abs(np.mean(diff)) < 5 * std / np.sqrt(diff.size)
    assert private["privacy"]["epsilon"] == pytest.approx(4.0, rel=1e-3)


def test_meta_learning_beats_each_task_alone_on_digits():
    out = quiet(config(algorithm="fewshot-meta-sgd", rounds=15, tasks_per_round=60,
                       learning_rate=0.5, **{"clipping": False}))
    m = out["metrics"]
    assert m["fresh_tasks"] == 60
    assert m["transfer_accuracy"] > m["local_accuracy"] + 0.02
    alone = quiet(config(algorithm="fewshot-local"))["metrics"]
    assert alone["transfer_accuracy"] == pytest.approx(m["local_accuracy"], abs=1e-12)


def test_clustering_sends_each_tasks_meta_gradient_in_the_row_of_its_choice():
    """A node's (q, P) sum: row j is the clipped sum over exactly the tasks whose support
    prefers network j (least support loss, computed here task by task)."""
    from fedpriv.algorithms.base import Part, Step
    from fedpriv.algorithms.fewshot.algorithms import FewShotMetaCluster
    from fedpriv.algorithms.fewshot.problem import problem_of, starting_bodies, task_block

    cfg = config(algorithm="fewshot-meta-cluster", meta_models=3, clip_norm=0.3)
    problem = problem_of(cfg)
    models = starting_bodies(cfg, 3)
    ids = np.arange(40)
    step = Step("round", 1, None, (Part("grads", models.shape, 0.3),), population=30)
    sent = FewShotMetaCluster.user_step(cfg, step, {"models": models}, ids).totals["grads"]
    block = task_block(cfg, problem, "train", ids)
    bodies = torch.from_numpy(models.astype(np.float32))
    losses = np.array([[float(fm.support_losses(problem.spec, m, block.x[i:i + 1],
                                                block.ys[i:i + 1], cfg.ways)[0])
                        for m in bodies] for i in ids])
    choice = losses.argmin(1)
    assert len(set(choice.tolist())) >= 2  # the check routes to more than one network
    for j in range(3):
        mine = torch.from_numpy(choice == j)
        expected = (fm.clipped_meta_gradients(problem.spec, bodies[j], block.x[mine],
                                              block.ys[mine], block.yq[mine], cfg.ways, 0,
                                              cfg.adapt_lr, False, 0.3)[0]
                    if bool(mine.any()) else np.zeros(models.shape[1]))
        assert np.allclose(sent[j], expected, rtol=1e-5, atol=1e-7), j
    out = quiet(config(algorithm="fewshot-private-meta-cluster", meta_models=2))
    m = out["metrics"]
    assert np.asarray(out["server_state"]["meta_models"]).shape[0] == 2
    assert m["model_0_share"] + m["model_1_share"] == pytest.approx(1.0)


def test_dp_ftmrl_visits_every_task_once():
    out = quiet(config(algorithm="fewshot-dp-ftmrl", rounds=3, tasks_per_round=0))
    rounds = [r for r in out["rounds"] if r["step"].startswith("round")]
    assert len(rounds) == 3 and sum(r["users_contributing"] for r in rounds) == 60
    assert out["privacy"]["epsilon"] == pytest.approx(4.0, rel=1e-3)


@pytest.mark.parametrize("keys, named", [
    ({"ways": 11}, "ways"),
    ({"shots": 30, "queries": 30}, "ways/shots/queries"),
    ({"task-source": "omniglot"}, "task-dir"),
    ({"task-source": "omniglot", "task-dir": "/nonexistent"}, "task-source"),
    ({"model": "conv4"}, "model"),  # digits' 8 x 8 images are too small for four poolings
    ({"meta-gradient": "second-order"}, "meta-gradient"),
])
def test_bad_settings_are_refused_before_the_run_naming_the_key(keys, named):
    with pytest.raises(ConfigError, match=f"^{named}"):
        config(algorithm="fewshot-meta-nsgd", **keys)


def test_omniglot_tasks_meta_learn_a_conv4_from_disjoint_characters(tmp_path):
    """The paper's setting with one key: Omniglot's layout (a fixture written here), meta-test
    tasks from the evaluation characters, the four-block conv net (ghost clipping's
    per-task convolution gradients)."""
    from test_fewshot import _write_omniglot

    _write_omniglot(tmp_path, {"images_background": {"Alpha": 3, "Beta": 3},
                               "images_evaluation": {"Gamma": 6}})
    out = quiet(config(algorithm="fewshot-meta-nsgd", task_source="omniglot",
                       task_dir=str(tmp_path), model="conv4", ways=3, shots=2, queries=2,
                       num_users=12, tasks_per_round=12, rounds=1, epsilon=8.0))
    assert out["metrics"]["fresh_tasks"] == 12
    assert 0.0 <= out["metrics"]["transfer_accuracy"] <= 1.0
    conv4_body = (9 * 64 + 64) + 3 * (64 * 64 * 9 + 64)  # four 3x3 convolutions, 64 channels
    assert np.asarray(out["server_state"]["meta_models"]).shape == (1, conv4_body)


def test_validation_runs_train_and_score_on_disjoint_images():
    """eval-tasks = "validation": training tasks draw from the kept meta-training images, the
    evaluation's tasks from the held-out sixth; the test split is not read by either."""
    from fedpriv.algorithms.fewshot.problem import problem_of
    from fedpriv.data.fewshot import draw_tasks

    cfg = config(algorithm="fewshot-meta-nsgd", eval_tasks="validation")
    pool = problem_of(cfg).pool
    test = problem_of(config(algorithm="fewshot-meta-nsgd")).pool
    assert set(pool.test_rows) < set(test.train_rows)  # held out of the meta-training images
    ids = np.arange(60)
    train = draw_tasks(pool, "train", ids, 5, 5, 3, cfg.seed)
    valid = draw_tasks(pool, "test", ids, 5, 5, 3, cfg.seed)
    seen = set(train.support.ravel()) | set(train.query.ravel())
    scored = set(valid.support.ravel()) | set(valid.query.ravel())
    assert not seen & scored and not scored & set(test.test_rows)
    out = quiet(cfg)
    assert out["metrics"]["fresh_tasks"] == 60 and 0 < out["metrics"]["transfer_accuracy"] < 1
