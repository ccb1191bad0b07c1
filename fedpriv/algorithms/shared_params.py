"""Run-config keys that several algorithm families read, declared once so that each has one
default and one meaning wherever it is used (see ``fedpriv.params``). A family's own keys live
in its folder (``personalization/params.py``, ``meta/params.py``, ``exp_mech/params.py``)."""

from __future__ import annotations

from fedpriv.data.synthetic import FEATURE_FAMILIES
from fedpriv.params import Param, non_negative, one_of, positive

# ----- the users' data (every synthetic problem) ------------------------------------------------
DIM = Param("dim", int, 20, "feature dimension d", positive, "an integer >= 1")
RANK = Param("rank", int, 2, "embedding rank k", positive, "an integer in [1, dim]")
SAMPLES_PER_USER = Param("samples-per-user", int, 10, "samples per user m (the first half S0 "
                         "trains, the held-back half S1 fits the final local model)",
                         lambda x: x >= 4, "an integer >= 4 (two disjoint batches from the "
                         "first half)")
LABEL_NOISE = Param("label-noise", float, 0.01, "label noise std R (Gaussian)", non_negative,
                    "a number >= 0")
FEATURE_DIST = Param("feature-dist", str, "auto", "feature family: `gaussian`, `rademacher`, "
                     "`uniform` (identity covariance) or `mixed` (each user one of them) for "
                     "personalization; `unit-ball` (uniform in the unit ball) for meta-learning "
                     "and jl-exp; `auto` = the algorithm's own",
                     *one_of(("auto", *FEATURE_FAMILIES, "unit-ball")))
TEST_SAMPLES = Param("test-samples-per-user", int, 10, "fresh test points per user for "
                     "`test_mse` (meta-learning: per fresh task, for `transfer_risk`)",
                     lambda x: x >= 1, "an integer >= 1")
VALIDATION_SAMPLES = Param("validation-samples-per-user", int, 10, "held-back validation points "
                           "per user, never trained on (synthetic data: a stream of their own; "
                           "real data: rows held back from the user's training rows, only "
                           "with `metrics-split = \"validation\"`, fewer for a user with fewer "
                           "than this plus 2 rows): what that split evaluates, "
                           "and `fedpriv tune` scores candidates on", lambda x: x >= 1,
                           "an integer >= 1")

# ----- gradient rounds --------------------------------------------------------------------------
LEARNING_RATE = Param("learning-rate", float, 0.0, "server step size eta; `0` = the "
                      "algorithm's own default", non_negative, "a number > 0 (0: the "
                      "algorithm's default)", fallback=1.0)
CLIP_NORM = Param("clip-norm", float, 0.5, "psi: per-user L2 (Frobenius) clip of the gradient",
                  positive, "a number > 0")
CLIPPING = Param("clipping", bool, True, "clip per-user contributions; `false` only for the "
                 "non-private baselines (private algorithms refuse it)")
RESPONSE_CLIP = Param("response-clip", float, 2.0, "zeta: clip of labels (Priv-AltMin, the "
                      "`pairs` init, a-exp's score bound B_y)", positive, "a number > 0")

# ----- each user's final choice (deep and linear personalization) -----------------------------
# the weights of the shared model in a user's mix with its local model, the first winning ties
# (the larger weight: the model with more data behind it)
MIX_WEIGHTS = (1.0, 0.75, 0.5, 0.25, 0.0)
FINAL_CHOICE = Param(
    "final-choice", str, "best", "each user's final model: `best` = of its local model "
    "(trained on its own rows alone), the method's personal model and mixes of the two, the "
    "one its own training rows favour by cross-validation (a post-processing on the user's "
    "node: no privacy cost, the release does not change; docs: never worse than training "
    "alone); `off` = the method's personal model for every user",
    *one_of(("best", "off")))
CHOICE_FOLDS = Param(
    "choice-folds", int, 5, "final-choice = best: k of the k-fold cross-validation on each "
    "user's training rows (row j in fold j mod k; k + 1 fits of each model)",
    lambda k: k >= 2, "an integer >= 2")
CHOICE_STD_ERRORS = Param(
    "choice-std-errors", float, 0.5, "final-choice = best (deep family): a user keeps the "
    "largest weight of the shared model whose cross-validated loss is within this many "
    "standard errors of the least one (paired over its rows; 0 = the least loss itself; "
    "above 0, a user with one row keeps the shared model)",
    lambda z: 0 <= z < float("inf"), "a finite number >= 0")
