"""The bases of the registered deep algorithms: ``DeepBase`` (every deep algorithm: the data and
model checked before the run, the users' hosting, the final step's personal fits and metric
sums) and ``DeepAlgorithm`` (T private rounds over a torch model, then each user's final
personal fit and its test metrics).

The server keeps the model as one flat float32 vector (``models.ModelSpec``: body, then head).
A round releases one part, ``update``: the mean over the public population of the users'
clipped local updates (the body's for FedRep, the whole model's for DP-FedAvg). Each user's
update is bounded to ``clip-norm`` in L2 over all its parameters before anything is summed, so
the mean has sensitivity ``clip-norm / population`` (add/remove; twice that for replace-one)
whoever takes part; the server adds the planned Gaussian noise and steps with momentum (a
post-processing of the noisy means). ``users-per-round = m > 0``: each round takes a Poisson
sample of the users (rate m / n, drawn from the seed and the user id, secret to the server) and
divides by m, accounted as a Poisson-subsampled Gaussian like Meta-NSGD. The final step releases
nothing: it reports metric sums to the operator. So do the ``eval`` steps of ``eval-every``
(a learning curve): the same work with the model of an earlier round, neither released nor
accounted, and they change nothing the run computes (the model, the noise and the Poisson
samples are the same with or without them; a test checks).

A subclass says what a round trains and releases (``released_part``, ``released_size``,
``ghost_eligible``, ``heads_per_user``, ``local_problem``: the body for FedRep,
``private_fedrep.py``; the whole model for DP-FedAvg, ``dp_fedavg.py``) and how each user's
final personal model is fitted (``head_from``: a head from zero, the global model as it is,
or the global head fine-tuned; ``final_scores``, ``final_fit.py``), and each user's final choice
among it, its own model and their mixes (``choice.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from fedpriv.algorithms.base import EXACT_EVAL, Algorithm, Part, Step, UserContribution
from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.batches import LocalProblem, disjoint_batches
from fedpriv.algorithms.deep.choice import (
    choice_scores,
    choice_sums,
    empty_choice_sums,
    summarize_choice,
)
from fedpriv.algorithms.deep.final_fit import (
    Scores,
    accuracy_sums,
    final_chunk,
    fitted_head_scores,
    global_model_scores,
)
from fedpriv.algorithms.deep.ghost_clipping import ghost_clipped_sum
from fedpriv.algorithms.deep.models import ModelSpec
from fedpriv.algorithms.deep.params import (
    FILE_SOURCES,
    PRIVATE_DEFAULTS,
    DeepConfig,
    DeepLocalConfig,
    auto_head_steps,
)
from fedpriv.algorithms.deep.problem import (
    DeepProblem,
    UserBlock,
    chunk_users,
    hosted_positions,
    model_of,
    problem_of,
    public_batch_size,
    user_block,
)
from fedpriv.data.sources import DatasetError, check_npz
from fedpriv.data.tables import TABLE_FORMATS, TableError, check_table
from fedpriv.params import ConfigError
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import adapted_clip
from fedpriv.randomness import user_uniforms

# accuracy_sums and disjoint_batches: imported from here by tests and benchmarks
__all__ = ["GHOST_FLOATS", "GHOST_ROWS", "PER_USER_FLOATS", "UNCLIPPED", "DeepAlgorithm",
           "DeepBase", "accuracy_sums", "adapted_clip", "disjoint_batches"]

_SAMPLING_PURPOSE = 0xD5A
UNCLIPPED = "unclipped"  # adaptive clipping's released part: the centred count

# rows (both batches, 2b a user) per ghost-clipping call: the float64 Grams and products run
# fastest cache-sized (docs/measurements.md)
GHOST_ROWS = 3072
# and at most this many floats of the rows' inputs and activations per call (64 MiB float32):
# memory-bound bodies (the built-in cnn) run faster in smaller calls; the MLP stays at GHOST_ROWS
GHOST_FLOATS = 2**24
# per-user parameters of a chunk on the per-user path (several local steps, or a model ghost
# clipping cannot take), on the CPU: at most this many floats (16 MiB float32), so each step's
# per-user parameters and gradients stay under glibc's mmap threshold and reuse their pages
# (fedpriv.allocator): 5 local steps of Fashion-MNIST's MLP went 87 -> 17 users a chunk and
# 91-115 -> 161-174 users/s (docs/measurements.md)
PER_USER_FLOATS = 2**22

DC = TypeVar("DC", bound=DeepLocalConfig)


def per_user_cap(problem: DeepProblem, own: int) -> int:
    """Users whose ``own`` per-user parameter floats a call of the per-user path holds at
    once: ``PER_USER_FLOATS`` of them on the CPU (above), no cap on an accelerator."""
    if problem.device.type != "cpu":
        return 2**62
    return max(1, PER_USER_FLOATS // max(1, own))


def model_tensor(arrays: Mapping[str, np.ndarray], problem: DeepProblem) -> torch.Tensor:
    """The broadcast model as a float32 tensor on the problem's device."""
    return torch.from_numpy(np.asarray(arrays["model"], dtype=np.float32)).to(problem.device)


class DeepBase(Algorithm[DC]):
    """Every deep algorithm: the data and model checked before the run, the users' hosting,
    the model broadcast, and the final step's personal fits and metric sums (``final_sums``)."""

    config_type = DeepLocalConfig

    partitions_in_validate = True  # parse_config checks the run's size first (fedpriv.cost)

    @classmethod
    def validate(cls, config: DC) -> None:
        super().validate(config)
        # the model from public values (of a data file: its header), or a ConfigError; the
        # server reads no user's rows. A built-in dataset's partition is public: cut it here,
        # so that what it cannot cut (too many label-skew users) is refused before the run
        model_of(config)
        if config.dataset not in FILE_SOURCES:
            problem_of(config, features=False)
        b = public_batch_size(config)
        if config.cross_fit > 2 * b:
            raise ConfigError(f"cross-fit: {config.cross_fit} folds of a user's two batches "
                              f"of {b} rows leave a fold empty (at most {2 * b})")

    @classmethod
    def resolved(cls, config: DC) -> DC:
        """head-steps = -1: ``auto_head_steps`` of the public batch size."""
        if config.head_steps >= 0:
            return config
        return replace(config, head_steps=auto_head_steps(public_batch_size(config)))

    @classmethod
    def check_inputs(cls, config: DC) -> None:
        """Of a data file, every label in the declared classes and every feature a finite
        number (the file read once and dropped), so that a bad row stops the run before it
        starts, naming it. (A node that meets one anyway isolates that row's user.)"""
        try:
            if config.dataset in TABLE_FORMATS:
                check_table(Path(config.data_file), config.dataset, config.num_classes)
            elif config.dataset == "npz":
                check_npz(Path(config.data_file), config.num_classes)
        except (TableError, DatasetError) as err:
            raise ConfigError(str(err)) from None
        if config.dataset in FILE_SOURCES:  # the partition the nodes will cut, or its error
            problem_of(config, features=False)

    @classmethod
    def input_notes(cls, config: DC) -> list[str]:
        """Under the natural partition every user of the file takes part and the releases
        divide by num-users: say so where the file holds another number of users."""
        if config.partition != "natural":
            return []
        users = len(problem_of(config, features=False).keys)
        if users == config.num_users:
            return []
        return [f"note: the natural partition takes every user of {config.data_file} ({users}"
                f" users); the releases divide by num-users = {config.num_users}, the public "
                "population n the privacy guarantee is stated for. Set num-users to the "
                "population you publish (a mean over n that differs from the file's count is "
                "biased, not less private)"]

    @classmethod
    def public_hosting(cls, config: DC) -> bool:
        """Natural users are hosted by a hash of their ids, which the server does not read:
        it then takes each node's user count from its reply."""
        return config.partition != "natural"

    @classmethod
    def hosted_users(cls, config: DC, partition_id: int, num_partitions: int) -> np.ndarray:
        if config.partition != "natural":
            return super().hosted_users(config, partition_id, num_partitions)
        problem = problem_of(config, features=False)
        return hosted_positions(config.partition, problem.keys, config.num_users,
                                partition_id, num_partitions)

    def __init__(self, config: DC) -> None:
        super().__init__(config)
        self.model = model_of(config).initial(config.seed)

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {"model": self.model}

    # ----- user side -------------------------------------------------------------------------
    @classmethod
    def user_step(
        cls, config: DC, step: Step, arrays: Mapping[str, np.ndarray], user_ids: np.ndarray
    ) -> UserContribution:
        problem = problem_of(config)
        model = model_tensor(arrays, problem)
        if step.is_final:
            return cls._final(config, problem, model, user_ids)
        return cls.round_contribution(config, step, problem, model, user_ids)

    @classmethod
    def round_contribution(cls, config: DC, step: Step, problem: DeepProblem,
                           model: torch.Tensor, user_ids: np.ndarray) -> UserContribution:
        """The users' summed contributions to a round (an algorithm with rounds says)."""
        raise NotImplementedError

    @classmethod
    def _final(cls, config: DC, problem: DeepProblem, model: torch.Tensor,
               user_ids: np.ndarray) -> UserContribution:
        size = final_chunk(config, problem, user_ids)
        sums: dict[str, float] = {}
        with torch.no_grad():
            for start in range(0, len(user_ids), size):
                ids = user_ids[start:start + size]
                part = cls.final_sums(config, problem, model, ids)
                sums = {k: sums.get(k, 0.0) + v for k, v in part.items()}
        if not sums:
            sums = cls.empty_sums(config)
        return UserContribution({}, len(user_ids), 0, sums)

    @classmethod
    def empty_sums(cls, config: DC) -> dict[str, float]:
        """The metric sums of a node without users (the same keys as its peers')."""
        return accuracy_sums(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))

    @classmethod
    def final_sums(cls, config: DC, problem: DeepProblem, model: torch.Tensor,
                   ids: np.ndarray) -> dict[str, float]:
        """Metric sums of a chunk of users after their final fit."""
        raise NotImplementedError


class DeepAlgorithm(DeepBase[DeepConfig]):
    """T rounds of clipped, noised local updates of a torch model, then personal fits."""

    config_type = DeepConfig
    defaults = PRIVATE_DEFAULTS
    # the state's "released" entry: the part of the model the rounds train and release
    released_part: ClassVar[str] = ""
    # each user's final head (``choice.HEAD_FROM``), for ``final_scores`` and the final choice
    head_from: ClassVar[str] = "zero"

    # ----- what a round trains and releases, and the final fit: each variant's own ----------
    @classmethod
    def released_size(cls, spec: ModelSpec) -> int:
        """Entries of the flat model (its leading ones) a round trains and releases."""
        raise NotImplementedError

    @classmethod
    def ghost_eligible(cls, spec: ModelSpec) -> bool:
        """Whether ghost clipping can compute one local step of what a round trains
        (``ghost_clipping.ghost_layers``)."""
        raise NotImplementedError

    @classmethod
    def heads_per_user(cls, config: DeepConfig) -> int:
        """Per-user heads a ghost-clipping chunk holds at once, in its memory estimate (one
        head's worth where a round fits no heads: the estimate every chunk size was set by)."""
        return 1

    @classmethod
    def local_problem(cls, config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                      block: UserBlock, first: np.ndarray, second: np.ndarray,
                      mask: np.ndarray) -> LocalProblem:
        """What the chunk's local steps start from and run on, as
        ``deep_math.local_updates`` takes them. ``mask`` (n, b): which batch entries are the
        user's (``disjoint_batches``)."""
        raise NotImplementedError

    @classmethod
    def final_scores(cls, config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                     ids: np.ndarray, split: str = "test") -> Scores:
        """Each user's accuracy and loss on its ``split`` rows (``test``, or ``validation``:
        the training rows held back) after its final fit as ``head_from`` says (a head fitted
        on all its training rows, the released body frozen, from zero or from the global
        head; or the global model as it is), and how many rows it has there."""
        if cls.head_from == "none":
            return global_model_scores(problem, model, ids, split)
        start = (model[problem.spec.body_size:].expand(len(ids), -1)
                 if cls.head_from == "global" else None)
        return fitted_head_scores(config, problem, model, ids, split, start)

    # ----- server side -----------------------------------------------------------------------
    def __init__(self, config: DeepConfig) -> None:
        super().__init__(config)
        self.release_size = self.released_size(model_of(config))
        self.velocity = np.zeros(self.release_size)
        self.clip = config.clip_norm

    @classmethod
    def sampling_rate(cls, config: DeepConfig) -> float:
        return config.users_per_round / config.num_users if config.users_per_round else 1.0

    def privacy_plan(self) -> list[PlannedRelease]:
        if not self.private:
            return []
        return [PlannedRelease("round", 1.0, self.config.rounds,
                               self.sampling_rate(self.config))]

    def steps(self) -> list[Step]:
        """T rounds, then the final fit. The rounds carry the current clip norm: with adaptive
        clipping it moves after each round (the server asks for the next step after each
        release), and the round also releases the count of unclipped users. ``eval-every = k``:
        exact evaluation steps of the initial model and after every k-th round before the
        last (the final step evaluates the last round's model)."""
        c = self.config
        clip = self.clip if c.clipping else float("inf")
        if c.clip_quantile > 0:
            share = c.clip_count_share
            parts: tuple[Part, ...] = (Part("update", (self.release_size,), clip, 1.0 - share),
                                       Part(UNCLIPPED, (1,), 0.5, share))
        else:
            parts = (Part("update", (self.release_size,), clip),)
        release = "round" if self.private else None
        steps = [Step(EXACT_EVAL, 0)] if c.eval_every else []  # the initial model
        for t in range(1, c.rounds + 1):
            steps.append(Step("round", t, release, parts, population=c.users_per_round or None))
            if c.eval_every and t % c.eval_every == 0 and t < c.rounds:
                steps.append(Step(EXACT_EVAL, t))
        return [*steps, Step("final")]

    def charge(self, step: Step) -> tuple[list[int] | None, float]:
        return None, self.sampling_rate(self.config)

    @classmethod
    def participants(cls, config: DeepConfig, step: Step, user_ids: np.ndarray) -> np.ndarray:
        if step.is_final or not config.users_per_round:
            return user_ids
        keys = (problem_of(config, features=False).keys[user_ids]
                if config.partition == "natural" else user_ids)  # each user's own key
        u = user_uniforms(config.seed, _SAMPLING_PURPOSE, step.index, keys, 1)[:, 0]
        chosen: np.ndarray = user_ids[u < cls.sampling_rate(config)]
        return chosen

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        mean = np.asarray(noisy_means["update"], dtype=np.float64)
        self.velocity = self.config.server_momentum * self.velocity + mean
        model = self.model.astype(np.float64)
        model[:self.release_size] += self.config.learning_rate * self.velocity
        self.model = model.astype(np.float32)
        report = {"update_norm": float(np.linalg.norm(mean)), "clip_norm": self.clip}
        if UNCLIPPED in noisy_means:  # adaptive clipping: a post-processing of the noisy count
            fraction = float(np.asarray(noisy_means[UNCLIPPED]).reshape(-1)[0]) + 0.5
            self.clip = adapted_clip(self.clip, fraction, self.config.clip_quantile,
                                     self.config.clip_lr)
            report["unclipped_fraction"] = fraction
        return report

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return summarize_choice(metric_sums)

    def state(self) -> dict[str, Any]:
        released = self.model[:self.release_size]
        state: dict[str, Any] = {"model": self.config.model, "released": self.released_part,
                                 "parameters": released.astype(float).tolist()}
        if self.config.clip_quantile > 0:
            state["clip_norm"] = self.clip  # the adaptive clip: a post-processing of the counts
        return state

    # ----- user side -------------------------------------------------------------------------
    @classmethod
    def round_contribution(cls, config: DeepConfig, step: Step, problem: DeepProblem,
                           model: torch.Tensor, user_ids: np.ndarray) -> UserContribution:
        b = problem.batch_size
        size = cls.round_chunk(config, problem)
        total, clipped = np.zeros(cls.released_size(problem.spec)), 0
        clip = step.parts[0].clip_norm
        with torch.no_grad():
            for start in range(0, len(user_ids), size):
                ids = user_ids[start:start + size]
                block = user_block(problem, ids)
                first, second, mask = disjoint_batches(config.seed, step.index, block.keys,
                                                       block.counts, block.y.shape[1], b)
                part, n_clipped = cls.clipped_work(config, problem, model, block, first,
                                                   second, mask, clip)
                total += part
                clipped += n_clipped
        totals = {"update": total}
        if len(step.parts) > 1:  # each user's centred bit 1[unclipped] - 1/2 (norm <= 1/2)
            totals[UNCLIPPED] = np.array([len(user_ids) / 2.0 - clipped])
        return UserContribution(totals, len(user_ids), clipped)

    @classmethod
    def round_chunk(cls, config: DeepConfig, problem: DeepProblem) -> int:
        """Users per vectorized call of a round: what ``chunk-mb`` holds; on the per-user
        path at most ``PER_USER_FLOATS`` floats of their own parameters; with ghost clipping at
        most ``GHOST_ROWS`` rows of their two batches (2b a user: its float64 Grams and
        products run fastest cache-sized) holding at most ``GHOST_FLOATS`` floats of inputs
        and activations (why: the comments there)."""
        spec, b = problem.spec, problem.batch_size
        own = cls.released_size(spec)
        ghost = config.body_steps == 1 and cls.ghost_eligible(spec)
        # per-user parameters held at once: none with ghost clipping but the users' heads (a
        # head each for FedRep, k with cross-fit = k)
        held = (cls.heads_per_user(config) * (spec.size - spec.body_size) if ghost
                else own * min(config.body_steps, 2))
        size = chunk_users(problem, 2 * b, held, config.chunk_mb)
        if not ghost:
            return min(size, per_user_cap(problem, own))
        rows = min(GHOST_ROWS, GHOST_FLOATS // spec.row_floats)
        return min(size, max(1, rows // (2 * b)))

    @classmethod
    def local_work(cls, config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                   block: UserBlock, first: np.ndarray, second: np.ndarray,
                   mask: np.ndarray) -> torch.Tensor:
        """The chunk's local updates (n, P_released), vectorized over users."""
        start, heads, x, y, weights = cls.local_problem(config, problem, model, block, first,
                                                        second, mask)
        with torch.enable_grad():
            return dm.local_updates(problem.spec, start, heads, x, y, weights,
                                    config.body_steps, config.local_lr)

    @classmethod
    def clipped_work(cls, config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                     block: UserBlock, first: np.ndarray, second: np.ndarray, mask: np.ndarray,
                     clip: float) -> tuple[np.ndarray, int]:
        """The chunk's sum of clipped local updates and how many were clipped: by ghost
        clipping for one local step of a model whose trained layers are all ``nn.Linear``
        (no per-user gradients formed), else ``local_work`` then ``deep_math.clipped_sum``."""
        start, heads, x, y, weights = cls.local_problem(
            config, problem, model, block, first, second, mask)  # head fits once, either path
        if config.body_steps == 1:
            ghost = ghost_clipped_sum(problem.spec, start, heads, x, y, weights,
                                      config.local_lr, clip)
            if ghost is not None:
                return ghost
        # per-user updates, in parts of at most per_user_cap users (a ghost-sized chunk whose
        # model ghost clipping turned down at run time holds more)
        total, clipped, step = np.zeros(start.shape[0]), 0, per_user_cap(problem, start.shape[0])
        for lo in range(0, x.shape[0], step):
            part = slice(lo, lo + step)
            with torch.enable_grad():
                updates = dm.local_updates(problem.spec, start,
                                           None if heads is None else heads[part], x[part],
                                           y[part], weights[part], config.body_steps,
                                           config.local_lr)
            part_sum, part_clipped = dm.clipped_sum(updates, clip)
            total += part_sum
            clipped += part_clipped
        return total, clipped

    @classmethod
    def final_sums(cls, config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                   ids: np.ndarray) -> dict[str, float]:
        """Metric sums of what the users keep: with final-choice = best, each user's choice
        between its local model, the personal model and their mixes (``choice.py``)."""
        if config.final_choice == "best":
            return choice_sums(choice_scores(config, problem, model, ids, cls.head_from))
        acc, loss, counts = cls.final_scores(config, problem, model, ids)
        return accuracy_sums(acc, loss, counts)

    @classmethod
    def kept_scores(cls, config: DeepConfig, problem: DeepProblem, model: torch.Tensor,
                    ids: np.ndarray, split: str) -> Scores:
        """``final_scores`` of what each user keeps (with final-choice = best, its choice)."""
        if config.final_choice == "best":
            kept = choice_scores(config, problem, model, ids, cls.head_from, split)
            return kept["acc"], kept["loss"], kept["counts"]
        return cls.final_scores(config, problem, model, ids, split)

    @classmethod
    def empty_sums(cls, config: DeepConfig) -> dict[str, float]:
        return empty_choice_sums() if config.final_choice == "best" else super().empty_sums(
            config)

    # ----- private evaluation (private-metrics; fedpriv.evaluation) ---------------------------
    @staticmethod
    def evaluation_bounds(config: DeepConfig) -> dict[str, float]:
        """Each user's error rate on its test rows (``test_error``) or, with metrics-split =
        "validation", on its held-back training rows (``validation_error``: what ``fedpriv
        tune`` scores candidates on), in [0, 1] (a user without such rows counts 1)."""
        return {f"{config.metrics_split}_error": 1.0}

    @classmethod
    def evaluation_values(cls, config: DeepConfig, arrays: Mapping[str, np.ndarray],
                          user_ids: np.ndarray) -> dict[str, np.ndarray]:
        split = config.metrics_split
        problem = problem_of(config)
        model = model_tensor(arrays, problem)
        size = final_chunk(config, problem, user_ids)
        errors = []
        with torch.no_grad():
            for start in range(0, len(user_ids), size):
                acc, loss, seen = cls.kept_scores(config, problem, model,
                                                  user_ids[start:start + size], split)
                errors.append(np.where((seen > 0) & np.isfinite(loss), 1.0 - acc, 1.0))
        return {f"{split}_error": np.concatenate(errors) if errors else np.zeros(0)}
