"""The contract between an algorithm and the runtime (Flower or in-process).

An algorithm is a sequence of ``Step``s. In each step the server broadcasts arrays; each node
computes, for the users it hosts that take part in the step, one contribution per user and
released ``Part``, bounds each to the part's ``clip_norm`` and returns the *sums* with the user
count. The server bounds every node's sums (so a misbehaving node cannot break the sensitivity),
divides by the step's public population, adds the planned Gaussian noise to each part and applies
the update. A step without parts is the final evaluation: nodes return metric sums instead.

Privacy of a step: its parts are Gaussian releases of the same users' data. Part ``j`` gets noise
multiplier ``z / sqrt(share_j)`` (shares sum to 1), so the step as a whole is exactly one Gaussian
mechanism with multiplier ``z`` (the privacy loss of composed Gaussians adds in ``1/z^2``). ``z``
comes from the calibrated plan entry named by ``release``. A step with ``release = None``
releases its sums without noise: only non-private baselines do that.

Disjoint user groups: a step with ``group = g`` sees only the users the algorithm assigns to
group ``g`` (``Algorithm.participants``); the accountant composes, for each user, only the steps
of its own group (parallel composition) plus the steps every user takes part in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from fedpriv.config import RunConfig, component_groups, plugin_config_type
from fedpriv.params import ConfigError, Param, ParamGroup, Rule, merge_params
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import gaussian_noise, symmetric_gaussian_noise


@dataclass(frozen=True)
class Part:
    """One released array of a step.

    ``clip_norm`` is the L2 (Frobenius) bound on one user's contribution to the sum (``inf``: no
    bound, non-private steps only); ``share`` is the part's share of the step's privacy loss;
    ``symmetric`` asks for symmetric noise on a symmetric square statistic.

    ``mechanism = "exponential"``: the part is a vector of candidate scores (lower is better),
    each user's score of every candidate in ``[0, clip_norm]``; the server samples one candidate
    with the exponential mechanism (sensitivity ``clip_norm / population``) and hands its index
    to ``apply`` as ``{"choice": index}`` instead of a noisy mean.
    """

    name: str
    shape: tuple[int, ...]
    clip_norm: float
    share: float = 1.0
    symmetric: bool = False
    mechanism: str = "gaussian"


# An exact evaluation of the model after round ``index`` (operator report only, nothing
# released): like the final step it has no parts, so nodes answer it with their final fit and
# metric sums, and the server records the metrics without noise or accounting.
EXACT_EVAL = "eval"


@dataclass(frozen=True)
class Step:
    """One server-node exchange."""

    kind: str  # e.g. "init", "round", "eval", "final"
    index: int = 0
    release: str | None = None  # privacy-plan entry; None: nothing noised (non-private)
    parts: tuple[Part, ...] = ()  # empty: a metrics step (``eval`` or the final one)
    population: int | None = None  # public number of users averaged over (None: all users)
    group: int | None = None  # disjoint user group taking part (None: every user)

    @property
    def label(self) -> str:
        return (f"{self.kind}-{self.index}" if self.kind in ("round", EXACT_EVAL)
                else self.kind)

    @property
    def is_final(self) -> bool:
        """A metrics step: the final one, or an exact evaluation between rounds (no parts:
        the nodes fit and score their users; nothing is released)."""
        return not self.parts

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Step:
        raw = json.loads(text)
        parts = tuple(Part(p["name"], tuple(p["shape"]), float(p["clip_norm"]),
                           float(p["share"]), bool(p["symmetric"]),
                           str(p.get("mechanism", "gaussian"))) for p in raw["parts"])
        return cls(raw["kind"], int(raw["index"]), raw["release"], parts, raw["population"],
                   raw["group"])


def partition_users(num_users: int, partition_id: int, num_partitions: int) -> np.ndarray:
    """Users of a partition: a contiguous, near-equal slice of ``range(num_users)``."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside [0, {num_partitions})")
    start = partition_id * num_users // num_partitions
    stop = (partition_id + 1) * num_users // num_partitions
    return np.arange(start, stop, dtype=np.int64)


@dataclass(frozen=True)
class UserContribution:
    """What a node sends for one step: per-part sums over its users and how many users."""

    totals: Mapping[str, np.ndarray]
    num_users: int
    num_clipped: int = 0
    metrics: Mapping[str, float] | None = None


C = TypeVar("C", bound=RunConfig)


class Algorithm(Generic[C]):
    """Base class of a registered algorithm; subclasses set ``name`` and implement the hooks.

    ``private = False`` marks a non-private baseline: its plan is empty and its steps release
    sums without noise (or release nothing at all).

    Keys: ``config_type`` is the typed config class the algorithm reads (``RunConfig`` plus its
    family's component classes, ``fedpriv/algorithms/*/params.py``), and ``C`` the same class
    for the type checker: ``class MyAlgorithm(Algorithm[MyConfig])`` with ``config_type =
    MyConfig``. ``components`` (the key groups listings and checks read) follows from it.
    A plug-in written before typed keys lists ``ParamGroup``s in ``components`` instead: its
    config class is made at run time from them (no type checking of its keys).
    """

    name: ClassVar[str] = ""
    private: ClassVar[bool] = True
    summary: ClassVar[str] = ""
    # may the server rescale a noisy mean for nodes that did not answer (post-processing)?
    rescale_for_missing_nodes: ClassVar[bool] = True
    # feature families the algorithm's problem supports (the first is what 'auto' means)
    feature_families: ClassVar[tuple[str, ...]] = ("gaussian", "rademacher", "uniform", "mixed")
    # the typed config class of the algorithm's keys (the core keys and its components')
    config_type: ClassVar[type[RunConfig]] = RunConfig
    # the groups of keys the algorithm reads besides the core ones, one per component
    # (problem, initialization, rounds, ...): derived from ``config_type``
    components: ClassVar[tuple[ParamGroup, ...]] = ()
    # the algorithm's own defaults of keys whose good value depends on the algorithm (a
    # ``Param`` with a ``fallback``: ``rounds``, ``learning-rate``, ...)
    defaults: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, config: C) -> None:
        self.config = config

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "components" in own and "config_type" in own:
            raise TypeError(f"{cls.__qualname__}: set config_type (typed keys) or, as plug-ins "
                            "did before typed keys, components (ParamGroups), not both")
        if "components" in own:  # a plug-in written against the ParamGroup contract
            made = plugin_config_type(f"{cls.__name__}Config", cls.config_type, cls.components)
            made.__module__ = cls.__module__  # found by pickle as <module>.<class>.config_type
            made.__qualname__ = f"{cls.__qualname__}.config_type"
            cls.config_type = made
        elif "config_type" in own:
            cls.components = component_groups(cls.config_type)

    # ----- configuration ---------------------------------------------------------------------
    @classmethod
    def declared_params(cls) -> dict[str, Param]:
        """Every key of the algorithm's components (a shared key is one declaration)."""
        return merge_params(cls.components)

    @classmethod
    def default_of(cls, param: Param, core: Mapping[str, Any] | None = None) -> Any:
        """The default of ``param`` for this algorithm: its own entry in ``defaults`` for a
        per-algorithm key, else the key's fallback; a plain key's declared default. An entry
        that is a ``Rule`` is computed from ``core`` (the run's core keys by attribute name);
        without ``core`` the rule itself is returned (for listings)."""
        if not param.per_algorithm:
            return param.default
        value = cls.defaults.get(param.key, param.fallback)
        if isinstance(value, Rule):
            return value if core is None else param.parse(value(core))
        return param.parse(value)

    @classmethod
    def validate(cls, config: C) -> None:
        """Raise ``fedpriv.params.ConfigError`` naming the key when the config cannot run.

        Called after every key was parsed and range-checked. Runs each component's relation
        check; subclasses add their own (calling ``super().validate``). A private algorithm
        needs clipping (it is what bounds the sensitivity), and the feature family must be one
        the problem supports.
        """
        for group in dict.fromkeys(cls.components):
            if group.check is not None:
                group.check(config)
        if cls.private and not getattr(config, "clipping", True):
            raise ConfigError(f"clipping: {cls.name} is private and needs clipping = true "
                              "(only the non-private baselines may turn it off)")
        family = getattr(config, "feature_dist", "auto")
        if family != "auto" and family not in cls.feature_families:
            raise ConfigError(f"feature-dist: {cls.name} supports "
                              f"{', '.join(cls.feature_families)} (or auto), not {family!r}")

    @classmethod
    def resolved(cls, config: C) -> C:
        """The config with the algorithm's defaults that follow public values of the problem
        (not only the core keys a ``Rule`` reads) filled in; called after ``validate``, so
        that the results' config holds the value that ran. The config as given by default."""
        return config

    @classmethod
    def check_inputs(cls, config: C) -> None:
        """Checks that read the run's input data in full (a data file's every value). The CLI
        runs them before a run whose nodes read the files it was given (``fedpriv run``,
        ``sweep``, ``tune``); not the server nor the nodes, which read only what they need, nor
        ``fedpriv deploy submit`` (each SuperNode may read its own copy, and the server's copy
        may lack real features). Raise ``ConfigError`` naming the key; nothing by default."""

    @classmethod
    def input_notes(cls, config: C) -> list[str]:
        """Remarks on the run's input data for the operator, printed by ``fedpriv run`` before
        the run (read from the operator's own copy of the data; never released): nothing by
        default."""
        return []

    def privacy_plan(self) -> list[PlannedRelease]:
        """Every private release one user takes part in, with budget weights."""
        raise NotImplementedError

    def steps(self) -> list[Step]:
        raise NotImplementedError

    # ----- server side -----------------------------------------------------------------------
    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        """Arrays sent to every node for this step."""
        raise NotImplementedError

    def noise(self, step: Step, part: Part, std: float, rng: np.random.Generator) -> np.ndarray:
        """Privacy noise for one part's population mean (symmetric when the part asks)."""
        if part.symmetric:
            return symmetric_gaussian_noise(part.shape[0], std, rng)
        return gaussian_noise(part.shape, std, rng)

    def charge(self, step: Step) -> tuple[list[int] | None, float]:
        """How the accountant charges the release of ``step``: the user groups whose data it
        depends on (None: every user) and its Poisson sampling rate (1: no sampling). Default:
        the step's own group, unsampled."""
        return (None if step.group is None else [step.group]), 1.0

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Update server state from the privatized means; returns metrics for the round report."""
        raise NotImplementedError

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        """Final metrics from the summed per-user metrics of the final step."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """The released model(s), JSON-serializable. It goes into the *release* of the run
        (``fedpriv.outputs``), so it must be computed only from the noisy releases (a
        post-processing): never exact statistics of the users' data or secret noise state."""
        return {}

    def record_level_privacy(self) -> dict[str, Any] | None:
        """A baseline whose only guarantee is record-level (DP-SGD on the nodes, no user-level
        noise): that guarantee as its accountant computed it (the results' ``privacy``
        entry); None for every user-level algorithm."""
        return None

    # ----- both sides ------------------------------------------------------------------------
    @classmethod
    def hosted_users(cls, config: C, partition_id: int, num_partitions: int) -> np.ndarray:
        """The users node ``partition_id`` of ``num_partitions`` hosts (default: a contiguous
        slice of ``range(num-users)``)."""
        return partition_users(config.num_users, partition_id, num_partitions)

    @classmethod
    def public_hosting(cls, config: C) -> bool:
        """Whether ``hosted_users`` is a function of public values, so that the server knows
        each node's user count (and checks and bounds its replies by it). False where it needs
        the users' data (natural users of a file): the server then takes each node's count
        from its reply, and reads no data."""
        return True

    @classmethod
    def participants(cls, config: C, step: Step, user_ids: np.ndarray) -> np.ndarray:
        """The users among ``user_ids`` that take part in ``step`` (default: all of them).

        Must depend only on public values (config, step, ids), never on data: the server uses
        it to check each node's user count and the accountant relies on it for parallel
        composition.
        """
        return user_ids

    # ----- user side (runs on the nodes; must not touch server state) ------------------------
    @classmethod
    def user_step(
        cls, config: C, step: Step, arrays: Mapping[str, np.ndarray], user_ids: np.ndarray
    ) -> UserContribution:
        """The summed contributions of ``user_ids`` (already filtered by ``participants``)."""
        raise NotImplementedError
