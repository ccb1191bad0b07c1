"""Personalization inside any Flower ClientApp (``fedpriv_flwr.personal``): the client mod keeps
the personal layers on the node (state + file), never sends them, restores them after a restart;
the hook freezes the right parameters. Unit tests on real Flower Message/Context objects, one run
through Flower's simulation engine, and one deployment (SuperLink + 2 SuperNodes as processes)
in which a SuperNode is killed and restarted between rounds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode

from fedpriv_flwr.personal import (
    STATE_KEY,
    personal_keys,
    personal_phases,
    personalize,
    state_file,
)
from tests.flower_grid import run_in_simulation

torch = pytest.importorskip("torch")

PATTERN = r"^head\."
ROOT = Path(__file__).resolve().parents[1]
KEYS = ["body.weight", "body.bias", "head.weight", "head.bias"]


# -- helpers --------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """A message built outside a ServerApp takes its sender from Flower's TaskIdentity."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 3), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _arrays(value: float, keys: list[str] = KEYS) -> ArrayRecord:
    shapes = {"body.weight": (3, 2), "body.bias": (3,), "head.weight": (2, 3), "head.bias": (2,)}
    return ArrayRecord({k: Array(np.full(shapes[k], value, dtype=np.float32)) for k in keys})


def _message(arrays: ArrayRecord, kind: str = "train", node: int = 7) -> Message:
    return Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"lr": 0.1})}),
                   dst_node_id=node, message_type=kind)


def _context(node: int = 7, state_dir: Path | None = None, run: int = 3) -> Context:
    config = {"partition-id": 0} | ({"personal-state-dir": str(state_dir)} if state_dir else {})
    return Context(run_id=run, node_id=node, node_config=config, state=RecordDict(),
                   run_config={})


class Handler:
    """A ClientApp handler: records the arrays it receives, replies with ``reply_value``."""

    def __init__(self, reply_value: float = 5.0) -> None:
        self.reply_value = reply_value
        self.seen: list[dict[str, np.ndarray]] = []

    def __call__(self, msg: Message, context: Context) -> Message:
        self.seen.append({k: v.numpy() for k, v in msg.content["arrays"].items()})
        return Message(RecordDict({"arrays": _arrays(self.reply_value),
                                   "metrics": MetricRecord({"num-examples": 10})}),
                       reply_to=msg)


def _value(arrays: dict[str, np.ndarray], key: str) -> float:
    values = np.unique(arrays[key])
    assert values.size == 1, values
    return float(values[0])


# -- personal_keys --------------------------------------------------------------------------------
def test_personal_keys_are_the_matches_and_a_useless_pattern_is_refused():
    assert personal_keys(PATTERN, KEYS) == ["head.weight", "head.bias"]
    assert personal_keys(r"bias$", KEYS) == ["body.bias", "head.bias"]  # re.search
    with pytest.raises(ValueError, match=r"'\^fc3\\\\\.' matches none of the 4 keys") as err:
        personal_keys(r"^fc3\.", KEYS)
    assert "'body.weight'" in str(err.value)
    with pytest.raises(ValueError, match=r"'\.' matches every key.*nothing would be shared"):
        personal_keys(".", KEYS)
    with pytest.raises(ValueError, match="not a regular expression"):
        personal_keys("head(", KEYS)
    with pytest.raises(ValueError, match="schedule 'fedavg'"):
        personalize(PATTERN, schedule="fedavg")


def test_the_module_imports_without_torch():
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "import fedpriv_flwr.personal as p\n"
            "assert 'torch' not in sys.modules\n"
            "print(p.personal_keys(r'^head', ['head.w', 'body.w']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['head.w']"


# -- the mod, schedule fedrep ---------------------------------------------------------------------
def test_fedrep_keeps_the_personal_layers_on_the_node_and_restores_them(tmp_path):
    mod = personalize(PATTERN)
    context = _context(state_dir=tmp_path)
    handler = Handler(reply_value=5.0)

    # round 1: the server's initial head is kept; the reply leaves without the head
    reply = mod(_message(_arrays(1.0)), context, handler)
    assert not reply.has_error()
    assert list(reply.content["arrays"].keys()) == ["body.weight", "body.bias"]
    assert _value(handler.seen[-1], "head.weight") == 1.0
    record = context.state[STATE_KEY]
    assert dict(record) == {"pattern": PATTERN, "schedule": "fedrep", "kind": "train",
                            "message-type": "train", "source": "server"}
    path = state_file(tmp_path, 3, 7)
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == [path.name]  # no tmp left
    with np.load(path, allow_pickle=False) as saved:
        assert json.loads(str(saved["meta"]))["entries"] == [["arrays", "head.weight"],
                                                             ["arrays", "head.bias"]]

    # round 2: the server sends the shared layers only (FedAvg of the replies); the node puts its
    # own head back, in the model's key order; a named handler ("train.xxx") is handled too
    handler.reply_value = 6.0
    reply = mod(_message(_arrays(2.0, KEYS[:2]), "train.custom"), context, handler)
    assert not reply.has_error() and "head.bias" not in reply.content["arrays"]
    assert list(handler.seen[-1]) == KEYS
    assert _value(handler.seen[-1], "head.weight") == 5.0  # what the node stored
    assert _value(handler.seen[-1], "body.weight") == 2.0  # the server's shared layers
    assert context.state[STATE_KEY]["source"] == "state"

    # the server sends a full model (e.g. its initial head): the node's own head replaces it
    reply = mod(_message(_arrays(9.0), "evaluate"), context, Handler(reply_value=0.0))
    assert context.state[STATE_KEY]["kind"] == "evaluate"
    assert list(reply.content["arrays"].keys()) == KEYS[:2]  # evaluate replies: no head either
    stored = context.state.array_records[STATE_KEY + ".arrays.arrays"]
    assert float(stored["head.bias"].numpy()[0]) == 6.0  # an evaluate reply is not stored

    # node restart: empty context.state, the head comes from the file
    restarted, fresh = _context(state_dir=tmp_path), Handler()
    assert not mod(_message(_arrays(3.0, KEYS[:2])), restarted, fresh).has_error()
    assert _value(fresh.seen[-1], "head.weight") == 6.0
    assert restarted.state[STATE_KEY]["source"] == "file"

    # another node (or a new node id after an insecure restart) has no head: a clear error
    other = Handler()
    reply = mod(_message(_arrays(3.0, KEYS[:2]), node=8), _context(node=8, state_dir=tmp_path),
                other)
    assert reply.has_error() and not other.seen
    assert reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "lacks the personal layers and node 8 has none stored" in reply.error.reason
    assert str(state_file(tmp_path, 3, 8)) in reply.error.reason


def test_without_a_state_dir_the_layers_live_in_the_context_state_only(tmp_path):
    mod, context = personalize(PATTERN), _context()
    mod(_message(_arrays(1.0)), context, Handler(4.0))
    handler = Handler()
    mod(_message(_arrays(2.0, KEYS[:2])), context, handler)
    assert _value(handler.seen[-1], "head.bias") == 4.0
    reply = mod(_message(_arrays(2.0, KEYS[:2])), _context(), Handler())
    assert reply.has_error() and "no personal-state-dir in the node config" in reply.error.reason


def test_the_first_message_is_checked_against_the_pattern():
    handler = Handler()
    reply = personalize(r"^fc3\.")(_message(_arrays(1.0)), _context(), handler)
    assert reply.has_error() and not handler.seen
    assert "'^fc3\\\\.' matches none of the 4 keys" in reply.error.reason
    reply = personalize(r"weight|bias")(_message(_arrays(1.0)), _context(), handler)
    assert reply.has_error() and "nothing would be shared" in reply.error.reason


def test_stored_layers_that_do_not_fit_the_model_are_refused(tmp_path):
    mod = personalize(PATTERN)
    mod(_message(_arrays(1.0)), _context(state_dir=tmp_path), Handler())
    wrong = ArrayRecord({**_arrays(1.0, KEYS[:2]), "head.weight": Array(np.zeros((4, 3))),
                         "head.bias": Array(np.zeros(2))})
    reply = mod(_message(wrong), _context(state_dir=tmp_path), Handler())
    assert reply.has_error() and "the node stored shape (2, 3)" in reply.error.reason
    reply = personalize(r"^head\.w")(_message(_arrays(1.0, KEYS[:2])),
                                     _context(state_dir=tmp_path), Handler())
    assert reply.has_error() and "remove the file" in reply.error.reason


def test_error_replies_and_other_messages_pass_through(tmp_path):
    mod, context = personalize(PATTERN), _context(state_dir=tmp_path)

    def failing(msg: Message, _: Context) -> Message:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="boom"),
                       reply_to=msg)

    reply = mod(_message(_arrays(1.0)), context, failing)
    assert reply.has_error() and reply.error.reason == "boom"
    assert not list(tmp_path.iterdir()) and STATE_KEY + ".arrays.arrays" not in context.state
    handler = Handler()
    query = _message(_arrays(1.0, KEYS[2:]), "query")  # not train/evaluate: untouched
    reply = mod(query, context, handler)
    assert list(reply.content["arrays"].keys()) == KEYS  # nothing removed from a query reply


# -- the mod, schedule finetune -------------------------------------------------------------------
def test_finetune_sends_the_whole_model_and_stores_nothing(tmp_path):
    mod, context = personalize(PATTERN, schedule="finetune"), _context(state_dir=tmp_path)
    handler = Handler(5.0)
    reply = mod(_message(_arrays(1.0)), context, handler)
    assert list(reply.content["arrays"].keys()) == KEYS
    reply = mod(_message(_arrays(2.0)), context, handler)
    assert _value(handler.seen[-1], "head.weight") == 2.0  # the global head, not the node's
    assert not list(tmp_path.iterdir())
    assert [k for k in context.state if k != STATE_KEY] == []
    reply = mod(_message(_arrays(2.0), "evaluate"), context, handler)
    assert list(reply.content["arrays"].keys()) == KEYS[:2]  # a fine-tuned head stays
    assert dict(context.state[STATE_KEY])["schedule"] == "finetune"


# -- the hook -------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(2, 3)
        self.head = torch.nn.Linear(3, 2)


def _phases_of(schedule: str, kind: str) -> list[tuple[str, tuple[str, ...], dict[str, bool]]]:
    """Run the mod around a handler that walks the phases; what each phase froze."""
    model, seen = Net(), []

    def handler(msg: Message, context: Context) -> Message:
        for phase in personal_phases(model, context):
            with phase as entered:
                seen.append((entered.name, entered.trains,
                             {n: p.requires_grad for n, p in model.named_parameters()}))
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict())}), reply_to=msg)

    personalize(PATTERN, schedule=schedule)(_message(_arrays(1.0), kind), _context(), handler)
    assert all(p.requires_grad for p in model.parameters())  # restored after the phases
    return seen


def test_phases_freeze_what_they_do_not_train():
    head = {"head.weight": True, "head.bias": True}
    body = {"body.weight": True, "body.bias": True}

    def frozen(flags: dict[str, bool]) -> dict[str, bool]:
        return dict.fromkeys(flags, False)

    assert _phases_of("fedrep", "train") == [
        ("personal", ("head.weight", "head.bias"), {**frozen(body), **head}),
        ("shared", ("body.weight", "body.bias"), {**body, **frozen(head)})]
    assert _phases_of("finetune", "train") == [("all", tuple(KEYS), {**body, **head})]
    for schedule in ("fedrep", "finetune"):
        assert _phases_of(schedule, "evaluate") == [
            ("personal", ("head.weight", "head.bias"), {**frozen(body), **head})]


def test_a_phase_restores_the_previous_flags_and_needs_the_mod():
    model, context = Net(), _context()
    model.body.bias.requires_grad_(False)  # frozen by the user: stays frozen
    personalize(PATTERN)(_message(_arrays(1.0)), context,
                         lambda m, c: Message(RecordDict(), reply_to=m))
    personal, shared = personal_phases(model, context)
    with shared:
        assert [n for n, p in model.named_parameters() if p.requires_grad] == ["body.weight"]
        assert [id(p) for p in shared.parameters()] == [id(model.body.weight),
                                                        id(model.body.bias)]
    with pytest.raises(ZeroDivisionError), personal:
        assert not model.body.weight.requires_grad
        raise ZeroDivisionError  # flags come back even when training fails
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {
        "body.weight": True, "body.bias": False, "head.weight": True, "head.bias": True}
    with pytest.raises(RuntimeError, match=r"add `personalize\(pattern, schedule\)` to the "
                                           r"ClientApp's mods"):
        personal_phases(model, _context())
    with pytest.raises(ValueError, match="matches every key"):
        personal_phases(torch.nn.Linear(2, 2), _context_with(r".", context))


def _context_with(pattern: str, like: Context) -> Context:
    context = _context()
    context.state[STATE_KEY] = ConfigRecord({**like.state[STATE_KEY], "pattern": pattern})
    return context


# -- a small Flower app: simulation and deployment ------------------------------------------------
APP_MODULE = '''"""A tiny Flower app for tests/test_flower_personal.py (one node = one user)."""
import json
import os
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedpriv_flwr.personal import STATE_KEY, personal_phases, personalize

PATTERN = r"^head\\."
SOURCES = ["server", "state", "file"]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def head_checksum(model):
    total = 0.0
    for name, p in model.named_parameters():
        if name.startswith("head."):
            flat = p.detach().double().flatten()
            total += float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    return total


def user_data(context):
    partition = int(context.node_config["partition-id"])
    g = torch.Generator().manual_seed(100 + partition)
    x = torch.randn(64, 4, generator=g)
    y = ((x[:, 0] > 0) ^ (partition % 2 == 1)).long()  # half the users flip their labels
    return x, y


def fit(model, x, y, steps=5):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def receive(msg, context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    source = SOURCES.index(str(context.state.config_records[STATE_KEY]["source"]))
    return model, {"head-in": head_checksum(model), "source": source}


app = ClientApp(mods=[personalize(PATTERN, schedule="fedrep")])


@app.train()
def train(msg: Message, context: Context) -> Message:
    model, metrics = receive(msg, context)
    x, y = user_data(context)
    for phase in personal_phases(model, context):
        with phase:
            fit(model, x, y)
    metrics.update({"num-examples": len(x), "head-out": head_checksum(model)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model, metrics = receive(msg, context)
    x, y = user_data(context)
    for phase in personal_phases(model, context):
        with phase:
            fit(model, x, y, steps=2)
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).double().mean())
    metrics.update({"num-examples": len(x), "accuracy": accuracy})
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


class Recording(FedAvg):
    """FedAvg that writes down every reply it receives (and may pause after a round)."""

    def __init__(self, out, pause, evaluate_rounds=0, **kwargs):
        super().__init__(**kwargs)
        self.out, self.pause, self.replies = Path(out), pause, []
        self.evaluate_rounds = evaluate_rounds  # evaluate in rounds 1..N only (0: in every round)

    def configure_evaluate(self, server_round, arrays, config, grid):
        if self.evaluate_rounds and server_round > self.evaluate_rounds:
            return []
        return super().configure_evaluate(server_round, arrays, config, grid)

    def _record(self, server_round, kind, replies):
        for r in replies:
            self.replies.append({
                "round": server_round, "kind": kind, "node": r.metadata.src_node_id,
                "error": r.error.reason if r.has_error() else None,
                "arrays": {} if r.has_error() else {
                    n: list(a.keys()) for n, a in r.content.array_records.items()},
                "metrics": {} if r.has_error() else {
                    k: v for m in r.content.metric_records.values() for k, v in m.items()}})
        self.out.write_text(json.dumps(self.replies))

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self._record(server_round, "train", replies)
        return super().aggregate_train(server_round, replies)

    def aggregate_evaluate(self, server_round, replies):
        replies = list(replies)
        self._record(server_round, "evaluate", replies)
        if self.pause and server_round == 1:  # the test restarts a SuperNode, then says go
            Path(self.pause, "round-1").touch()
            deadline = time.monotonic() + 300
            while not Path(self.pause, "go").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        return super().aggregate_evaluate(server_round, replies)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    nodes = int(config.get("nodes", 0) or os.environ.get("PERSONAL_TEST_NODES", "4"))
    strategy = Recording(
        config.get("out") or os.environ["PERSONAL_TEST_OUT"], config.get("pause-dir", ""),
        int(config.get("evaluate-rounds", 0)), fraction_train=1.0, fraction_evaluate=1.0,
        min_train_nodes=nodes,
        min_evaluate_nodes=nodes, min_available_nodes=nodes)
    torch.manual_seed(0)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                   num_rounds=int(config.get("rounds", 0) or 3))
'''

PYPROJECT = '''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "personal-test-app"
version = "1.0.0"
description = "fedpriv personalization test app"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "fedpriv-tests"

[tool.flwr.app.components]
serverapp = "personal_test_app:server"
clientapp = "personal_test_app:app"

[tool.flwr.app.config]
out = ""
pause-dir = ""
nodes = 2
rounds = 3
evaluate-rounds = 0
'''


def _write_app(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "personal_test_app.py").write_text(APP_MODULE)
    (folder / "pyproject.toml").write_text(PYPROJECT)
    return folder


def _by(replies: list[dict], kind: str) -> dict[tuple[int, int], dict]:
    """(round, node) -> the reply's metrics, for the replies of ``kind`` (none has an error)."""
    assert [r["error"] for r in replies] == [None] * len(replies)
    return {(r["round"], r["node"]): r["metrics"] for r in replies if r["kind"] == kind}


def _check_the_run(replies: list[dict], nodes: int, rounds: int, evaluated: int = 0) -> dict:
    """What every run must show: the server never saw a head; each node kept its own head from
    round to round, evaluated it (in rounds 1..``evaluated``; 0: every round), and the heads
    differ between the nodes."""
    for r in replies:
        keys = [k for ks in r["arrays"].values() for k in ks]
        assert not [k for k in keys if k.startswith("head.")], r
        if r["kind"] == "train":
            assert keys == ["body.weight", "body.bias"], r
    train, evaluate = _by(replies, "train"), _by(replies, "evaluate")
    ids = sorted({node for _, node in train})
    evaluated = evaluated or rounds
    assert len(ids) == nodes and len(train) == nodes * rounds
    assert len(evaluate) == nodes * evaluated
    for node in ids:
        for rnd in range(1, rounds + 1):
            if rnd <= evaluated:
                assert evaluate[rnd, node]["head-in"] == train[rnd, node]["head-out"]
            if rnd > 1:
                assert train[rnd, node]["head-in"] == train[rnd - 1, node]["head-out"]
        assert train[1, node]["source"] == 0  # round 1: the server's initial head
    first = {train[1, node]["head-in"] for node in ids}
    assert len(first) == 1  # every node started from the same head ...
    assert len({train[rounds, node]["head-out"] for node in ids}) == nodes  # ... now its own
    return train


@pytest.mark.integration
def test_simulation_keeps_each_users_head_on_its_node(tmp_path, flower_env):
    """Four SuperNodes, three rounds of plain FedAvg in Flower's simulation engine."""
    app = _write_app(tmp_path / "app")
    out = tmp_path / "replies.json"
    env = {**flower_env, "PERSONAL_TEST_OUT": str(out), "PERSONAL_TEST_NODES": "4"}
    proc = run_in_simulation("personal_test_app", str(app), 4, env, str(tmp_path))
    assert proc.returncode == 0 and out.is_file(), (proc.stdout + proc.stderr)[-4000:]
    train = _check_the_run(json.loads(out.read_text()), nodes=4, rounds=3)
    # in the simulation the context.state keeps the heads (no state dir in the node config)
    assert {m["source"] for (rnd, _), m in train.items() if rnd > 1} == {1}


# -- deployment: a SuperNode restarted between rounds ---------------------------------------------
@pytest.fixture
def procs():
    """Processes on 127.0.0.1 with a private FLWR_HOME; all stopped (by PID) at the end."""
    import shutil
    import tempfile

    from tests.test_deployment import Processes, _free_port

    short = Path(tempfile.mkdtemp(prefix="fpp", dir="/tmp"))
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_HOME": str(short / "flwr"),
           "RAY_TMPDIR": str(short / "ray"),
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    for sub in ("flwr", "ray", "logs"):
        (short / sub).mkdir()
    processes = Processes(env, short / "logs")
    processes.short = short  # type: ignore[attr-defined]
    try:
        yield processes
    finally:
        leftover = processes.stop()
        shutil.rmtree(short, ignore_errors=True)
        assert not leftover, f"processes still running after the test: {leftover}"


def _head_checksum(path: Path) -> float:
    """The app's head_checksum, from a node's state file."""
    with np.load(path, allow_pickle=False) as data:
        entries = json.loads(str(data["meta"]))["entries"]
        total = 0.0
        for i, (_, key) in enumerate(entries):
            assert key.startswith("head."), key
            flat = data[f"a{i}"].astype(np.float64).ravel()
            total += float((flat * np.arange(1, flat.size + 1)).sum())
    return total


@pytest.mark.integration
def test_a_restarted_supernode_reloads_its_personal_layers_from_its_state_dir(procs):
    """SuperLink + 2 SuperNodes (TLS, SuperNode authentication: a SuperNode keeps its node id
    across restarts), each with its own personal-state-dir; after round 1 the ServerApp waits,
    SuperNode 0 is stopped and started again (its context.state is gone), then rounds 2-3 run:
    node 0 takes its head from its file, node 1 from its context.state. Round 1 evaluates
    (the kept head, and its fine-tuning rewrites no file: the file holds round 1's trained
    head); rounds 2-3 train only: every deployment message starts a ClientApp process that
    imports torch and Flower, and evaluation in every round is the simulation test's."""
    from fedpriv import deploy as dep
    from fedpriv.config_files import toml_value
    from tests.test_deployment import _free_port, _python, _start_superlink, _wait

    short: Path = procs.short
    app = _write_app(short / "app")
    certs = dep.generate_certs(short / "certs", 2, log=lambda _: None)
    d = dep.Deployment(num_nodes=2, superlink_host="127.0.0.1", bind_host="127.0.0.1",
                       superlink_port=_free_port(),
                       node_ports=(_free_port(), _free_port()), certs=str(certs),
                       mounted=False, app_dir=str(app))
    _start_superlink(procs, d, str(certs / "public" / "ca.crt"))
    reg = subprocess.run(_python(dep.register_command(d)), env=procs.env, capture_output=True,
                         text=True, timeout=120)
    assert reg.returncode == 0, reg.stdout + reg.stderr

    state_dirs = [short / f"state-{i}" for i in range(2)]

    def node(i: int, port: int | None = None) -> list[str]:
        argv = dep.supernode_command(d, i, port=port)
        argv[argv.index("--node-config") + 1] += (
            f" personal-state-dir={toml_value(str(state_dirs[i]))}")
        return argv

    for i in range(2):
        procs.start(f"supernode-{i}", node(i))
    out, pause = short / "replies.json", short / "pause"
    pause.mkdir()
    started = time.monotonic()
    submit = procs.start("submit", [
        "flwr", "run", str(app), d.connection, "--run-config",
        dep.run_config_string({"out": str(out), "pause-dir": str(pause), "nodes": 2,
                               "rounds": 3, "evaluate-rounds": 1}), "--stream"])
    _wait(lambda: (pause / "round-1").exists() or submit.poll() is not None, 300,
          "round 1 of the run")
    assert submit.poll() is None, procs.tails()
    files = [list(s.glob("personal-run*-node*.npz")) for s in state_dirs]
    assert [len(f) for f in files] == [1, 1], files
    saved = _head_checksum(files[0][0])
    node0 = int(files[0][0].stem.rsplit("node", 1)[1])

    first = procs.started["supernode-0"]
    os.killpg(first.pid, signal.SIGTERM)  # the SuperNode and what it started
    first.wait(timeout=60)
    procs.start("supernode-0-restarted", node(0, port=_free_port()))
    (pause / "go").touch()
    _wait(lambda: submit.poll() is not None, 300, "the end of the run")
    assert submit.returncode == 0, procs.tails()
    print(f"deployment run: {time.monotonic() - started:.0f}s")

    train = _check_the_run(json.loads(out.read_text()), nodes=2, rounds=3, evaluated=1)
    assert node0 in {n for _, n in train}  # two node ids in all: the restarted one kept its id
    node1 = next(n for _, n in train if n != node0)
    assert train[1, node0]["head-out"] == pytest.approx(saved, rel=1e-12)
    assert train[2, node0]["source"] == 2  # restarted: empty context.state, head from the file
    assert train[2, node0]["head-in"] == train[1, node0]["head-out"]
    assert train[2, node1]["source"] == 1 and train[3, node0]["source"] == 1
    assert f"SuperNode ID: {node0}" in procs.log("supernode-0-restarted")
