"""The base of the registered deep algorithms: T private rounds over a torch model, then each
user's final personal fit and its test metrics.

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

Subclasses set ``trains`` (``"body"`` or ``"model"``) and ``final_fit`` (``"head"``: each user
fits its head from zero with the released body; ``"fine-tune"``: from the global head;
``"none"``: the global model as it is).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from fedpriv.algorithms.base import EXACT_EVAL, Algorithm, Part, Step, UserContribution
from fedpriv.algorithms.deep import deep_math as dm
from fedpriv.algorithms.deep.batches import cross_fitted, disjoint_batches, take_rows
from fedpriv.algorithms.deep.ghost_clipping import ghost_clipped_sum, ghost_layers
from fedpriv.algorithms.deep.params import (
    DATA,
    FILE_SOURCES,
    LOCAL,
    MODEL,
    PRIVATE_DEFAULTS,
    ROUNDS,
)
from fedpriv.algorithms.deep.problem import (
    DeepProblem,
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
from fedpriv.randomness import user_uniforms

_SAMPLING_PURPOSE = 0xD5A
HISTOGRAM_BINS = 101  # per-user accuracy to 1% (for the percentile)


UNCLIPPED = "unclipped"  # adaptive clipping's released part: the centred count


def adapted_clip(clip: float, unclipped_fraction: float, quantile: float, rate: float) -> float:
    """Andrew et al. (2021), Alg. 1: the geometric step of the clip norm towards the
    ``quantile`` of the users' update norms, from the (noisy) fraction of unclipped users."""
    return clip * math.exp(-rate * (unclipped_fraction - quantile))


def bin_keys(prefix: str = "acc") -> list[str]:
    return [f"{prefix}_bin_{k:03d}" for k in range(HISTOGRAM_BINS)]


def accuracy_sums(acc: np.ndarray, loss: np.ndarray, counts: np.ndarray,
                  prefix: str = "acc") -> dict[str, float]:
    """Metric sums of users with test rows: accuracy, loss, how many, and the histogram of
    per-user accuracy (for the 10th-percentile user). A user whose loss or accuracy is not
    finite (its data overflowed the model, or was isolated) is left out and counted apart
    (``_unscored``): one user's data never makes its node's metrics unusable."""
    scored = np.isfinite(acc) & np.isfinite(loss)
    seen = (counts > 0) & scored
    hist = np.bincount(np.rint(acc[seen] * 100).astype(np.int64), minlength=HISTOGRAM_BINS)
    return {f"{prefix}_sum": float(acc[seen].sum()), f"{prefix}_loss_sum": float(loss[seen].sum()),
            f"{prefix}_users": float(seen.sum()),
            f"{prefix}_unscored": float(((counts > 0) & ~scored).sum()),
            **{k: float(v) for k, v in zip(bin_keys(prefix), hist, strict=True)}}


def summarize(sums: Mapping[str, float], prefix: str = "acc") -> dict[str, float]:
    """Mean per-user accuracy, 10th-percentile user's accuracy (1% bins) and mean test loss."""
    users = sums[f"{prefix}_users"]
    unscored = {"users_not_scored": sums[f"{prefix}_unscored"]} if sums.get(
        f"{prefix}_unscored") else {}
    if not users:
        return {"accuracy": float("nan"), "accuracy_p10": float("nan"),
                "test_loss": float("nan"), **unscored}
    hist = np.array([sums[k] for k in bin_keys(prefix)])
    p10 = int(np.searchsorted(np.cumsum(hist), 0.1 * users)) / 100.0
    return {"accuracy": sums[f"{prefix}_sum"] / users, "accuracy_p10": p10,
            "test_loss": sums[f"{prefix}_loss_sum"] / users, "users_evaluated": users,
            **unscored}


# rows (both batches, 2b a user) per ghost-clipping call: the float64 Grams and products run
# fastest cache-sized (docs/measurements.md)
GHOST_ROWS = 3072
# and at most this many floats of the rows' inputs and activations per call (64 MiB float32):
# memory-bound bodies (the built-in cnn) run faster in smaller calls; the MLP stays at GHOST_ROWS
GHOST_FLOATS = 2**24


class DeepAlgorithm(Algorithm):
    """T rounds of clipped, noised local updates of a torch model, then personal fits."""

    components = (DATA, MODEL, LOCAL, ROUNDS)
    defaults = PRIVATE_DEFAULTS
    trains: ClassVar[str] = "body"
    final_fit: ClassVar[str] = "head"

    @classmethod
    def validate(cls, config: Any) -> None:
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
    def check_inputs(cls, config: Any) -> None:
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
    def input_notes(cls, config: Any) -> list[str]:
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
    def public_hosting(cls, config: Any) -> bool:
        """Natural users are hosted by a hash of their ids, which the server does not read:
        it then takes each node's user count from its reply."""
        return config.partition != "natural"

    @classmethod
    def hosted_users(cls, config: Any, partition_id: int, num_partitions: int) -> np.ndarray:
        if config.partition != "natural":
            return super().hosted_users(config, partition_id, num_partitions)
        problem = problem_of(config, features=False)
        return hosted_positions(config.partition, problem.keys, config.num_users,
                                partition_id, num_partitions)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        spec = model_of(config)
        self.model = spec.initial(config.seed)
        self.release_size = spec.body_size if self.trains == "body" else spec.size
        self.velocity = np.zeros(self.release_size)
        self.clip = config.clip_norm if config.has("clip-norm") else float("inf")

    @classmethod
    def sampling_rate(cls, config: Any) -> float:
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
    def participants(cls, config: Any, step: Step, user_ids: np.ndarray) -> np.ndarray:
        if step.is_final or not config.users_per_round:
            return user_ids
        keys = (problem_of(config, features=False).keys[user_ids]
                if config.partition == "natural" else user_ids)  # each user's own key
        u = user_uniforms(config.seed, _SAMPLING_PURPOSE, step.index, keys, 1)[:, 0]
        return user_ids[u < cls.sampling_rate(config)]

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {"model": self.model}

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
        return summarize(metric_sums)

    def state(self) -> dict[str, Any]:
        released = self.model[:self.release_size]
        state = {"model": self.config.model, "released": self.trains,
                 "parameters": released.astype(float).tolist()}
        if self.config.has("clip-quantile") and self.config.clip_quantile > 0:
            state["clip_norm"] = self.clip  # the adaptive clip: a post-processing of the counts
        return state

    # ----- user side -------------------------------------------------------------------------
    @classmethod
    def user_step(
        cls, config: Any, step: Step, arrays: Mapping[str, np.ndarray], user_ids: np.ndarray
    ) -> UserContribution:
        problem = problem_of(config)
        model = torch.from_numpy(np.asarray(arrays["model"], dtype=np.float32)).to(
            problem.device)
        if step.is_final:
            return cls._final(config, problem, model, user_ids)
        spec, b = problem.spec, problem.batch_size
        own = spec.body_size if cls.trains == "body" else spec.size
        size = cls.round_chunk(config, problem)
        total, clipped = np.zeros(own), 0
        clip = step.parts[0].clip_norm
        with torch.no_grad():
            for start in range(0, len(user_ids), size):
                ids = user_ids[start:start + size]
                block = user_block(problem, ids)
                batches = disjoint_batches(config.seed, step.index, block.keys, block.counts,
                                           block.y.shape[1], b)
                part, n_clipped = cls.clipped_work(config, problem, model, block, *batches,
                                                   clip)
                total += part
                clipped += n_clipped
        totals = {"update": total}
        if len(step.parts) > 1:  # each user's centred bit 1[unclipped] - 1/2 (norm <= 1/2)
            totals[UNCLIPPED] = np.array([len(user_ids) / 2.0 - clipped])
        return UserContribution(totals, len(user_ids), clipped)

    @classmethod
    def round_chunk(cls, config: Any, problem: DeepProblem) -> int:
        """Users per vectorized call of a round: what ``chunk-mb`` holds, and with ghost
        clipping at most ``GHOST_ROWS`` rows of their two batches (2b a user: its float64
        Grams and products run fastest cache-sized) holding at most ``GHOST_FLOATS`` floats of
        inputs and activations (why: the comments there)."""
        spec, b = problem.spec, problem.batch_size
        own = spec.body_size if cls.trains == "body" else spec.size
        ghost = config.body_steps == 1 and ghost_layers(spec, cls.trains == "body")
        # per-user parameters held at once: none with ghost clipping (a head each for FedRep,
        # k with cross-fit = k)
        heads = max(1, config.cross_fit) if cls.trains == "body" else 1
        held = heads * (spec.size - spec.body_size) if ghost else own * min(config.body_steps, 2)
        size = chunk_users(problem, 2 * b, held, config.chunk_mb)
        if not ghost:
            return size
        rows = min(GHOST_ROWS, GHOST_FLOATS // spec.row_floats)
        return min(size, max(1, rows // (2 * b)))

    @classmethod
    def local_problem(cls, config: Any, problem: DeepProblem, model: torch.Tensor, block: Any,
                      first: np.ndarray, second: np.ndarray, mask: np.ndarray) -> tuple:
        """What the chunk's local steps start from and run on: (start, heads, x, y, mask) as
        ``deep_math.local_updates`` takes them. FedRep fits each user's head on the first batch
        and trains the body on the second; FedAvg trains the whole model on both. ``mask``
        (n, b): which batch entries are the user's (``disjoint_batches``)."""
        spec = problem.spec
        weights = torch.from_numpy(mask).to(model.device)
        if cls.trains != "body":  # both batches' rows in one gather
            both = np.concatenate([first, second], 1)
            return (model, None, take_rows(block.x, both), take_rows(block.y, both),
                    torch.cat([weights, weights], 1))
        body = model[:spec.body_size]
        if config.cross_fit:
            return body, *cross_fitted(spec, body, block, first, second, mask, config)
        x1, y1 = take_rows(block.x, first), take_rows(block.y, first)
        n, b = y1.shape
        feats = dm.features(spec, body, x1.reshape(n * b, *spec.input_shape))
        heads = dm.fit_heads(feats.reshape(n, b, -1), y1, weights, spec.num_classes,
                             config.head_steps, config.head_lr, bias=spec.head_bias)
        return body, heads, take_rows(block.x, second), take_rows(block.y, second), weights

    @classmethod
    def local_work(cls, config: Any, problem: DeepProblem, model: torch.Tensor, block: Any,
                   first: np.ndarray, second: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        """The chunk's local updates (n, P_released), vectorized over users."""
        start, heads, x, y, mask = cls.local_problem(config, problem, model, block, first,
                                                     second, mask)
        with torch.enable_grad():
            return dm.local_updates(problem.spec, start, heads, x, y, mask, config.body_steps,
                                    config.local_lr)

    @classmethod
    def clipped_work(cls, config: Any, problem: DeepProblem, model: torch.Tensor, block: Any,
                     first: np.ndarray, second: np.ndarray, mask: np.ndarray,
                     clip: float) -> tuple[np.ndarray, int]:
        """The chunk's sum of clipped local updates and how many were clipped: by ghost
        clipping for one local step of a model whose trained layers are all ``nn.Linear``
        (no per-user gradients formed), else ``local_work`` then ``deep_math.clipped_sum``."""
        start, heads, x, y, mask = cls.local_problem(config, problem, model, block, first,
                                                     second, mask)  # head fits once, either path
        if config.body_steps == 1:
            ghost = ghost_clipped_sum(problem.spec, start, heads, x, y, mask, config.local_lr,
                                      clip)
            if ghost is not None:
                return ghost
        with torch.enable_grad():
            updates = dm.local_updates(problem.spec, start, heads, x, y, mask,
                                       config.body_steps, config.local_lr)
        return dm.clipped_sum(updates, clip)

    @classmethod
    def _final(cls, config: Any, problem: DeepProblem, model: torch.Tensor,
               user_ids: np.ndarray) -> UserContribution:
        size = _final_chunk(config, problem, user_ids)
        sums: dict[str, float] = {}
        with torch.no_grad():
            for start in range(0, len(user_ids), size):
                ids = user_ids[start:start + size]
                part = cls.final_sums(config, problem, model, ids)
                sums = {k: sums.get(k, 0.0) + v for k, v in part.items()}
        if not sums:
            sums = cls.empty_sums()
        return UserContribution({}, len(user_ids), 0, sums)

    @classmethod
    def empty_sums(cls) -> dict[str, float]:
        return accuracy_sums(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))

    @classmethod
    def final_sums(cls, config: Any, problem: DeepProblem, model: torch.Tensor,
                   ids: np.ndarray) -> dict[str, float]:
        """Metric sums of a chunk of users after their final fit."""
        acc, loss, counts = cls.final_scores(config, problem, model, ids)
        return accuracy_sums(acc, loss, counts)

    @classmethod
    def final_scores(cls, config: Any, problem: DeepProblem, model: torch.Tensor,
                     ids: np.ndarray, split: str = "test"
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each user's accuracy and loss on its ``split`` rows (``test``, or ``validation``:
        the training rows held back) after its final fit, and how many rows it has there."""
        spec = problem.spec
        train, test = user_block(problem, ids, "train"), user_block(problem, ids, split)
        n, r = test.y.shape
        if cls.final_fit == "none":
            logits = functional_logits(spec, model, test.x.reshape(n * r, *spec.input_shape))
            acc, loss = dm.accuracy_and_loss(logits.reshape(n, r, -1), test.y, test.mask)
            return acc, loss, test.counts
        body = model[:spec.body_size]
        nt, rt = train.y.shape
        feats = dm.features(spec, body, train.x.reshape(nt * rt, *spec.input_shape))
        init = None
        if cls.final_fit == "fine-tune":
            init = model[spec.body_size:].expand(n, -1)
        heads = dm.fit_heads(feats.reshape(nt, rt, -1), train.y, train.mask, spec.num_classes,
                             config.final_head_steps, config.head_lr, init, spec.head_bias)
        test_feats = dm.features(spec, body, test.x.reshape(n * r, *spec.input_shape))
        logits = dm.head_logits(test_feats.reshape(n, r, -1), heads, spec.num_classes,
                                spec.head_bias)
        acc, loss = dm.accuracy_and_loss(logits, test.y, test.mask)
        return acc, loss, test.counts

    # ----- private evaluation (private-metrics; fedpriv.evaluation) ---------------------------
    @staticmethod
    def evaluation_bounds(config: Any) -> dict[str, float]:
        """Each user's error rate on its test rows (``test_error``) or, with metrics-split =
        "validation", on its held-back training rows (``validation_error``: what ``fedpriv
        tune`` scores candidates on), in [0, 1] (a user without such rows counts 1)."""
        return {f"{config.metrics_split}_error": 1.0}

    @classmethod
    def evaluation_values(cls, config: Any, arrays: Mapping[str, np.ndarray],
                          user_ids: np.ndarray) -> dict[str, np.ndarray]:
        split = config.metrics_split
        problem = problem_of(config)
        model = torch.from_numpy(np.asarray(arrays["model"], dtype=np.float32)).to(
            problem.device)
        size = _final_chunk(config, problem, user_ids)
        errors = []
        with torch.no_grad():
            for start in range(0, len(user_ids), size):
                acc, loss, seen = cls.final_scores(config, problem, model,
                                                   user_ids[start:start + size], split)
                errors.append(np.where((seen > 0) & np.isfinite(loss), 1.0 - acc, 1.0))
        return {f"{split}_error": np.concatenate(errors) if errors else np.zeros(0)}


def _final_chunk(config: Any, problem: DeepProblem, user_ids: np.ndarray) -> int:
    """Users per chunk of the final fit and evaluation (their training rows, and their test
    or held-back validation rows)."""
    train = int(problem.users.train.counts[user_ids].max(initial=1))
    scored = max(int(problem.users.test.counts.max(initial=1)),
                 0 if problem.validation is None else int(problem.validation.counts.max()))
    return chunk_users(problem, train + scored, 0, config.chunk_mb)


def functional_logits(spec: Any, model: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The global model's logits on rows x (N, *input)."""
    return torch.func.functional_call(spec.module, spec.unflatten(model), (x,))
