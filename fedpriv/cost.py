"""What a run will cost, estimated from its public sizes before anything is allocated.

``estimate(config)`` adds up the dominant terms of the peak memory and the wall time of the run
as the in-process engine runs it (a Flower simulation on one machine holds the same data, split
over its processes, and adds its own fixed overhead: Ray and one process per ClientApp actor).
``check_size(config)`` refuses, with a ``ConfigError`` naming the key(s) and the estimate, a run
that would not fit the machine or that nobody means to run; ``size-check = false`` lets it
through. ``estimate_line(config)`` is the line printed before a long run.

It reads public sizes only: num-users, the steps of the algorithm, the per-user sample counts
and dimension, the shapes of the released parts, the candidates of an exponential mechanism, the
deep family's dataset and chunk budget. It allocates none of what it estimates: the steps come
from the algorithm itself, built for at most ``PROBE_USERS`` users and, above ``PROBE_ROUNDS``
rounds, for two small round counts whose figures are extrapolated linearly.

The formula (n users, S steps, U user-steps = the users taking part, summed over the steps)::

    memory = BASE (+ TORCH for the deep family)
           + ID_BYTES n (+ GROUP_BYTES n where users are in disjoint groups)
           + min(cache, n x bytes a user's points take in the data cache)   (cached families)
           + min(n, block) x bytes of a user's points                       (one block at work)
           + min(n, block) x candidates x 8                                 (exponential mechanism)
           + STEP_BYTES S + NODE_BYTES nodes + 32 x the largest released part
           + the deep family's dataset and its chunk-mb working set
    time   = FIXED + U x (USER_STEP (META_USER_STEP) + FLOAT x (a user's floats + its part floats)
                          + GEN_FLOAT x its floats regenerated where the cache misses
                          + candidates / scores per second)
           + S x (STEP + NODE_STEP x nodes) + releases x RELEASE[accountant] + STEP2 x S^2

The S^2 term: the server re-reads the algorithm's steps and saves its state after every step.
The constants were measured on the machine this was written on (2 cores, Python 3.11, NumPy,
dp-accounting; in-process runs, peak RSS from ``getrusage``); each says what gave it. Expect a
factor of two either way elsewhere: the estimate decides only what is absurd.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpriv.config import ConfigError, RunConfig
from fedpriv.data.cache import CACHE_MB_ENV, DEFAULT_CACHE_MB, block_users
from fedpriv.evaluation import algorithm_for
from fedpriv.nodes import auto_num_nodes

MB = 2**20

# ----- memory (bytes), measured ------------------------------------------------------------------
BASE = 320 * MB  # a 100-user private-fedrep run's peak RSS: 310-320 MB
TORCH = 110 * MB  # a 100-user deep run on digits peaks at 424-430 MB
ID_BYTES = 9  # check_run at 5e7 users: +389 MB (7.8 B a user), and a node's own id array
GROUP_BYTES = 16  # the seeded permutation and group of every user, where users are grouped
STEP_BYTES = 1536  # 8,000 against 500 rounds of dp-global-model: +9.5 MB (1.3 KB a step)
NODE_BYTES = 3500  # users-per-node = 1 at 20,000 users: +67 MB
# ----- time (seconds), measured ------------------------------------------------------------------
FIXED = 0.5  # calibration and checks of a small run (the imports before are not counted)
USER_STEP = 3e-6  # } private-fedrep, 10^5 users, 7 steps: 9.5 us a user-step at dim 50 and
FLOAT = 5e-9  # } 5.6 us at dim 20 (m = 10): 3 us + 5 ns a float of its points and parts
GEN_FLOAT = 2e-9  # a float drawn again where the cache misses (10^6 users, 80% missed: 7 us
#                   a user-step; drawing is cheap next to the users' computation)
STEP = 1e-3  # server and node bookkeeping of a step
NODE_STEP = 150e-6  # users-per-node = 1 at 20,000 users: 22 s more over 7 steps
RELEASE = {"pld": 0.03, "rdp": 1e-3}  # composing one release (PLD: 11-35 ms, RDP: 0.6 ms)
STEP2 = 4e-6  # dp-global-model, RDP: 2,000 / 4,000 / 8,000 rounds ran 7 / 60 / 311 s
META_USER_STEP = 25e-6  # a task's base learner: meta-nsgd and dp-ftmrl, 10^5 tasks: 32 us
SCORE = 5e-6  # an exponential mechanism's user score, where its class states no rate
DEEP_USER_STEP = 5e-4  # built-in mlp: 0.15 ms (Fashion-MNIST) to 0.8 ms (digits) a user-step
DEEP_LOCAL_USER = 0.03  # deep-local-only: a user training its own network alone (digits)
DEEP_LOAD = 1e-8  # reading and converting a dataset byte (Fashion-MNIST: about 3 s)
DATASETS = {"digits": 1797 * 64 * 8, "fashion-mnist": 70_000 * 784 * 5}  # bytes in memory
# ----- the bounds --------------------------------------------------------------------------------
MAX_STEPS = 10**7  # a record of every step stays in memory and each step re-reads them all
MAX_SECONDS = 43_200.0  # half a day: the largest documented run (10^7 users) took 17 minutes
MEMORY_SHARE = 0.9  # of the memory available: the rest is the machine's margin
LINE_SECONDS = 30.0  # estimate_line says nothing about a shorter run
PROBE_USERS = 4096  # the steps are built for at most this many users
PROBE_ROUNDS = 1000  # above this many rounds, built for 250 and 500 and extrapolated


@dataclass(frozen=True)
class Term:
    """One summand of an estimate: what it is, its value, the keys that drive it."""

    name: str
    value: float
    keys: tuple[str, ...] = ()
    detail: str = ""


@dataclass(frozen=True)
class Estimate:
    """A run's estimated peak memory (bytes) and wall time (seconds), term by term."""

    memory: tuple[Term, ...]
    time: tuple[Term, ...]
    steps: float

    @property
    def memory_bytes(self) -> float:
        return sum(t.value for t in self.memory)

    @property
    def seconds(self) -> float:
        return sum(t.value for t in self.time)


@dataclass(frozen=True)
class _Profile:
    """The steps of a run: how many, how many release, and per user of the run the steps it
    takes part in, the part floats and candidates it computes in them (sums over the steps)."""

    steps: float
    releases: float
    user_steps: float
    part_floats: float
    candidates: float
    largest_part: float = 0.0
    grouped: bool = False
    has_parts: bool = True

    def at(self, other: _Profile, x0: float, x1: float, x: float) -> _Profile:
        """Linear extrapolation to ``x`` rounds from ``self`` at ``x0`` and ``other`` at ``x1``."""
        def line(a: float, b: float) -> float:
            return max(0.0, a + (b - a) * (x - x0) / (x1 - x0))
        return _Profile(line(self.steps, other.steps), line(self.releases, other.releases),
                        line(self.user_steps, other.user_steps),
                        line(self.part_floats, other.part_floats),
                        line(self.candidates, other.candidates), other.largest_part,
                        other.grouped, other.has_parts)


def _profile_of(config: RunConfig, rounds: int, rate: float | None) -> _Profile:
    """The steps of ``config``'s algorithm at ``rounds`` rounds, built for at most
    ``PROBE_USERS`` users (some algorithms' steps hold a number per user): each step's share
    of the users is its group's or, where it samples, the real run's sampling rate."""
    users = min(config.num_users, PROBE_USERS)
    probe = dataclasses.replace(config, num_users=users, rounds=rounds)
    steps = algorithm_for(probe)(probe).steps()
    total = releases = user_steps = floats = candidates = largest = 0.0
    grouped = False
    for step in steps:
        total += 1
        releases += step.release is not None
        if step.group is not None:  # a disjoint group of the users
            grouped = True
            share = (step.population or users) / users
        elif step.population is not None and not step.is_final:  # a sample of them
            share = rate if rate is not None else min(1.0, step.population / users)
        else:
            share = 1.0
        user_steps += share
        for part in step.parts:
            size = float(math.prod(part.shape))
            largest = max(largest, size)
            if part.mechanism == "exponential":
                candidates += share * size
            else:
                floats += share * size
    return _Profile(total, releases, user_steps, floats, candidates, largest, grouped,
                    any(step.parts for step in steps))


def _profile(config: RunConfig) -> _Profile:
    """The run's steps from a probe of its algorithm (see the module docstring); where the
    probe fails, every user in each of rounds + 2 steps."""
    try:
        sampling = getattr(algorithm_for(config), "sampling_rate", None)
        rate = float(sampling(config)) if callable(sampling) else None
        if config.rounds <= PROBE_ROUNDS:
            return _profile_of(config, config.rounds, rate)
        low, high = PROBE_ROUNDS // 4, PROBE_ROUNDS // 2
        return _profile_of(config, low, rate).at(_profile_of(config, high, rate), low, high,
                                                 config.rounds)
    except Exception:  # noqa: BLE001 - a plug-in's steps may need more than a probe gives
        steps = config.rounds + 2.0
        return _Profile(steps, steps - 1, steps, 0.0, 0.0)


def _attr(config: RunConfig, key: str, default: Any = 0) -> Any:
    return getattr(config, key.replace("-", "_"), default)


def local_steps_factor(body_steps: int) -> float:
    """A deep user-step's time with ``body-steps`` local steps, in one-step user-steps: one
    step is ghost clipping (no per-user gradients); several are per-user updates through
    torch.func (DP-FedAvg-ft, Fashion-MNIST, n = 2,000, 40 rounds: about 45 s a run with one
    step, 203 / 214 / 281 s with 2 / 3 / 5)."""
    return 1.0 if body_steps <= 1 else 2.0 + body_steps


def _rounds_keys(config: RunConfig) -> tuple[str, ...]:
    """The keys that set how many steps a run has."""
    return ("rounds", "eval-every") if _attr(config, "eval-every") else ("rounds",)


def _cache_bytes() -> float:
    try:
        return max(0.0, float(os.environ.get(CACHE_MB_ENV, str(DEFAULT_CACHE_MB)))) * MB
    except ValueError:
        return float(DEFAULT_CACHE_MB * MB)


def _user_sizes(config: RunConfig) -> tuple[float, float, tuple[str, ...]]:
    """(floats of one user's points, bytes they take in the data cache, the keys): its
    training points, read whole and as the first half S0, and its evaluation points."""
    dim, samples = _attr(config, "dim"), _attr(config, "samples-per-user")
    split = config.metrics_split if config.has(f"{config.metrics_split}-samples-per-user") \
        else "test"
    held = _attr(config, f"{split}-samples-per-user")
    floats = (dim + 1.0) * (samples + held) + _attr(config, "rank")
    item = 4 if _attr(config, "data-dtype", "float64") == "float32" else 8
    cached = item * (dim + 1.0) * (1.5 * samples + held) + 8 * (1 + _attr(config, "rank"))
    keys = tuple(k for k in ("dim", "samples-per-user", f"{split}-samples-per-user")
                 if config.has(k))
    return floats, cached, keys


def _deep_dataset(config: RunConfig) -> float:
    """Bytes of a built-in dataset (public); 0 for the user's own data file: its size is a
    function of the users' rows, which the server's checks do not read."""
    return float(DATASETS.get(str(_attr(config, "dataset", "")), 0))


def estimate(config: RunConfig) -> Estimate:
    """The run's estimated peak memory and wall time (see the module docstring)."""
    n = float(config.num_users)
    prof = _profile(config)
    nodes = float(auto_num_nodes(config.num_users, config.users_per_node))
    rounds = _rounds_keys(config)
    deep = config.has("model")
    memory = [Term("base", BASE + (TORCH if deep else 0)),
              Term("user ids", (ID_BYTES + GROUP_BYTES * prof.grouped) * n, ("num-users",)),
              Term("step records", STEP_BYTES * prof.steps, rounds),
              Term("nodes", NODE_BYTES * nodes, ("num-users", "users-per-node")),
              Term("released arrays", 32 * prof.largest_part)]
    user_steps = n * prof.user_steps
    time = [Term("start", FIXED),
            Term("steps", prof.steps * (STEP + NODE_STEP * nodes)
                 + prof.releases * RELEASE.get(config.accountant, RELEASE["pld"]), rounds),
            Term("re-read steps", STEP2 * prof.steps**2, rounds)]
    # the keys a term names: num-users, and the rounds where users take part in many steps
    work = ("num-users", *(rounds if prof.user_steps > 10 else ()))
    block = min(n, float(block_users()))
    if deep:
        data = _deep_dataset(config)
        memory += [Term("dataset", data, ("dataset",)),
                   Term("chunk", min(_attr(config, "chunk-mb") * MB, data), ("chunk-mb",))]
        local = int(_attr(config, "body-steps", 1))
        per_user = (DEEP_USER_STEP * local_steps_factor(local) if prof.has_parts
                    else DEEP_LOCAL_USER)
        time += [Term("dataset", DEEP_LOAD * data, ("dataset",)),
                 Term("user work", user_steps * per_user, work + ("body-steps",) * (local > 1),
                      f"{user_steps:.3g} user-steps x {per_user * 1e3:g} ms")]
        return Estimate(tuple(memory), tuple(time), prof.steps)
    floats, cached, sizes = _user_sizes(config)
    if config.has("data-dtype"):  # the synthetic linear problem: its points are cached
        cache = min(_cache_bytes(), n * cached)
        memory.append(Term("cached data", cache, ("num-users", *sizes)))
        miss = 1.0 - cache / (n * cached) if n * cached > 0 else 0.0
    else:  # drawn again in every step
        miss = 1.0
    # the block at work: where it is a cached one, only its float64 copies and temporaries
    memory.append(Term("a block of data", block * cached * (1.0 if miss else 0.25), sizes))
    fixed = META_USER_STEP if config.has("meta-lambda") else USER_STEP
    per_user = fixed + FLOAT * floats + GEN_FLOAT * miss * floats
    seconds = user_steps * per_user + n * FLOAT * prof.part_floats
    if prof.candidates:
        rate = getattr(algorithm_for(config), "scores_per_second", None)
        score = 1.0 / float(rate(config)) if callable(rate) else SCORE
        seconds += n * prof.candidates * score
        memory.append(Term("scores", block * prof.largest_part * 8, ("num-users", "candidates")))
    cost = seconds / max(user_steps, 1.0)
    keys = (*work, *(sizes if cost > 10 * USER_STEP else ()),
            *(("candidates",) if prof.candidates and config.has("candidates") else ()))
    time.append(Term("user work", seconds, keys,
                     f"{user_steps:.3g} user-steps x {cost * 1e6:.3g} us"))
    return Estimate(tuple(memory), tuple(time), prof.steps)


# ----- the machine -------------------------------------------------------------------------------
def available_memory() -> int | None:
    """Bytes the machine can still give: ``MemAvailable`` of /proc/meminfo (else the OS's count
    of free pages), lowered to a cgroup v2 limit less its usage where one is set; None where
    none is known (the memory rule is then skipped)."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, OSError, ValueError):
            pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _own_rss() -> int:
    """This process's resident memory (the estimate's base is partly in it already)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


# ----- refusing and saying -----------------------------------------------------------------------
def size_text(value: float) -> str:
    return f"{value / 1e9:.1f} GB" if value >= 1e8 else f"{value / 1e6:.0f} MB"


def time_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.3g} days"


def _named(config: RunConfig, keys: Sequence[str]) -> str:
    shown = [k for k in dict.fromkeys(keys) if config.has(k)]
    return ", ".join(f"{k} = {_attr(config, k)}" for k in shown) or "the run"


def _top(terms: Sequence[Term]) -> Term:
    return max((t for t in terms if t.keys), key=lambda t: t.value, default=terms[0])


def _breakdown(terms: Sequence[Term], show: Callable[[float], str]) -> str:
    """The largest terms (at most three, each at least a tenth of the total)."""
    total = sum(t.value for t in terms)
    big = sorted(terms, key=lambda t: -t.value)[:3]
    return ", ".join(f"{show(t.value)} {t.name}" + (f" ({t.detail})" if t.detail else "")
                     for t in big if t.value >= 0.1 * total)


def check_size(config: RunConfig, machine: bool = True) -> Estimate | None:
    """Refuse (``ConfigError``) a run with more than ``MAX_STEPS`` steps, one estimated to take
    more than ``MAX_SECONDS`` and, with ``machine``, one whose estimated memory is more than
    ``MEMORY_SHARE`` of what this machine has available; each reason names the keys of its
    largest term and the estimate. ``machine = False``: the run is not on this machine (a
    deployment submitted from here). ``size-check = false``: nothing is checked (None)."""
    if not config.size_check:
        return None
    est = estimate(config)
    problems = []
    if est.steps > MAX_STEPS:
        problems.append(f"{_named(config, _rounds_keys(config))}: {est.steps:,.0f} steps, "
                        f"above the {MAX_STEPS:,} a run may have (the server keeps a record of "
                        "every step and reads them all again after each one)")
    available = available_memory() if machine else None
    if available is not None:
        need = est.memory_bytes - min(_own_rss(), BASE)
        if need > MEMORY_SHARE * available:
            problems.append(
                f"{_named(config, _top(est.memory).keys)}: this run needs about "
                f"{size_text(est.memory_bytes)} of memory (estimate: "
                f"{_breakdown(est.memory, size_text)}), this machine has "
                f"{size_text(available)} available")
    if est.seconds > MAX_SECONDS:
        problems.append(f"{_named(config, _top(est.time).keys)}: this run would take about "
                        f"{time_text(est.seconds)} (estimate: {_breakdown(est.time, time_text)}"
                        f"), above the {time_text(MAX_SECONDS)} a run may take")
    if problems and est.steps > MAX_STEPS:
        problems = problems[:1]  # the rest follows from the steps
    if problems:
        raise ConfigError("; ".join(problems) + "; lower what is named, or set size-check = "
                          "false to run it anyway")
    return est


def estimate_line(config: RunConfig, est: Estimate | None = None) -> str | None:
    """The line to print before a run estimated to take more than ``LINE_SECONDS``, naming the
    keys of its largest terms; None for a shorter run."""
    est = est or estimate(config)
    if est.seconds <= LINE_SECONDS:
        return None
    keys = (*_top(est.time).keys, *_top(est.memory).keys)
    return (f"fedpriv: estimated ~{time_text(est.seconds)}, ~{size_text(est.memory_bytes)} "
            f"peak (from {_named(config, keys)})")
