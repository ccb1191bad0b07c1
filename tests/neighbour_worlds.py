"""Neighbouring datasets a config cannot name: one user's data changed inside the synthetic
problems' generators, or in a built-in dataset's rows, while a context is active (the caches
that hold generated or loaded data are cleared on the way in and out)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import torch

from fedpriv.algorithms.deep import problem as deep_problem
from fedpriv.algorithms.exp_mech import jl_exp
from fedpriv.algorithms.meta import meta_algorithm
from fedpriv.config import RunConfig
from fedpriv.data import cache as cohorts
from fedpriv.neighbours import Neighbour

Change = Callable[[np.ndarray], np.ndarray]


def _clear() -> None:
    cohorts.block_cache().clear()
    deep_problem._problem.cache_clear()


@contextlib.contextmanager
def _patched(module, name: str, wrapper) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, wrapper(original))
    _clear()
    try:
        yield
    finally:
        setattr(module, name, original)
        _clear()


def _rows_of(ids: np.ndarray, user: int) -> np.ndarray:
    return np.asarray(ids) == user


def synthetic(user: int, features: Change | None = None,
              labels: Change | None = None) -> Callable[[], contextlib.AbstractContextManager]:
    """A context in which the synthetic generators give ``user`` changed data (the linear
    problems' users, the meta-learning tasks, the margin problems' users)."""
    def change(data, ids_field: str, x_field: str, y_field: str):
        mine = _rows_of(getattr(data, ids_field), user)
        if not mine.any():
            return data
        x = np.array(getattr(data, x_field), dtype=np.float64)
        y = np.array(getattr(data, y_field), dtype=np.float64)
        with np.errstate(all="ignore"):
            if features is not None:
                x[mine] = features(x[mine])
            if labels is not None:
                y[mine] = labels(y[mine])
        return dataclasses.replace(data, **{x_field: x, y_field: y})

    def users(original):
        def generate(problem, user_ids, *args, **kwargs):
            return change(original(problem, user_ids, *args, **kwargs), "user_ids",
                          "features", "labels")
        return generate

    def tasks(original):
        def generate(problem, task_ids, *args, **kwargs):
            return change(original(problem, task_ids, *args, **kwargs), "task_ids",
                          "features", "labels")
        return generate

    def margin(original):
        def generate(problem, user_ids, *args, **kwargs):
            data = original(problem, user_ids, *args, **kwargs)
            mine = _rows_of(user_ids, user)
            x, y = np.array(data.features), np.array(data.labels)
            with np.errstate(all="ignore"):
                if features is not None:
                    x[mine] = features(x[mine])
                if labels is not None:
                    y[mine] = labels(y[mine])
            return dataclasses.replace(data, features=x, labels=y)
        return generate

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with (_patched(cohorts, "generate_users", users),
              _patched(meta_algorithm, "generate_tasks", tasks),
              _patched(jl_exp, "margin_tasks", margin)):
            yield
    return context


def builtin_rows(config: RunConfig, user: int,
                 features: Change) -> Callable[[], contextlib.AbstractContextManager]:
    """A context in which a built-in dataset's rows of partition user ``user`` hold changed
    features (its labels, and so the partition, stay: the partition is public)."""
    users = deep_problem.problem_of(config, features=False).users
    train = users.train.rows[users.train.offsets[user]:users.train.offsets[user + 1]]
    test = users.test.rows[users.test.offsets[user]:users.test.offsets[user + 1]]

    def loader(original):
        def load(name, *args, **kwargs):
            source = original(name, *args, **kwargs)
            if not len(source.x_train):
                return source
            x_train, x_test = source.x_train.copy(), source.x_test.copy()
            with np.errstate(all="ignore"):
                x_train[train] = features(x_train[train].astype(np.float64))
                x_test[test] = features(x_test[test].astype(np.float64))
            return dataclasses.replace(source, x_train=x_train, x_test=x_test)
        return load

    return lambda: _patched(deep_problem, "load_source", loader)


def fewshot_task(user: int, features: Change) -> Callable[[], contextlib.AbstractContextManager]:
    """A context in which few-shot task ``user`` (its meta-training task and its fresh
    meta-test task: the whole task is the user's) holds changed pixels, whatever they were."""
    from fedpriv.algorithms.fewshot import algorithms as fewshot

    def blocks(original):
        def block(config, problem, part, task_ids):
            out = original(config, problem, part, task_ids)
            mine = np.flatnonzero(np.asarray(task_ids) == user)
            if not len(mine):
                return out
            x = out.x.clone()
            with np.errstate(all="ignore"):
                x[mine] = torch.from_numpy(features(x[mine].double().numpy())).to(x.dtype)
            return dataclasses.replace(out, x=x)
        return block

    return lambda: _patched(fewshot, "task_block", blocks)


def neighbour(name: str, config: RunConfig, context) -> Neighbour:
    return Neighbour(name, "replace", config, context)
