"""The few-shot problem of a run: the image pool its tasks draw from, the network, the device;
and a chunk of tasks' rows as tensors (``task_block``: what a node computes on)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedpriv.algorithms.deep.ghost_clipping import ghost_layers
from fedpriv.algorithms.deep.models import ModelSpec, model_spec
from fedpriv.algorithms.deep.problem import resolve_device
from fedpriv.algorithms.fewshot.params import FewShotConfig
from fedpriv.data.fewshot import (
    FewShotPool,
    draw_tasks,
    omniglot_pool,
    source_pool,
    validation_pool,
)
from fedpriv.data.sources import DatasetError, load_source
from fedpriv.params import ConfigError

_INIT_STREAM = 0xF5E  # the seeded starting networks


@dataclass(frozen=True, eq=False)
class FewShotProblem:
    """The pool, its images as one float32 tensor on the device, and the network."""

    pool: FewShotPool
    images: torch.Tensor
    spec: ModelSpec
    device: torch.device


@dataclass(frozen=True)
class TaskBlock:
    """A chunk of n tasks: rows x (n, N (K + Q), *input), support labels ys (n, N K) and
    query labels yq (n, N Q)."""

    x: torch.Tensor
    ys: torch.Tensor
    yq: torch.Tensor


@lru_cache(maxsize=4)
def pool_of(source: str, task_dir: str) -> FewShotPool:
    """The images a run's tasks draw from (read once per process)."""
    try:
        if source == "omniglot":
            return omniglot_pool(task_dir)
        return source_pool(load_source(source, data_dir=task_dir))
    except (DatasetError, OSError) as err:
        raise ConfigError(f"task-source: {source!r} cannot be read: {err}") from None


@lru_cache(maxsize=4)
def _problem(source: str, task_dir: str, model: str, hidden: str, ways: int, device: str,
             validation: bool) -> FewShotProblem:
    pool = pool_of(source, task_dir)
    if validation:
        pool = validation_pool(pool)
    spec = model_spec(model, hidden, tuple(pool.x.shape[1:]), ways)
    where = resolve_device(device)
    return FewShotProblem(pool, torch.from_numpy(pool.x).to(where), spec, where)


def problem_of(config: FewShotConfig) -> FewShotProblem:
    """The run's problem. ``eval-tasks = "validation"``: the pool's meta-training part split
    (``validation_pool``): training tasks draw from the rest, the evaluation's fresh tasks
    from the held-out part (its "test" part)."""
    return _problem(config.task_source, config.task_dir, config.model, config.hidden_sizes,
                    config.ways, config.device, config.eval_tasks == "validation")


def starting_bodies(config: FewShotConfig, count: int, whole: bool = False) -> np.ndarray:
    """``count`` starting embeddings (count, body size) float64: the network's own
    initialization under seeds derived from the run seed (public values only); ``whole``:
    the whole networks (count, size), head included."""
    spec = problem_of(config).spec
    seeds = np.random.SeedSequence([config.seed, _INIT_STREAM]).generate_state(count)
    width = spec.size if whole else spec.body_size
    return np.stack([spec.initial(int(s))[:width] for s in seeds]).astype(np.float64)


def task_block(config: FewShotConfig, problem: FewShotProblem, part: str,
               task_ids: np.ndarray) -> TaskBlock:
    """The tasks ``task_ids`` of ``part`` ("train": meta-training tasks, the users; "test":
    the fresh tasks of the final evaluation: meta-test or validation tasks), drawn by
    ``draw_tasks`` (each a pure function of the seed, the part and its id)."""
    tasks = draw_tasks(problem.pool, part, task_ids, config.ways, config.shots, config.queries,
                       config.seed)
    rows = np.concatenate([tasks.rows("support"), tasks.rows("query")], axis=1)
    where = problem.device
    return TaskBlock(problem.images[torch.from_numpy(rows).to(where)],
                     torch.from_numpy(tasks.labels("support")).to(where),
                     torch.from_numpy(tasks.labels("query")).to(where))


def chunk_tasks(config: FewShotConfig, problem: FewShotProblem) -> int:
    """Tasks computed at once: their rows' inputs and activations (times 4: the backward pass
    and the float64 Grams) and, for a body ghost clipping cannot take, a per-task gradient
    (float32 and its float64 copy), within ``chunk-mb``."""
    rows = config.ways * (config.shots + config.queries)
    ghost = ghost_layers(problem.spec, True) is not None
    per_task = 4 * 4 * rows * problem.spec.row_floats + (0 if ghost else
                                                         12 * problem.spec.body_size)
    return max(1, int(config.chunk_mb * 2**20 // per_task))
