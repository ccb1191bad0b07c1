"""The meta-learning problem: how a run's config makes the task distribution, the paper's
default number of tasks per round, and the evaluation on fresh tasks (see the package
docstring for the metrics)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedpriv.algorithms.meta import meta_math as ml
from fedpriv.algorithms.meta.params import MetaConfig, TaskKeys
from fedpriv.data.meta import MetaProblem, Tasks, cluster_centers, generate_tasks


def meta_problem_of(config: TaskKeys) -> MetaProblem:
    return MetaProblem(
        num_tasks=config.num_users,
        dim=config.dim,
        samples_per_task=config.samples_per_user,
        label_noise=config.label_noise,
        clusters=config.task_clusters,
        task_mean=config.task_mean,
        task_std=config.task_std,
        loss=config.task_loss,
        seed=config.seed,
    )


def _fresh_fit(config: MetaConfig, models: np.ndarray,
               task_ids: np.ndarray) -> tuple[MetaProblem, Tasks, Tasks, np.ndarray, ml.Fit]:
    """The fresh tasks with these ids (training and test points) and their models fitted from
    the meta-model(s): (problem, train, test, chosen meta-model, fit)."""
    problem = meta_problem_of(config)
    train = generate_tasks(problem, task_ids, fresh=True)
    test = generate_tasks(problem, task_ids, fresh=True,
                          test_samples=config.test_samples_per_user)
    choice, fitted = ml.select_and_fit(train.features, train.labels, models, config.meta_lambda,
                                       config.task_loss, config.base_accuracy)
    return problem, train, test, choice, fitted


def evaluate_fresh(config: MetaConfig, models: np.ndarray,
                   task_ids: np.ndarray) -> dict[str, float]:
    """Metric sums over the fresh tasks with these ids (see the module docstring)."""
    lam, acc, loss = config.meta_lambda, config.base_accuracy, config.task_loss
    problem, train, test, choice, fitted = _fresh_fit(config, models, task_ids)
    local = ml.fit(train.features, train.labels, np.zeros(problem.dim), lam, loss, acc)
    sums = {
        "risk": float(ml.task_losses(test.features, test.labels, fitted.models, loss).sum()),
        "local_risk": float(ml.task_losses(test.features, test.labels, local.models,
                                           loss).sum()),
        "unconverged": float((~fitted.converged(acc)).sum() + (~local.converged(acc)).sum()),
    }
    if loss == "squared":
        scale = problem.feature_covariance_scale
        sums["excess"] = float(scale * ((fitted.models - train.vectors) ** 2).sum())
        sums["local_excess"] = float(scale * ((local.models - train.vectors) ** 2).sum())
    else:
        sums["error"] = float(ml.task_errors(test.features, test.labels, fitted.models).sum())
        sums["local_error"] = float(ml.task_errors(test.features, test.labels,
                                                   local.models).sum())
    if len(models) > 1 or problem.clusters > 1:
        for i in range(len(models)):
            for j in range(problem.clusters):
                sums[f"assign_{i}_{j}"] = float(((choice == i) & (train.cluster == j)).sum())
    return sums


def fresh_task_values(config: MetaConfig, models: np.ndarray,
                      task_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Each fresh task's transfer risk (test loss of the model fitted from the meta-model(s))
    and, for logistic tasks, its 0-1 error: the per-task values of ``evaluate_fresh``."""
    loss = config.task_loss
    _, _, test, _, fitted = _fresh_fit(config, models, task_ids)
    values = {"transfer_risk": ml.task_losses(test.features, test.labels, fitted.models, loss)}
    if loss == "logistic":
        values["transfer_error"] = ml.task_errors(test.features, test.labels, fitted.models)
    return values


def evaluation_bounds(config: TaskKeys) -> dict[str, float]:
    """Private metrics of meta-learning: each fresh task's transfer risk clipped to
    ``[0, metric-clip]`` (0: twice the squared-loss risk of h = 0 on the farthest cluster
    center, or 2 for the logistic loss, from public parameters), and its 0-1 error in [0, 1]
    (logistic tasks)."""
    clip = config.metric_clip
    if not clip:  # twice the risk of h = 0 on the farthest cluster (public parameters only)
        if config.task_loss == "logistic":
            clip = 2.0
        else:
            problem = meta_problem_of(config)
            far = float(np.max(np.sum(cluster_centers(problem) ** 2, axis=1)))
            second_moment = far + config.dim * config.task_std**2
            clip = 2.0 * (config.label_noise**2 + problem.feature_covariance_scale
                          * second_moment)
    bounds = {"transfer_risk": clip}
    if config.task_loss == "logistic":
        bounds["transfer_error"] = 1.0
    return bounds


def final_meta_metrics(config: TaskKeys, sums: Mapping[str, float], num_tasks: int,
                       num_models: int) -> dict[str, float]:
    metrics = {
        "transfer_risk": sums["risk"] / num_tasks,
        "local_risk": sums["local_risk"] / num_tasks,
        "fresh_tasks": float(num_tasks),
        "base_learner_unconverged": sums["unconverged"],
    }
    if "excess" in sums:
        floor = config.label_noise**2
        metrics["population_transfer_risk"] = floor + sums["excess"] / num_tasks
        metrics["population_local_risk"] = floor + sums["local_excess"] / num_tasks
    if "error" in sums:
        metrics["transfer_error"] = sums["error"] / num_tasks
        metrics["local_error"] = sums["local_error"] / num_tasks
    if "assign_0_0" in sums and num_models > 1:
        table = np.array([[sums[f"assign_{i}_{j}"] for j in range(config.task_clusters)]
                          for i in range(num_models)])
        metrics["cluster_purity"] = float(table.max(axis=0).sum() / num_tasks)
    return metrics
