"""Batched math of the exponential-mechanism constructions: the users' local problems (ball-
constrained least squares, the best margin vector), the data-independent candidate sets (Haar
embeddings, the JL matrix and the grid cover), and every user's score of every candidate.

A user's score lies in ``[0, B]`` whatever its data (``B = response-clip^2`` for A_Exp, 1 for the
JL margin loss); that bound is the exponential mechanism's sensitivity times n.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from fedpriv.algorithms.exp_mech.params import AExpKeys, JLExpConfig
from fedpriv.privacy.mechanisms import clip_by_norm

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

    def coords(mu: np.ndarray) -> np.ndarray:
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
    haar: np.ndarray = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
    return haar


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
    kept: np.ndarray = grid[(grid**2).sum(axis=1) <= limit] * spacing
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


def a_exp_scores(config: AExpKeys, x0: np.ndarray, y0: np.ndarray,
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


def jl_scores(config: JLExpConfig, x0: np.ndarray, y0: np.ndarray) -> np.ndarray:
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
