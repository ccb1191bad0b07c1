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

Files: ``exp_mech_math`` (batched math: local problems, candidate sets, scores),
``mechanism`` (the shared base class), ``a_exp`` (a-exp, a-exp-nonprivate), ``jl_exp`` (jl-exp,
jl-exp-nonprivate); their run-config keys, as typed component classes, in ``params``.
"""
