"""The Flower app of ``flower_port_compare.py``: the example app's task (examples/flower-app:
Fashion-MNIST label skew, the MLP 784-256-128-10 whose head is ``fc3``, its ``train`` and
``test``) with the server and client of each stage of a port from Flower's DP wrapper to
``PrivateStrategy`` (issue 47's table):

=================  =========================================================================
variant            server / client
=================  =========================================================================
flower-rdp         the app as it was: ``DifferentialPrivacyServerSideFixedClipping(FedAvg)``
                   with Flower's ``RdpAccountant``, z = the PLD calibration for the target
flower-pld         the same wrapper and z with ``fedpriv_flwr.PldAccountant`` (accountant only)
fedpriv-finetune   ``PrivateStrategy(FedAvg)``, the ``personalize(..., "finetune")`` mod
fedpriv-fedrep     ``PrivateStrategy(FedAvg, personal_layers=...)``, the ``"fedrep"`` mod
local              no federation: each node fits its head on the initial (untrained) model
fedpriv-*-best     the same as fedpriv-finetune / fedpriv-fedrep, each node keeping the better
                   of its own linear model and the shared one (``keep_best``) to test
=================  =========================================================================

Every variant has the same clip (fixed), rounds, local training and evaluation: each node fits
its head (``fc3``, the body frozen) with fedpriv's rule (``fit_head``: ``head_steps`` full-batch
steps of size 1/L) on all its training rows before testing; the accuracy is FedAvg's aggregate
of the nodes' ``eval_acc`` after the last round (weighted by their test rows).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flowerapp.task import Net, load_data
from flowerapp.task import test as test_fn
from flowerapp.task import train as train_fn
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import (
    Grid,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
    ServerApp,
)
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fedpriv_flwr import PldAccountant, PrivateStrategy, calibrate_noise_multiplier
from fedpriv_flwr.choice import keep_best
from fedpriv_flwr.heads import fit_head
from fedpriv_flwr.personal import fit_personal, personalize

VARIANTS = ("flower-rdp", "flower-pld", "fedpriv-finetune", "fedpriv-fedrep", "local",
            "fedpriv-finetune-best", "fedpriv-fedrep-best")
PATTERN = r"^fc3\."
HEAD = ("fc3.weight", "fc3.bias")
DEVICE = torch.device("cpu")


def _model(msg: Message) -> Net:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model


def _data(context: Context, s: dict[str, Any]):
    return load_data(int(context.node_config["partition-id"]),
                     int(context.node_config["num-partitions"]), s["batch_size"], s["seed"])


def client_app(variant: str, s: dict[str, Any]) -> ClientApp:
    """The nodes' app of ``variant`` with the settings ``s``."""
    schedule = {"fedpriv-finetune": "finetune", "fedpriv-fedrep": "fedrep"}.get(
        variant.removesuffix("-best"))
    best = variant.endswith("-best")
    app = ClientApp(mods=[personalize(PATTERN, schedule=schedule)] if schedule else [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = _model(msg)
        trainloader, _ = _data(context, s)
        if schedule:  # fedrep: the node's head fitted, then frozen; finetune: nothing
            fit_personal(model, context, trainloader, steps=s["head_steps"])
        loss = train_fn(model, trainloader, s["local_steps"], msg.content["config"]["lr"], DEVICE)
        # every user weighs the same in a user-level DP mean (Flower's wrapper with an
        # accountant refuses unequal weights; PrivateStrategy ignores them)
        metrics = MetricRecord({"train_loss": loss, "num-examples": 1})
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = _model(msg)
        trainloader, testloader = _data(context, s)
        if best:  # the better of its own model and the shared one, on its training rows
            model = keep_best(model, context, trainloader, steps=s["head_steps"])
        elif schedule:
            fit_personal(model, context, trainloader, steps=s["head_steps"])
        else:
            fit_head(model, HEAD, trainloader, steps=s["head_steps"])
        loss, acc = test_fn(model, testloader, DEVICE)
        metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc,
                                "num-examples": len(testloader.dataset)})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def strategy(variant: str, s: dict[str, Any]):
    """The server's strategy of ``variant`` (not ``local``)."""
    inner = FedAvg(fraction_train=1.0, fraction_evaluate=1.0)
    n, rounds = s["num_nodes"], s["rounds"]
    if variant.startswith("flower-"):
        config = PrivacyConfig(target_delta=s["delta"], population_size=n,
                               neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                               sampling_method=SamplingMethod.NO_AMPLIFICATION)
        accountant = RdpAccountant(config) if variant == "flower-rdp" else PldAccountant(config)
        z = calibrate_noise_multiplier(s["epsilon"], s["delta"], rounds)
        return DifferentialPrivacyServerSideFixedClipping(
            inner, noise_multiplier=z, clipping_norm=s["clip_norm"], num_sampled_clients=n,
            accountant=accountant)
    return PrivateStrategy(
        inner, num_users=n, num_rounds=rounds, evaluate_every=rounds, epsilon=s["epsilon"],
        delta=s["delta"], clip_norm=s["clip_norm"], seed=s["seed"],
        results_path=str(Path(s["out"]).with_suffix(".operator.json")),
        personal_layers=PATTERN if variant.startswith("fedpriv-fedrep") else None)


def _evaluate_once(grid: Grid, arrays: ArrayRecord) -> dict[str, float]:
    """``local``: every node evaluates the initial model (after fitting its head)."""
    messages = [Message(RecordDict({"arrays": arrays, "config": ConfigRecord(
        {"server-round": 0})}), dst_node_id=node, message_type=MessageType.EVALUATE)
        for node in grid.get_node_ids()]
    replies = [r.content["metrics"] for r in grid.send_and_receive(messages) if r.has_content()]
    weights = np.array([float(m["num-examples"]) for m in replies])
    acc = np.array([float(m["eval_acc"]) for m in replies])
    return {"eval_acc": float(weights @ acc / weights.sum()), "nodes": float(len(replies))}


def serve(variant: str, s: dict[str, Any], grid: Grid) -> dict[str, Any]:
    """The server's whole run; the final accuracy and epsilon, also written to ``s["out"]``."""
    torch.manual_seed(s["seed"])
    np.random.seed(s["seed"])  # Flower's wrapper draws its noise from numpy's global generator
    arrays = ArrayRecord(Net().state_dict())
    if variant == "local":
        metrics, epsilon, z = _evaluate_once(grid, arrays), 0.0, 0.0
    else:
        strat = strategy(variant, s)
        result = strat.start(grid=grid, initial_arrays=arrays, num_rounds=s["rounds"],
                             train_config=ConfigRecord({"lr": s["lr"]}))
        last = max(result.evaluate_metrics_clientapp)
        metrics = dict(result.evaluate_metrics_clientapp[last])
        spent = strat.privacy_spent()
        epsilon, z = float(spent.epsilon), float(strat.noise_multiplier)
    out = {"variant": variant, "seed": s["seed"], "accuracy": float(metrics["eval_acc"]),
           "epsilon": epsilon, "noise_multiplier": z}
    Path(s["out"]).write_text(json.dumps(out))
    return out


def server_app(variant: str, s: dict[str, Any]) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        serve(variant, s, grid)

    return app


class InProcessGrid:
    """A Grid that hands each message to the ClientApp in this process (one Context per node,
    as a SuperNode keeps it): the apps' code without Flower's runtime, for quick runs and tests."""

    def __init__(self, app: ClientApp, nodes: int) -> None:
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
        self.app = app
        self.contexts = {i + 1: Context(run_id=1, node_id=i + 1, node_config={
            "partition-id": i, "num-partitions": nodes}, state=RecordDict(), run_config={})
            for i in range(nodes)}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> list[Message]:
        return [self.app(m, self.contexts[m.metadata.dst_node_id]) for m in messages]
