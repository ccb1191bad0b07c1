"""Synthetic meta-learning tasks (Zhou & Bassily 2022, Section 6).

Each task ``mu`` has a parameter vector ``w_mu`` drawn from the task distribution ``rho``:

* one cluster: ``w_mu ~ N(task-mean * 1, task-std^2 I)`` (the paper: mean 4, std 1, d = 30);
* ``c > 1`` clusters: a cluster ``j`` is drawn uniformly, then ``w_mu ~ N(center_j,
  task-std^2 I)``. Center ``j`` is ``(-1)^j 2 (j + 1)`` on the j-th of c equal coordinate blocks
  and 0 elsewhere: for c = 3, d = 30 exactly the paper's ``[2]*10 + [0]*20``, ``[0]*10 + [-4]*10 +
  [0]*10`` and ``[0]*20 + [6]*10`` (orthogonal, different norms).

A task's data are ``samples-per-user`` points with features uniform in the unit ball and

* squared loss: ``y = <w_mu, x> + N(0, label-noise^2)``;
* logistic loss: ``y in {-1, +1}`` with ``P(y = 1 | x) = sigmoid(<w_mu, x>)``.

Every draw is a pure function of ``(seed, stream, task id)`` computed with a counter-based hash,
vectorized over tasks: any node regenerates exactly the tasks it hosts, and a round that samples
a few hundred tasks generates only those. Training tasks, the fresh evaluation tasks (new tasks
from the same ``rho``, one per id) and the fresh tasks' test points are independent streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedpriv.randomness import user_uniforms

LOSSES = ("squared", "logistic")

_TRAIN, _FRESH = 0, 1  # task populations
_P_TASK, _P_POINTS, _P_TEST = 0x7A5, 0x7A6, 0x7A7  # purposes


@dataclass(frozen=True)
class MetaProblem:
    num_tasks: int
    dim: int
    samples_per_task: int
    label_noise: float = 0.5
    clusters: int = 1
    task_mean: float = 4.0
    task_std: float = 1.0
    loss: str = "squared"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not 1 <= self.clusters <= self.dim:
            raise ValueError(f"clusters must be in [1, dim={self.dim}], got {self.clusters}")

    @property
    def feature_covariance_scale(self) -> float:
        """``E[x x^T] = I / (d + 2)`` for x uniform in the d-dimensional unit ball."""
        return 1.0 / (self.dim + 2)


@dataclass(frozen=True)
class Tasks:
    """A batch of tasks; arrays carry a leading task axis."""

    task_ids: np.ndarray  # (n,)
    features: np.ndarray  # (n, m, d)
    labels: np.ndarray  # (n, m)
    vectors: np.ndarray  # (n, d) the true w_mu
    cluster: np.ndarray  # (n,) the cluster each task was drawn from


def cluster_centers(problem: MetaProblem) -> np.ndarray:
    """The ``c`` cluster centers, shape (c, d)."""
    c, d = problem.clusters, problem.dim
    if c == 1:
        return np.full((1, d), problem.task_mean)
    centers = np.zeros((c, d))
    for j, block in enumerate(np.array_split(np.arange(d), c)):
        centers[j, block] = (-1) ** j * 2.0 * (j + 1)
    return centers


def counter_normals(seed: int, purpose: int, stream: int, ids: np.ndarray,
                    count: int) -> np.ndarray:
    """Standard normals (n, count) by Box-Muller from counter-based uniforms."""
    u = user_uniforms(seed, purpose, stream, ids, 2 * count)
    radius = np.sqrt(-2.0 * np.log1p(-u[:, :count]))  # 1 - u in (0, 1]: finite
    normals: np.ndarray = radius * np.cos(2.0 * np.pi * u[:, count:])
    return normals


def unit_ball_points(seed: int, purpose: int, stream: int, ids: np.ndarray, m: int,
                     d: int) -> np.ndarray:
    """``m`` points uniform in the d-dimensional unit ball per id, (n, m, d)."""
    g = counter_normals(seed, purpose, stream, ids, m * d).reshape(len(ids), m, d)
    r = user_uniforms(seed, purpose + 0x100, stream, ids, m) ** (1.0 / d)
    norms = np.linalg.norm(g, axis=2, keepdims=True)
    points: np.ndarray = g / np.maximum(norms, 1e-300) * r[:, :, None]
    return points


def generate_tasks(problem: MetaProblem, task_ids: np.ndarray, fresh: bool = False,
                   test_samples: int | None = None) -> Tasks:
    """Training data of the given tasks (``fresh=False``), or of the fresh evaluation tasks with
    the same ids (``fresh=True``). ``test_samples``: instead of the training points, that many
    new test points from each (fresh) task's distribution."""
    ids = np.asarray(task_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= problem.num_tasks):
        raise ValueError(f"task ids must lie in [0, {problem.num_tasks}), got {ids}")
    n, d = len(ids), problem.dim
    stream = _FRESH if fresh else _TRAIN
    seed = problem.seed
    centers = cluster_centers(problem)
    if problem.clusters > 1:
        cluster = np.minimum((user_uniforms(seed, _P_TASK + 0x200, stream, ids, 1)[:, 0]
                              * problem.clusters).astype(np.int64), problem.clusters - 1)
    else:
        cluster = np.zeros(n, dtype=np.int64)
    vectors = centers[cluster] + problem.task_std * counter_normals(seed, _P_TASK, stream, ids,
                                                                    d)
    purpose = _P_POINTS if test_samples is None else _P_TEST
    m = problem.samples_per_task if test_samples is None else int(test_samples)
    x = unit_ball_points(seed, purpose, stream, ids, m, d)
    margin = np.einsum("nmd,nd->nm", x, vectors)
    if problem.loss == "squared":
        y = margin + problem.label_noise * counter_normals(seed, purpose + 0x300, stream, ids,
                                                            m)
    else:
        u = user_uniforms(seed, purpose + 0x300, stream, ids, m)
        y = np.where(u < 1.0 / (1.0 + np.exp(-margin)), 1.0, -1.0)
    return Tasks(ids, x, y, vectors, cluster)
