"""The math of meta-learning with a biased regularizer (Zhou & Bassily 2022, Sections 3-5).

Base learner: a task with data ``Z = (X, y)`` (m points) and a bias ``h`` solves

    w_h(Z) = argmin_w  F(w) = R_Z(w) + lambda/2 ||w - h||^2

over ``w in R^d`` (unconstrained: the paper's parameter set W constrains the meta-model ``h``,
which the server projects onto a ball). ``R_Z`` is the mean loss over the task's points:

* squared: ``(<w, x> - y)^2`` -- F is quadratic and solved in closed form;
* logistic: ``log(1 + exp(-y <w, x>))`` -- solved by damped Newton.

Stated accuracy: the solver stops when ``||grad F(w^)|| <= b`` (``base-accuracy``). F is
lambda-strongly convex, so ``||w^ - w_h(Z)|| <= ||grad F(w^)|| / lambda <= b / lambda``: exactly
the paper's requirement, certified per task rather than assumed. (Privacy never depends on it:
the meta-gradient is clipped.)

Meta loss ``L_Z(h) = min_w F(w)`` is the Moreau envelope of ``R_Z``; its gradient is
``grad L_Z(h) = -lambda (w_h(Z) - h)`` (Proposition 2), which each task sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MAX_NEWTON = 100


@dataclass(frozen=True)
class Fit:
    models: np.ndarray  # (n, d) w^
    grad_norms: np.ndarray  # (n,) ||grad F(w^)||: the accuracy certificate (times 1/lambda)
    objective: np.ndarray  # (n,) F(w^) = the (approximate) meta loss L_Z(h)

    def converged(self, accuracy: float) -> np.ndarray:
        return self.grad_norms <= accuracy


def task_losses(x: np.ndarray, y: np.ndarray, w: np.ndarray, loss: str) -> np.ndarray:
    """Mean loss of each task's ``w`` (n, d) on its points (n, m, d), (n, m) -> (n,)."""
    margin = np.einsum("nmd,nd->nm", x, w)
    if loss == "squared":
        squared: np.ndarray = ((margin - y) ** 2).mean(axis=1)
        return squared
    logistic: np.ndarray = np.logaddexp(0.0, -y * margin).mean(axis=1)
    return logistic


def task_errors(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """0-1 error of the sign classifier (logistic tasks), (n,)."""
    errors: np.ndarray = (np.sign(np.einsum("nmd,nd->nm", x, w)) != y).mean(axis=1)
    return errors


def _gradient(x: np.ndarray, y: np.ndarray, w: np.ndarray, h: np.ndarray, lam: float,
              loss: str) -> np.ndarray:
    m = x.shape[1]
    margin = np.einsum("nmd,nd->nm", x, w)
    if loss == "squared":
        coef = 2.0 * (margin - y) / m
    else:
        coef = -y * _sigmoid(-y * margin) / m
    gradient: np.ndarray = np.einsum("nmd,nm->nd", x, coef) + lam * (w - h)
    return gradient


def _sigmoid(t: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * t))  # stable for any t


def objective(x: np.ndarray, y: np.ndarray, w: np.ndarray, h: np.ndarray, lam: float,
              loss: str) -> np.ndarray:
    value: np.ndarray = task_losses(x, y, w, loss) + 0.5 * lam * ((w - h) ** 2).sum(axis=1)
    return value


def fit(x: np.ndarray, y: np.ndarray, h: np.ndarray, lam: float, loss: str,
        accuracy: float) -> Fit:
    """``w_h(Z)`` for a batch of tasks; ``h`` is (d,) or one bias per task (n, d)."""
    n, m, d = x.shape
    hb = np.broadcast_to(np.asarray(h, dtype=np.float64), (n, d))
    if n == 0:
        return Fit(np.zeros((0, d)), np.zeros(0), np.zeros(0))
    if loss == "squared":
        a = (2.0 / m) * np.einsum("nmd,nme->nde", x, x) + lam * np.eye(d)
        b = (2.0 / m) * np.einsum("nmd,nm->nd", x, y) + lam * hb
        w = np.linalg.solve(a, b[..., None])[..., 0]
    else:
        w = hb.copy()
        f = objective(x, y, w, hb, lam, loss)
        for _ in range(_MAX_NEWTON):
            g = _gradient(x, y, w, hb, lam, loss)
            active = np.linalg.norm(g, axis=1) > accuracy
            if not active.any():
                break
            p = _sigmoid(np.einsum("nmd,nd->nm", x, w))
            hess = np.einsum("nmd,nm,nme->nde", x, p * (1 - p) / m, x) + lam * np.eye(d)
            step = np.linalg.solve(hess, g[..., None])[..., 0]
            step[~active] = 0.0
            t = np.ones(n)
            slope = -(g * step).sum(axis=1)
            for _ in range(40):  # backtracking (Armijo) per task
                trial = w - t[:, None] * step
                ft = objective(x, y, trial, hb, lam, loss)
                bad = ft > f + 1e-4 * t * slope
                if not bad.any():
                    break
                t = np.where(bad, 0.5 * t, t)
            w, f = trial, ft
    grad = _gradient(x, y, w, hb, lam, loss)
    return Fit(w, np.linalg.norm(grad, axis=1), objective(x, y, w, hb, lam, loss))


def meta_gradients(fitted: Fit, h: np.ndarray, lam: float) -> np.ndarray:
    """``-lambda (w^_h(Z) - h)`` per task, (n, d)."""
    gradients: np.ndarray = lam * (np.asarray(h) - fitted.models)
    return gradients


def select_and_fit(x: np.ndarray, y: np.ndarray, models: np.ndarray, lam: float, loss: str,
                   accuracy: float) -> tuple[np.ndarray, Fit]:
    """Algorithm 2, lines 5-6: fit against each of the q meta-models and keep the one with the
    lowest regularized loss. Returns (choice (n,), the chosen fits with their own h)."""
    fits = [fit(x, y, h, lam, loss, accuracy) for h in models]
    choice = np.argmin(np.stack([f.objective for f in fits]), axis=0)
    rows = np.arange(x.shape[0])
    chosen = Fit(np.stack([f.models for f in fits])[choice, rows],
                 np.stack([f.grad_norms for f in fits])[choice, rows],
                 np.stack([f.objective for f in fits])[choice, rows])
    return choice, chosen


def project_to_ball(h: np.ndarray, radius: float) -> np.ndarray:
    """Euclidean projection of each row of ``h`` onto the ball of the given radius."""
    h = np.atleast_2d(np.asarray(h, dtype=np.float64))
    norms = np.linalg.norm(h, axis=1, keepdims=True)
    projected: np.ndarray = h * np.minimum(1.0, radius / np.maximum(norms, 1e-300))
    return projected


# ----- tree aggregation (DP-FTRL, Kairouz et al. 2021) -------------------------------------
def new_tree_node(t: int) -> tuple[int, int]:
    """The dyadic node ``(level, k)`` covering rounds ``[k 2^l + 1, (k + 1) 2^l]`` that the
    binary mechanism releases at round ``t >= 1`` (the last node of the decomposition of
    ``[1, t]``; every other node of it was released earlier)."""
    level = (t & -t).bit_length() - 1
    return level, (t >> level) - 1


def prefix_nodes(t: int) -> list[tuple[int, int]]:
    """The dyadic decomposition of ``[1, t]`` (one node per set bit of t)."""
    nodes, start = [], 0
    for level in range(t.bit_length() - 1, -1, -1):
        if t >> level & 1:
            nodes.append((level, start >> level))
            start += 1 << level
    return nodes


def node_rounds(node: tuple[int, int]) -> range:
    level, k = node
    return range(k * (1 << level) + 1, (k + 1) * (1 << level) + 1)


def max_nodes_per_round(rounds: int) -> int:
    """How many released nodes contain one round's leaf, at most: ``floor(log2 T) + 1``."""
    return rounds.bit_length()
