import numpy as np
import pytest

from fedpriv.config import RunConfig


def small_config(**overrides) -> RunConfig:
    """A small, fast Private FedRep config; keyword names use underscores."""
    values = {"num-users": 600, "dim": 10, "rank": 2, "samples-per-user": 10,
              "epsilon": 4.0, "rounds": 4, "test-samples-per-user": 5}
    values.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return RunConfig.from_mapping(values)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
