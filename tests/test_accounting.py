import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize
from scipy.stats import norm

from fedpriv.privacy.accounting import (
    Accountant,
    InfeasiblePlanError,
    PlannedRelease,
    calibrate_gaussian_plan,
    mean_sensitivity,
    plan_epsilon,
)


def analytic_gaussian_epsilon(multipliers, delta):
    """Exact epsilon of composed Gaussian mechanisms (Balle & Wang 2018; Dong, Roth & Su 2019):
    the composition is mu-GDP with mu^2 = sum 1/z^2, and
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    mu = math.sqrt(sum(1.0 / z**2 for z in multipliers))

    def gap(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return optimize.brentq(gap, 0.0, 200.0, xtol=1e-12)


@pytest.mark.parametrize("z,count,delta", [(5.0, 5, 1e-6), (12.0, 6, 1e-6), (1.5, 3, 1e-5),
                                           (30.0, 40, 1e-6)])
def test_reported_epsilon_matches_the_exact_formula_within_one_percent(z, count, delta):
    acc = Accountant("pld", "add-remove", delta)
    for t in range(count):
        reported = acc.record(f"round-{t}", z)
    exact = analytic_gaussian_epsilon([z] * count, delta)
    assert reported == pytest.approx(exact, rel=0.01)
    assert len(acc.ledger) == count and acc.ledger[-1]["epsilon_spent"] == reported


def test_mixed_plan_matches_the_exact_formula_and_rdp_is_looser():
    plan = [PlannedRelease("init", 0.5), PlannedRelease("round", 0.1, 5)]
    z = calibrate_gaussian_plan(plan, 1.0, 1e-6)
    exact = analytic_gaussian_epsilon([z[0]] + [z[1]] * 5, 1e-6)
    assert exact == pytest.approx(1.0, rel=0.01)
    assert plan_epsilon(plan, z, 1e-6, "rdp") > plan_epsilon(plan, z, 1e-6, "pld")
    # weights are shares of 1/z^2
    assert (1 / z[0] ** 2) / (1 / z[1] ** 2) == pytest.approx(5.0)


@settings(max_examples=12, deadline=None)
@given(st.floats(0.2, 10.0), st.sampled_from([1e-5, 1e-6, 1e-8]), st.integers(1, 20),
       st.floats(0.05, 0.95), st.sampled_from(["pld", "rdp"]))
def test_calibration_never_overshoots_the_target(eps, delta, rounds, init_share, kind):
    plan = [PlannedRelease("init", init_share), PlannedRelease("round",
                                                               (1 - init_share) / rounds, rounds)]
    z = calibrate_gaussian_plan(plan, eps, delta, kind)
    spent = plan_epsilon(plan, z, delta, kind)
    assert spent <= eps
    assert spent >= 0.97 * eps  # and does not waste the budget either


def test_infeasible_plans_are_refused():
    with pytest.raises(InfeasiblePlanError):
        calibrate_gaussian_plan([PlannedRelease("x", 1.0)], 1e6, 1e-6)
    with pytest.raises(InfeasiblePlanError):
        calibrate_gaussian_plan([PlannedRelease("x", 1.0)], -1.0, 1e-6)


def test_tiny_and_floor_targets_calibrate_or_are_refused_cleanly():
    z = calibrate_gaussian_plan([PlannedRelease("x", 1.0)], 1e-3, 1e-5)
    assert plan_epsilon([PlannedRelease("x", 1.0)], z, 1e-5) <= 1e-3
    # a sampled plan whose target is met only near the multiplier floor is still calibrated
    plan = [PlannedRelease("r", 1.0, 1, sampling_rate=0.5)]
    z = calibrate_gaussian_plan(plan, 20.0, 1e-5)
    assert 0.05 <= z[0] and plan_epsilon(plan, z, 1e-5) <= 20.0


def test_sensitivity_follows_the_neighbouring_relation():
    assert mean_sensitivity(2.0, 100, "add-remove") == pytest.approx(0.02)
    assert mean_sensitivity(2.0, 100, "replace-one") == pytest.approx(0.04)
    with pytest.raises(ValueError):
        mean_sensitivity(2.0, 100, "swap")


def test_empty_accountant_reports_zero():
    assert Accountant("pld", "add-remove", 1e-6).epsilon() == 0.0
    assert np.isfinite(Accountant("rdp", "replace-one", 1e-6).record("r", 3.0))


def test_replace_one_epsilon_is_the_exact_gaussian_one_at_the_stated_sensitivity():
    """Under replace-one the released mean moves by at most 2 psi / n; a Gaussian with std
    z * (2 psi / n) is then exactly the mechanism of the analytic formula with multiplier z."""
    acc = Accountant("pld", "replace-one", 1e-6)
    for _ in range(4):
        part = {"name": "total", "l2_sensitivity": 2.0, "noise_std": 16.0}
        reported = acc.record("r", 8.0, [part])
    assert reported == pytest.approx(analytic_gaussian_epsilon([8.0] * 4, 1e-6), rel=0.01)


def test_a_release_with_a_fixed_multiplier_keeps_it_and_the_rest_fills_the_target():
    from fedpriv.privacy.accounting import InfeasiblePlanError, PlannedRelease, gdp_mu

    eps, delta = 1.0, 1e-6
    z_fixed = 1.0 / (0.3 * gdp_mu(eps, delta))  # 9% of the target's mu^2
    plan = [PlannedRelease("round", 1.0, 5), PlannedRelease("eval", 1.0, multiplier=z_fixed)]
    zs = calibrate_gaussian_plan(plan, eps, delta)
    assert zs[1] == z_fixed
    # independent check: the whole plan is mu-GDP with mu^2 = 5 / z^2 + 1 / z_fixed^2
    assert analytic_gaussian_epsilon([zs[0]] * 5 + [z_fixed], delta) == pytest.approx(eps,
                                                                                    rel=1e-4)
    sampled = [PlannedRelease("round", 1.0, 20, sampling_rate=0.05),
               PlannedRelease("eval", 1.0, multiplier=z_fixed)]
    zs = calibrate_gaussian_plan(sampled, eps, delta)
    assert zs[1] == z_fixed and plan_epsilon(sampled, zs, delta) <= eps
    with pytest.raises(InfeasiblePlanError, match="fixed noise .*eval.* alone spend"):
        calibrate_gaussian_plan([PlannedRelease("round", 1.0),
                                 PlannedRelease("eval", 1.0, multiplier=0.5)], eps, delta)


def test_a_zcdp_release_of_disjoint_groups_charges_each_group_its_own():
    """Distributed noise with disjoint user groups (priv-altmin): a release of group g's users
    is charged to group g alone, as the Gaussian releases of a central run are."""
    from fedpriv.privacy.accounting import DISCRETE_ACCOUNTANT, Accountant

    by_group = Accountant(DISCRETE_ACCOUNTANT, "add-remove", 1e-5)
    common = Accountant(DISCRETE_ACCOUNTANT, "add-remove", 1e-5)
    one = Accountant(DISCRETE_ACCOUNTANT, "add-remove", 1e-5)
    for g in (0, 1, 0, 1):
        by_group.record_zcdp(f"round-{g}", 0.05, {}, groups=[g])
        common.record_zcdp(f"round-{g}", 0.05, {})
    for _ in range(2):  # what one group's users took part in
        one.record_zcdp("round", 0.05, {})
    assert by_group.epsilon() == pytest.approx(one.epsilon(), rel=1e-12)
    assert by_group.epsilon() < common.epsilon()
    assert [e["user_group"] for e in by_group.ledger] == [0, 1, 0, 1]
