"""The worked example examples/flower-app: a plain Flower PyTorch app (its own ClientApp, data
loading and training loop) made user-level private with personal heads by the lines marked
``# fedpriv``, which docs/tutorials/flower-app.md shows.

Checked here: removing the marked lines leaves a plain Flower app that loads; every marked line
is on the tutorial page; the app's users and model are fedpriv's (the comparison with
``deep-dp-fedavg-ft`` rests on it); and, through the real ``flwr run``, the app completes, the
epsilon it prints is the PLD accountant's for the noise it used, and its release file holds no
exact metric and no count."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower-app"
TUTORIAL = ROOT / "docs" / "tutorials" / "flower-app.md"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
MARK = re.compile(r"#\s*fedpriv\b(?:[,;:]?\s*was:\s*(?P<was>.*))?")
APP_FILES = ("pyproject.toml", "flowerapp/__init__.py", "flowerapp/task.py",
             "flowerapp/client_app.py", "flowerapp/server_app.py")

needs_fmnist = pytest.mark.skipif(not FMNIST.is_dir(), reason="needs Debian's "
                                  "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)")


# ----- the plain app: the example without its fedpriv lines -------------------------------------
def marked(text: str) -> list[tuple[int, str]]:
    """(line number, code before the comment) of each line marked ``# fedpriv``."""
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        match = MARK.search(line)
        if match:
            out.append((number, line[:match.start()].rstrip()))
    return out


def plain(text: str) -> str:
    """``text`` without its fedpriv lines: a marked line is removed, or replaced by what its
    ``# fedpriv, was: ...`` comment says it was; a removed line that opens a block (``for ...:``,
    ``with ...:``) unwraps it (its lines dedented by one level)."""
    out: list[str] = []
    openers: list[int] = []  # indentation of the removed block openers still open
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip())
        if line.strip():
            while openers and indent <= openers[-1]:
                openers.pop()
        match = MARK.search(line)
        if match is None:
            out.append(line[4 * len(openers):] if line.strip() else line)
            continue
        code = line[:match.start()].rstrip()
        if match.group("was"):
            out.append(" " * (indent - 4 * len(openers)) + match.group("was").strip())
        elif code.strip().endswith(":"):
            openers.append(indent)
    return "\n".join(out)


def test_plain_unwraps_removed_blocks_and_restores_replaced_lines():
    text = ("def f(x):\n"
            "    for p in g():  # fedpriv\n"
            "        with p:  # fedpriv: a phase\n"
            "            y = h(x)\n"
            "            z = y  # fedpriv\n"
            "    app = A(mods=m)  # fedpriv, was: app = A()\n"
            "    return y\n")
    assert plain(text) == ("def f(x):\n"
                           "    y = h(x)\n"
                           "    app = A()\n"
                           "    return y\n")


def test_without_the_fedpriv_lines_the_example_is_a_plain_flower_app(tmp_path):
    """The stripped files hold nothing of fedpriv_flwr, parse and compile, and load as a Flower
    app: a ClientApp without mods and a ServerApp; the run config loses only fedpriv's keys."""
    for name in APP_FILES:
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(plain((APP / name).read_text()))
    for name in APP_FILES[1:]:
        code = (tmp_path / name).read_text()
        compile(code, name, "exec")
        assert "fedpriv_flwr" not in code and "personal" not in code, name
        assert "PrivateStrategy" not in code and "head_lr" not in code, name
    config = tomllib.loads((tmp_path / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    full = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert set(config["config"]) == {"num-server-rounds", "fraction-evaluate", "local-steps",
                                      "learning-rate", "batch-size", "seed"}
    assert set(config["config"]) < set(full["config"]) and config["components"] == \
        full["components"]
    load = ("import flowerapp.client_app as c, flowerapp.server_app as s\n"
            "from flwr.clientapp import ClientApp\nfrom flwr.serverapp import ServerApp\n"
            "assert isinstance(c.app, ClientApp) and isinstance(s.app, ServerApp)\n"
            "print('mods', len(c.app._mods))\n")
    done = subprocess.run([sys.executable, "-c", load], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mods 0" in done.stdout


def test_every_fedpriv_line_is_on_the_tutorial_page():
    """The example differs from the plain app only by lines the tutorial shows."""
    page = TUTORIAL.read_text()
    lines = [(name, n, code) for name in APP_FILES
             for n, code in marked((APP / name).read_text())
             if code.strip() and not code.strip().startswith("#")]  # comments need not be
    assert len(lines) >= 20  # the server's wrapper, the mod, the phases, the keys
    missing = [f"{name}:{n}: {code.strip()}" for name, n, code in lines
               if code.strip() not in page]
    assert not missing, "lines of the example that the tutorial does not show:\n" + \
        "\n".join(missing)


# ----- the same users and the same model as fedpriv's deep-dp-fedavg-ft -------------------------
@pytest.fixture
def task():
    sys.path.insert(0, str(APP))
    try:
        import flowerapp.task as module

        yield module
    finally:
        sys.path.remove(str(APP))


@needs_fmnist
def test_the_app_holds_fedpriv_users_and_model(task):
    import torch

    from fedpriv.algorithms.deep.problem import problem_of, user_block
    from fedpriv.configure import parse_config

    config = parse_config({"algorithm": "deep-dp-fedavg-ft", "dataset": "fashion-mnist",
                           "num-users": 40, "seed": 3, "rounds": 1})
    problem = problem_of(config)
    for user in (0, 17, 39):
        trainloader, testloader = task.load_data(user, 40, 24, seed=3)
        for loader, split in ((trainloader, "train"), (testloader, "test")):
            x, y = loader.dataset.tensors
            block = user_block(problem, np.array([user]), split)
            count = int(block.counts[0])
            assert len(y) == count and count > 0
            assert torch.equal(y, block.y[0, :count].cpu())
            assert torch.equal(x, block.x[0, :count].cpu())
    torch.manual_seed(3)
    flat = torch.cat([p.detach().reshape(-1) for p in task.Net().parameters()]).numpy()
    assert np.array_equal(flat, problem.spec.initial(3))  # the same seeded initialization
    assert [n for n, _ in task.Net().named_parameters()][-2:] == ["fc3.weight", "fc3.bias"]


# ----- through `flwr run` -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pld_epsilon(z: float, rounds: int, delta: float) -> float:
    """Epsilon of ``rounds`` Gaussian releases of multiplier ``z`` (add/remove one user),
    straight from dp-accounting's PLD accountant."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                        value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(z), rounds)
    return float(acc.get_epsilon(delta))


def _rdp_epsilon(z: float, rounds: int, delta: float) -> float:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(z), rounds)
    return float(acc.get_epsilon(delta))


@pytest.fixture
def short_dir():
    folder = tempfile.mkdtemp(prefix="fpex", dir="/tmp")  # Ray's socket paths: short
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


@needs_fmnist
@pytest.mark.integration
def test_the_example_runs_through_flwr_run_privately(tmp_path, short_dir):
    """6 SuperNodes (one user each), 2 rounds at epsilon = 1: the run completes; the printed
    epsilon is the PLD accountant's for the noise multiplier of the ledger (not RDP's) and meets
    the target; every node fine-tuned and evaluated; the release holds the public plan, the
    ledger and the clip, and none of the exact metrics or counts of the operator report."""
    from fedpriv.launcher import stop_local_superlink
    from fedpriv.privacy.accounting import epsilon_of

    (short_dir / "ray").mkdir()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_LOCAL_")}
    env.update({"FLWR_HOME": str(short_dir / "flwr"), "RAY_TMPDIR": str(short_dir / "ray"),
                "FLWR_TELEMETRY_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
                "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    report = tmp_path / "results" / "app.json"
    overrides = f'num-users=6 num-server-rounds=2 seed=1 results-path="{report}"'
    cmd = ["flwr", "run", str(APP), "--stream", "--run-config", overrides,
           "--federation-config", "num-supernodes=6 client-resources-num-cpus=1"]
    try:
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
    finally:
        stop_local_superlink(port)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    printed = re.findall(r"fedpriv: epsilon spent = ([0-9.]+) at delta = (\S+) \(PLD", log)
    assert printed, log[-4000:]
    epsilon, delta = float(printed[-1][0]), float(printed[-1][1])
    release_path = report.with_name("app.release.json")
    assert f"fedpriv: release (what may leave the server): {release_path}" in log
    operator = json.loads(report.read_text())
    release = json.loads(release_path.read_text())

    # the epsilon: the PLD accountant's, for the multiplier the rounds were noised with
    ledger = release["privacy"]["ledger"]
    multipliers = {e["noise_multiplier"] for e in ledger}
    assert len(ledger) == 2 and len(multipliers) == 1 and delta == 1e-5
    z = multipliers.pop()
    pld = _pld_epsilon(z, 2, delta)
    assert abs(epsilon - pld) < 6e-4  # printed to 4 decimals
    assert abs(pld - epsilon_of({(z, 1.0): 2}, delta, "pld")) < 1e-9
    assert abs(_rdp_epsilon(z, 2, delta) - epsilon) > 0.02  # the test tells RDP apart
    assert 0.99 <= epsilon <= 1.0 + 1e-6  # calibrated to the target, not above it
    assert release["privacy"]["epsilon"] == pytest.approx(epsilon, abs=6e-4)
    assert release["plan"]["num_users"] == 6 and release["plan"]["clip_quantile"] == 0.5

    # the operator report: every node answered, fine-tuned and evaluated (exact metrics)
    rounds = operator["rounds"]
    assert [r["answered_nodes"] for r in rounds] == [6, 6]
    assert rounds[-1]["evaluated_nodes"] == 6
    exact = rounds[-1]["exact_metrics"]
    assert 0.0 <= exact["eval_acc"] <= 1.0 and math.isfinite(exact["eval_loss"])

    # the release: a whitelist; no exact metric, no count from the users' data, no seed
    assert set(release) <= {"document", "publishable", "not_publishable_because", "strategy",
                            "trusted", "plan", "privacy", "rounds"}
    for row in release["rounds"]:
        assert set(row) <= {"round", "epsilon_spent", "clip_norm", "private_metrics"}
    text = json.dumps(release)
    for word in ("exact_metrics", "eval_acc", "eval_loss", "answered_nodes", "users",
                 "unclipped_users", "evaluated_nodes", "seed", "server_seconds"):
        assert f'"{word}"' not in text, word
    for value in exact.values():
        assert repr(value) not in text and f"{value:.6f}" not in text
    assert "seed" in operator and "rounds" in operator  # what the release leaves out is there
