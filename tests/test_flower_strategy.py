"""PrivateStrategy: user-level DP around a Flower strategy (fedpriv_flwr.strategy).

Driven through Flower's own ``Strategy.start`` loop on an in-memory grid (tests/flower_grid.py)
for the privacy properties; the simulation-engine test at the end runs the real runtime."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import (
    Bulyan,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    Krum,
    QFedAvg,
)

from fedpriv.algorithms.base import Algorithm, Part, Step
from fedpriv.configure import parse_config
from fedpriv.privacy.accounting import PlannedRelease, epsilon_of
from fedpriv.server.release import Releaser
from fedpriv_flwr.aggregate import USERS_KEY
from fedpriv_flwr.plan import PlanError
from fedpriv_flwr.strategy import PrivateStrategy
from tests.flower_grid import FakeGrid, run_in_simulation

SHAPES = {"w": (6, 5), "b": (5,)}
DIM = 35


def _init(value: float = 0.0) -> ArrayRecord:
    return ArrayRecord({k: Array(np.full(s, value, np.float32)) for k, s in SHAPES.items()})


def _shift(step: float):
    """Node i moves every coordinate by step * i (norms grow with the node id)."""
    return lambda node, arrays: {k: v + step * node for k, v in arrays.items()}


def _run(tmp_path: Path, grid: FakeGrid, rounds: int = 2, name: str = "r", **kw):
    kw.setdefault("num_users", len(grid.nodes))
    kw.setdefault("num_rounds", rounds)
    initial = kw.pop("initial", _init())
    s = PrivateStrategy(kw.pop("inner", FedAvg()), results_path=str(tmp_path / f"{name}.json"),
                        **kw)
    result = s.start(grid=grid, initial_arrays=initial)
    return s, result


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().reshape(-1).astype(np.float64) for k in SHAPES])


# ----- refused before round 1 -------------------------------------------------------------------
@pytest.mark.parametrize("inner", [Krum(), FedMedian(), FedTrimmedAvg(), Bulyan(),
                                   QFedAvg(client_learning_rate=0.1)])
def test_robust_aggregators_are_refused_by_name(inner):
    with pytest.raises(ValueError, match=type(inner).__name__):
        PrivateStrategy(inner, num_users=100, num_rounds=2)


def test_a_strategy_that_already_wraps_a_dp_wrapper_is_refused():
    dp = DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 10)
    with pytest.raises(ValueError, match="already adds differential privacy"):
        PrivateStrategy(dp, num_users=100, num_rounds=2)
    inner = PrivateStrategy(FedAvg(), num_users=100, num_rounds=2)
    with pytest.raises(ValueError, match="PrivateStrategy already adds"):
        PrivateStrategy(inner, num_users=100, num_rounds=2)


@pytest.mark.parametrize("inner", [FedAvg(), FedAvgM(), FedProx(), FedAdam()])
def test_mean_aggregators_are_accepted(inner):
    assert PrivateStrategy(inner, num_users=100, num_rounds=2).plan.multipliers["round"] > 0


@pytest.mark.parametrize("kw, key", [
    ({"epsilon": 5e4}, "epsilon"),  # would need multipliers below the floor
    ({"delta": 0.5}, "delta"),
    ({"num_rounds": 0}, "num_rounds"),
    ({"sampling_rate": 0.0}, "sampling_rate"),
    ({"clip_norm": -1.0}, "clip_norm"),
    ({"clip_quantile": 1.5}, "clip_quantile"),
    ({"noise_multiplier": 0.3, "epsilon": None, "max_epsilon": 1.0}, "max_epsilon"),
    ({"private_metrics": {"accuracy": -1.0}}, "private_metrics"),
])
def test_bad_plans_fail_before_round_1_naming_the_setting(kw, key):
    args = {"num_users": 1000, "num_rounds": 5, **kw}
    with pytest.raises(PlanError, match=key):
        PrivateStrategy(FedAvg(), **args)


def test_more_rounds_than_planned_are_refused_before_any_message(tmp_path):
    grid = FakeGrid(10, _shift(0.0))
    s = PrivateStrategy(FedAvg(), num_users=10, num_rounds=2, delta=1e-3,
                        results_path=str(tmp_path / "r.json"))
    with pytest.raises(ValueError, match="num_rounds"):
        s.start(grid=grid, initial_arrays=_init(), num_rounds=3)
    assert grid.sent == []


@pytest.mark.parametrize("pattern, problem", [("^nothing", "matches no"), (".", "every")])
def test_a_personal_pattern_matching_nothing_or_everything_fails_before_any_message(
        tmp_path, pattern, problem):
    grid = FakeGrid(10, _shift(0.0))
    with pytest.raises(ValueError, match=problem):
        _run(tmp_path, grid, delta=1e-3, personal_layers=pattern)
    assert grid.sent == []


# ----- the noise and the accounting -------------------------------------------------------------
def test_epsilon_is_the_pld_accountants_for_the_calibrated_plan(tmp_path):
    grid = FakeGrid(200, _shift(0.01))
    s, result = _run(tmp_path, grid, rounds=3, epsilon=1.0, delta=1e-5)
    z = s.plan.multipliers["round"]
    assert s.accountant.epsilon() == pytest.approx(epsilon_of({(z, 1.0): 3}, 1e-5), rel=1e-12)
    assert 0.99 <= s.accountant.epsilon() <= 1.0
    assert result.train_metrics_clientapp[3]["epsilon"] == pytest.approx(s.accountant.epsilon())


def test_privacy_noise_is_applied_with_the_stated_std(tmp_path):
    # every node sends the broadcast model back: the exact mean update is 0, what moves is noise
    big = {"w": (400, 100), "b": (100,)}
    init = ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in big.items()})
    grid = FakeGrid(50, lambda node, arrays: arrays)
    s, result = _run(tmp_path, grid, rounds=1, delta=1e-3, clip_norm=2.0, initial=init)
    released = np.concatenate([result.arrays[k].numpy().reshape(-1) for k in big])
    std = s.plan.multipliers["round"] * 2.0 / 50
    assert s.accountant.ledger[0]["noise_std"] == pytest.approx(std)
    assert np.std(released) == pytest.approx(std, rel=0.02)
    assert abs(np.mean(released)) < 5 * std / math.sqrt(released.size)


def test_the_noise_equals_fedprivs_own_release_for_the_same_seed_clip_and_z(tmp_path):
    grid = FakeGrid(40, lambda node, arrays: arrays)
    s, result = _run(tmp_path, grid, rounds=1, delta=1e-3, clip_norm=1.5, seed=7)
    z = s.plan.multipliers["round"]
    config = parse_config({"algorithm": "deep-dp-fedavg", "num-users": 40, "seed": 7,
                           "epsilon": 1.0, "delta": 1e-3})

    class Capture:  # the part of the Algorithm contract a release uses
        noise = Algorithm.noise
        released: dict = {}

        def apply(self, step, noisy):
            self.released.update(noisy)
            return {}

        def charge(self, step):
            return None, 1.0

    algorithm = Capture()
    releaser = Releaser(config, algorithm, [PlannedRelease("round", 1.0)], [z], None)  # type: ignore[arg-type]
    step = Step("round", 1, "round", (Part("update", (DIM,), 1.5),))
    releaser.check_budget([step], [step])
    releaser.gaussian(step, {"update": np.zeros(DIM)}, population=40)
    assert np.array_equal(_flat(result.arrays), algorithm.released["update"].astype(np.float32))
    assert releaser.accountant.epsilon() == pytest.approx(s.accountant.epsilon(), rel=1e-12)


def test_a_secure_run_draws_noise_the_seed_does_not_determine(tmp_path):
    runs = [_run(tmp_path, FakeGrid(20, lambda n, a: a), rounds=1, delta=1e-3, seed=3,
                 secure_noise=True, name=f"s{i}")[1].arrays for i in range(2)]
    assert not np.array_equal(_flat(runs[0]), _flat(runs[1]))
    seeded = [_run(tmp_path, FakeGrid(20, lambda n, a: a), rounds=1, delta=1e-3, seed=3,
                   name=f"p{i}")[1].arrays for i in range(2)]
    assert np.array_equal(_flat(seeded[0]), _flat(seeded[1]))
    release = json.loads((tmp_path / "s1.release.json").read_text())
    assert release["publishable"] and release["privacy"]["noise"] == "os-entropy"
    assert not json.loads((tmp_path / "p1.release.json").read_text())["publishable"]


@pytest.mark.parametrize("extreme", [1e9, np.nan, -1e12])
def test_one_user_moves_the_release_by_at_most_the_stated_sensitivity(tmp_path, extreme):
    """Neighbouring populations (one user removed), same seeds, whatever that user sends,
    whatever weight it claims: the releases differ by at most C / N."""
    n, clip = 30, 1.0
    normal = _shift(0.02)

    def odd(node, arrays):
        return ({k: np.full_like(v, extreme) for k, v in arrays.items()} if node == n
                else normal(node, arrays))

    with_user = FakeGrid(n, odd, weight_fn=lambda node: 1e6 if node == n else 1.0)
    without = FakeGrid(n - 1, normal)
    a, ra = _run(tmp_path, with_user, rounds=1, num_users=n, delta=1e-3, clip_norm=clip,
                 name="a")
    b, rb = _run(tmp_path, without, rounds=1, num_users=n, delta=1e-3, clip_norm=clip,
                 name="b")
    gap = np.linalg.norm(_flat(ra.arrays) - _flat(rb.arrays))
    assert gap <= clip / n * (1 + 1e-5)
    assert a.accountant.ledger[0]["l2_sensitivity"] == pytest.approx(clip / n)
    if np.isnan(extreme):
        (reason,) = a.rows[0]["rejected_nodes"]
        assert reason.startswith("holds non-finite values")


@pytest.mark.parametrize("value", [1e9, -5.0, np.nan, 0.9])
def test_one_user_moves_a_private_metric_by_at_most_its_bound_over_n(tmp_path, value):
    """The released metric is a mean over the declared population: neither the user's value
    nor whether it answered at all moves it by more than bound / N (same seeds)."""
    n = 40

    def metric(node):
        return {"accuracy": value if node == n else 0.5}

    kw = {"rounds": 1, "num_users": n, "delta": 1e-3, "private_metrics": {"accuracy": 1.0}}
    _, ra = _run(tmp_path, FakeGrid(n, _shift(0.0), metric_fn=metric), name="a", **kw)
    _, rb = _run(tmp_path, FakeGrid(n - 1, _shift(0.0), metric_fn=metric), name="b", **kw)
    gap = abs(ra.evaluate_metrics_clientapp[1]["accuracy"]
              - rb.evaluate_metrics_clientapp[1]["accuracy"])
    assert gap <= 1.0 / n * (1 + 1e-9)


def test_a_private_metric_is_not_rescaled_by_how_many_nodes_answered(tmp_path):
    """Silent nodes count as 0: a rescale by the number that answered would publish that
    (data-dependent) count through the metric."""
    n = 40

    class Silent(FakeGrid):
        def send_and_receive(self, messages, *, timeout=None):
            out = super().send_and_receive(messages, timeout=timeout)
            return [m for m in out if m.content.metric_records.get("metrics") is None
                    or "accuracy" not in m.content["metrics"]
                    or m.metadata.src_node_id % 4 != 0]

    kw = {"rounds": 1, "num_users": n, "delta": 1e-3, "private_metrics": {"accuracy": 1.0}}
    _, full = _run(tmp_path, FakeGrid(n, _shift(0.0), metric_fn=lambda node: {"accuracy": 1.0}),
                   name="a", **kw)
    _, part = _run(tmp_path, Silent(n, _shift(0.0), metric_fn=lambda node: {"accuracy": 1.0}),
                   name="b", **kw)
    gap = (full.evaluate_metrics_clientapp[1]["accuracy"]
           - part.evaluate_metrics_clientapp[1]["accuracy"])
    assert gap == pytest.approx(10 / n, abs=1e-9)  # the same noise; 10 silent nodes of 40


def test_poisson_sampling_is_accounted_and_the_sample_stays_in_the_operator_report(tmp_path):
    grid = FakeGrid(300, _shift(0.001))
    s, _ = _run(tmp_path, grid, rounds=2, epsilon=1.0, delta=1e-5, sampling_rate=0.2)
    z = s.plan.multipliers["round"]
    assert s.accountant.epsilon() == pytest.approx(epsilon_of({(z, 0.2): 2}, 1e-5), rel=1e-12)
    sampled = [r["sampled_nodes"] for r in s.rows]
    trained = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(30 <= k <= 90 for k in sampled) and len(trained) == sum(sampled)
    release = (tmp_path / "r.release.json").read_text()
    assert "sampled_nodes" not in release and "users" not in json.loads(release)["rounds"][0]


def test_adaptive_clipping_moves_the_clip_and_accounts_the_count(tmp_path):
    # update norms sqrt(35) * 0.01 * node: node 1..100 -> 0.06 .. 5.9; median ~3
    grid = FakeGrid(100, _shift(0.01))
    s, _ = _run(tmp_path, grid, rounds=4, epsilon=4.0, delta=1e-4, clip_norm=0.5,
                clip_quantile=0.5, clip_lr=0.5)
    clips = [r["clip_norm"] for r in s.rows]
    assert clips[0] == 0.5 and clips[-1] > clips[0] * 1.5  # most users clipped: the clip grows
    entry = s.accountant.ledger[0]
    assert [p["name"] for p in entry["parts"]] == ["update", "unclipped"]
    z = s.plan.multipliers["round"]
    # the two parts are one Gaussian mechanism with the planned multiplier
    assert sum(1 / p["noise_multiplier"] ** 2 for p in entry["parts"]) == pytest.approx(1 / z**2)
    assert s.accountant.epsilon() <= 4.0


def test_bad_replies_are_rejected_and_counted_and_the_run_goes_on(tmp_path):
    def reply(node, arrays):
        if node == 1:
            return {"w": np.zeros((2, 2))}  # wrong shape, missing key
        if node == 2:
            return {k: np.full_like(v, np.inf) for k, v in arrays.items()}
        if node == 3:
            return None  # fails
        return {k: v + 0.01 for k, v in arrays.items()}

    s, result = _run(tmp_path, FakeGrid(10, reply), rounds=2, delta=1e-3)
    row = s.rows[0]
    assert row["answered_nodes"] == 7 and row["failed_nodes"] == 1
    assert sum(row["rejected_nodes"].values()) == 2
    assert result.arrays is not None and len(s.accountant.ledger) == 2


def test_flower_result_and_logs_get_no_exact_metric(tmp_path):
    grid = FakeGrid(50, _shift(0.0), metric_fn=lambda node: {"accuracy": 0.8, "loss": 0.3})
    s, result = _run(tmp_path, grid, rounds=2, delta=1e-3,
                     private_metrics={"accuracy": 1.0})
    assert set(result.train_metrics_clientapp[1]) == {"epsilon", "clip-norm"}
    assert set(result.evaluate_metrics_clientapp) == {2}  # the planned evaluation round only
    (noisy,) = result.evaluate_metrics_clientapp[2].values()
    assert noisy != 0.8 and abs(noisy - 0.8) < 10 * s.accountant.ledger[-1]["noise_std"] * 50
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rounds"][1]["exact_metrics"] == pytest.approx({"accuracy": 0.8, "loss": 0.3})
    release = json.loads((tmp_path / "r.release.json").read_text())
    def keys(doc):
        if isinstance(doc, dict):
            return set(doc) | {k for v in doc.values() for k in keys(v)}
        return {k for v in doc for k in keys(v)} if isinstance(doc, list) else set()

    assert not keys(release) & {"exact_metrics", "seed", "users", "unclipped_users",
                                "sampled_nodes", "answered_nodes", "evaluated_nodes"}
    assert release["rounds"][1]["private_metrics"]["accuracy"] != pytest.approx(0.8)
    assert set(release["rounds"][1]) <= {"round", "epsilon_spent", "clip_norm",
                                          "private_metrics"}
    s2, r2 = _run(tmp_path, FakeGrid(50, _shift(0.0), metric_fn=lambda node: {"loss": 0.3}),
                  rounds=1, delta=1e-3, exact_metrics="operator-only", name="o")
    assert r2.evaluate_metrics_clientapp[1]["operator-only/loss"] == pytest.approx(0.3)


def test_fedadam_applies_its_server_step_to_the_noisy_mean(tmp_path):
    s, result = _run(tmp_path, FakeGrid(30, _shift(0.01)), rounds=2, delta=1e-3,
                     inner=FedAdam(eta=0.1))
    assert np.all(np.isfinite(_flat(result.arrays)))
    assert len(s.accountant.ledger) == 2


def test_checkpoint_and_resume_continue_the_same_run(tmp_path):
    def run(stop_after: int | None, name: str):
        calls = {"n": 0}
        normal = _shift(0.01)

        def reply(node, arrays):
            if node == 1:
                calls["n"] += 1
                if stop_after is not None and calls["n"] > stop_after:
                    raise KeyboardInterrupt  # the server dies mid-round
            return normal(node, arrays)

        return reply

    kw = {"rounds": 4, "delta": 1e-3, "clip_quantile": 0.5, "seed": 11}
    full, rf = _run(tmp_path, FakeGrid(20, run(None, "f")), name="full", **kw)
    ck = str(tmp_path / "ck")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, FakeGrid(20, run(2, "x")), name="part", checkpoint_path=ck, **kw)
    resumed, rr = _run(tmp_path, FakeGrid(20, run(None, "y")), name="part", checkpoint_path=ck,
                       resume=True, **kw)
    assert resumed.accountant.epsilon() == pytest.approx(full.accountant.epsilon(), rel=1e-12)
    assert [e["release"] for e in resumed.accountant.ledger] == [
        e["release"] for e in full.accountant.ledger]
    assert resumed.clip == pytest.approx(full.clip)
    assert np.allclose(_flat(rr.arrays), _flat(rf.arrays), atol=1e-6)
    assert not Path(ck).exists()  # a finished run removes its checkpoint


def test_budget_guard_stops_a_release_beyond_the_plan(tmp_path):
    s = PrivateStrategy(FedAvg(), num_users=20, num_rounds=1, delta=1e-3,
                        results_path=str(tmp_path / "r.json"))
    grid = FakeGrid(20, _shift(0.0))
    s.start(grid=grid, initial_arrays=_init())
    with pytest.raises(PrivacyBudgetExhausted):
        s.configure_train(2, _init(), __import__("flwr").app.ConfigRecord(), grid)


def _user_sum_grid(nodes, models_for, edit=lambda node, content: None):
    """A FakeGrid whose nodes answer each train message with ``user_sum_reply`` of the user
    models ``models_for(node, broadcast)`` gives (``edit`` may change the reply's content)."""
    from flwr.app import Message

    from fedpriv_flwr.users import user_sum_reply

    grid = FakeGrid(nodes, lambda node, arrays: arrays)

    def send(messages, timeout=None):
        out = []
        for m in messages:
            if m.metadata.message_type != "train":
                continue
            node = m.metadata.dst_node_id
            base = {k: v.numpy() for k, v in m.content["arrays"].items()}
            content = user_sum_reply(m, models_for(node, base))
            edit(node, content)
            out.append(Message(content, reply_to=m))
        return out

    grid.send_and_receive = send  # type: ignore[method-assign]  # nodes answer with sums
    return grid


def test_multi_user_nodes_send_clipped_sums_and_an_oversized_sum_is_rejected(tmp_path):
    def models(node, base):  # each node hosts 3 users
        users = [{k: v + 10.0 * (u + 1) for k, v in base.items()} for u in range(3)]
        if node == 2:  # one user's NaN costs only that user
            users[0] = {k: np.full_like(v, np.nan) for k, v in users[0].items()}
        return users

    def lie(node, content):
        if node == 1:
            content["metrics"][USERS_KEY] = 1  # claims 1 user for a sum of 3 clipped ones

    grid = _user_sum_grid(4, models, lie)
    s, _ = _run(tmp_path, grid, rounds=1, num_users=12, delta=1e-3, multi_user_nodes=True)
    row = s.rows[0]
    assert row["users"] == 9 and row["unclipped_users"] == 0  # node 1 (3 users) rejected
    assert sum(row["rejected_nodes"].values()) == 1
    assert row["answered_nodes"] == 3


# ----- the real runtime -------------------------------------------------------------------------
SIM_APP = '''
import json, os
import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from fedpriv_flwr import PrivateStrategy
from fedpriv_flwr.personal import personalize

app = ClientApp(mods=[personalize("^b$")])  # each node keeps its own bias

@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    arrays = {k: Array(v.numpy() + 0.05 * (pid + 1)) for k, v in msg.content["arrays"].items()}
    return Message(RecordDict({"arrays": ArrayRecord(arrays),
                               "metrics": MetricRecord({"num-examples": 10 ** pid})}),
                   reply_to=msg)

@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.75,
                                                         "num-examples": 1})}), reply_to=msg)

server = ServerApp()

@server.main()
def main(grid: Grid, context: Context) -> None:
    out = os.environ["SIM_OUT"]
    strategy = PrivateStrategy(FedAvg(), num_users=6, num_rounds=2, epsilon=2.0, delta=1e-2,
                               clip_norm=0.5, private_metrics={"accuracy": 1.0},
                               personal_layers="^b$",
                               results_path=os.path.join(out, "report.json"))
    init = ArrayRecord({"w": Array(np.zeros((4, 3), np.float32)),
                        "b": Array(np.zeros(3, np.float32))})
    result = strategy.start(grid=grid, initial_arrays=init)
    with open(os.path.join(out, "result.json"), "w") as fh:
        json.dump({"train": {str(k): dict(v) for k, v in result.train_metrics_clientapp.items()},
                   "evaluate": {str(k): dict(v)
                                for k, v in result.evaluate_metrics_clientapp.items()},
                   "multiplier": strategy.plan.multipliers["round"],
                   "b": result.arrays["b"].numpy().tolist()}, fh)
'''


@pytest.mark.integration
def test_the_wrapper_runs_in_flowers_simulation_engine(tmp_path, flower_env):
    (tmp_path / "sim_app.py").write_text(SIM_APP)
    proc = run_in_simulation("sim_app", str(tmp_path), 6, {**flower_env, "SIM_OUT": str(tmp_path)},
                             str(tmp_path))
    out = tmp_path / "result.json"
    assert proc.returncode == 0 and out.is_file(), (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    report = json.loads((tmp_path / "report.json").read_text())
    z = result["multiplier"]
    epsilon = epsilon_of({(z, 1.0): 2, (report["plan"]["noise_multipliers"]["evaluate"], 1.0):
                          1}, 1e-2)
    assert report["epsilon"] == pytest.approx(epsilon, rel=1e-9) and epsilon <= 2.0
    assert f"fedpriv: epsilon spent = {epsilon:.4f}" in proc.stdout + proc.stderr
    assert [r["answered_nodes"] for r in report["rounds"]] == [6, 6]
    # the personal bias never reached the server (a reply carrying it would be rejected), and
    # the server's copy of it is never updated
    assert [r["rejected_nodes"] for r in report["rounds"]] == [{}, {}]
    assert result["b"] == [0.0, 0.0, 0.0]
    assert result["train"]["2"].keys() == {"epsilon", "clip-norm"}
    assert result["evaluate"].keys() == {"2"} and "accuracy" in result["evaluate"]["2"]
    assert result["evaluate"]["2"]["accuracy"] != pytest.approx(0.75)
    assert report["rounds"][1]["exact_metrics"]["accuracy"] == pytest.approx(0.75)


def test_resume_counts_the_evaluation_released_before_the_crash(tmp_path):
    calls = {"n": 0}

    def reply(node, arrays):
        if node == 1:
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt  # dies in round 2's training, after evaluation 1
        return {k: v + 0.01 for k, v in arrays.items()}

    kw = {"rounds": 3, "delta": 1e-3, "seed": 5, "evaluate_every": 1,
          "private_metrics": {"accuracy": 1.0}}
    metric = lambda node: {"accuracy": 0.5}  # noqa: E731
    full, _ = _run(tmp_path, FakeGrid(10, _shift(0.01), metric_fn=metric), name="full", **kw)
    ck = str(tmp_path / "ck")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, FakeGrid(10, reply, metric_fn=metric), name="p", checkpoint_path=ck, **kw)
    resumed, _ = _run(tmp_path, FakeGrid(10, _shift(0.01), metric_fn=metric), name="p",
                      checkpoint_path=ck, resume=True, **kw)
    assert [e["release"] for e in resumed.accountant.ledger] == [
        e["release"] for e in full.accountant.ledger]
    assert resumed.releases == full.releases  # no noise stream used twice
    assert resumed.accountant.epsilon() == pytest.approx(full.accountant.epsilon(), rel=1e-12)


def test_malformed_replies_are_rejected_without_stopping_the_run(tmp_path):
    def reply(node, arrays):
        if node == 1:
            return {k: np.full(v.shape, "x") for k, v in arrays.items()}  # strings
        return {k: v + 0.01 for k, v in arrays.items()}

    s, _ = _run(tmp_path, FakeGrid(6, reply), rounds=1, delta=1e-2)
    assert s.rows[0]["answered_nodes"] == 5 and sum(s.rows[0]["rejected_nodes"].values()) == 1


def test_multi_user_nodes_refuse_private_metrics_and_personal_layers():
    with pytest.raises(ValueError, match="private_metrics"):
        PrivateStrategy(FedAvg(), num_users=100, num_rounds=2, multi_user_nodes=True,
                        private_metrics={"accuracy": 1.0})
    with pytest.raises(ValueError, match="personal_layers"):
        PrivateStrategy(FedAvg(), num_users=100, num_rounds=2, multi_user_nodes=True,
                        personal_layers="^b$")


@pytest.mark.parametrize("factor, bad_counts", [(1.0, {}), (2.0, {"nan": 1})])
def test_multi_user_replies_with_bad_users_or_counts(tmp_path, factor, bad_counts):
    """A user with a missing key or wrong shape adds nothing to its node's sum (the node's other
    users still count); a non-finite user count is rejected; with factor 2 a node's sum is
    checked against C (it must clip its sum)."""
    def models(node, base):
        users = [{k: v + 1.0 for k, v in base.items()} for _ in range(3)]
        users[0].pop("b")  # missing key
        users[1]["w"] = np.zeros((2, 2))  # wrong shape
        return users

    def bad_count(node, content):
        if node == 3 and bad_counts:
            content["metrics"][USERS_KEY] = float("nan")

    grid = _user_sum_grid(3, models, bad_count)
    s, _ = _run(tmp_path, grid, rounds=1, num_users=9, delta=1e-2, clip_norm=1.0,
                multi_user_nodes=True, user_sensitivity_factor=factor)
    row = s.rows[0]
    if factor == 1.0:
        assert row["answered_nodes"] == 3 and row["rejected_nodes"] == {}
    else:  # each node's sum is one user's clipped update (norm 1 = C): accepted; nan rejected
        assert row["answered_nodes"] == 2 and sum(row["rejected_nodes"].values()) == 1


def test_a_node_clipping_its_sum_is_checked_against_c_with_factor_2(tmp_path):
    """user_sensitivity_factor = 2 states that a node clips the sum of its users to C: a sum
    above C (what k users clipped one by one can make) is rejected, one within C accepted."""
    def models(node, base):  # node 1's sum of 3 users has norm 3 > C
        return [{k: v + 1.0 for k, v in base.items()} for _ in range(3 if node == 1 else 1)]

    grid = _user_sum_grid(2, models)
    s, _ = _run(tmp_path, grid, rounds=1, num_users=4, delta=1e-2, clip_norm=1.0,
                multi_user_nodes=True, user_sensitivity_factor=2.0)
    row = s.rows[0]
    assert row["answered_nodes"] == 1 and row["users"] == 1
    assert sum(row["rejected_nodes"].values()) == 1
