"""PrivateStrategy built the way Flower's DP wrapper is built (fedpriv_flwr.dropin), the one-line
head fit of a ported ClientApp (``fit_personal``), and the failures a port makes said plainly:
replies that miss keys, evaluations that fail on their node. Driven through Flower's own
``Strategy.start`` on the in-memory grid."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.serverapp import (
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
)
from flwr.serverapp.strategy import FedAvg

from fedpriv.privacy.accounting import epsilon_of
from fedpriv_flwr import PlanError, PrivateStrategy
from fedpriv_flwr.personal import STATE_KEY, fit_personal
from tests.flower_grid import FakeGrid
from tests.test_flower_dropin import _init, _move, _net


def _config(population: int = 20, max_epsilon: float | None = None) -> PrivacyConfig:
    return PrivacyConfig(target_delta=1e-5, population_size=population, max_epsilon=max_epsilon,
                         neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                         sampling_method=SamplingMethod.NO_AMPLIFICATION)


def test_flowers_constructor_runs_as_written_and_its_accountant_sees_each_release(tmp_path):
    """``DifferentialPrivacyServerSideFixedClipping(FedAvg(), z, C, N, accountant=...)`` with
    the class name changed: the plan is made by ``start(num_rounds=...)``, the release is the one
    fedpriv's own arguments give, the given accountant composed every round (its RDP epsilon)
    and ``privacy_spent()`` is fedpriv's PLD epsilon, below it."""
    z, path = 2.5, str(tmp_path / "flower.json")
    accountant = RdpAccountant(_config())
    flower = PrivateStrategy(FedAvg(), z, 0.5, 20, accountant=accountant, results_path=path)
    assert flower.noise_multiplier == z and flower.clipping_norm == 0.5  # before start()
    flower.start(grid=FakeGrid(20, _move), initial_arrays=_init(), num_rounds=3)
    ours = PrivateStrategy(FedAvg(), num_users=20, num_rounds=3, noise_multiplier=z,
                           clip_norm=0.5, epsilon=None, results_path=str(tmp_path / "f.json"))
    ours.start(grid=FakeGrid(20, _move), initial_arrays=_init())
    assert flower.accountant.ledger == ours.accountant.ledger
    assert flower.plan.public() == ours.plan.public()
    assert np.array_equal(flower.current_arrays["body"].numpy(),
                          ours.current_arrays["body"].numpy())
    rdp = accountant.get_privacy_spent()
    assert rdp.num_releases == 3
    pld = flower.privacy_spent().epsilon
    assert pld == pytest.approx(epsilon_of({(z, 1.0): 3}, 1e-5, "pld"), rel=1e-9)
    assert pld < rdp.epsilon


@pytest.mark.parametrize("kw, words", [
    ({"num_users": 20, "clip_norm": 1.0, "clipping_norm": 2.0},
     "clip_norm=1.0 and clipping_norm=2.0"),
    ({"num_users": 10, "num_sampled_clients": 20}, "num_users=10 and num_sampled_clients=20"),
    ({"num_users": 30, "accountant": RdpAccountant(_config(20))}, "population_size=20"),
    ({"delta": 1e-6, "accountant": RdpAccountant(_config(20))}, "target_delta=1e-05"),
    ({}, "num_users: the population"),
])
def test_a_setting_given_two_ways_that_disagree_is_refused(tmp_path, kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        PrivateStrategy(FedAvg(), noise_multiplier=2.0, results_path=str(tmp_path / "r.json"),
                        **kw)


def test_a_per_round_count_under_sampling_and_no_rounds_at_all_are_refused(tmp_path, caplog):
    with pytest.raises(ValueError, match="per-round count"):
        PrivateStrategy(FedAvg(fraction_train=0.5), 2.0, 1.0, 10)
    with pytest.raises(ValueError, match="fraction_train") as zero:
        PrivateStrategy(FedAvg(fraction_train=0.0), 2.0, 1.0, 10)
    assert "per-round count" not in str(zero.value)  # the setting that is wrong is named
    # the population given, Flower's accountant saying no amplification: the run's sampling
    # (Poisson at fraction_train) is what fedpriv accounts, and the log says so
    caplog.set_level(logging.WARNING)
    PrivateStrategy(FedAvg(fraction_train=0.5), 2.0, 1.0, accountant=RdpAccountant(_config()),
                    results_path=str(tmp_path / "r.json"))
    assert "sampling_method=no-amplification" in caplog.text and "rate 0.5" in caplog.text
    s = PrivateStrategy(FedAvg(), 2.0, 1.0, 20, results_path=str(tmp_path / "r.json"))
    with pytest.raises(ValueError, match="num_rounds: give it to start"):
        s.start(grid=FakeGrid(20, _move), initial_arrays=_init())
    with pytest.raises(RuntimeError, match="no num_rounds yet"):
        _ = s.plan


def test_the_accountants_max_epsilon_is_the_ceiling(tmp_path):
    s = PrivateStrategy(FedAvg(), 1.0, 1.0, 20, accountant=RdpAccountant(_config(20, 0.5)),
                        results_path=str(tmp_path / "r.json"))
    with pytest.raises(PlanError, match="max_epsilon"):
        s.start(grid=FakeGrid(20, _move), initial_arrays=_init(), num_rounds=3)
    assert not (tmp_path / "r.json").exists()  # refused before round 1


# ----- fit_personal: one line in each handler ---------------------------------------------------
def _context(schedule: str, kind: str) -> Context:
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    context.state[STATE_KEY] = ConfigRecord({"pattern": r"^2\.", "schedule": schedule,
                                             "kind": kind, "message-type": kind,
                                             "source": "server"})
    return context


def test_fit_personal_fits_the_head_where_the_schedule_asks_and_freezes_it_for_fedrep():
    import torch

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g)
    reference = _net()
    with torch.no_grad():
        feats = reference[1](reference[0](x))
    from fedpriv.algorithms.deep.head_fit import fit_heads

    start = torch.cat([reference[2].weight.reshape(-1), reference[2].bias])[None]
    fitted = fit_heads(feats[None], y[None], torch.ones(1, 30), 3, 20, 1.0, init=start)[0]

    def head(m):
        return torch.cat([m[2].weight.reshape(-1), m[2].bias])

    for kind, schedule, phase in (("train", "fedrep", "shared"),
                                  ("evaluate", "fedrep", "personal"),
                                  ("evaluate", "finetune", "personal")):
        model = _net()
        assert fit_personal(model, _context(schedule, kind), (x, y), steps=20) == phase
        assert torch.allclose(head(model), fitted, atol=1e-5)
    # fedrep train: the handler's own training that follows moves the body, not the head
    model = _net()
    fit_personal(model, _context("fedrep", "train"), (x, y), steps=20)
    body = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert torch.allclose(head(model), fitted, atol=1e-5)
    assert not torch.equal(model[0].weight, body)
    # finetune train: the whole model trains as before, nothing fitted
    model = _net()
    assert fit_personal(model, _context("finetune", "train"), (x, y)) == "all"
    assert torch.equal(head(model), head(reference))
    assert all(p.requires_grad for p in model.parameters())


# ----- a port's failures, said plainly ----------------------------------------------------------
def test_replies_that_miss_a_key_are_said_as_such_not_as_a_schedule(tmp_path, caplog):
    """A handler that drops a key on every node (no personalization anywhere): Flower's log says
    which key the replies miss, and no schedule mismatch is claimed."""
    caplog.set_level(logging.WARNING)
    s = PrivateStrategy(FedAvg(), num_users=8, num_rounds=2, delta=1e-3,
                        results_path=str(tmp_path / "r.json"))
    s.start(grid=FakeGrid(8, lambda node, a: {"body": a["body"] + 0.01}), initial_arrays=_init())
    assert s.mismatch is None and "schedule" not in caplog.text
    assert caplog.text.count("8 x a reply that misses released keys ['head']") == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "learned nothing" in errors[0] and "['head']" in errors[0]


def test_evaluations_that_fail_on_their_nodes_are_counted_and_said(tmp_path, caplog):
    caplog.set_level(logging.WARNING)

    # a failure as Flower's simulation reports it: colour codes, a process id, a traceback
    reason = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::"
              "ClientAppActor.run()\x1b[39m (pid={pid}, ip=127.0.0.1)\n" + "  File x\n" * 60
              + "RuntimeError: evaluate raised'>")

    class FailingEvaluations(FakeGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages and messages[0].metadata.message_type == "evaluate":
                return [Message(Error(code=0, reason=reason.format(pid=1000 + i % 2)),
                                reply_to=m) for i, m in enumerate(messages)]
            return super().send_and_receive(messages, timeout=timeout)

    s = PrivateStrategy(FedAvg(), num_users=8, num_rounds=2, delta=1e-3,
                        results_path=str(tmp_path / "r.json"))
    s.start(grid=FailingEvaluations(8, _move), initial_arrays=_init())
    assert caplog.text.count("8 of 8 evaluation replies failed") == 2
    assert "no node's metrics arrived" in caplog.text
    row = json.loads((tmp_path / "r.json").read_text())["rounds"][0]
    assert row["failed_evaluations"] == 8
    [(kept, n)] = row["failed_evaluation_reasons"].items()  # one reason, whatever the process
    assert n == 8 and kept.endswith("RuntimeError: evaluate raised'>") and "\x1b" not in kept
    assert len(kept) <= 300 and "pid=..." in kept
    closing = caplog.records[-1].getMessage()
    assert "evaluation replies failed in 2 of 2 rounds (2 with no node's metrics)" in closing
    assert "RuntimeError, in the operator report" in closing and "evaluate raised" not in closing
    release = (tmp_path / "r.release.json").read_text()
    assert "failed" not in release and "evaluate raised" not in release


def test_every_array_moves_whatever_the_model_calls_it(tmp_path):
    """Flower's constructor on a model whose arrays are not called body/head: each key is
    released and moved by the noisy mean (nothing in the wrapper keys on names)."""
    init = ArrayRecord({"classifier.weight": _init()["body"], "classifier.bias": _init()["head"]})
    s = PrivateStrategy(FedAvg(), 3.0, 1.0, 8, results_path=str(tmp_path / "r.json"))
    s.start(grid=FakeGrid(8, _move), initial_arrays=init, num_rounds=2)
    assert s.layout is not None and set(s.layout.keys) == set(init.keys())
    for key in init.keys():
        assert not np.array_equal(s.current_arrays[key].numpy(), init[key].numpy()), key


def test_flowers_poisson_accountant_is_fed_the_rate_the_run_samples_at(tmp_path):
    """``fraction_train = 0.22`` of 20 nodes: fedpriv's plan is Poisson at 0.22 and the user's
    Flower accountant (POISSON) is fed events of sample size ceil(0.22 x 20) = 5 of 20 (never a
    lower rate than the run's); a REPLACE_ONE accountant makes fedpriv's plan replace-one."""
    config = PrivacyConfig(target_delta=1e-3, population_size=20,
                           neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                           sampling_method=SamplingMethod.POISSON)
    accountant = RdpAccountant(config)
    inner = FedAvg(fraction_train=0.22, min_available_nodes=1, min_train_nodes=2)
    s = PrivateStrategy(inner, 2.0, 1.0, num_users=20, accountant=accountant,
                        results_path=str(tmp_path / "r.json"))
    s.start(grid=FakeGrid(20, _move), initial_arrays=_init(), num_rounds=3)
    assert s.plan.sampling_rate == 0.22 and s.plan.relation == "add-remove"
    assert s.plan.delta == 1e-3
    fed = accountant.get_privacy_spent()
    assert fed.num_releases == 3
    from flwr.serverapp import GaussianPrivacyEvent

    same = RdpAccountant(config)
    same.compose(GaussianPrivacyEvent(noise_multiplier=2.0, sample_size=5, population_size=20),
                 count=3)
    assert fed.epsilon == pytest.approx(same.get_privacy_spent().epsilon, rel=1e-12)
    replace = PrivacyConfig(target_delta=1e-3, population_size=10,
                            neighboring_relation=NeighboringRelation.REPLACE_ONE,
                            sampling_method=SamplingMethod.WITHOUT_REPLACEMENT)
    s = PrivateStrategy(FedAvg(), 2.0, 1.0, 10, accountant=RdpAccountant(replace),
                        results_path=str(tmp_path / "r.json"))
    s.start(grid=FakeGrid(10, _move), initial_arrays=_init(), num_rounds=1)
    assert s.plan.relation == "replace-one" and s.accountant.relation == "replace-one"


def test_bad_values_given_flowers_way_are_refused_not_replaced(tmp_path):
    for kw, words in (({"clipping_norm": 0.0}, "clip_norm"), ({"delta": 0.0}, "delta"),
                      ({"num_users": 100.7}, "num_users")):
        args = {"noise_multiplier": 2.0, "num_users": 20, "num_rounds": 2, **kw}
        with pytest.raises(PlanError, match=words):
            PrivateStrategy(FedAvg(), results_path=str(tmp_path / "r.json"), **args)
    with pytest.raises(ValueError, match="no accountant="):
        PrivateStrategy(FedAvg(), 2.0, 1.0, 20, accountant=RdpAccountant(_config()),
                        checkpoint_path=str(tmp_path / "c.ckpt"), resume=True)


def test_a_given_noise_multiplier_is_capped_in_fedprivs_form_and_warned_in_flowers(
        tmp_path, caplog):
    """fedpriv's keywords keep the target epsilon = 1 as a ceiling for a given z (as before);
    Flower's form has no target: the projected epsilon is said before round 1."""
    with pytest.raises(PlanError, match="max_epsilon: the plan spends epsilon"):
        PrivateStrategy(FedAvg(), num_users=20, num_rounds=5, noise_multiplier=0.5,
                        results_path=str(tmp_path / "r.json"))
    caplog.set_level(logging.WARNING)
    s = PrivateStrategy(FedAvg(), 0.5, 1.0, 20, results_path=str(tmp_path / "r.json"))
    s.start(grid=FakeGrid(20, _move), initial_arrays=_init(), num_rounds=5)
    assert s.plan.epsilon is None and s.plan.projected_epsilon > 10
    said = f"will spend epsilon = {s.plan.projected_epsilon:.4f}"
    assert said in caplog.text
    assert s.privacy_spent().epsilon == pytest.approx(s.plan.projected_epsilon, rel=1e-6)


def test_the_plan_names_evaluation_rounds_only_where_fedpriv_chooses_them(tmp_path):
    """Without ``evaluate_every`` or private metrics the nodes evaluate whenever the inner
    strategy has them evaluate: the public plan says None, not the last round."""
    def plan(**kw):
        return PrivateStrategy(FedAvg(), num_users=8, num_rounds=3, delta=1e-3, **kw,
                               results_path=str(tmp_path / "r.json")).plan.public()

    assert plan()["evaluate_rounds"] is None
    assert plan(evaluate_every=3)["evaluate_rounds"] == [3]
    assert plan(private_metrics={"acc": 1.0}, exact_metrics="report")["evaluate_rounds"] == [3]
