"""Synthetic problems; a user's data is a pure function of (seed, user id)."""

from fedpriv.data.synthetic import (
    FEATURE_FAMILIES,
    SyntheticProblem,
    UserData,
    generate_users,
    ground_truth_embedding,
    true_user_models,
)

__all__ = [
    "FEATURE_FAMILIES",
    "SyntheticProblem",
    "UserData",
    "generate_users",
    "ground_truth_embedding",
    "true_user_models",
]
