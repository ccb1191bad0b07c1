"""What a run reports: the per-step report, the progress line, the results dict and its summary.

Pure functions of their arguments: the server passes in what it counted and released. The
results dict is the results file (``fedpriv.engine.write_results``); its fields are documented
in docs/concepts/release-and-report.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpriv.algorithms.base import EXACT_EVAL, Step
from fedpriv.config import RunConfig
from fedpriv.server.discrete import discrete, trust

# metrics shown on a progress line, when a step reports them
PROGRESS_METRICS = ("subspace_distance", "population_mse", "test_mse", "local_only_mse",
                    "meta_model_norm", "transfer_risk", "local_risk", "cluster_purity",
                    "test_accuracy", "local_only_accuracy", "accuracy", "accuracy_p10")


def step_report(step: Step, nodes_answered: int, num_nodes: int, users: int,
                rejected: Mapping[str, int]) -> dict[str, Any]:
    """The head of one step's report (the release or final metrics are added after it)."""
    report: dict[str, Any] = {
        "step": step.label,
        "nodes_answered": nodes_answered,
        "nodes_failed": num_nodes - nodes_answered,
        "users_contributing": users,
        "rejected": dict(rejected),
    }
    if step.group is not None:
        report["user_group"] = step.group
    if step.kind == EXACT_EVAL:
        report["after_round"] = step.index
    return report


def progress_line(report: Mapping[str, Any], total_steps: int, done: int) -> str:
    """One line per step: steps done, epsilon spent, the step's metrics, nodes, seconds."""
    parts = [f"[{done}/{total_steps}] {report['step']:<9}"]
    if "epsilon_spent" in report:
        parts.append(f"epsilon_spent={report['epsilon_spent']:.4f}")
    for key in PROGRESS_METRICS:
        if key in report:
            parts.append(f"{key}={report[key]:.4g}")
    if "note" in report:  # a step the nodes were not sent
        return "  ".join([*parts, report["note"]])
    if report["step"] != "final":
        parts.append(f"users={report['users_contributing']}")
    parts.append(f"nodes={report['nodes_answered']}")
    if report["nodes_failed"]:
        parts.append(f"failed={report['nodes_failed']}")
    if report.get("rejected"):
        parts.append("rejected=" + ",".join(f"{k}:{n}" for k, n in report["rejected"].items()))
    parts.append(f"{report['seconds']:.2f}s")
    return "  ".join(parts)


def results_dict(config: RunConfig, *, num_nodes: int, runtime: str, private: bool,
                 epsilon: float | None, pure: bool, multipliers: Mapping[str, float],
                 ledger: list[dict[str, Any]], metrics: dict[str, float],
                 rounds: list[dict[str, Any]],
                 rejections: Mapping[str, int], bounded: int, resumed_from: int | None,
                 server_state: dict[str, Any], wall_time_s: float,
                 private_metrics: Mapping[str, Any] | None = None,
                 record_level: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The results file of a run. ``epsilon`` None: sums were released without noise;
    ``pure``: a pure epsilon-DP run (exponential mechanism), reported at delta 0;
    ``record_level``: a baseline's record-level guarantee (``Algorithm.record_level_privacy``),
    under ``privacy.record_level``."""
    c = config
    results: dict[str, Any] = {
        "algorithm": c.algorithm,
        "num_users": c.num_users,
        "runtime": runtime,
        "num_nodes": num_nodes,
        "config": c.to_mapping(),
        "privacy": {
            "private": private,
            # None: sums were released without noise (a non-private baseline)
            "epsilon": epsilon,
            "target_epsilon": c.epsilon,
            "max_epsilon": c.ceiling,
            "noise": "os-entropy" if c.secure_noise or c.noise_shares
                     else "seeded",
            # who the guarantee trusts, and what noise it was drawn with
            "trust": trust(c, num_nodes),
            # pure epsilon-DP runs (exponential mechanism): delta 0
            "delta": 0.0 if pure else c.delta,
            "accountant": ("rdp (integer orders, zCDP bounds of discrete noise)"
                           if discrete(c) else c.accountant),
            "neighbouring_relation": c.neighbouring_relation,
            "level": "user",
            "noise_multipliers": multipliers,
            "ledger": ledger,
        },
        "metrics": metrics,
        "private_metrics": dict(private_metrics or {}),
        "rounds": rounds,
        "rejections": dict(rejections),
        "norm_bounded_nodes": bounded,
        "node_faults": {"rate": c.node_fault_rate, "kind": c.node_fault_kind},
        "resumed_from_step": resumed_from,
        "server_state": server_state,
        "wall_time_s": wall_time_s,
    }
    if record_level is not None:  # who its guarantee trusts is its own, and per record
        record = dict(record_level)
        results["privacy"].update(trust=record.pop("trust", None), level="record",
                                  record_level=record)
    return results


def measured_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """A run's exact final metrics for its operator: the server's (central runs), or in a
    distributed or secure run of the in-process engine the simulator's own measurement on its
    nodes (``simulation_metrics``: no server received them); {} where there are none."""
    return dict(results.get("metrics") or results.get("simulation_metrics") or {})


def silent_run(results: Mapping[str, Any]) -> str | None:
    """A message where no node answered any step of the run (every release is noise alone and
    nothing was evaluated: a node config, data file or model the nodes cannot use); else None.
    The run is private all the same; the CLI exits non-zero so that nobody mistakes it for a
    result."""
    steps = results.get("rounds") or []
    if not steps or any(step.get("nodes_answered", 1) for step in steps):
        return None
    return (f"no node answered any of the run's {len(steps)} steps: every release is noise "
            f"alone and there are no metrics (rejected replies: {dict(results['rejections'])};"
            " the nodes' logs say why)")


def summary_lines(results: Mapping[str, Any]) -> list[str]:
    """A few lines on a finished run: what ran, its quality, its privacy, its wall time."""
    m, p = results["metrics"], results["privacy"]
    simulated = results.get("simulation_metrics") or {}
    shares = p.get("trust", {}).get("aggregation", "central") != "central"
    if not m and simulated:
        quality = (quality_line(simulated) + "\n  (measured by the in-process simulator on "
                   "the nodes: the server received no metrics)")
    elif not m and shares:
        quality = (f"  no exact metrics: {p['trust']['aggregation']} nodes send none "
                   "(private-metrics = true releases them with noise)")
    elif not m:  # no user was evaluated (every node failed the final step)
        quality = "  no metrics: no node answered the final step (see the rejected replies)"
    else:
        quality = quality_line(m)
    choice = choice_line(m or simulated)
    if choice:
        quality += "\n" + choice
    note = local_only_note(m or simulated, results)
    if note:
        quality += "\n" + note  # one entry with the quality line, so the indices stay
    lines = [
        f"fedpriv: {results['algorithm']} on {results['num_users']} users "
        f"({results['num_nodes']} nodes, {results['runtime']})",
        quality,
        privacy_line(p),
        f"  server time {results['wall_time_s']:.1f}s (from the server's start; the engine's "
        "start-up and shutdown not included)",
    ]
    for name, m in results.get("private_metrics", {}).items():
        exact = ("none on the server" if m["exact_clipped"] is None
                 else f"{m['exact_clipped']:.4g}, operator only")
        lines.append(f"  private {name} (released): {m['value']:.4g} (noise std "
                     f"{m['noise_std']:.2g}; exact clipped {exact})")
    if results["rejections"]:
        lines.append(f"  rejected node replies: {results['rejections']}")
    return lines


def quality_line(m: Mapping[str, float]) -> str:
    """The quality line of the summary from a run's exact metrics."""
    if "transfer_risk" in m:  # meta-learning: risk of fresh tasks
        quality = (f"  transfer risk {m['transfer_risk']:.4g} on {m['fresh_tasks']:.0f} fresh tasks"
                   f"   local training {m['local_risk']:.4g}")
        if "cluster_purity" in m:
            quality += f"   cluster purity {m['cluster_purity']:.3f}"
    elif "test_accuracy" in m:  # classification
        quality = (f"  test accuracy {m['test_accuracy']:.4f}   each user alone "
                   f"{m['local_only_accuracy']:.4f}   known embedding "
                   f"{m['known_embedding_accuracy']:.4f}")
    elif "accuracy" in m:  # deep personalization: each user's test accuracy
        quality = (f"  mean per-user test accuracy {m['accuracy']:.4f}   10th-percentile user "
                   f"{m['accuracy_p10']:.2f}   test loss {m['test_loss']:.4f}")
    else:  # the figures it has (a plug-in's own metrics where it has none of these)
        shown = [f"{name} {m[k]:.4g}" for k, name in (("population_mse", "population MSE"),
                                                       ("local_only_mse", "local-only MSE"),
                                                       ("test_mse", "test MSE")) if k in m]
        shown = shown or [f"{k} {v:.4g}" if isinstance(v, (int, float)) else f"{k} {v}"
                          for k, v in m.items()]
        quality = "  " + "   ".join(shown)
    return quality


def choice_line(m: Mapping[str, float]) -> str | None:
    """What the users kept with final-choice = best (docs: never worse than training alone):
    the shares of each kind and the figures without the choice and alone; None without it."""
    if "chose_shared" not in m:
        return None
    if "accuracy_shared" in m:
        figures = (f"without the choice {m['accuracy_shared']:.4f}, each user's linear model "
                   f"alone {m['accuracy_local']:.4f}")
    else:
        figures = f"population MSE without the choice {m['population_mse_shared']:.4g}"
    return (f"  each user's final choice (on its own training rows): shared model "
            f"{m['chose_shared']:.0%}, a mix {m['chose_mix']:.0%}, its own {m['chose_local']:.0%};"
            f" {figures}")


# (the model's metric, each user alone, its name, whether lower is better), in quality_line's
# order; the first pair a run reports both of is compared
LOCAL_ONLY = (("transfer_risk", "local_risk", "transfer risk", True),
              ("test_accuracy", "local_only_accuracy", "test accuracy", False),
              ("population_mse", "local_only_mse", "MSE", True))


def local_only_note(m: Mapping[str, float], results: Mapping[str, Any]) -> str | None:
    """A one-line hint where the run's model is worse than each user training alone (the
    local-only figure its metrics carry beside it); None where it is not, or where the metrics
    carry no local-only figure (the deep family: compare with `deep-local-only`)."""
    for metric, local, name, lower in LOCAL_ONLY:
        if metric not in m or local not in m:
            continue
        model, alone = m[metric], m[local]
        if not (model > alone if lower else model < alone):  # nan: never worse
            return None
        p = results["privacy"]
        head = (f"  note: worse than each user training alone (local-only {name} {alone:.4g} "
                f"vs {model:.4g})")
        if p["epsilon"] is None:
            return head + "; a non-private baseline: no noise was added, so not a privacy cost"
        if not p["ledger"]:
            return head
        return (f"{head}: at epsilon = {p['target_epsilon']:g} the noise dominates at "
                f"{results['num_users']} users; raise num-users (or epsilon; see docs/results.md)")
    return None


def plan_lines(multipliers: Mapping[str, float], pure_epsilons: Mapping[str, float]) -> list[str]:
    """What a run's calibrated plan prints before it starts: the noise multiplier of each
    Gaussian release, or the epsilon of each exponential-mechanism release; nothing for a run
    without noise (no line without values)."""
    lines = []
    if multipliers:
        lines.append("fedpriv: noise multipliers "
                     + ", ".join(f"{k}={v:.4g}" for k, v in multipliers.items()))
    if pure_epsilons:
        lines.append("fedpriv: epsilon per release (exponential mechanism) "
                     + ", ".join(f"{k}={v:.4g}" for k, v in pure_epsilons.items()))
    return lines


def privacy_line(p: Mapping[str, Any]) -> str:
    """The privacy line of the summary, from the results' ``privacy`` entry."""
    if p["epsilon"] is None and p.get("record_level"):
        r = p["record_level"]
        return (f"  privacy: record-level only: epsilon {r['epsilon']:.4f} per record (target "
                f"{r['target_epsilon']}), delta {r['delta']:g}, {r['accountant']}, "
                f"{r['neighbouring_relation']}; NO task-level (user-level) guarantee: a "
                "task's whole data is not protected")
    if p["epsilon"] is None:
        return "  privacy: none (a non-private baseline: sums released without noise)"
    if not p["ledger"]:
        return "  privacy: nothing released from user data (epsilon 0)"
    if p["delta"] == 0.0:
        return (f"  privacy: pure epsilon-DP, epsilon spent {p['epsilon']:.4f} (target "
                f"{p['target_epsilon']}), exponential mechanism, {p['neighbouring_relation']} "
                "user-level")
    return (f"  privacy: epsilon spent {p['epsilon']:.4f} (target {p['target_epsilon']}), "
            f"delta {p['delta']:g}, {p['accountant'].upper()} accountant, "
            f"{p['neighbouring_relation']} user-level")
