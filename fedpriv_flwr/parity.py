"""What Flower's DP wrappers (``DifferentialPrivacyServerSideFixedClipping`` and kin) let a user
read, on ``PrivateStrategy``: ``privacy_spent()`` (Flower's ``PrivacySpent``), and the
``noise_multiplier`` and ``clipping_norm`` attributes. The epsilon is fedpriv's accountant's:
PLD accounting of every release so far (RDP with discrete noise), at the plan's delta."""

from __future__ import annotations

from logging import INFO
from typing import TYPE_CHECKING, Any

from flwr.common import log
from flwr.serverapp import PrivacySpent

from fedpriv_flwr.plan import ROUND

if TYPE_CHECKING:
    from fedpriv.privacy.accounting import Accountant
    from fedpriv_flwr.plan import PrivatePlan


class FlowerDPView:
    """The attributes of Flower's DP wrappers, read from a ``PrivateStrategy``'s plan, clip and
    accountant."""

    clip: float
    secure_noise: bool
    accountant: Accountant
    strategy: Any
    _plan: PrivatePlan | None
    _plan_args: dict[str, Any]

    @property
    def plan(self) -> PrivatePlan:
        """The private plan (made at construction, or by ``start(num_rounds=...)``)."""
        if self._plan is None:
            raise RuntimeError("PrivateStrategy: no num_rounds yet: the private plan is made "
                               "when start(num_rounds=...) is called, or give num_rounds to "
                               "PrivateStrategy")
        return self._plan

    def privacy_spent(self) -> PrivacySpent:
        """The privacy spent so far, as Flower's DP wrappers report it: the epsilon of every
        release so far at the plan's delta, by fedpriv's accountant."""
        method = ("rdp (fedpriv, discrete Gaussian)" if self.secure_noise
                  else "pld (fedpriv, dp-accounting)")
        return PrivacySpent(epsilon=float(self.accountant.epsilon()), delta=self.accountant.delta,
                            num_releases=len(self.accountant.ledger), accounting_method=method)

    @property
    def noise_multiplier(self) -> float:
        """The noise multiplier of each round's release (calibrated to the target): the noise
        std over the round's L2 sensitivity as a whole. With adaptive clipping the round's
        budget is split between the update and the clip count (each part's own multiplier is
        in the ledger); with ``user_sensitivity_factor=2`` the sensitivity is ``2 C``."""
        if self._plan is None and self._plan_args["noise_multiplier"] is not None:
            return float(self._plan_args["noise_multiplier"])  # given, before start()
        return float(self.plan.multipliers[ROUND])

    @property
    def clipping_norm(self) -> float:
        """The clip norm of the next round (it moves with adaptive clipping)."""
        return float(self.clip)

    def summary(self) -> None:
        """Flower's strategy summary (logged by ``start``), with the private plan's."""
        p = self.plan
        log(INFO, "\t├──> fedpriv user-level DP (%s):", "integer-order RDP accounting, "
            "discrete noise" if self.secure_noise else "PLD accounting")
        log(INFO, "\t│\t├── target epsilon=%s delta=%g over %d rounds, projected epsilon=%.4f",
            p.epsilon, p.delta, p.num_rounds, p.projected_epsilon)
        log(INFO, "\t│\t├── noise multiplier(s) %s, clip %g%s, sampling rate %g",
            {k: round(v, 4) for k, v in p.multipliers.items()}, p.clip_norm,
            f" (adaptive to quantile {p.clip_quantile})" if p.clip_quantile else "",
            p.sampling_rate)
        log(INFO, "\t│\t└── private metrics: %s", dict(p.private_metrics) or "none")
        self.strategy.summary()
