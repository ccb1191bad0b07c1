"""A multi-user node's failure on one user costs only that user (fedpriv_flwr.users), and the
wrapper's secure_noise is exact discrete Gaussian noise on a grid (fedpriv_flwr.grid).

Neighbouring datasets D and D' (one hostile user added to, or replacing an honest user of, a
node that hosts honest users), same seeds so identical noise: the releases differ by at most
the stated L2 sensitivity, and the node's other users still count. The nodes answer through
the handler the docs show (``per_user`` + ``user_sum_reply``); an exception in a handler
becomes Flower's error reply, as in a ClientApp, which would drop the whole node."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Error, Message
from flwr.serverapp.strategy import FedAvg

from fedpriv.privacy.discrete import CryptoRandom
from fedpriv.privacy.grid import central_grid
from fedpriv_flwr.grid import noisy_mean_on_grid
from fedpriv_flwr.plan import PlanError
from fedpriv_flwr.strategy import PrivateStrategy
from fedpriv_flwr.users import per_user, sample_users, user_sum_reply
from tests.flower_grid import FakeGrid
from tests.test_flower_strategy import SHAPES, _flat, _init, _run

NODES, PER_NODE, CLIP = 3, 4, 1.0
NUM_USERS = NODES * PER_NODE + 1  # the declared population (room for the added user)


def _rows(user: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(user)
    x = torch.randn(8, SHAPES["w"][0], generator=g)
    return x, torch.zeros(8, dtype=torch.long)  # alike users: losing a node shows


def local_train(arrays, rows):
    """A user's training (softmax regression, 3 steps): its model as a torch state dict."""
    w = torch.tensor(arrays["w"].numpy(), requires_grad=True)
    b = torch.tensor(arrays["b"].numpy(), requires_grad=True)
    x, y = rows
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(x @ w + b, y)  # IndexError on a bad label
        gw, gb = torch.autograd.grad(loss, (w, b))
        with torch.no_grad():
            w -= 5.0 * gw
            b -= 5.0 * gb
    return {"w": w.detach(), "b": b.detach()}


def _node_grid(users_of, data_of, model_of=None):
    """Nodes whose ClientApp train handler is the docs' one; ``model_of(user, arrays)``, when
    it returns something, stands for that user's model (a hostile model)."""
    grid = FakeGrid(NODES, lambda node, arrays: arrays)

    def train(msg):
        def one(u):
            model = model_of(u, msg.content["arrays"]) if model_of else None
            return model if model is not None else local_train(msg.content["arrays"],
                                                               data_of(u))
        users = sample_users(users_of(msg.metadata.dst_node_id), msg)
        work = per_user(one, users)
        return Message(user_sum_reply(msg, work), reply_to=msg)

    def send(messages, timeout=None):
        out = []
        for m in messages:
            if m.metadata.message_type != "train":
                continue
            try:
                out.append(train(m))
            except Exception as err:  # what Flower does with a handler's exception
                out.append(Message(Error(code=0, reason=repr(err)), reply_to=m))
        return out

    grid.send_and_receive = send  # type: ignore[method-assign]
    return grid


def _honest(node):
    return list(range(node * 10, node * 10 + PER_NODE))


HOSTILE = 999


def _label_out_of_classes(u):
    x, y = _rows(u)
    return (x, torch.full_like(y, 7)) if u == HOSTILE else (x, y)


def _hostile_model(kind):
    def model(u, arrays):
        if u != HOSTILE:
            return None
        base = {k: v.numpy() for k, v in arrays.items()}
        if kind == "int 10**400":
            return {"w": np.full(SHAPES["w"], 10**400, dtype=object), "b": 10**400}
        if kind == "requires grad":
            return {k: torch.tensor(v + 0.3, requires_grad=True) for k, v in base.items()}
        return {k: np.full_like(v, np.nan) for k, v in base.items()}  # nan
    return model


CASES = ["int 10**400", "requires grad", "nan", "label outside the classes"]


def _pair(tmp_path, case, relation, **kw):
    """The releases of D and D' (same seeds) and the two strategies."""
    def users(hostile):
        def of(node):
            mine = _honest(node)
            if hostile and node == 2:
                mine = mine + [HOSTILE] if relation == "add" else mine[:-1] + [HOSTILE]
            return mine
        return of

    data = _label_out_of_classes if case == "label outside the classes" else _rows
    model = None if case in ("label outside the classes", "honest") else _hostile_model(case)
    out = []
    for name, hostile in (("d", False), ("d2", True)):
        grid = _node_grid(users(hostile), data, model)
        out.append(_run(tmp_path, grid, rounds=1, num_users=NUM_USERS, delta=1e-3,
                        clip_norm=CLIP, multi_user_nodes=True, seed=5, name=name, **kw))
    return out


@pytest.mark.parametrize("relation", ["add", "replace"])
@pytest.mark.parametrize("case", CASES)
def test_a_hostile_user_moves_the_release_by_at_most_the_sensitivity(tmp_path, case,
                                                                      relation):
    (a, ra), (b, rb) = _pair(tmp_path, case, relation)
    gap = np.linalg.norm(_flat(ra.arrays) - _flat(rb.arrays))
    sensitivity = a.accountant.ledger[0]["l2_sensitivity"]
    assert sensitivity == pytest.approx(CLIP / NUM_USERS)
    assert gap <= (1 if relation == "add" else 2) * sensitivity * (1 + 1e-5)
    for s in (a, b):  # every node answered; the hostile user's node kept its other users
        assert s.rows[0]["answered_nodes"] == NODES and s.rows[0]["failed_nodes"] == 0
    assert b.rows[0]["users"] == a.rows[0]["users"] + (relation == "add")


def test_per_user_zeroes_exactly_the_failing_user():
    """The reply of a node with a failing user equals that of the node without its model (the
    same count, a zero update for it): the honest users' clipped updates are all there."""
    s = PrivateStrategy(FedAvg(), num_users=5, num_rounds=1, multi_user_nodes=True,
                        clip_norm=100.0, delta=1e-3)
    msg = list(s.configure_train(1, _init(), ConfigRecord(), FakeGrid(2, None)))[0]
    reply = user_sum_reply(msg, per_user(lambda u: local_train(msg.content["arrays"],
                                                               _label_out_of_classes(u)),
                                         [1, 2, HOSTILE]))
    honest = user_sum_reply(msg, [local_train(msg.content["arrays"], _rows(u)) for u in (1, 2)])
    for k in SHAPES:
        assert np.allclose(reply["arrays"][k].numpy(), honest["arrays"][k].numpy())
    assert reply["metrics"]["fedpriv-users"] == 3 and honest["metrics"]["fedpriv-users"] == 2
    assert reply["metrics"]["fedpriv-unclipped"] == 2


# ----- secure_noise: exact discrete Gaussian noise on a grid ------------------------------------
@pytest.mark.parametrize("z, sensitivity, dim", [(1.3, 1.0, 35), (0.7, 2.5, 1),
                                                  (40.0, 0.01, 10**5)])
def test_the_grid_is_the_cores_central_grid(z, sensitivity, dim):
    _, entry = noisy_mean_on_grid(np.zeros(dim), 7.0, z, sensitivity, CryptoRandom(1))
    grid = central_grid(z, sensitivity, dim)
    assert (entry["granularity"], entry["sigma_grid"], entry["l2_sensitivity"]) == (
        grid.granularity, grid.sigma, grid.sensitivity / 7.0)


def test_secure_noise_is_integer_multiples_of_the_grid():
    exact = np.linspace(-3.0, 3.0, 35)
    value, entry = noisy_mean_on_grid(exact, 10.0, 1.5, 1.0, CryptoRandom(7))
    g = entry["granularity"]
    assert math.log2(g) == int(math.log2(g))  # a power of two
    units = value * 10.0 / g
    assert np.array_equal(units, np.rint(units))
    noise = np.rint(units) - np.rint(exact / g)
    assert np.any(noise != 0) and entry["mechanism"] == "discrete gaussian"
    assert entry["l2_sensitivity"] > 1.0 / 10.0  # the grid's slack is in the sensitivity
    assert entry["noise_std"] == pytest.approx(entry["sigma_grid"] * g / 10.0)


def test_a_secure_run_is_discrete_publishable_and_bounded_for_neighbours(tmp_path, monkeypatch):
    """secure_noise: the ledger records discrete Gaussian parts (grid, sigma, the sensitivity
    with the grid's slack), the RDP accountant, and a publishable release; with the streams
    seeded (identical noise) one more (honest) user moves the release by at most that
    sensitivity."""
    monkeypatch.setattr(PrivateStrategy, "_crypto_stream",
                        lambda self, index: CryptoRandom(1000 + index))
    (a, ra), (b, rb) = _pair(tmp_path, "honest", "add", secure_noise=True,
                             clip_quantile=0.5)
    parts = a.accountant.ledger[0]["parts"]
    assert [p["mechanism"] for p in parts] == ["discrete gaussian"] * 2
    update = parts[0]
    assert update["l2_sensitivity"] > CLIP / NUM_USERS
    gap = np.linalg.norm(_flat(ra.arrays) - _flat(rb.arrays))
    assert 0 < gap <= update["l2_sensitivity"] * (1 + 1e-5)
    release = json.loads((tmp_path / "d.release.json").read_text())
    assert release["publishable"] is True and release["privacy"]["accountant"] == "rdp-int"
    assert release["privacy"]["mechanism"].startswith("discrete gaussian")


def test_seeded_noise_is_floating_point_and_not_publishable(tmp_path):
    _run(tmp_path, FakeGrid(10, lambda n, a: a), rounds=1, delta=1e-3, name="p")
    release = json.loads((tmp_path / "p.release.json").read_text())
    assert release["publishable"] is False
    assert "floating-point" in release["not_publishable_because"]
    assert release["privacy"]["mechanism"] == "float64 gaussian"


def test_secure_noise_refuses_poisson_sampling():
    with pytest.raises(PlanError, match="sampling_rate"):
        PrivateStrategy(FedAvg(), num_users=100,
                        num_rounds=2, sampling_rate=0.5, secure_noise=True)


# ----- numbers float64 cannot hold, on the server ------------------------------------------------
def test_an_int_beyond_float64_in_a_reply_is_rejected_not_a_crash(tmp_path):
    """A node's count or metric of 10**400 (an OverflowError for math.isfinite): the count's
    node is rejected, the metric is skipped, and the run goes on."""
    from tests.test_flower_strategy import _user_sum_grid

    def lie(node, content):
        if node == 1:
            content["metrics"]["fedpriv-users"] = 10**400

    grid = _user_sum_grid(3, lambda node, base: [base], lie)
    s, _ = _run(tmp_path, grid, rounds=1, num_users=3, delta=1e-2, multi_user_nodes=True)
    assert s.rows[0]["answered_nodes"] == 2 and sum(s.rows[0]["rejected_nodes"].values()) == 1
    metrics = FakeGrid(4, lambda n, a: a, metric_fn=lambda n: {"acc": 10**400 if n == 1 else 0.5})
    s, _ = _run(tmp_path, metrics, rounds=1, delta=1e-2, private_metrics={"acc": 1.0}, name="m")
    assert s.rows[0]["exact_metrics"] == {"acc": 0.5} and "acc" in s.rows[0]["private_metrics"]
