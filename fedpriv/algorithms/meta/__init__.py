"""Task-level DP meta-learning (Zhou & Bassily 2022): Meta-NSGD, DP-FTMRL and private
clustering-based meta-learning, their non-private versions and local training.

Users are tasks: each holds ``samples-per-user`` points of its own distribution (see
``fedpriv.data.meta``). The server learns meta-model(s) ``h``; a task then fits its own model
with the base learner regularized towards ``h`` (``fedpriv.algorithms.meta.meta_math``). The
neighbouring relation is task-level: one task's whole dataset added/removed (``add-remove``) or
replaced (``replace-one``, the paper's).

* ``meta-nsgd`` (Algorithm 1): each round a Poisson sample of the tasks (each independently with
  rate ``q = m / K``, ``m = tasks-per-round``; the sample is drawn by the server's seed and never
  released) sends the meta-gradient ``-lambda (w^_h(Z) - h)`` clipped to ``clip-norm``; the server
  divides the sum by the expected batch size ``m`` (public), adds Gaussian noise, steps with
  ``learning-rate``, projects onto the ball of radius ``meta-radius`` and outputs the average of
  the iterates ``h_1..h_T``. Accounting: ``T`` Poisson-subsampled Gaussian mechanisms
  (dp-accounting's ``PoissonSampledDpEvent``), the noise multiplier calibrated to the target.
  (The paper's Theorem 3 states the noise for sampling with its m; we account the sampling we
  actually do, exactly, with the PLD accountant.)
* ``private-meta-cluster`` (Algorithm 2): ``q = meta-models`` meta-models; a sampled task fits
  against each, keeps the one with the lowest regularized loss ``C(Z)`` and sends a (q, d) array
  that holds its clipped meta-gradient in row ``C(Z)`` and zeros elsewhere. One task changes one
  row by at most ``clip-norm``, so the (q, d) release has the same sensitivity as Algorithm 1 and
  the same accounting (Theorem 6); every row gets its own independent noise. Outputs the last
  iterates. The q models start at seeded random points of norm ``meta-init-scale``.
* ``dp-ftmrl``: one pass. A seeded permutation cuts the K tasks into T = ``rounds`` disjoint
  batches of ``floor(K/T)`` or ``ceil(K/T)`` tasks; round t visits batch t only. The server keeps
  the running sum ``S_t`` of the batch-mean meta-gradients private with the binary tree mechanism
  (DP-FTRL, Kairouz et al. 2021): round t releases one new dyadic node (noise ``N(0, sigma^2)``)
  and the noisy prefix sum is the sum of ``popcount(t)`` nodes. FTRL update:
  ``h_{t+1} = argmin_{||h|| <= R} <S~_t, h> + ||h - h_0||^2 / (2 eta) = Proj(h_0 - eta S~_t)``;
  output the average of the iterates. A task's batch is in at most ``L = floor(log2 T) + 1``
  released nodes, so each task is charged L Gaussian mechanisms of multiplier ``z`` (the ledger
  charges every node to the batches it covers); the plan calibrates ``z`` for L releases.
* ``meta-sgd``, ``meta-cluster``, ``ftmrl``: the same without noise (``clipping = false`` removes
  clipping too). ``meta-local``: each fresh task fits alone (bias ``h = 0``, same lambda).
  ``meta-oracle``: a reference, the base learner biased towards the true cluster center(s).

Evaluation (every algorithm, the final step): one fresh task per task id, drawn from the same
task distribution with its own ``samples-per-user`` training points, fits its model from the
released meta-model(s) (choosing among q by regularized loss) and is scored on
``test-samples-per-user`` fresh test points: ``transfer_risk`` is the mean test loss. Reported
with it: ``local_risk`` (the same fresh task with ``h = 0``), ``population_transfer_risk`` (the
exact risk, squared loss), ``transfer_error`` (0-1 error, logistic loss) and ``cluster_purity``
(q > 1 or clustered tasks: fraction of fresh tasks whose chosen model is the one most of their
true cluster chose).

Files: ``meta_math`` (batched math: base learner, meta-gradients, tree nodes), ``problem`` (the
task distribution and the evaluation), ``schedule`` (the server side of any meta-model: the
sampled rounds and the one pass, shared with ``fedpriv.algorithms.fewshot``),
``meta_algorithm`` (the linear family's base class); registered
algorithms in ``meta_nsgd`` (meta-nsgd, meta-sgd, private-meta-cluster, meta-cluster),
``dp_ftmrl`` (dp-ftmrl, ftmrl) and ``references`` (meta-local, meta-oracle); their run-config
keys in ``params``.
"""
