"""``fedpriv audit``: an empirical lower bound on the epsilon of one real release.

The first private release of a run (for Private FedRep the initialization statistic, for
Meta-NSGD a round) is run ``trials`` times through the server's release path (its node bounds,
the noise std from the run's calibrated plan and the stated sensitivity, the algorithm's own
noise function, the server's generator family) on two neighbouring
populations: the run's users (D) and the same users plus one canary (D'), whose contribution is
the largest a user may make (``clip_norm`` along the first coordinate). The statistic is the
release's first coordinate (the likelihood-ratio test of a Gaussian shift along the canary); a
threshold is chosen on the first half of the trials and evaluated on the second half, so the
bound stays valid after the choice. With Clopper-Pearson upper bounds FPR+ and FNR+ (each at
confidence 1 - alpha/2), any (epsilon, delta)-DP release satisfies
``FPR + e^epsilon FNR >= 1 - delta`` in both directions, hence

    epsilon >= max( log((1 - delta - FNR+) / FPR+), log((1 - delta - FPR+) / FNR+) )

with probability at least 1 - alpha. The bound is compared with what the accountant charges for
that one release. ``noise-scale < 1`` cuts the noise below the calibrated level (to show that
the audit has power: it must then find epsilon above the accountant's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta

from fedpriv.algorithms.base import UserContribution
from fedpriv.config import RunConfig
from fedpriv.privacy.accounting import epsilon_of, mean_sensitivity
from fedpriv.randomness import server_generator
from fedpriv.server import PrivateServer


@dataclass(frozen=True)
class AuditResult:
    release: str
    trials: int
    epsilon_lower_bound: float
    accountant_epsilon: float  # what the accountant charges for this one release, at delta
    delta: float
    alpha: float
    noise_scale: float
    threshold: float
    false_positive_rate: float
    false_negative_rate: float

    @property
    def violation(self) -> bool:
        return self.epsilon_lower_bound > self.accountant_epsilon

    def lines(self) -> list[str]:
        verdict = ("VIOLATION: the release leaks more than the accountant charges"
                   if self.violation else "consistent with the accountant")
        return [
            f"fedpriv audit: release {self.release!r}, {self.trials} trials per population, "
            f"noise x{self.noise_scale:g}",
            f"  empirical epsilon >= {self.epsilon_lower_bound:.4f} with confidence "
            f"{1 - self.alpha:g} (threshold {self.threshold:.4g}; "
            f"FPR {self.false_positive_rate:.4f}, "
            f"FNR {self.false_negative_rate:.4f} on held-out trials)",
            f"  accountant: epsilon {self.accountant_epsilon:.4f} at delta {self.delta:g} for "
            f"this release",
            f"  {verdict}",
        ]


def clopper_pearson_upper(errors: int, n: int, alpha: float) -> float:
    """One-sided upper confidence bound at level 1 - alpha on a binomial rate."""
    if errors >= n:
        return 1.0
    return float(beta.ppf(1.0 - alpha, errors + 1, n - errors))


def epsilon_lower_bound(fpr_hi: float, fnr_hi: float, delta: float) -> float:
    bounds = [0.0]
    for a, b in ((fpr_hi, fnr_hi), (fnr_hi, fpr_hi)):
        if a > 0 and 1.0 - delta - b > 0:
            bounds.append(math.log((1.0 - delta - b) / a))
    return max(bounds)


def _release_samples(config: RunConfig, trials: int, noise_scale: float) -> tuple[
        str, float, np.ndarray, np.ndarray]:
    """First coordinate of the first private release, ``trials`` times on D and on D'."""
    server = PrivateServer(config, 1, log=lambda _: None)
    step = next((s for s in server.steps() if s.release is not None), None)
    if step is None or step.release is None:
        raise ValueError(f"{config.algorithm} makes no private release to audit")
    if step.parts[0].mechanism != "gaussian":
        raise ValueError("the audit covers Gaussian releases (not the exponential mechanism)")
    part = step.parts[0]
    cls = type(server.algorithm)
    users = cls.participants(config, step, cls.hosted_users(config, 0, 1))
    honest = cls.user_step(config, step, server.payload(step), users)
    canary_total = np.zeros(part.shape)
    canary_total.flat[0] = part.clip_norm  # the largest contribution, along coordinate 0
    canary = UserContribution({p.name: (canary_total if p is part else np.zeros(p.shape))
                               for p in step.parts}, 1)
    z = server.multipliers[step.release]
    population = step.population or config.num_users
    std = (z * noise_scale / math.sqrt(part.share)) * mean_sensitivity(
        part.clip_norm, population, config.neighbouring_relation)
    seen: list[float] = []
    for accepted in ([honest], [honest, canary]):
        mean = server._bounded_sum(part, accepted) / population  # the server's node bounds
        for _ in range(trials):
            # the server's own noise function and generator family, a fresh stream per trial
            rng = server_generator(config.seed, 1_000_000 + len(seen))
            seen.append(float((mean + server.algorithm.noise(step, part, std, rng)).flat[0]))
    samples = np.array(seen)
    one_release = epsilon_of({(float(z), 1.0): 1}, config.delta, config.accountant,
                             config.neighbouring_relation)
    return step.label, one_release, samples[:trials], samples[trials:]


def run_audit(config: RunConfig, trials: int = 20000, alpha: float = 0.05,
              noise_scale: float = 1.0) -> AuditResult:
    if trials < 100:
        raise ValueError("trials: at least 100 per population")
    label, charged, without, with_canary = _release_samples(config, trials, noise_scale)
    half = trials // 2
    # choose the threshold on the first half: the one with the best empirical bound
    candidates = np.quantile(np.concatenate([without[:half], with_canary[:half]]),
                             np.linspace(0.01, 0.99, 197))

    def rates(a: np.ndarray, b: np.ndarray, t: float) -> tuple[float, float]:
        return float((a > t).mean()), float((b <= t).mean())

    def empirical(t: float) -> float:
        fpr, fnr = rates(without[:half], with_canary[:half], t)
        return epsilon_lower_bound(max(fpr, 1.0 / half), max(fnr, 1.0 / half), config.delta)

    threshold = float(max(candidates, key=empirical))
    held_a, held_b = without[half:], with_canary[half:]
    n = len(held_a)
    fp, fn = int((held_a > threshold).sum()), int((held_b <= threshold).sum())
    bound = epsilon_lower_bound(clopper_pearson_upper(fp, n, alpha / 2),
                                clopper_pearson_upper(fn, n, alpha / 2), config.delta)
    return AuditResult(label, trials, bound, charged, config.delta, alpha, noise_scale,
                       threshold, fp / n, fn / n)


def audit_lines(config: RunConfig, trials: int = 20000, alpha: float = 0.05,
                noise_scale: float = 1.0) -> list[str]:
    return run_audit(config, trials, alpha, noise_scale).lines()
