"""PrivateStrategy where Flower's DP wrapper stood (fedpriv_flwr.agreement, fedpriv_flwr.parity):
what a Flower user reads, the inner strategy's sampling and evaluation settings kept or refused,
the personal-layer schedule agreed with the nodes' mod, and rounds with no accepted reply said
plainly. Driven through Flower's own ``Strategy.start`` on the in-memory grid."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import PrivacySpent
from flwr.serverapp.strategy import FedAvg

from fedpriv.privacy.accounting import epsilon_of
from fedpriv_flwr.personal import PERSONAL_CONFIG, personalize
from fedpriv_flwr.strategy import PrivateStrategy
from tests.flower_grid import FakeGrid

SHAPES = {"body": (4, 3), "head": (3,)}


def _init() -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in SHAPES.items()})


def _move(node: int, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v + 0.01 for k, v in arrays.items()}


def _strategy(tmp_path, inner=None, **kw) -> PrivateStrategy:
    kw.setdefault("num_users", 8)
    kw.setdefault("num_rounds", 2)
    kw.setdefault("delta", 1e-3)
    return PrivateStrategy(inner or FedAvg(), results_path=str(tmp_path / "r.json"), **kw)


# ----- what a Flower user reads -----------------------------------------------------------------
def test_privacy_spent_and_the_wrappers_attributes_are_the_accountants(tmp_path):
    s = _strategy(tmp_path)
    assert s.privacy_spent().epsilon == 0 and s.privacy_spent().num_releases == 0
    s.start(grid=FakeGrid(8, _move), initial_arrays=_init())
    spent = s.privacy_spent()
    assert isinstance(spent, PrivacySpent) and spent.num_releases == 2
    z = s.noise_multiplier
    assert z == s.plan.multipliers["round"] > 0 and s.clipping_norm == s.clip == 1.0
    # an independent computation: two full-participation Gaussian releases of multiplier z
    assert spent.epsilon == pytest.approx(epsilon_of({(z, 1.0): 2}, 1e-3, "pld"), rel=1e-9)
    assert spent.delta == 1e-3 and spent.accounting_method.startswith("pld")
    assert 0.99 <= spent.epsilon <= 1.0 + 1e-9  # calibrated to the default target


# ----- the inner strategy's sampling settings ---------------------------------------------------
def test_fraction_train_is_the_poisson_rate_the_plan_is_calibrated_for(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    s = _strategy(tmp_path, FedAvg(fraction_train=0.25), num_users=40, num_rounds=3)
    assert s.plan.sampling_rate == 0.25
    assert "fraction_train=0.25 is the Poisson sampling rate" in caplog.text
    full = _strategy(tmp_path, num_users=40, num_rounds=3)
    assert s.noise_multiplier < full.noise_multiplier  # amplification by sampling, accounted
    grid = FakeGrid(40, _move)
    s.start(grid=grid, initial_arrays=_init())
    trained = [row["sampled_nodes"] for row in s.rows if "sampled_nodes" in row]
    sent = sum(1 for m in grid.sent if m.metadata.message_type == "train")
    assert len(trained) == 3 and 0 < sent == sum(trained) < 3 * 40  # about 10 of 40 a round
    assert "trains" in caplog.text and "Poisson sampling at rate 0.25" in caplog.text


@pytest.mark.parametrize("inner, kw, words", [
    (FedAvg(fraction_train=0.25), {"sampling_rate": 0.5}, "disagree"),
    (FedAvg(fraction_train=0.0), {}, "fraction_train=0.0"),
    (FedAvg(fraction_train=0.5, min_train_nodes=10), {}, "min_train_nodes=10"),
    (FedAvg(fraction_train=0.5), {"multi_user_nodes": True}, "multi_user_nodes"),
    (FedAvg(fraction_train=0.5), {"secure_noise": True}, "fraction_train=0.5.*secure_noise"),
    (FedAvg(fraction_evaluate=0.5), {"private_metrics": {"accuracy": 1.0}},
     "fraction_evaluate=0.5"),
])
def test_sampling_settings_that_cannot_be_kept_are_refused_naming_them(tmp_path, inner, kw,
                                                                      words):
    with pytest.raises(ValueError, match=words):
        _strategy(tmp_path, inner, **kw)


def test_the_same_rate_given_twice_and_the_default_minimum_are_kept(tmp_path):
    s = _strategy(tmp_path, FedAvg(fraction_train=0.5), sampling_rate=0.5)
    assert s.plan.sampling_rate == 0.5
    assert _strategy(tmp_path, FedAvg(min_train_nodes=10)).plan.sampling_rate == 1.0


# ----- evaluation: Flower's flow ----------------------------------------------------------------
def test_fraction_evaluate_is_respected_and_flowers_result_has_the_metrics(tmp_path):
    grid = FakeGrid(8, _move, metric_fn=lambda node: {"accuracy": node / 10})
    s = _strategy(tmp_path, FedAvg(fraction_evaluate=0.5, min_evaluate_nodes=2))
    result = s.start(grid=grid, initial_arrays=_init())
    evaluated = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert len(evaluated) == 2 * 4  # every round, half of the nodes (FedAvg's own sample)
    assert all(m.content["config"][PERSONAL_CONFIG] == "" for m in evaluated)
    metrics = result.evaluate_metrics_clientapp
    assert set(metrics) == {1, 2} and 0.1 <= metrics[2]["accuracy"] <= 0.8  # FedAvg's mean
    release = json.loads((tmp_path / "r.release.json").read_text())
    assert "accuracy" not in json.dumps(release)  # exact metrics never reach the release


def test_replies_the_inner_strategy_cannot_aggregate_cost_a_round_entry_not_the_run(
        tmp_path, caplog):
    """One node reporting another metric name makes FedAvg's aggregate refuse the round's
    replies (InconsistentMessageReplies): that round has no entry in Flower's result."""
    caplog.set_level(logging.WARNING)
    grid = FakeGrid(8, _move, metric_fn=lambda node: {"loss" if node == 3 else "accuracy": 0.5})
    s = _strategy(tmp_path)
    result = s.start(grid=grid, initial_arrays=_init())
    assert len(s.accountant.ledger) == 2 and not result.evaluate_metrics_clientapp
    assert "FedAvg could not aggregate the evaluation replies" in caplog.text
    assert s.rows[-1]["exact_metrics"] == {"accuracy": 0.5, "loss": 0.5}  # the report's


def test_no_evaluation_when_the_inner_strategy_evaluates_no_node(tmp_path):
    grid = FakeGrid(8, _move, metric_fn=lambda node: {"accuracy": 0.5})
    s = _strategy(tmp_path, FedAvg(fraction_evaluate=0.0))
    s.start(grid=grid, initial_arrays=_init())
    assert not [m for m in grid.sent if m.metadata.message_type == "evaluate"]


def test_private_metrics_keep_the_planned_rounds_and_refuse_flowers_exact_flow(tmp_path):
    with pytest.raises(ValueError, match="exact_metrics='flower' with private_metrics"):
        _strategy(tmp_path, private_metrics={"accuracy": 1.0}, exact_metrics="flower")
    grid = FakeGrid(8, _move, metric_fn=lambda node: {"accuracy": 0.5})
    s = _strategy(tmp_path, private_metrics={"accuracy": 1.0})
    result = s.start(grid=grid, initial_arrays=_init())
    assert set(result.evaluate_metrics_clientapp) == {2}  # the last round only (the plan's)


# ----- the population ---------------------------------------------------------------------------
def test_a_population_that_is_not_the_connected_nodes_is_warned_not_refused(tmp_path, caplog):
    """num_users=300 with 20 SuperNodes: said in Flower's log and the operator report; not a
    refusal (how many nodes connect changes with one user's presence)."""
    caplog.set_level(logging.WARNING)
    s = _strategy(tmp_path, num_users=300, num_rounds=1)
    s.start(grid=FakeGrid(20, _move), initial_arrays=_init())
    assert "20 SuperNodes are connected but num_users=300" in caplog.text
    assert "15 times slower" in caplog.text
    report = json.loads((tmp_path / "r.json").read_text())
    assert "num_users=300" in report["population_warning"]
    caplog.clear()
    fine = _strategy(tmp_path, num_users=20, num_rounds=1)
    fine.start(grid=FakeGrid(20, _move), initial_arrays=_init())
    assert "SuperNodes are connected" not in caplog.text and fine.population_note == ""


# ----- the schedule -----------------------------------------------------------------------------
class ModGrid(FakeGrid):
    """Nodes whose ClientApp runs the personalize mod (``schedule``) before a handler that
    moves every array it gets, or no mod (``schedule=None``)."""

    def __init__(self, nodes: int, pattern: str, schedule: str | None) -> None:
        super().__init__(nodes, _move)
        self.mod = personalize(pattern, schedule) if schedule else None
        self.states: dict[int, RecordDict] = {}

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            self.sent.append(m)
            node = m.metadata.dst_node_id

            def handler(msg, context, node=node):
                if msg.metadata.message_type == "evaluate":
                    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}),
                                   reply_to=msg)
                arrays = {k: v.numpy() for k, v in msg.content["arrays"].items()}
                new = _move(node, arrays)
                return Message(RecordDict({
                    "arrays": ArrayRecord({k: Array(v) for k, v in new.items()}),
                    "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

            context = Context(run_id=1, node_id=node, node_config={},
                              state=self.states.setdefault(node, RecordDict()), run_config={})
            reply = (self.mod(m, context, handler) if self.mod else handler(m, context))
            self.received.append(reply)
            out.append(reply)
        return out


@pytest.mark.parametrize("server, schedule, words", [
    (None, "fedrep", "without personal_layers"),  # FedRep on the client only
    ("^head", "finetune", "needs no personal_layers"),  # FedRep on the server only
    ("^head", None, "carry the personal layers"),  # no mod on the client
])
def test_a_schedule_the_nodes_do_not_share_is_reported_in_each_round_and_at_the_end(
        tmp_path, server, schedule, words, caplog):
    """Said plainly (Flower's log at ERROR, the operator report, the closing line), naming
    both sides; the run is not stopped (a reply is a user's: module agreement), and the
    release is what any round without accepted replies releases."""
    caplog.set_level(logging.WARNING)
    grid = ModGrid(8, "^head", schedule)
    s = _strategy(tmp_path, personal_layers=server)
    s.start(grid=grid, initial_arrays=_init())
    rounds = [row for row in s.rows if "answered_nodes" in row]
    assert [row["answered_nodes"] for row in rounds] == [0, 0]
    assert all(words in row["schedule_mismatch"] for row in rounds)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert sum("every reply disagrees with the server on the personal layers" in m
               for m in errors) == 3  # each round, and the closing line
    assert "2 of 2 rounds had no accepted reply" in caplog.text and words in errors[-1]
    assert len(s.accountant.ledger) == 2  # the releases are made, as for any empty round
    release = (tmp_path / "r.release.json").read_text()
    assert "mismatch" not in release and "personal layers" not in release


def test_an_agreed_schedule_trains_and_keeps_the_head_on_the_node(tmp_path):
    grid = ModGrid(8, "^head", "fedrep")
    s = _strategy(tmp_path, personal_layers="^head")
    s.start(grid=grid, initial_arrays=_init())
    assert [row["answered_nodes"] for row in s.rows] == [8, 8]
    assert all("head" not in r.content["arrays"] for r in grid.received
               if r.metadata.message_type == "train")
    finetune = ModGrid(8, "^head", "finetune")
    s = _strategy(tmp_path)
    s.start(grid=finetune, initial_arrays=_init())
    assert [row["answered_nodes"] for row in s.rows] == [8, 8]


@pytest.mark.parametrize("nodes", [8, 1])
def test_a_node_claiming_a_mismatch_is_a_failed_node_alone_or_not(tmp_path, nodes):
    """One node that says "schedule mismatch" (alone in its round, or beside honest ones)
    changes nothing but its own reply: the run goes on."""
    from flwr.app import Error

    grid = ModGrid(nodes, "^head", "fedrep")
    real = grid.send_and_receive

    def one_liar(messages, *, timeout=None):
        messages = list(messages)
        replies = real(messages, timeout=timeout)
        if messages[0].metadata.message_type == "train":
            replies[0] = Message(Error(code=0, reason="personalize: schedule mismatch: lies"),
                                 reply_to=messages[0])
        return replies

    grid.send_and_receive = one_liar
    inner = FedAvg(min_available_nodes=1, min_train_nodes=1, min_evaluate_nodes=1)
    s = _strategy(tmp_path, inner, num_users=nodes, personal_layers="^head")
    s.start(grid=grid, initial_arrays=_init())
    assert [row["answered_nodes"] for row in s.rows] == [nodes - 1] * 2
    assert len(s.accountant.ledger) == 2


# ----- rounds with no accepted reply ------------------------------------------------------------
def test_rounds_with_no_accepted_reply_are_said_plainly_and_kept_out_of_the_release(
        tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    s = _strategy(tmp_path)
    s.start(grid=FakeGrid(8, lambda node, arrays: None), initial_arrays=_init())
    assert all(row["no_accepted_reply"] for row in s.rows if "answered_nodes" in row)
    assert caplog.text.count("no reply was accepted (8 nodes sampled, 8 failed") == 2
    assert "2 of 2 rounds had no accepted reply" in caplog.text
    assert "the model learned nothing from the nodes" in caplog.text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rounds"][0]["failed_reasons"] == {"node failed": 8}
    release = (tmp_path / "r.release.json").read_text()
    assert "no_accepted_reply" not in release and "failed" not in release
    caplog.clear()
    _strategy(tmp_path).start(grid=FakeGrid(8, _move), initial_arrays=_init())
    assert "no accepted reply" not in caplog.text and "no reply was accepted" not in caplog.text


# ----- the migration page -----------------------------------------------------------------------
def _migration_blocks() -> list[str]:
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "tutorials" / "flower-app.md")
    section = page.read_text().split("## From Flower's DP wrapper to PrivateStrategy", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)[:3]


def test_the_migration_page_runs_before_and_after_in_few_changed_lines(tmp_path, capsys,
                                                                      monkeypatch):
    """The three blocks of docs/tutorials/flower-app.md ("From Flower's DP wrapper"), run as
    written on an in-memory grid of 20 nodes: Flower's wrapper with its RDP accountant; the
    same call with ``PrivateStrategy`` (the class and its import changed: at most 4 lines), the
    same noise, so the same release up to the noise draws, and the PLD epsilon printed where
    RDP reports more; and the target stated instead of the noise, calibrated to it. All three
    keep Flower's evaluation (half the nodes, metrics in Flower's result)."""
    import difflib

    from fedpriv_flwr import calibrate_noise_multiplier

    before, after, target = _migration_blocks()
    changed = [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(),
                                                     lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    added, removed = (sum(line.startswith(c) for line in changed) for c in "+-")
    assert max(added, removed) <= 4, changed  # lines changed (a replaced line counts once)
    monkeypatch.chdir(tmp_path)  # the drop-in block writes its report where it runs
    z = calibrate_noise_multiplier(1.0, 1e-5, 3)
    cfg = {"num-users": 20, "num-rounds": 3, "epsilon": 1.0, "delta": 1e-5, "clip-norm": 1.0,
           "noise-multiplier": z, "results-path": str(tmp_path / "r.json")}
    runs = {}
    for name, code in (("before", before), ("after", after), ("target", target)):
        grid = FakeGrid(20, _move, metric_fn=lambda node: {"accuracy": 0.5})
        scope = {"cfg": cfg, "grid": grid, "arrays": _init()}
        exec(compile(code, f"flower-app.md ({name})", "exec"), scope)
        runs[name] = (scope["strategy"], scope["result"], grid, capsys.readouterr().out)
    for _, result, grid, _ in runs.values():
        assert len([m for m in grid.sent if m.metadata.message_type == "evaluate"]) == 3 * 10
        assert result.evaluate_metrics_clientapp[3]["accuracy"] == pytest.approx(0.5)
    printed = {k: float(v[3].split("epsilon spent = ")[1]) for k, v in runs.items()}
    assert 0.99 <= printed["after"] <= 1.0 + 1e-4 and printed["before"] > printed["after"] * 1.02
    assert printed["target"] == pytest.approx(printed["after"], abs=1e-4)
    assert runs["target"][0].noise_multiplier == pytest.approx(z, rel=1e-9)
    assert (tmp_path / "results" / "flower-operator-report.json").is_file()
    assert printed["after"] == pytest.approx(runs["after"][0].privacy_spent().epsilon, abs=1e-4)


# ----- the personal head, fitted by the library -------------------------------------------------
def _net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _personal_phase(model, schedule="fedrep", pattern=r"^2\."):
    from flwr.app import ConfigRecord

    from fedpriv_flwr.personal import STATE_KEY, personal_phases

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    context.state[STATE_KEY] = ConfigRecord({"pattern": pattern, "schedule": schedule,
                                             "kind": "train", "message-type": "train",
                                             "source": "server"})
    return personal_phases(model, context)


def test_fit_head_is_fedprivs_deep_fedrep_rule_on_the_nodes_rows_and_leaves_the_body():
    """The head after ``phase.fit_head`` equals fedpriv's own ``fit_heads`` on the same
    features (the inputs of the head layer) from the same start; the body is untouched; the
    loss falls; the data may come as a DataLoader in batches or as one pair."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from fedpriv.algorithms.deep.head_fit import fit_heads

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    model = _net()
    body = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("2.")}
    with torch.no_grad():
        feats = model[1](model[0](x))
        start = torch.cat([model[2].weight.reshape(-1), model[2].bias])[None]
        before = float(torch.nn.functional.cross_entropy(model(x), y))
    expected = fit_heads(feats[None], y[None], torch.ones(1, 40), 3, 50, 1.0, init=start)[0]
    personal, shared = _personal_phase(model)
    assert personal.name == "personal" and shared.name == "shared"
    with personal:
        loss = personal.fit_head(DataLoader(TensorDataset(x, y), batch_size=16), steps=50)
    got = torch.cat([model[2].weight.reshape(-1), model[2].bias])
    assert torch.allclose(got, expected, atol=1e-5)
    assert loss < before and all(torch.equal(model.state_dict()[k], v) for k, v in body.items())
    again = _net()
    with _personal_phase(again)[0] as phase:
        phase.fit_head((x, y), steps=50)
    assert torch.allclose(torch.cat([again[2].weight.reshape(-1), again[2].bias]), expected,
                          atol=1e-5)


def test_fit_head_refuses_personal_layers_that_are_not_one_linear_head():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 5),
                                torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with _personal_phase(model, pattern=r"^(2|4)\.")[0] as personal:  # two layers
        assert personal.name == "personal"
        with pytest.raises(ValueError, match="one torch.nn.Linear"):
            personal.fit_head((torch.zeros(4, 6), torch.zeros(4, dtype=torch.long)))
