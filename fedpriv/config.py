"""One frozen, validated config per run, parsed from a Flower run-config (kebab-case keys).

Every key, its type, default and allowed range is declared once in ``FIELDS``; bad values fail in
``RunConfig.from_mapping`` with a message that names the key and what is allowed, before any user
is touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from fedpriv.data.meta import LOSSES
from fedpriv.data.synthetic import FEATURE_FAMILIES
from fedpriv.faults import FAULT_KINDS
from fedpriv.privacy.accounting import ACCOUNTANTS, NEIGHBOURING_RELATIONS


class ConfigError(ValueError):
    """A run-config value is invalid; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Field:
    key: str
    kind: type
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None
    allowed: str = ""


def _positive(x: Any) -> bool:
    return x > 0


INIT_CHOICES = ("auto", "u-statistic", "pairs", "random")
ALL_FEATURE_FAMILIES = ("auto", *FEATURE_FAMILIES, "unit-ball")

FIELDS: tuple[Field, ...] = (
    Field("algorithm", str, "private-fedrep", "registered algorithm name"),
    Field("num-users", int, 2000, "number of users n", _positive, "an integer >= 1"),
    Field("dim", int, 20, "feature dimension d", _positive, "an integer >= 1"),
    Field("rank", int, 2, "embedding rank k", _positive, "an integer in [1, dim]"),
    Field("samples-per-user", int, 10, "samples per user m", lambda x: x >= 4,
          "an integer >= 4 (two disjoint batches from the first half)"),
    Field("label-noise", float, 0.01, "label noise std R", lambda x: x >= 0, "a number >= 0"),
    Field("feature-dist", str, "auto", "feature family ('auto': gaussian for the "
          "personalization algorithms, unit-ball for meta-learning)",
          lambda x: x in ALL_FEATURE_FAMILIES, f"one of {', '.join(ALL_FEATURE_FAMILIES)}"),
    Field("epsilon", float, 1.0, "target epsilon", lambda x: x > 0 and math.isfinite(x),
          "a finite number > 0"),
    Field("delta", float, 1e-6, "target delta", lambda x: 0 < x < 1, "a number in (0, 1)"),
    Field("accountant", str, "pld", "dp-accounting accountant", lambda x: x in ACCOUNTANTS,
          f"one of {', '.join(ACCOUNTANTS)}"),
    Field("neighbouring-relation", str, "add-remove", "user-level neighbouring relation",
          lambda x: x in NEIGHBOURING_RELATIONS, f"one of {', '.join(NEIGHBOURING_RELATIONS)}"),
    Field("rounds", int, 5, "rounds T", _positive, "an integer >= 1"),
    Field("learning-rate", float, 1.0, "server step size eta", _positive, "a number > 0"),
    Field("clip-norm", float, 0.5, "per-user gradient clip psi (Frobenius)", _positive,
          "a number > 0"),
    Field("init-clip-norm", float, 1.0, "per-user U-statistic clip psi_init", _positive,
          "a number > 0"),
    Field("init-budget-fraction", float, 0.5,
          "share of the privacy budget (in 1/z^2 units) spent on the initialization",
          lambda x: 0 < x < 1, "a number in (0, 1)"),
    Field("init", str, "auto", "initialization: 'u-statistic' (Snedeker et al. Alg. 2), "
          "'pairs' (Jain et al. Alg. 3), 'random' (data-free) or 'auto' (the algorithm's own)",
          lambda x: x in INIT_CHOICES, f"one of {', '.join(INIT_CHOICES)}"),
    Field("user-groups", int, 1, "Priv-AltMin: disjoint user groups G; round t uses group "
          "(t-1) mod G, so each user takes part in rounds/G rounds", _positive,
          "an integer >= 1 that divides rounds"),
    Field("feature-clip", float, 10.0, "Priv-AltMin: per-sample clip eta of vec(x v^T)",
          _positive, "a number > 0"),
    Field("response-clip", float, 2.0, "Priv-AltMin and the pairs init: clip zeta of labels",
          _positive, "a number > 0"),
    Field("cov-budget-share", float, 0.5, "Priv-AltMin: share of each round's privacy loss "
          "(1/z^2 units) spent on sum W W^T; the rest goes to sum y W (0.5: the paper's equal "
          "multipliers)", lambda x: 0 < x < 1, "a number in (0, 1)"),
    Field("task-loss", str, "squared", "meta-learning: the tasks' loss",
          lambda x: x in LOSSES, f"one of {', '.join(LOSSES)}"),
    Field("task-clusters", int, 1, "meta-learning: clusters of the task distribution (1: "
          "N(task-mean * 1, task-std^2 I); c > 1: the paper's c orthogonal block centers)",
          _positive, "an integer in [1, dim]"),
    Field("task-mean", float, 4.0, "meta-learning, one cluster: every entry of the mean task "
          "vector", lambda x: math.isfinite(x), "a finite number"),
    Field("task-std", float, 1.0, "meta-learning: std of task vectors around their center",
          lambda x: x >= 0, "a number >= 0"),
    Field("meta-lambda", float, 0.05, "meta-learning: base learner regularization lambda",
          _positive, "a number > 0"),
    Field("meta-radius", float, 50.0, "meta-learning: radius of the ball W the meta-models "
          "are projected onto", _positive, "a number > 0"),
    Field("meta-models", int, 1, "meta-learning: number q of meta-models (clustering)",
          _positive, "an integer >= 1"),
    Field("meta-init-scale", float, 1.0, "meta-learning, q > 1: norm of the random starting "
          "meta-models", lambda x: x >= 0, "a number >= 0"),
    Field("tasks-per-round", int, 0, "meta-learning: expected tasks per round m (Poisson "
          "sampling rate m/K); 0: the paper's m = max(K sqrt(eps/(4T)), 1)", lambda x: x >= 0,
          "an integer >= 0"),
    Field("base-accuracy", float, 1e-6, "meta-learning: base learner stops at ||grad|| <= b, "
          "so ||w^ - w_h|| <= b/lambda", _positive, "a number > 0"),
    Field("candidates", int, 2000, "a-exp: number of Haar-random candidate embeddings",
          _positive, "an integer >= 1"),
    Field("projected-feature-clip", float, 3.0, "a-exp: L2 clip L_f of the projected "
          "features U^T x in the score", _positive, "a number > 0"),
    Field("local-norm", float, 5.0, "a-exp: bound C on ||v|| in the score and the local fit",
          _positive, "a number > 0"),
    Field("jl-dim", int, 4, "jl-exp: JL target dimension k'", _positive, "an integer >= 1"),
    Field("margin", float, 0.1, "jl-exp: margin rho of the data and of the score's margin "
          "loss", _positive, "a number > 0"),
    Field("cover-radius", float, 0.25, "jl-exp: gamma of the grid cover of the Frobenius "
          "ball", _positive, "a number > 0"),
    Field("max-score-evaluations", float, 2e8, "exponential mechanisms: refuse runs that "
          "would score more than this many (candidate, user) pairs", _positive,
          "a number > 0"),
    Field("clipping", bool, True, "clip per-user contributions (private algorithms need it; "
          "false only for the non-private baselines)"),
    Field("batch-size", str, "max", "'max', 'paper' or an integer b",
          lambda x: x in ("max", "paper") or x.isdigit(), "'max', 'paper' or an integer >= 1"),
    Field("test-samples-per-user", int, 10, "fresh test points per user for test_mse",
          lambda x: x >= 1, "an integer >= 1"),
    Field("seed", int, 0, "run seed", lambda x: x >= 0, "an integer >= 0"),
    Field("users-per-node", int, 0, "cohort size per SuperNode (0 = auto)", lambda x: x >= 0,
          "an integer >= 0"),
    Field("results-path", str, "results/fedpriv-results.json", "where the JSON results go"),
    Field("node-timeout", float, 600.0, "seconds to wait for replies in a step", _positive,
          "a number > 0"),
    Field("max-epsilon", float, 0.0, "budget ceiling: a run (or a resumed run) whose plan "
          "would spend more refuses to start; 0: the target epsilon is the ceiling",
          lambda x: x >= 0 and math.isfinite(x), "a finite number >= 0"),
    Field("secure-noise", bool, False, "draw privacy noise from an OS-entropy-seeded "
          "generator (not reproducible; refuses a fixed noise-seed)"),
    Field("noise-seed", int, -1, "seed of the privacy noise; -1: derived from seed",
          lambda x: x >= -1, "an integer >= -1"),
    Field("node-fault-rate", float, 0.0, "simulated faults: the fraction of nodes (rounded "
          "down) that fail in every step", lambda x: 0 <= x < 1, "a number in [0, 1)"),
    Field("node-fault-kind", str, "crash", "simulated faults: 'crash' (the node errors), "
          "'timeout' (it answers after node-timeout) or 'corrupt' (it sends non-finite sums)",
          lambda x: x in FAULT_KINDS, f"one of {', '.join(FAULT_KINDS)}"),
    Field("rescale-missing-nodes", bool, True, "scale a release by (users hosted) / (users "
          "hosted by the nodes that answered): post-processing of the noisy mean, so privacy "
          "is unchanged; keeps failed nodes from shrinking the step"),
    Field("checkpoint", bool, True, "save the server state after every step (atomically) so "
          "an interrupted run can be resumed"),
    Field("checkpoint-path", str, "", "checkpoint file; '': the results path with suffix "
          ".checkpoint"),
    Field("resume", bool, False, "continue from the checkpoint (set by fedpriv run --resume)"),
)

# Keys that may change when a run is resumed: where things go and how the run is operated,
# never what it computes or what it may spend beyond max-epsilon (checked separately).
RESUMABLE_KEYS = frozenset({"results-path", "node-timeout", "max-epsilon", "checkpoint",
                            "checkpoint-path", "resume", "users-per-node", "node-fault-rate",
                            "node-fault-kind"})

_BY_KEY = {f.key: f for f in FIELDS}


def _coerce(field: Field, value: Any) -> Any:
    if field.kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{field.key}: expected true or false, got {value!r}")
    if field.kind is str:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ConfigError(f"{field.key}: expected {field.allowed or 'a string'}, got {value!r}")
        return str(value)
    if field.kind is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and float(value).is_integer())
        ):
            raise ConfigError(f"{field.key}: expected {field.allowed or 'an integer'}, "
                              f"got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field.key}: expected {field.allowed or 'a number'}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RunConfig:
    """Resolved settings of one run (attribute names are the keys in snake_case)."""

    algorithm: str
    num_users: int
    dim: int
    rank: int
    samples_per_user: int
    label_noise: float
    feature_dist: str
    epsilon: float
    delta: float
    accountant: str
    neighbouring_relation: str
    rounds: int
    learning_rate: float
    clip_norm: float
    init_clip_norm: float
    init_budget_fraction: float
    init: str
    user_groups: int
    feature_clip: float
    response_clip: float
    cov_budget_share: float
    candidates: int
    projected_feature_clip: float
    local_norm: float
    jl_dim: int
    margin: float
    cover_radius: float
    max_score_evaluations: float
    task_loss: str
    task_clusters: int
    task_mean: float
    task_std: float
    meta_lambda: float
    meta_radius: float
    meta_models: int
    meta_init_scale: float
    tasks_per_round: int
    base_accuracy: float
    clipping: bool
    batch_size: str
    test_samples_per_user: int
    seed: int
    users_per_node: int
    results_path: str
    node_timeout: float
    max_epsilon: float
    secure_noise: bool
    noise_seed: int
    node_fault_rate: float
    node_fault_kind: str
    rescale_missing_nodes: bool
    checkpoint: bool
    checkpoint_path: str
    resume: bool

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], strict: bool = False) -> RunConfig:
        """Parse and validate. Unknown keys are an error with ``strict`` (the CLI), and ignored
        otherwise (a Flower run-config may carry keys for other components)."""
        unknown = sorted(set(values) - set(_BY_KEY))
        if strict and unknown:
            raise ConfigError(f"unknown key(s) {unknown}; known keys: {sorted(_BY_KEY)}")
        resolved: dict[str, Any] = {}
        for field in FIELDS:
            value = _coerce(field, values.get(field.key, field.default))
            if field.check is not None and not field.check(value):
                raise ConfigError(f"{field.key}: {value!r} is not allowed; expected "
                                  f"{field.allowed}")
            resolved[field.key.replace("-", "_")] = value
        config = cls(**resolved)
        config._check_relations()
        return config

    def _check_relations(self) -> None:
        from fedpriv.registry import get_algorithm  # late import: registry imports algorithms

        if self.rank > self.dim:
            raise ConfigError(f"rank: {self.rank} is not allowed; expected rank <= dim "
                              f"({self.dim})")
        if self.task_clusters > self.dim:
            raise ConfigError(f"task-clusters: {self.task_clusters} is not allowed; expected "
                              f"task-clusters <= dim ({self.dim})")
        if self.rounds % self.user_groups:
            raise ConfigError(f"user-groups: {self.user_groups} does not divide rounds "
                              f"({self.rounds}); each group must take part in the same number "
                              "of rounds")
        if self.user_groups > self.num_users:
            raise ConfigError(f"user-groups: {self.user_groups} exceeds num-users "
                              f"({self.num_users})")
        if self.users_per_node > self.num_users:
            raise ConfigError(f"users-per-node: {self.users_per_node} exceeds num-users "
                              f"({self.num_users})")
        if self.secure_noise and self.noise_seed >= 0:
            raise ConfigError(f"noise-seed: {self.noise_seed} is not allowed with secure-noise "
                              "= true (the noise comes from OS entropy; a fixed noise seed "
                              "would make it predictable); remove noise-seed")
        if self.max_epsilon and self.epsilon > self.max_epsilon:
            raise ConfigError(f"epsilon: the target {self.epsilon} exceeds max-epsilon "
                              f"({self.max_epsilon}); the run would spend more than allowed")
        if self.resume and not self.checkpoint:
            raise ConfigError("resume: needs checkpoint = true")
        try:
            algorithm = get_algorithm(self.algorithm)
        except KeyError as err:
            raise ConfigError(f"algorithm: {err.args[0]}") from None
        algorithm.validate(self)

    @property
    def ceiling(self) -> float:
        """The most epsilon the run may spend: max-epsilon, or the target when it is 0."""
        return self.max_epsilon or self.epsilon

    def to_mapping(self) -> dict[str, Any]:
        """The resolved config with kebab-case keys (what goes in the results file)."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}


def default_mapping() -> dict[str, Any]:
    return {f.key: f.default for f in FIELDS}
