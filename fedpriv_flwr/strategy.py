"""``PrivateStrategy``: user-level DP for any Flower strategy whose aggregate is a mean.

Wrap the strategy of an existing ``ServerApp``::

    strategy = PrivateStrategy(FedAvg(), num_users=2000, num_rounds=5, epsilon=1.0, delta=1e-5)
    result = strategy.start(grid=grid, initial_arrays=arrays)

or with the arguments of Flower's ``DifferentialPrivacyServerSideFixedClipping``
(``noise_multiplier, clipping_norm, num_sampled_clients, accountant=``; ``fedpriv_flwr.dropin``).

Each round the wrapper Poisson-samples the nodes (one node = one user unless ``multi_user_nodes``;
the rate is ``sampling_rate`` or the inner strategy's ``fraction_train``:
``fedpriv_flwr.agreement``, which refuses settings it cannot keep before round 1 and reports the
population and the nodes' personal-layer schedule), clips each user's update, releases the noisy
mean of the clipped updates over the expected cohort (``fedpriv_flwr.aggregate``: the sensitivity
argument), and hands the inner strategy that one noisy mean as its only reply, so FedAvg, FedAvgM,
FedProx and the FedOpt family (FedAdam, FedYogi, FedAdagrad) apply their own server step to it
(post-processing). The noise multiplier is calibrated before round 1 to the target (epsilon, delta)
with fedpriv's PLD accounting (``fedpriv_flwr.plan``; ``secure_noise=True``: exact discrete
Gaussian noise on a power-of-two grid from an OS-keyed ChaCha20 stream, RDP-accounted,
``fedpriv_flwr.grid``, the only publishable noise); each release is composed into fedpriv's
accountant and the run stops before a release over the ceiling. Adaptive clipping (Andrew et al.
2021) releases the count of unclipped users through the same Gaussian, accounted. Evaluation
follows the inner strategy (its ``fraction_evaluate``; its aggregate of the exact metrics in
Flower's result, operator-side, as Flower's DP wrappers do; never in the release), unless metrics
are declared private (then each user's value is clipped to ``[0, bound]`` and the noisy mean over
the declared ``num_users`` is released and accounted: a node that does not answer counts as 0,
since rescaling by how many answered would publish that count); ``exact_metrics="operator-only"``
adds the exact ones to Flower's result under an ``operator-only/`` prefix.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType, log
from flwr.serverapp import Grid, PrivacyAccountant
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import Result, Strategy

from fedpriv.privacy.accounting import mean_sensitivity
from fedpriv.privacy.discrete import CryptoRandom
from fedpriv.privacy.mechanisms import adapted_clip
from fedpriv.randomness import server_generator
from fedpriv_flwr import dropin
from fedpriv_flwr.aggregate import (
    UNCLIPPED_KEY,
    USERS_KEY,
    Layout,
    RejectedReply,
    RoundSum,
    noisy_mean,
    reply_update,
)
from fedpriv_flwr.agreement import (
    PERSONAL_CONFIG,
    check_evaluation,
    inner_evaluation,
    no_reply_reason,
    no_reply_summary,
    population_warning,
    rejection_summary,
    schedule_mismatch,
    train_sampling_rate,
)
from fedpriv_flwr.checks import check_inner_strategy, check_options, personal_of
from fedpriv_flwr.grid import noisy_mean_on_grid
from fedpriv_flwr.metrics import (
    error_reason,
    evaluation_summary,
    failed_evaluations,
    merge_row,
    read_metrics,
)
from fedpriv_flwr.outputs import release_document, write_outputs
from fedpriv_flwr.parity import FlowerDPView
from fedpriv_flwr.plan import EVALUATE, ROUND, UNCLIPPED_PART, PrivatePlan, evaluate_rounds
from fedpriv_flwr.replies import count_metric, reply_arrays, users_of
from fedpriv_flwr.resume import load_state, save_state

CLIP_CONFIG = "fedpriv-clip-norm"  # sent to the nodes each round (multi-user nodes clip with it)
RATE_CONFIG = "fedpriv-sampling-rate"  # multi-user nodes sample their users with it
_SAMPLE_STREAM = 0x5A3


class PrivateStrategy(FlowerDPView, Strategy):
    """User-level DP around a mean-aggregating Flower strategy (see the module docstring).

    ``num_users``: the population (nodes, or users over all nodes with ``multi_user_nodes``);
    ``epsilon``/``delta``: the target the noise is calibrated to (or give ``noise_multiplier``);
    ``sampling_rate``: each node (user) takes part in a round independently with this
    probability, drawn by the server (accounted as Poisson sampling; Flower's own samplers draw
    without replacement; default: the inner strategy's ``fraction_train``);
    ``exact_metrics``: where the nodes' exact evaluation metrics go besides the operator report
    ("flower": the inner strategy's aggregate in Flower's result, the default without private
    metrics; "operator-only": prefixed; "report": nowhere else); ``clip_quantile``: adaptive
    clipping; ``private_metrics``: metric name -> bound of each user's value;
    ``personal_layers``: a regular expression of the layers the nodes keep
    (``fedpriv_flwr.personal``): never expected from nodes, never updated;
    ``secure_noise``: exact discrete Gaussian noise on a grid from a cryptographic stream keyed
    by the OS (``fedpriv_flwr.grid``; a publishable release; needs ``sampling_rate=1``), else
    float64 Gaussian noise and the sample from ``seed`` (not publishable); ``checkpoint_path``
    and ``resume``: continue a stopped run.
    """

    def __init__(self, strategy: Strategy, noise_multiplier: float | None = None,
                 clipping_norm: float | None = None, num_sampled_clients: int | None = None, *,
                 accountant: PrivacyAccountant | None = None, num_users: int | None = None,
                 num_rounds: int | None = None, epsilon: float | None = dropin.DEFAULT_EPSILON,
                 delta: float | None = None, clip_norm: float | None = None,
                 sampling_rate: float | None = None,
                 clip_quantile: float | None = None, clip_lr: float = 0.2,
                 clip_count_share: float = 0.05, max_epsilon: float | None = None,
                 relation: str | None = None, private_metrics: Mapping[str, float] | None = None,
                 metrics_budget_fraction: float = 0.1,
                 evaluate_every: int | Sequence[int] | None = None,
                 personal_layers: str | None = None, multi_user_nodes: bool = False,
                 user_sensitivity_factor: float = 1.0, secure_noise: bool = False,
                 seed: int = 0, exact_metrics: str | None = None,
                 results_path: str = "results/flower-operator-report.json",
                 checkpoint_path: str | None = None, resume: bool = False) -> None:
        super().__init__()
        check_inner_strategy(strategy)
        given = dropin.flower_arguments(  # Flower's DP wrapper's arguments (fedpriv_flwr.dropin)
            strategy, noise_multiplier=noise_multiplier, clipping_norm=clipping_norm,
            num_sampled_clients=num_sampled_clients, accountant=accountant, num_users=num_users,
            clip_norm=clip_norm, epsilon=epsilon, delta=delta, max_epsilon=max_epsilon,
            relation=relation)
        exact_metrics = check_options(multi_user_nodes, personal_layers, bool(private_metrics),
                                      exact_metrics)
        sampling_rate = train_sampling_rate(strategy, sampling_rate, multi_user_nodes,
                                            secure_noise)
        check_evaluation(strategy, bool(private_metrics))
        dropin.sampling_note(accountant, sampling_rate)
        if multi_user_nodes and sampling_rate < 1:
            log(INFO, "multi_user_nodes: each node samples its own users at rate %g",
                sampling_rate)
        self.strategy = strategy
        self._plan_args: dict[str, Any] = dict(
            num_users=given.num_users, epsilon=given.epsilon, delta=given.delta,
            clip_norm=given.clip_norm, noise_multiplier=noise_multiplier,
            sampling_rate=sampling_rate, clip_quantile=clip_quantile, clip_lr=clip_lr,
            clip_count_share=clip_count_share, max_epsilon=given.max_epsilon,
            relation=given.relation, private_metrics=dict(private_metrics or {}),
            metrics_budget_fraction=metrics_budget_fraction,
            user_sensitivity_factor=user_sensitivity_factor, secure_noise=secure_noise)
        self._evaluate_every = evaluate_every
        self._plan: PrivatePlan | None = None
        if num_rounds is not None:  # else made by start(num_rounds=...), as Flower's wrapper
            self._make_plan(num_rounds)
        self.flower_accountant = accountant
        self.personal_pattern = personal_layers
        self.multi_user_nodes = multi_user_nodes
        self.secure_noise, self.seed = secure_noise, seed
        self.exact_metrics = exact_metrics
        self.population_note: str | None = None  # the first round's check ("" when fine)
        self.mismatch: str | None = None  # why the nodes' replies disagreed on the schedule
        self.results_path = results_path
        self.checkpoint_path = (Path(checkpoint_path).expanduser().resolve()
                                if checkpoint_path else None)
        self.resume = resume
        if resume and (self.checkpoint_path is None or accountant is not None):
            raise ValueError("resume: needs a checkpoint_path, and no accountant= (yours would "
                             "miss the rounds before the restart; fedpriv's is in the checkpoint)")
        self.clip = given.clip_norm
        self.accountant = PrivatePlan.accountant_for(secure_noise, given.relation, given.delta)
        self.releases = 0  # index of the next noise stream
        self.offset = 0  # rounds done before this start (a resumed run)
        self.rows: list[dict[str, Any]] = []
        self.layout: Layout | None = None
        self.personal: frozenset[str] = frozenset()
        self.current_arrays = ArrayRecord()
        self._sampled: dict[int, int] = {}
        self._server_time = 0.0
        self._round_started = 0.0
        self._last_arrays: ArrayRecord | None = None

    def _make_plan(self, num_rounds: int) -> None:
        planned = self._evaluate_every is not None or self._plan_args["private_metrics"]
        p = self._plan = PrivatePlan(num_rounds=num_rounds, evaluate_rounds=evaluate_rounds(
            num_rounds, self._evaluate_every) if planned else (), **self._plan_args)
        dropin.note_no_ceiling(p.epsilon, p.max_epsilon, p.projected_epsilon)

    # ----- Flower's Strategy -----------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        t0 = self._round_started = time.perf_counter()
        r = self.offset + server_round
        if r > self.plan.num_rounds:
            raise PrivacyBudgetExhausted(
                f"round {r}: the privacy plan covers {self.plan.num_rounds} rounds; a further "
                "release would exceed the calibrated budget")
        self._set_model(arrays)
        # the inner strategy waits for its min_available_nodes (Flower's convention)
        inner = list(self.strategy.configure_train(server_round, arrays, config, grid))
        record = inner[0].content if inner else self._record(arrays, config)
        cfg = record.config_records.get(self._key("configrecord_key", "config"))
        if cfg is not None:
            cfg[CLIP_CONFIG] = float(self.clip)
            cfg[RATE_CONFIG] = float(self.plan.sampling_rate)
            cfg[PERSONAL_CONFIG] = self.personal_pattern or ""
        nodes = sorted(grid.get_node_ids())
        if self.population_note is None and not self.multi_user_nodes:  # the first round
            self.population_note = population_warning(len(nodes), self.plan.num_users,
                                                      self.plan.sampling_rate) or ""
            if self.population_note:
                log(WARNING, "fedpriv: %s", self.population_note)
        if self.multi_user_nodes or self.plan.sampling_rate >= 1:
            chosen = nodes
        else:
            u = self._rng(_SAMPLE_STREAM, r).random(len(nodes))
            chosen = [n for n, x in zip(nodes, u, strict=True) if x < self.plan.sampling_rate]
        self._sampled[r] = len(chosen)
        if len(chosen) < len(nodes) and not self.multi_user_nodes:
            log(INFO, "fedpriv: round %d trains %d of %d nodes (Poisson sampling at rate %g, "
                "drawn by PrivateStrategy)", r, len(chosen), len(nodes),
                self.plan.sampling_rate)
        self._server_time += time.perf_counter() - t0
        return [Message(record, dst_node_id=n, message_type=MessageType.TRAIN) for n in chosen]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        t0 = time.perf_counter()
        r = self.offset + server_round
        assert self.layout is not None, "configure_train runs first"
        sums = self._round_sum(self.layout, replies)
        # reported, never a reason to stop: the replies are the users' (module agreement)
        mismatch = schedule_mismatch(self.personal_pattern, sums.errors, dict(sums.rejected),
                                     sums.nodes)
        if sums.rejected and sums.nodes:  # Flower's log: no node id, no value (agreement)
            log(WARNING, "fedpriv: round %d: %d replies rejected (%s; reasons in the operator "
                "report)", r, sum(sums.rejected.values()), rejection_summary(sums.rejected))
        clip_used = self.clip
        noisy = self._release_round(r, sums)
        new = self.layout.unflatten(self._current + noisy[0])
        model = {k: new.get(k, v.numpy()) for k, v in self.current_arrays.items()}
        reply = Message(RecordDict({
            self._key("arrayrecord_key", "arrays"): ArrayRecord(
                {k: Array(np.asarray(v)) for k, v in model.items()}),
            "metrics": MetricRecord({self._key("weighted_by_key", "num-examples"): 1})}),
            dst_node_id=0, message_type=MessageType.TRAIN)
        aggregated, _ = self.strategy.aggregate_train(server_round, [reply])
        spent = self.accountant.epsilon()
        row: dict[str, Any] = {
            "round": r, "epsilon_spent": spent, "clip_norm": clip_used,
            "sampled_nodes": self._sampled.pop(r, None), "answered_nodes": sums.nodes,
            "users": sums.users, "unclipped_users": sums.unclipped, "failed_nodes": sums.failed,
            "rejected_nodes": dict(sums.rejected), "failed_reasons": dict(Counter(sums.errors))}
        if sums.nodes == 0:  # operator-side: Flower's log and the report, never the release
            row["no_accepted_reply"] = True
            if mismatch:
                row["schedule_mismatch"] = mismatch
                self.mismatch = mismatch
                log(ERROR, "fedpriv: round %d: %s", r, mismatch)
            log(WARNING, "fedpriv: round %d: %s; this round's release is noise alone", r,
                no_reply_reason(row))
        if self.plan.clip_quantile is not None:
            row["next_clip_norm"] = self.clip
        self.rows.append(row)
        self._server_time += time.perf_counter() - t0
        row["server_seconds"] = self._server_time  # the strategy's own work in the round
        row["round_seconds"] = time.perf_counter() - self._round_started  # with the nodes
        self._server_time = 0.0
        if aggregated is not None:
            self._last_arrays = aggregated
            self._save_checkpoint(r, aggregated)
        self._write()
        return aggregated, MetricRecord({"epsilon": spent, "clip-norm": clip_used})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if not self._evaluates(self.offset + server_round):
            return []
        # the inner strategy's own sample (fraction_evaluate, min_evaluate_nodes)
        inner = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        for message in inner:
            cfg = message.content.config_records.get(self._key("configrecord_key", "config"))
            if cfg is not None:
                cfg[PERSONAL_CONFIG] = self.personal_pattern or ""
        return inner

    def _evaluates(self, r: int) -> bool:
        """Whether nodes evaluate after round ``r``: the planned rounds for private metrics
        (or with ``evaluate_every``), else whenever the inner strategy does (Flower's flow)."""
        return (r in self.plan.evaluate_rounds or not (self.plan.private_metrics
                                                        or self._evaluate_every is not None))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        r = self.offset + server_round
        if not self._evaluates(r):  # Flower aggregates the empty round too
            return None
        replies = list(replies)
        exact, counts, answered, rejected = read_metrics(
            replies, self.plan.private_metrics, (USERS_KEY, self._key("weighted_by_key",
                                                                      "num-examples")))
        means = {n: exact[n] / counts[n] for n in exact}
        row: dict[str, Any] = {"round": r, "evaluated_nodes": answered,
                               "rejected_evaluations": rejected, "exact_metrics": means,
                               **failed_evaluations(r, replies, rejected, answered)}
        out: dict[str, float] = {}
        if self.plan.private_metrics:
            out.update(self._release_metrics(r, exact))
            row["private_metrics"] = dict(out)
        merge_row(self.rows, row)
        if self.plan.private_metrics and self._last_arrays is not None:
            # the evaluation release is in the checkpoint before it leaves the server, so a
            # resumed run counts it (and never reuses its noise stream)
            self._save_checkpoint(r, self._last_arrays)
        if self.exact_metrics == "operator-only":
            out.update({f"operator-only/{n}": v for n, v in means.items()})
        self._write()
        if self.exact_metrics == "flower":  # Flower's own evaluation flow (operator-side)
            return inner_evaluation(self.strategy, server_round, replies)
        return MetricRecord(out) if out else None  # type: ignore[arg-type]

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None = None,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """Flower's loop over the planned rounds (``num_rounds`` defaults to the plan's; more
        is refused before round 1), resumed from the checkpoint with ``resume``; prints the
        epsilon spent (the PLD accountant's) and where the two output files are."""
        if self._plan is None:
            if num_rounds is None:
                raise ValueError("num_rounds: give it to start() or to PrivateStrategy (the "
                                 "private plan is calibrated for a number of rounds)")
            self._make_plan(num_rounds)
        total = self.plan.num_rounds if num_rounds is None else num_rounds
        if total > self.plan.num_rounds:
            raise ValueError(f"num_rounds: the privacy plan was calibrated for "
                             f"{self.plan.num_rounds} rounds, not {total}")
        arrays = initial_arrays
        if self.resume and self.checkpoint_path and self.checkpoint_path.is_file():
            arrays = self._load_checkpoint()
            log(INFO, "fedpriv: resuming after round %d (epsilon spent %.4f)", self.offset,
                self.accountant.epsilon())
        result = super().start(grid, arrays, total - self.offset, timeout, train_config,
                               evaluate_config, evaluate_fn)
        report, release = self._write()
        spent = self.accountant.epsilon()
        kind = "RDP accountant, discrete noise" if self.secure_noise else "PLD accountant"
        line = (f"fedpriv: epsilon spent = {spent:.4f} at delta = {self.plan.delta:g} "
                f"({kind}, {len(self.accountant.ledger)} releases)")
        for text in (line, f"fedpriv: operator report (exact, not private; do not publish): "
                     f"{report}", f"fedpriv: release (what may leave the server): {release}"):
            log(INFO, text)  # Flower's log: what `flwr run --stream` and `flwr log` show
        warning = no_reply_summary(self.rows, self.mismatch)
        if warning:
            learned_nothing = "learned nothing" in warning
            log(ERROR if self.mismatch or learned_nothing else WARNING, "fedpriv: %s", warning)
        if failed := evaluation_summary(self.rows):
            log(WARNING, "fedpriv: %s", failed)
        if self.checkpoint_path is not None:
            self.checkpoint_path.unlink(missing_ok=True)
        return result

    # ----- the private release ---------------------------------------------------------------
    def _round_sum(self, layout: Layout, replies: Iterable[Message]) -> RoundSum:
        sums = RoundSum(layout.size)
        buffer = np.empty(layout.size)  # one buffer for every reply of the round
        for reply in replies:
            if reply.has_error():
                sums.failed += 1
                sums.errors.append(error_reason(reply))
                continue
            try:
                returned, metrics = reply_arrays(reply)
                if USERS_KEY in metrics:
                    if not self.multi_user_nodes:
                        raise RejectedReply("a multi-user reply, but multi_user_nodes=False")
                    total = reply_update(layout, np.zeros(layout.size), returned, self.personal,
                                         buffer)
                    sums.add_node_sum(total, users_of(metrics, self.plan.num_users),
                                      count_metric(metrics, UNCLIPPED_KEY), self.clip,
                                      sum_clipped=self.plan.user_sensitivity_factor == 2.0)
                else:
                    if self.multi_user_nodes:
                        raise RejectedReply(f"no {USERS_KEY} count from a multi-user node")
                    sums.add_user(reply_update(layout, self._current, returned, self.personal,
                                               buffer), self.clip)
            except RejectedReply as err:
                sums.reject(str(err))
        return sums

    def _release_round(self, r: int, sums: RoundSum) -> list[np.ndarray]:
        p = self.plan
        z = p.multipliers[ROUND]
        if sum(e["release"].startswith(ROUND) for e in self.accountant.ledger) >= p.num_rounds:
            raise PrivacyBudgetExhausted(f"round {r}: every planned round was released")
        cohort = p.expected_cohort
        noisy, parts = [], []
        for name, bound, z_part in p.round_parts(self.clip):
            exact = (sums.total if name != UNCLIPPED_PART
                     else np.array([sums.unclipped - sums.users / 2.0]))
            value, part = self._noisy_part(name, exact, cohort, bound, z_part)
            noisy.append(value)
            parts.append(part)
        spent = self.accountant.record(f"{ROUND} {r}", z, parts,
                                       sampling_rate=p.sampling_rate)
        dropin.feed_accountant(self.flower_accountant, z, p.num_users, p.sampling_rate)
        self._guard(spent)
        if p.clip_quantile is not None:
            fraction = float(noisy[1][0]) + 0.5  # a post-processing of the noisy count
            self.clip = adapted_clip(self.clip, fraction, p.clip_quantile, p.clip_lr)
        return noisy

    def _release_metrics(self, r: int, exact: Mapping[str, float]) -> dict[str, float]:
        p = self.plan
        out, parts = {}, []
        for name, bound, z_part in p.metric_parts():
            # the mean over the declared population: no rescale by how many answered (that
            # count would tell whether one user took part); a silent node counts as 0
            value, part = self._noisy_part(name, np.array([exact.get(name, 0.0)]),
                                           p.num_users, bound, z_part)
            out[name] = float(value[0])
            parts.append(part)
        spent = self.accountant.record(f"{EVALUATE} {r}", p.multipliers[EVALUATE], parts)
        self._guard(spent)
        return out

    def _guard(self, spent: float | None) -> None:
        ceiling = self.plan.ceiling
        if spent is not None and ceiling is not None and spent > ceiling * (1 + 1e-9):
            raise PrivacyBudgetExhausted(f"epsilon spent {spent:.6g} would exceed the ceiling "
                                         f"{ceiling:g}; the release was not published")

    def _noisy_part(self, name: str, exact: np.ndarray, denominator: float, bound: float,
                    z_part: float) -> tuple[np.ndarray, dict[str, Any]]:
        """One part's noisy mean and its ledger entry: seeded float64 Gaussian noise, or with
        ``secure_noise`` the exact sum on a grid plus exact discrete Gaussian noise."""
        index, self.releases = self.releases, self.releases + 1
        if self.secure_noise:
            sensitivity = mean_sensitivity(bound, 1, self.plan.relation)  # of the sum
            value, entry = noisy_mean_on_grid(exact, denominator, z_part, sensitivity,
                                              self._crypto_stream(index))
            return value, {"name": name, **entry}
        std = self.plan.std(bound, z_part, denominator)
        return (noisy_mean(exact, denominator, std, server_generator(self.seed, index)),
                {"name": name, "noise_multiplier": z_part, "noise_std": std,
                 "l2_sensitivity": std / z_part})

    def _crypto_stream(self, index: int) -> CryptoRandom:
        """A fresh ChaCha20 key from the OS for each part (neighbour tests seed it)."""
        return CryptoRandom()

    def _rng(self, stream: int, index: int) -> np.random.Generator:
        if self.secure_noise:
            return np.random.default_rng(np.random.SeedSequence())
        return np.random.default_rng([self.seed, stream, index])

    # ----- helpers ---------------------------------------------------------------------------
    def _key(self, name: str, default: str) -> str:
        value = getattr(self.strategy, name, default)
        return value if isinstance(value, str) else default

    def _record(self, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        return RecordDict({self._key("arrayrecord_key", "arrays"): arrays,
                           self._key("configrecord_key", "config"): config})

    def _set_model(self, arrays: ArrayRecord) -> None:
        if self.layout is None:
            self.personal = personal_of(self.personal_pattern, list(arrays.keys()))
            released = [k for k in arrays.keys() if k not in self.personal]
            self.layout = Layout.of({k: v.numpy() for k, v in arrays.items()}, released)
        self.current_arrays = arrays
        self._current = self.layout.flatten({k: arrays[k].numpy() for k in self.layout.keys})

    def operator_report(self) -> dict[str, Any]:
        return {"strategy": type(self.strategy).__name__, "plan": self.plan.public(),
                "population_warning": self.population_note or None, "seed": self.seed,
                "secure_noise": self.secure_noise,
                "epsilon": self.accountant.epsilon(), "ledger": self.accountant.ledger,
                "rounds": self.rows}

    def _write(self) -> tuple[Path, Path]:
        release = release_document(self.plan.public(), type(self.strategy).__name__,
                                   self.secure_noise, self.accountant.ledger,
                                   self.accountant.epsilon(), self.rows)
        return write_outputs(self.results_path, self.operator_report(), release)

    # ----- checkpoint (fedpriv_flwr.resume) --------------------------------------------------
    def _save_checkpoint(self, r: int, arrays: ArrayRecord) -> None:
        save_state(self, r, arrays)

    def _load_checkpoint(self) -> ArrayRecord:
        return load_state(self)


__all__ = ["PrivateStrategy"]
