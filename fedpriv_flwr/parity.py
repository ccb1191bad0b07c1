"""What Flower's DP wrappers (``DifferentialPrivacyServerSideFixedClipping`` and kin) let a user
read, on ``PrivateStrategy``: ``privacy_spent()`` (Flower's ``PrivacySpent``), and the
``noise_multiplier`` and ``clipping_norm`` attributes. The epsilon is fedpriv's accountant's:
PLD accounting of every release so far (RDP with discrete noise), at the plan's delta."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flwr.serverapp import PrivacySpent

from fedpriv_flwr.plan import ROUND

if TYPE_CHECKING:
    from fedpriv.privacy.accounting import Accountant
    from fedpriv_flwr.plan import PrivatePlan


class FlowerDPView:
    """The attributes of Flower's DP wrappers, read from a ``PrivateStrategy``'s plan, clip and
    accountant."""

    plan: PrivatePlan
    clip: float
    secure_noise: bool
    accountant: Accountant

    def privacy_spent(self) -> PrivacySpent:
        """The privacy spent so far, as Flower's DP wrappers report it: the epsilon of every
        release so far at the plan's delta, by fedpriv's accountant."""
        method = ("rdp (fedpriv, discrete Gaussian)" if self.secure_noise
                  else "pld (fedpriv, dp-accounting)")
        return PrivacySpent(epsilon=float(self.accountant.epsilon()), delta=self.plan.delta,
                            num_releases=len(self.accountant.ledger), accounting_method=method)

    @property
    def noise_multiplier(self) -> float:
        """The noise multiplier of each round's release (calibrated to the target): the noise
        std over the round's L2 sensitivity as a whole. With adaptive clipping the round's
        budget is split between the update and the clip count (each part's own multiplier is
        in the ledger); with ``user_sensitivity_factor=2`` the sensitivity is ``2 C``."""
        return float(self.plan.multipliers[ROUND])

    @property
    def clipping_norm(self) -> float:
        """The clip norm of the next round (it moves with adaptive clipping)."""
        return float(self.clip)
