"""The empirical privacy audit: valid against the accountant, and with power."""

import pytest

from fedpriv.audit import clopper_pearson_upper, epsilon_lower_bound, run_audit
from fedpriv.cli import main
from tests.conftest import small_config


def test_the_audit_lower_bound_stays_below_the_accountant():
    result = run_audit(small_config(), trials=20000)
    assert result.release == "init"
    assert 0 < result.epsilon_lower_bound < result.accountant_epsilon
    assert not result.violation


def test_the_audit_detects_a_release_with_its_noise_cut():
    result = run_audit(small_config(), trials=20000, noise_scale=0.1)
    assert result.epsilon_lower_bound > result.accountant_epsilon
    assert result.violation


def test_a_meta_learning_round_is_audited_too():
    config = small_config(algorithm="meta-nsgd", dim=20, feature_dist="unit-ball",
                          num_users=400, epsilon=2.0)
    result = run_audit(config, trials=5000)
    assert result.release == "round-1" and not result.violation


def test_the_statistics():
    # Clopper-Pearson: 0 errors out of n gives 1 - alpha^(1/n)
    assert clopper_pearson_upper(0, 100, 0.05) == pytest.approx(1 - 0.05 ** (1 / 100))
    assert clopper_pearson_upper(100, 100, 0.05) == 1.0
    assert epsilon_lower_bound(0.5, 0.5, 0.0) == 0.0
    assert epsilon_lower_bound(0.01, 0.5, 0.0) == pytest.approx(3.912, abs=1e-3)


def test_fedpriv_audit_command(capsys):
    assert main(["audit", "--set", "num-users=600", "--set", "dim=10", "--set", "epsilon=4",
                 "--trials", "2000"]) == 0
    assert "empirical epsilon >=" in capsys.readouterr().out
    assert main(["audit", "--set", "num-users=600", "--set", "dim=10", "--set", "epsilon=4",
                 "--trials", "2000", "--noise-scale", "0.05"]) == 1
    capsys.readouterr()
    assert main(["audit", "--trials", "5"]) == 2
    assert "--trials: 5; at least 100" in capsys.readouterr().err
    assert main(["audit", "--alpha", "1.5"]) == 2
    assert "--alpha: 1.5; in (0, 1)" in capsys.readouterr().err
