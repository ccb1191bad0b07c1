"""Exponential-mechanism constructions: Jain et al. (2021) A_Exp and Snedeker, Zhou & Bassily
(2025) Algorithm 3 (JL + exponential mechanism for margin classification).

Both papers give these as information-theoretic algorithms over a net of embeddings; here the net
is a finite candidate set chosen from the run seed, independently of the data, so the pure
epsilon-DP guarantee of the exponential mechanism holds for it as stated (it holds for any
data-independent candidate set). One step: every node scores every candidate for each of its
users (a score in ``[0, B]`` per user and candidate), the server averages the scores over the
fixed population n and samples one candidate with the exponential mechanism at sensitivity
``B / n`` (Gumbel-max: no overflow); then each user fits its local vector on its held-back half.

* ``a-exp`` (Jain et al. Alg. 4), regression. Candidates: ``candidates`` Haar-random d x k
  matrices with orthonormal columns. Score of U: the mean over users of
  ``min_{||v|| <= C} (2/m) sum_{i in S0} (<clip(U^T x_i, L_f), v> - clip(y_i, B_y))^2`` with
  ``C = local-norm``, ``L_f = projected-feature-clip`` and ``B_y = response-clip``. A user's
  term lies in ``[0, B_y^2]`` (``v = 0`` is feasible), so ``B = B_y^2`` is its range without any
  Lipschitz argument. Final fit: ``v_i = argmin_{||v|| <= C}`` squared loss on S1 with the
  released U (Alg. 4 line 4).
* ``jl-exp`` (Snedeker et al. Alg. 3), binary classification with a margin. A random ``k' x d``
  matrix M with i.i.d. entries ``+-1/sqrt(k')`` (``jl-dim`` = k'), drawn from the seed. Candidates:
  a grid cover of the Frobenius ball of radius ``sqrt(2k)`` in ``R^{k' x k}`` (``cover-radius``
  gamma: grid spacing ``2 gamma / sqrt(k' k)``, so every point of the ball lies within gamma of
  a grid point; grid points within ``sqrt(2k) + gamma`` of 0 are kept). Score of U~: the mean
  over users of ``min_{||v|| <= 1} (2/m) sum_{i in S0} 1[y_i <M x_i, U~ v> <= rho]`` (``margin``
  rho), in ``[0, 1]``: sensitivity 1/n. ``U_priv = M^T U~`` (so ``<x, U_priv v> = <Mx, U~ v>``).
  Final fit: ``v_i`` minimizing the 0-1 loss on S1 over the same set of v.

The best v of the 0-1 margin loss: scaling v up only increases correct margins, so it lies on
the sphere ``||v|| = 1``: for k = 1 it is +1 or -1 (exact); for k = 2 the minimum over 64 evenly
spaced directions (an approximation of the min; the sensitivity bound holds for any per-user
score in [0, 1], so privacy does not depend on it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cached_property, lru_cache
from typing import Any, ClassVar

import numpy as np

from fedpriv.algorithms import meta_learning as ml
from fedpriv.algorithms.base import Algorithm, Part, Step, UserContribution
from fedpriv.algorithms.linear import subspace_distance
from fedpriv.algorithms.personalization import evaluate_models, final_metrics, problem_of
from fedpriv.cohorts import cohort_data
from fedpriv.data.margin import MarginProblem, MarginTasks, margin_tasks
from fedpriv.data.synthetic import ground_truth_embedding
from fedpriv.privacy.accounting import PlannedRelease
from fedpriv.privacy.mechanisms import clip_by_norm
from fedpriv.registry import register

_CANDIDATE_STREAM = 0xE4A
_JL_STREAM = 0xE4B
_CHUNK = 4_000_000  # candidate x user x sample entries scored at once (memory bound)
_DIRECTIONS_K2 = 64


# ----- the local problems ----------------------------------------------------------------------
def ball_least_squares(z: np.ndarray, y: np.ndarray, radius: float,
                       iters: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """``min_{||v|| <= radius} mean_i (<z_i, v> - y_i)^2`` for every leading index.

    ``z`` (..., m, k), ``y`` (..., m) -> (v (..., k), value (...)). With the Gram matrix
    ``G = Q diag(lam) Q^T`` the constrained solution is ``(G + mu I)^+ b`` with the smallest
    ``mu >= 0`` that puts it in the ball (found by bisection: its norm decreases in mu)."""
    m = z.shape[-2]
    if z.shape[-1] == 1:  # closed form: the unconstrained minimizer clipped to [-C, C]
        g = (z[..., 0] ** 2).mean(axis=-1)
        b1 = (z[..., 0] * y).mean(axis=-1)
        v1 = np.clip(np.where(g > 0, b1 / np.where(g > 0, g, 1.0), 0.0), -radius, radius)
        value = (y**2).mean(axis=-1) - 2 * b1 * v1 + g * v1**2
        return v1[..., None], np.maximum(value, 0.0)
    gram = np.einsum("...mk,...ml->...kl", z, z) / m
    b = np.einsum("...mk,...m->...k", z, y) / m
    lam, q = np.linalg.eigh(gram)
    beta = np.einsum("...kl,...k->...l", q, b)  # Q^T b
    tiny = 1e-12 * np.maximum(lam.max(axis=-1, keepdims=True), 1e-300)

    def coords(mu):
        denom = lam + mu[..., None]
        return np.where(denom > tiny, beta / np.maximum(denom, tiny), 0.0)

    zero = np.zeros(lam.shape[:-1])
    inside = np.linalg.norm(coords(zero), axis=-1) <= radius
    lo, hi = zero, np.linalg.norm(b, axis=-1) / radius + 1e-300
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        big = np.linalg.norm(coords(mid), axis=-1) > radius
        lo, hi = np.where(big, mid, lo), np.where(big, hi, mid)
    mu = np.where(inside, zero, hi)
    w = coords(mu)
    v = np.einsum("...kl,...l->...k", q, w)
    value = (y**2).mean(axis=-1) - 2 * (b * v).sum(-1) + np.einsum("...k,...kl,...l->...", v,
                                                                     gram, v)
    return v, np.maximum(value, 0.0)


def _directions(k: int) -> np.ndarray:
    """The unit vectors the 0-1 loss is minimized over: +-1 (k = 1), 64 angles (k = 2)."""
    if k == 1:
        return np.array([[1.0], [-1.0]])
    angles = 2 * np.pi * np.arange(_DIRECTIONS_K2) / _DIRECTIONS_K2
    return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def best_margin_vectors(features: np.ndarray, labels: np.ndarray,
                        margin: float) -> tuple[np.ndarray, np.ndarray]:
    """``min_v mean_i 1[y_i <f_i, v> <= margin]`` over ``_directions(k)``: features (..., m, k),
    labels (..., m) -> (best v (..., k), loss (...))."""
    dirs = _directions(features.shape[-1])
    margins = labels[..., None] * np.einsum("...mk,jk->...mj", features, dirs)
    losses = (margins <= margin).mean(axis=-2)  # (..., directions)
    best = losses.argmin(axis=-1)
    return dirs[best], np.take_along_axis(losses, best[..., None], axis=-1)[..., 0]


# ----- candidates ---------------------------------------------------------------------------------
def haar_candidates(seed: int, count: int, dim: int, rank: int) -> np.ndarray:
    """``count`` Haar-random d x k matrices with orthonormal columns, (count, d, k)."""
    rng = np.random.default_rng([seed, _CANDIDATE_STREAM])
    q, r = np.linalg.qr(rng.standard_normal((count, dim, rank)))
    return q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[:, None, :]


def jl_matrix(seed: int, jl_dim: int, dim: int) -> np.ndarray:
    """The k' x d JL matrix with i.i.d. entries +-1/sqrt(k')."""
    rng = np.random.default_rng([seed, _JL_STREAM])
    return rng.choice([-1.0, 1.0], size=(jl_dim, dim)) / math.sqrt(jl_dim)


@lru_cache(maxsize=4)
def frobenius_cover(jl_dim: int, rank: int, gamma: float) -> np.ndarray:
    """Grid points of spacing ``2 gamma / sqrt(D)`` (D = k' k) within ``sqrt(2k) + gamma`` of 0,
    as (count, k', k): every point of the radius-sqrt(2k) Frobenius ball is within gamma of one."""
    dims = jl_dim * rank
    spacing = 2.0 * gamma / math.sqrt(dims)
    radius = math.sqrt(2.0 * rank) + gamma
    steps = int(math.floor(radius / spacing))
    axis = np.arange(-steps, steps + 1)
    grid = np.stack(np.meshgrid(*([axis] * dims), indexing="ij"), axis=-1).reshape(-1, dims)
    limit = int(math.floor((radius / spacing) ** 2 + 1e-9))  # integer test: exact
    kept = grid[(grid**2).sum(axis=1) <= limit] * spacing
    kept.setflags(write=False)
    return kept.reshape(-1, jl_dim, rank)


def cover_size(jl_dim: int, rank: int, gamma: float) -> int:
    """How many grid points ``frobenius_cover`` keeps, without building them: the lattice
    points of a D-ball, counted exactly by convolving the per-axis squared offsets."""
    dims = jl_dim * rank
    spacing = 2.0 * gamma / math.sqrt(dims)
    radius = math.sqrt(2.0 * rank) + gamma
    steps = int(math.floor(radius / spacing))
    limit = int(math.floor((radius / spacing) ** 2 + 1e-9))
    counts = np.zeros(limit + 1)
    counts[0] = 1.0
    for _ in range(dims):
        new = np.zeros_like(counts)
        for j in range(-steps, steps + 1):
            new[j * j:] += counts[: limit + 1 - j * j]
        counts = new
    return int(counts.sum())


# ----- the algorithms -----------------------------------------------------------------------------
class _ExponentialMechanism(Algorithm):
    """One exponential-mechanism step over a data-independent candidate set, then local fits."""

    @classmethod
    def num_candidates(cls, config: Any) -> int:
        raise NotImplementedError

    @classmethod
    def score_bound(cls, config: Any) -> float:
        raise NotImplementedError

    @classmethod
    def validate(cls, config: Any) -> None:
        from fedpriv.config import ConfigError

        super().validate(config)
        if config.samples_per_user < 4:
            raise ConfigError("samples-per-user: needs >= 2 samples in each half")
        cost = cls.num_candidates(config) * config.num_users
        if cost > config.max_score_evaluations:
            raise ConfigError(
                f"max-score-evaluations: {cls.name} would score {cls.num_candidates(config):,} "
                f"candidates x {config.num_users:,} users = {cost:.3g} user scores, above the "
                f"limit {config.max_score_evaluations:.3g} (about "
                f"{cost / cls.scores_per_second(config) / 60:.0f} min on one core); "
                f"{cls.size_advice} or num-users (or raise max-score-evaluations)")

    @classmethod
    def scores_per_second(cls, config: Any) -> float:
        """Measured on one core of the 2-core CI machine (m = 10): rank 1 and 2."""
        return 2e6 if config.rank == 1 else 2e5

    size_advice: ClassVar[str] = "lower candidates"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.choice: int | None = None

    def privacy_plan(self) -> list[PlannedRelease]:
        if not self.private:
            return []
        return [PlannedRelease("select", 1.0, mechanism="exponential")]

    def steps(self) -> list[Step]:
        c = self.config
        part = Part("scores", (self.num_candidates(c),), self.score_bound(c),
                    mechanism="exponential")
        return [Step("select", 0, "select" if self.private else None, (part,)), Step("final")]

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        self.choice = int(noisy_means["choice"])
        return {"chosen_candidate": float(self.choice)}

    def state(self) -> dict[str, Any]:
        return {"chosen_candidate": self.choice, "candidates": self.num_candidates(self.config)}


@register
class AExp(_ExponentialMechanism):
    name = "a-exp"
    summary = "A_Exp (Jain et al. 2021, Alg. 4): exponential mechanism over embeddings"

    @classmethod
    def num_candidates(cls, config: Any) -> int:
        return config.candidates

    @classmethod
    def score_bound(cls, config: Any) -> float:
        return config.response_clip**2

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.problem = problem_of(config)
        self._truth = ground_truth_embedding(self.problem)  # evaluation only

    @cached_property
    def candidate_set(self) -> np.ndarray:
        c = self.config
        return haar_candidates(c.seed, c.candidates, c.dim, c.rank)

    def embedding(self) -> np.ndarray:
        return self.candidate_set[self.choice]

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {"embedding": self.embedding()} if step.is_final else {}

    def apply(self, step: Step, noisy_means: Mapping[str, np.ndarray]) -> dict[str, float]:
        report = super().apply(step, noisy_means)
        report["subspace_distance"] = subspace_distance(self.embedding(), self._truth)
        return report

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        c = self.config
        metrics = final_metrics(c, metric_sums, num_users)
        metrics["subspace_distance"] = subspace_distance(self.embedding(), self._truth)
        # the candidate set's own limit (evaluation only): its closest member to U*
        # candidates are orthonormal: the sine of the largest principal angle, all at once
        cands = self.candidate_set
        residual = self._truth[None] - cands @ np.einsum("cdk,dl->ckl", cands, self._truth)
        metrics["best_candidate_distance"] = float(
            np.linalg.norm(residual, ord=2, axis=(1, 2)).min())
        return metrics

    def state(self) -> dict[str, Any]:
        return {**super().state(), "embedding": self.embedding().tolist()}

    @classmethod
    def user_step(cls, config: Any, step: Step, arrays: Mapping[str, np.ndarray],
                  user_ids: np.ndarray) -> UserContribution:
        problem = problem_of(config)
        data = cohort_data(problem, user_ids)
        (x0, y0), (x1, y1) = data.split_halves()
        if step.is_final:
            u = np.asarray(arrays["embedding"])
            v, _ = ball_least_squares(np.einsum("nmd,dk->nmk", x1, u), y1, config.local_norm)
            metrics = evaluate_models(problem, user_ids, v @ u.T, config.test_samples_per_user)
            return UserContribution({}, len(user_ids), 0, metrics)
        cands = haar_candidates(config.seed, config.candidates, config.dim, config.rank)
        return UserContribution({"scores": a_exp_scores(config, x0, y0, cands).sum(axis=1)},
                                len(user_ids), 0)


@register
class AExpBest(AExp):
    name = "a-exp-nonprivate"
    private = False
    summary = "A_Exp's candidate with the best score, without privacy (baseline)"


@register
class JLExp(_ExponentialMechanism):
    name = "jl-exp"
    summary = ("JL + exponential mechanism for margin classification (Snedeker et al. 2025, "
               "Alg. 3)")
    size_advice = "raise cover-radius, lower jl-dim"
    feature_families = ("unit-ball",)

    @classmethod
    def num_candidates(cls, config: Any) -> int:
        return cover_size(config.jl_dim, config.rank, config.cover_radius)

    @classmethod
    def score_bound(cls, config: Any) -> float:
        return 1.0

    @classmethod
    def validate(cls, config: Any) -> None:
        from fedpriv.config import ConfigError

        if config.rank > 2:
            raise ConfigError(f"rank: {cls.name} supports rank 1 or 2, not {config.rank}")
        if config.jl_dim * config.rank > 8:
            raise ConfigError(f"jl-dim: the cover of a {config.jl_dim} x {config.rank} ball "
                              "grows like (1/gamma)^(jl-dim * rank); keep jl-dim * rank <= 8")
        super().validate(config)

    def cover(self) -> np.ndarray:
        c = self.config
        return frobenius_cover(c.jl_dim, c.rank, c.cover_radius)

    def embedding(self) -> np.ndarray:
        c = self.config
        return jl_matrix(c.seed, c.jl_dim, c.dim).T @ self.cover()[self.choice]

    def broadcast(self, step: Step) -> dict[str, np.ndarray]:
        return {"embedding": self.embedding()} if step.is_final else {}

    def finalize(self, metric_sums: Mapping[str, float], num_users: int) -> dict[str, float]:
        return {k.removesuffix("_sum"): v / num_users for k, v in metric_sums.items()}

    @classmethod
    def user_step(cls, config: Any, step: Step, arrays: Mapping[str, np.ndarray],
                  user_ids: np.ndarray) -> UserContribution:
        problem = MarginProblem.of(config)
        tasks = margin_tasks(problem, user_ids)
        half = config.samples_per_user // 2
        if step.is_final:
            return UserContribution({}, len(user_ids), 0,
                                    evaluate_margin(config, problem, user_ids, tasks,
                                                    np.asarray(arrays["embedding"])))
        scores = jl_scores(config, tasks.features[:, :half], tasks.labels[:, :half])
        return UserContribution({"scores": scores.sum(axis=1)}, len(user_ids), 0)


def a_exp_scores(config: Any, x0: np.ndarray, y0: np.ndarray,
                 candidates: np.ndarray) -> np.ndarray:
    """Each user's A_Exp score of each candidate, (candidates, users), every entry in
    ``[0, response-clip^2]`` whatever the data (v = 0 is feasible and labels are clipped)."""
    y = np.clip(y0, -config.response_clip, config.response_clip)
    scores = np.zeros((len(candidates), x0.shape[0]))
    chunk = max(1, _CHUNK // max(1, x0.shape[0] * x0.shape[1]))
    for start in range(0, len(candidates), chunk):
        z = np.einsum("nmd,cdk->cnmk", x0, candidates[start:start + chunk])
        shape = z.shape
        z = clip_by_norm(z.reshape(-1, shape[-1]), config.projected_feature_clip)
        _, value = ball_least_squares(z.reshape(shape), y[None], config.local_norm)
        scores[start:start + chunk] = np.minimum(value, config.response_clip**2)
    return scores


def jl_scores(config: Any, x0: np.ndarray, y0: np.ndarray) -> np.ndarray:
    """Each user's margin-loss score of each cover point, (cover points, users), in [0, 1]."""
    cover = frobenius_cover(config.jl_dim, config.rank, config.cover_radius)
    projected = np.einsum("nmd,jd->nmj", x0, jl_matrix(config.seed, config.jl_dim, config.dim))
    scores = np.zeros((len(cover), x0.shape[0]))
    chunk = max(1, _CHUNK // max(1, x0.shape[0] * x0.shape[1] * 8))
    for start in range(0, len(cover), chunk):
        feats = np.einsum("nmj,cjk->cnmk", projected, cover[start:start + chunk])
        _, loss = best_margin_vectors(feats, y0[None], config.margin)
        scores[start:start + chunk] = loss
    return scores


def evaluate_margin(config: Any, problem: MarginProblem, user_ids: np.ndarray,
                    train: MarginTasks, embedding: np.ndarray) -> dict[str, float]:
    """Metric sums: each user's v on its held-back half S1 with the released embedding, scored
    on fresh test points (accuracy and margin loss), against each user alone (L2-regularized
    logistic regression on all its m points, lambda = 1e-2) and the true embedding."""
    half = config.samples_per_user // 2
    x1, y1 = train.features[:, half:], train.labels[:, half:]
    test = margin_tasks(problem, user_ids, test_samples=config.test_samples_per_user)

    def fitted(u: np.ndarray) -> np.ndarray:  # each user's w = U v, v fitted on S1
        v, _ = best_margin_vectors(np.einsum("nmd,dk->nmk", x1, u), y1, 0.0)
        return v @ u.T

    def test_margins(w: np.ndarray) -> np.ndarray:
        return test.labels * np.einsum("nmd,nd->nm", test.features, w)

    margins = test_margins(fitted(embedding))
    true_margins = test_margins(fitted(ground_truth_embedding(problem.embedding_problem())))
    local = ml.fit(train.features, train.labels, np.zeros(config.dim), 1e-2, "logistic", 1e-6)
    local_margins = test_margins(local.models)
    return {
        "test_accuracy_sum": float((margins > 0).mean(axis=1).sum()),
        "test_margin_loss_sum": float((margins <= config.margin).mean(axis=1).sum()),
        "local_only_accuracy_sum": float((local_margins > 0).mean(axis=1).sum()),
        "known_embedding_accuracy_sum": float((true_margins > 0).mean(axis=1).sum()),
    }


@register
class JLExpBest(JLExp):
    name = "jl-exp-nonprivate"
    private = False
    summary = "the JL construction's best-scoring cover point, without privacy (baseline)"
