"""fedpriv inside any Flower app: a private strategy wrapper, a PLD accountant behind Flower's
``PrivacyAccountant`` protocol with calibration to a target epsilon, and personalization for any
ClientApp (docs/tutorials/flower-app.md)."""

from fedpriv_flwr.accountant import PldAccountant, calibrate_noise_multiplier
from fedpriv_flwr.plan import PlanError, PrivatePlan
from fedpriv_flwr.strategy import PrivateStrategy

__all__ = ["PlanError", "PldAccountant", "PrivatePlan", "PrivateStrategy",
           "calibrate_noise_multiplier"]
