"""Model personalization with a shared embedding (Jain et al. 2021; Snedeker, Zhou & Bassily
2025): users share U (d x k, orthonormal columns), learned privately; each keeps its own v_i.

Batched math over users (``*_math.py``): ``linear_math`` (least squares, QR, subspace
distance), ``init_math`` (U-statistic and pair initializations), ``fedrep_math`` (disjoint-batch
gradients), ``altmin_math`` (sufficient statistics). The problem and its metrics: ``problem``.
Registered algorithms: ``private_fedrep`` (private-fedrep, fedrep), ``priv_altmin``
(priv-altmin, altmin), ``baselines`` (local-only, known-embedding, dp-global-model), on the
shared skeleton in ``embedding``. Their run-config keys: ``params``.
"""
