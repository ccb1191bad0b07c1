"""PldAccountant (Flower's PrivacyAccountant protocol on fedpriv's PLD accounting) and
calibrate_noise_multiplier (fedpriv_flwr.accountant).

Checked against Flower's own RdpAccountant (PLD is never looser), an independent closed-form
Gaussian-DP computation (unsampled plans), fedpriv's plan epsilon, and Flower's
DifferentialPrivacyServerSideFixedClipping driven for a few rounds on an in-memory grid."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyAccountant,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant
from scipy.stats import norm

from fedpriv.privacy.accounting import epsilon_of
from fedpriv_flwr.accountant import PldAccountant, calibrate_noise_multiplier
from tests.flower_grid import FakeGrid

DELTA = 1e-5
POP = 2000


def config(sampling: SamplingMethod = SamplingMethod.NO_AMPLIFICATION,
           max_epsilon: float | None = None, population: int = POP,
           delta: float = DELTA) -> PrivacyConfig:
    relation = (NeighboringRelation.REPLACE_ONE if sampling is SamplingMethod.WITHOUT_REPLACEMENT
                else NeighboringRelation.ADD_OR_REMOVE_ONE)
    return PrivacyConfig(target_delta=delta, population_size=population,
                         neighboring_relation=relation, sampling_method=sampling,
                         max_epsilon=max_epsilon)


def event(z: float, sample: int = POP, population: int = POP) -> GaussianPrivacyEvent:
    return GaussianPrivacyEvent(noise_multiplier=z, sample_size=sample,
                                population_size=population)


def both(sampling: SamplingMethod, ledger: list[tuple[GaussianPrivacyEvent, int]]
         ) -> tuple[PldAccountant, RdpAccountant]:
    pld, rdp = PldAccountant(config(sampling)), RdpAccountant(config(sampling))
    for ev, n in ledger:
        pld.compose(ev, n)
        rdp.compose(ev, n)
    return pld, rdp


# --- closed form, independent of fedpriv: composed Gaussians are exactly mu-GDP -------------

def gdp_delta(mu: float, eps: float) -> float:
    """Dong, Roth & Su: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    return float(norm.cdf(-eps / mu + mu / 2)
                 - math.exp(eps + norm.logcdf(-eps / mu - mu / 2)))


def gdp_epsilon(mu: float, delta: float) -> float:
    lo, hi = 0.0, 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2.0
    for _ in range(200):  # delta(eps) decreases in eps: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gdp_delta(mu, mid) > delta else (lo, mid)
    return hi


# --- numbers -------------------------------------------------------------------------------

@pytest.mark.parametrize("ledger", [
    [(2.0, 1)], [(3.0, 4)], [(5.0, 10)], [(10.0, 50)], [(4.0, 3), (8.0, 2)],
])
def test_unsampled_pld_is_never_above_rdp_and_matches_closed_form_gdp(ledger):
    pld, rdp = both(SamplingMethod.NO_AMPLIFICATION, [(event(z), n) for z, n in ledger])
    eps = pld.get_epsilon(DELTA)
    assert eps <= rdp.get_epsilon(DELTA)
    mu = math.sqrt(sum(n / z**2 for z, n in ledger))
    exact = gdp_epsilon(mu, DELTA)
    assert eps == pytest.approx(exact, rel=1e-5)
    assert eps >= exact * (1 - 1e-6)  # PLD's pessimistic estimate: an upper bound
    assert pld.num_releases == sum(n for _, n in ledger)
    # delta at that epsilon, the other way round
    assert pld.get_delta(exact) == pytest.approx(gdp_delta(mu, exact), rel=1e-5)


@pytest.mark.parametrize("ledger", [
    [(1.0, 20, 10)], [(2.0, 100, 20)], [(0.8, 200, 5)], [(1.5, 400, 3)],
    [(1.0, 20, 5), (2.0, 200, 5)],
])
def test_poisson_sampled_pld_is_never_above_rdp(ledger):
    pld, rdp = both(SamplingMethod.POISSON, [(event(z, sample), n) for z, sample, n in ledger])
    eps = pld.get_epsilon(DELTA)
    assert 0 < eps <= rdp.get_epsilon(DELTA)
    # exactly fedpriv's own accounting of the same Poisson-sampled plan
    counts: dict[tuple[float, float], int] = {}
    for z, sample, n in ledger:
        counts[(z, sample / POP)] = counts.get((z, sample / POP), 0) + n
    assert eps == epsilon_of(counts, DELTA)
    # sampling amplifies: the same multipliers unsampled spend more
    unsampled = PldAccountant(config())
    for z, _, n in ledger:
        unsampled.compose(event(z), n)
    assert eps < unsampled.get_epsilon(DELTA)
    assert pld.get_delta(eps) <= DELTA * 1.01


def test_privacy_spent_and_empty_accountant():
    acc = PldAccountant(config())
    assert acc.get_epsilon(DELTA) == 0.0 and acc.get_delta(1.0) == 0.0
    acc.compose(event(5.0), 3)
    spent = acc.get_privacy_spent()
    assert spent.accounting_method == "pld" and spent.delta == DELTA
    assert spent.num_releases == 3 and spent.epsilon == acc.get_epsilon(DELTA)
    assert acc.get_privacy_spent(1e-3).epsilon < spent.epsilon
    with pytest.raises(ValueError, match="population_size"):
        acc.compose(event(5.0, 10, 100))
    with pytest.raises(ValueError, match="count"):
        acc.compose(event(5.0), 0)
    with pytest.raises(ValueError, match="delta"):
        acc.get_epsilon(1.5)
    with pytest.raises(ValueError, match="epsilon"):
        acc.get_delta(-1.0)


# --- calibration ---------------------------------------------------------------------------

def test_calibrated_multiplier_spends_the_target_unsampled():
    z = calibrate_noise_multiplier(1.0, DELTA, 5)
    acc = PldAccountant(config())
    acc.compose(event(z), 5)
    eps = acc.get_epsilon(DELTA)
    assert 0.99 <= eps <= 1.0
    assert eps == epsilon_of({(z, 1.0): 5}, DELTA)
    # a hair less noise overshoots: the multiplier is the smallest that meets the target
    tighter = PldAccountant(config())
    tighter.compose(event(z * 0.99), 5)
    assert tighter.get_epsilon(DELTA) > 1.0


def test_calibrated_multiplier_spends_the_target_poisson_sampled():
    rate, rounds = 0.1, 4
    z = calibrate_noise_multiplier(1.0, DELTA, rounds, sampling_rate=rate)
    acc = PldAccountant(config(SamplingMethod.POISSON))
    for _ in range(rounds):
        acc.compose(event(z, sample=int(rate * POP)))
    eps = acc.get_epsilon(DELTA)
    assert 0.99 <= eps <= 1.0
    assert z < calibrate_noise_multiplier(1.0, DELTA, rounds)  # amplification: less noise


@pytest.mark.parametrize("kwargs, name", [
    ({"epsilon": 0.0}, "epsilon"), ({"epsilon": -1.0}, "epsilon"),
    ({"epsilon": math.inf}, "epsilon"), ({"delta": 0.0}, "delta"), ({"delta": 1.0}, "delta"),
    ({"rounds": 0}, "rounds"), ({"rounds": 2.5}, "rounds"), ({"sampling_rate": 0.0},
                                                             "sampling_rate"),
    ({"sampling_rate": 1.5}, "sampling_rate"), ({"relation": "swap"}, "relation"),
])
def test_bad_calibration_inputs_name_the_argument(kwargs, name):
    args = {"epsilon": 1.0, "delta": DELTA, "rounds": 5, **kwargs}
    with pytest.raises(ValueError, match=rf"^{name} "):
        calibrate_noise_multiplier(**args)


def test_unreachable_calibration_target_says_what_to_change():
    with pytest.raises(ValueError, match="epsilon=10000.0.*rounds=1.*lower epsilon"):
        calibrate_noise_multiplier(1e4, DELTA, 1)


# --- Flower's protocol: prospective checks, state, refusals ---------------------------------

def test_would_exceed_does_not_mutate():
    acc = PldAccountant(config(max_epsilon=1.0))
    acc.compose(event(8.0), 3)
    before = (acc.num_releases, acc.get_epsilon(DELTA), acc.state_dict())
    assert acc.would_exceed(event(8.0), count=100)  # the configured limit
    assert not acc.would_exceed(event(8.0), count=1)
    assert not acc.would_exceed(event(8.0), max_epsilon=100.0, count=100)
    assert (acc.num_releases, acc.get_epsilon(DELTA), acc.state_dict()) == before
    with pytest.raises(ValueError, match="max_epsilon"):
        PldAccountant(config()).would_exceed(event(8.0))


def test_state_dict_round_trips_through_json():
    acc = PldAccountant(config(SamplingMethod.POISSON, max_epsilon=3.0))
    acc.compose(event(1.2, sample=100), 3)
    acc.compose(event(2.0, sample=400))
    state = json.loads(json.dumps(acc.state_dict()))
    restored = PldAccountant(config(SamplingMethod.POISSON, max_epsilon=3.0))
    restored.load_state_dict(state)
    assert restored.num_releases == acc.num_releases == 4
    assert restored.get_epsilon(DELTA) == acc.get_epsilon(DELTA) > 0
    assert restored.state_dict() == acc.state_dict()


def test_load_state_dict_refuses_other_backend_and_mismatched_config():
    acc = PldAccountant(config())
    acc.compose(event(5.0), 2)
    state = acc.state_dict()
    rdp = RdpAccountant(config())
    rdp.compose(event(5.0), 2)
    target = PldAccountant(config())
    with pytest.raises(ValueError, match="different backend"):
        target.load_state_dict(rdp.state_dict())
    with pytest.raises(ValueError, match="configuration does not match"):
        PldAccountant(config(population=POP + 1)).load_state_dict(state)
    with pytest.raises(ValueError, match="configuration does not match"):
        PldAccountant(config(max_epsilon=2.0)).load_state_dict(state)
    with pytest.raises(ValueError, match="schema version"):
        target.load_state_dict({**state, "schema_version": 99})
    with pytest.raises(ValueError, match="Invalid composition"):
        target.load_state_dict({**state, "compositions": [{"event": {}, "count": 1}]})
    assert target.num_releases == 0  # nothing restored by a refused state
    # and Flower's RdpAccountant refuses a PLD ledger the same way
    with pytest.raises(ValueError, match="different backend"):
        RdpAccountant(config()).load_state_dict(state)


def test_sampling_without_replacement_is_refused_clearly():
    with pytest.raises(ValueError, match="without-replacement") as err:
        PldAccountant(config(SamplingMethod.WITHOUT_REPLACEMENT))
    assert "POISSON" in str(err.value) and "RdpAccountant" in str(err.value)


# --- inside Flower's own DP strategy --------------------------------------------------------

def _run_flower_dp(accountant: PrivacyAccountant, z: float, rounds: int, nodes: int = 4
                   ) -> DifferentialPrivacyServerSideFixedClipping:
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes),
        noise_multiplier=z, clipping_norm=1.0, num_sampled_clients=nodes,
        accountant=accountant)
    grid = FakeGrid(nodes, lambda node, arrays: {k: v + 0.01 * node for k, v in arrays.items()})
    strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(3))}),
                   num_rounds=rounds)
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(trains) == rounds * nodes  # every round really trained
    return strategy


def test_flower_dp_strategy_with_pld_accountant_spends_fedpriv_plan_epsilon():
    rounds = 5
    z = calibrate_noise_multiplier(1.0, DELTA, rounds)
    pld = PldAccountant(config(max_epsilon=1.0))
    strategy = _run_flower_dp(pld, z, rounds)
    spent = strategy.privacy_spent()
    assert spent is not None
    assert spent.num_releases == rounds and spent.accounting_method == "pld"
    assert spent.epsilon == epsilon_of({(z, 1.0): rounds}, DELTA) <= 1.0
    assert spent.epsilon >= 0.99
    # Flower's RDP accountant on the same run reports more (about 1.09 here)
    rdp = RdpAccountant(config())
    _run_flower_dp(rdp, z, rounds)
    assert rdp.get_epsilon(DELTA) > 1.05 * spent.epsilon
    # ...and with max_epsilon = 1 it refuses the very run PLD admits
    with pytest.raises(PrivacyBudgetExhausted):
        _run_flower_dp(RdpAccountant(config(max_epsilon=1.0)), z, rounds)


def test_flower_dp_strategy_stops_at_the_pld_budget():
    z = calibrate_noise_multiplier(1.0, DELTA, 3)
    pld = PldAccountant(config(max_epsilon=1.0))
    with pytest.raises(PrivacyBudgetExhausted):
        _run_flower_dp(pld, z, 4)  # the 4th release would exceed epsilon = 1
    assert pld.num_releases == 3 and pld.get_epsilon(DELTA) <= 1.0


@pytest.mark.parametrize("sampling, sample", [(SamplingMethod.NO_AMPLIFICATION, POP),
                                              (SamplingMethod.POISSON, POP // 10)])
def test_a_noise_multiplier_near_zero_is_accounted_in_closed_form_not_with_gigabytes(
        sampling, sample):
    """A debug run with the noise nearly off (z = 1e-3 asked dp-accounting for a PLD grid of
    about 76 GiB): epsilon is the unsampled composition's exact mu-GDP value (an upper bound
    when sampled), inf where it is beyond any use, and said to be GDP."""
    tiny = PldAccountant(config(sampling))
    tiny.compose(event(1e-3, sample), count=5)
    spent = tiny.get_privacy_spent()
    assert spent.epsilon == math.inf and spent.accounting_method == "gdp"
    near = PldAccountant(config(sampling))
    near.compose(event(0.04, sample), count=5)
    mu = math.sqrt(5) / 0.04
    eps = near.get_epsilon(DELTA)
    assert math.isfinite(eps) and gdp_delta(mu, eps) == pytest.approx(DELTA, rel=1e-4)
    assert near.get_delta(eps) == pytest.approx(DELTA, rel=1e-4)
    assert near.would_exceed(event(0.04, sample), max_epsilon=eps * 1.01)
