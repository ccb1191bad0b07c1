"""Secure aggregation (``aggregation = "secure"``) through the real Flower runtime: the
simulation engine (with and without nodes crashing mid-protocol), what the ServerApp receives
from the nodes, a TLS + SuperNode-authenticated deployment whose server is killed and resumed,
and the compose override that runs the deployment with secure aggregation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedpriv import checkpoint
from fedpriv import deploy as dep
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.server.secagg import check_threshold
from tests.flower_grid import run_in_simulation
from tests.test_deployment import (
    _free_port,
    _python,
    _start_superlink,
    _wait,
    processes,  # noqa: F401 -- the fixture, used by name
)
from tests.test_flower_integration import run_cli
from tests.test_flower_reliability import _alive

ROOT = Path(__file__).resolve().parents[1]
SECURE = dict(aggregation="secure", accountant="rdp")
SIM = dict(num_users=800, users_per_node=200, dim=10, epsilon=2.0, rounds=2, seed=3, **SECURE)


def _in_process(settings: dict, **kw) -> dict:
    config = parse_config({k.replace("_", "-"): v for k, v in settings.items()})
    return json.loads(json.dumps(run_in_process(config, log=lambda _: None, **kw),
                                 default=float))


# -- the simulation engine --------------------------------------------------------------------
@pytest.mark.integration
def test_a_secure_run_through_flower_releases_the_planned_skellam_noise(tmp_path,
                                                                      shared_flower_env):
    results, proc = run_cli(shared_flower_env, tmp_path, **SIM)
    assert results["runtime"] == "flower" and results["num_nodes"] == 4
    ledger = results["privacy"]["ledger"]
    assert [e["release"] for e in ledger] == ["init", "round-1", "round-2"]
    assert {e["mechanism"] for e in ledger} == {"distributed skellam"}
    assert [e["honest_nodes"] for e in ledger] == [4, 4, 4]  # floor(0.1 * 4) = 0 colluders
    assert 1.9 < results["privacy"]["epsilon"] <= 2.0
    # the plan is a function of the config: the same ledger as the in-process secure run
    assert ledger == _in_process(SIM)["privacy"]["ledger"]
    for report in results["rounds"][:-1]:
        assert report["nodes_answered"] == 4 and report["rejected"] == {}
        assert report["users_contributing"] == 800  # the public count, in the masked sum
        assert report["secure_bytes_to_nodes"] > 0 and report["secure_bytes_from_nodes"] > 0
    # the final step is never sent: the server receives no exact metrics
    assert results["metrics"] == {} and results["rounds"][-1]["nodes_answered"] == 0
    release = json.loads((tmp_path / "results.release.json").read_text())
    assert release["privacy"]["trust"]["aggregation"] == "secure"
    assert release["privacy"]["trust"]["honest_nodes_guaranteed"] == 4


@pytest.mark.integration
def test_nodes_crashing_mid_protocol_are_dropped_and_the_ledger_counts_the_noise_left(
        tmp_path, shared_flower_env):
    """10 nodes, 2 of them crash in every step's collect stage (after sharing their keys):
    their masks are removed, the run completes; 2 dropouts exceed the 1 node the collusion
    threshold allows, so the ledger records 8 honest nodes' noise, not the planned 9."""
    settings = dict(SIM, num_users=1000, users_per_node=100, node_fault_rate=0.2,
                    node_fault_kind="crash", max_epsilon=4.0)
    results, proc = run_cli(shared_flower_env, tmp_path, **settings)
    assert results["runtime"] == "flower" and results["num_nodes"] == 10
    assert results["privacy"]["trust"]["honest_nodes_guaranteed"] == 9
    steps = [r["step"] for r in results["rounds"]]
    assert steps == ["init", "round-1", "round-2", "final"]  # completed, final step included
    for report in results["rounds"][:-1]:
        assert report["nodes_answered"] == 8 and report["rejected"] == {"node-error": 2}
        assert report["users_contributing"] == 800
    assert [r["honest_nodes"] for r in results["rounds"][:-1]] == [8, 8, 8]
    ledger = results["privacy"]["ledger"]
    assert [e["honest_nodes"] for e in ledger] == [8, 8, 8]
    assert "simulated crash" in proc.stdout + proc.stderr
    assert "only 8 honest nodes' noise shares" in proc.stdout + proc.stderr
    # less noise than planned: more epsilon than the target, within the ceiling, and exactly
    # what the in-process run with the same faults records
    clean = _in_process(dict(SIM, num_users=1000, users_per_node=100))["privacy"]
    assert all(e["rho"] > c["rho"] for e, c in zip(ledger, clean["ledger"], strict=True))
    assert 2.0 < results["privacy"]["epsilon"] <= 4.0
    assert ledger == _in_process(settings)["privacy"]["ledger"]


@pytest.mark.integration
def test_secagg_plus_neighbourhoods_run_through_flower_with_nodes_crashing(
        tmp_path, shared_flower_env):
    """64 nodes (the smallest default ring: k = 26, t = 7), one round, 10% crashing in the
    collect stage: every node recomputes its neighbours from the bitmap and beacon keys it gets
    through Flower's records, the masks of the crashed nodes are rebuilt from their
    neighbours' shares, and the ledger is the in-process run's."""
    settings = dict(SIM, num_users=64 * 5, users_per_node=5, rounds=1, node_fault_rate=0.1,
                    node_fault_kind="crash", max_epsilon=4.0)
    results, proc = run_cli(shared_flower_env, tmp_path, **settings)
    assert results["runtime"] == "flower" and results["num_nodes"] == 64
    trust = results["privacy"]["trust"]
    assert (trust["secure_graph"], trust["secure_neighbours"]) == ("ring (SecAgg+)", 26)
    for report in results["rounds"][:-1]:
        assert report["nodes_failed"] >= 1 and report["rejected"].keys() == {"node-error"}
        assert report["nodes_answered"] == 64 - report["nodes_failed"]
    assert "simulated crash" in proc.stdout + proc.stderr
    assert results["privacy"]["ledger"] == _in_process(settings)["privacy"]["ledger"]


# -- what the ServerApp receives --------------------------------------------------------------
SPY_APP = '''
import json, os
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
import clients.app as fed
import strategies.server_app as server_app

SETTINGS = json.loads(SETTINGS_JSON)
OUT = OUT_PATH


def _configured(context):
    """The context with the run config (run_simulation has none, and a ClientApp's may not be
    modified): the same state record, so what a node keeps between messages is kept."""
    return Context(run_id=context.run_id, node_id=context.node_id,
                   node_config=context.node_config, state=context.state,
                   run_config={**context.run_config, **SETTINGS})


app = ClientApp()
for kind, name, fn in [("query", "hello", fed.hello), ("train", "step", fed.step),
                       ("evaluate", "final", fed.final),
                       ("train", "secagg_setup", fed.secagg_setup),
                       ("query", "secagg_keys", fed.secagg_keys),
                       ("query", "secagg_collect", fed.secagg_collect),
                       ("query", "secagg_unmask", fed.secagg_unmask)]:
    getattr(app, kind)(name)(lambda msg, context, fn=fn: fn(msg, _configured(context)))


def _record(content):
    out = {}
    for key, record in content.items():
        entry = {"type": type(record).__name__, "keys": sorted(record)}
        if type(record).__name__ == "ArrayRecord":
            entry["arrays"] = {k: v.numpy().tolist() for k, v in record.items()}
        elif type(record).__name__ == "ConfigRecord" and "layout" in record:
            entry["layout"] = str(record["layout"])
        out[key] = entry
    return out


class Spy:
    """The Grid, recording every message sent and every reply received."""

    def __init__(self, grid):
        self.grid, self.log = grid, []

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *args, **kwargs):
        messages = list(messages)
        for m in messages:
            self.log.append({"dir": "sent", "type": m.metadata.message_type,
                             "content": _record(m.content)})
        replies = list(self.grid.send_and_receive(messages, *args, **kwargs))
        for r in replies:
            self.log.append({"dir": "reply", "type": r.metadata.message_type,
                             "error": r.has_error(),
                             "content": {} if r.has_error() else _record(r.content)})
        return replies


server = ServerApp()


@server.main()
def main(grid, context):
    spy = Spy(grid)
    server_app.main(spy, _configured(context))
    with open(OUT, "w") as fh:
        json.dump(spy.log, fh)
'''


@pytest.mark.integration
def test_the_server_receives_no_node_count_or_metric_in_plain(tmp_path, flower_env):
    """fedpriv's ServerApp and ClientApp in Flower's simulation engine, the ServerApp's Grid
    wrapped to record every reply: a node's replies carry public keys, encrypted shares, its
    masked vector and mask shares, never its user count, clipped count or a metric."""
    from fedpriv.privacy.quantize import from_ring
    from fedpriv.secagg.crypto import Layout
    from fedpriv.secagg.node import COUNT_BITS, COUNTS

    settings = {k.replace("_", "-"): v for k, v in SIM.items()}
    settings["results-path"] = str(tmp_path / "results.json")
    out = tmp_path / "spy.json"
    (tmp_path / "spy_app.py").write_text(SPY_APP.replace(
        "SETTINGS_JSON", repr(json.dumps(settings))).replace("OUT_PATH", repr(str(out))))
    proc = run_in_simulation("spy_app", str(tmp_path), 4, flower_env, str(tmp_path),
                             timeout=300)
    assert proc.returncode == 0 and out.is_file(), (proc.stdout + proc.stderr)[-4000:]
    log = json.loads(out.read_text())
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["users_contributing"] for r in results["rounds"]] == [800] * 3 + [None]

    replies = [e for e in log if e["dir"] == "reply"]
    assert not any(e["error"] for e in replies)
    stages = ["train.secagg_setup", "query.secagg_keys", "query.secagg_collect",
              "query.secagg_unmask"]
    assert {e["type"] for e in replies} == {"query.hello", *stages}  # no plain step reply
    # 4 nodes in each of init and 2 rounds (the final step is not sent); keys ahead: the rounds
    # after init send the key list with the setup, no separate share-keys exchange
    for stage in stages:
        expected = 4 if stage == "query.secagg_keys" else 12
        assert sum(e["type"] == stage for e in replies) == expected, stage
    plain = {"num-users", "num-clipped", "compute-s", "decode-s"}
    for e in replies:
        for record in e["content"].values():
            assert record["type"] != "MetricRecord", e
            assert not plain & set(record["keys"]), e
            assert not any(k.startswith("m.") for k in record["keys"]), e
    collect = [e for e in replies if e["type"] == "query.secagg_collect"]
    assert all(e["content"]["arrays"]["keys"] == ["masked"] for e in collect)
    # the counts segment of each masked vector is uniform modulo 2^62 to the server: a plain
    # count or fixed-point metric would lift to a small integer (|x| < 2^40 for a uniform value:
    # probability 2^-21 per coordinate)
    layouts = [Layout.from_json(json.loads(e["content"]["config"]["layout"]))
               for e in log if e["dir"] == "sent" and "layout" in e["content"].get("config", {})
               and e["type"] in ("query.secagg_keys", "train.secagg_setup")]
    layouts = layouts[::4]  # one per step: every node gets the same layout
    assert len(layouts) == 3
    for i, e in enumerate(collect):
        counts = layouts[i // 4].split(np.array(e["content"]["arrays"]["arrays"]["masked"],
                                                dtype=np.uint64))[COUNTS]
        assert len(counts) >= 2
        assert np.all(np.abs(from_ring(counts, COUNT_BITS).astype(float)) > 2.0 ** 40), counts


# -- a deployment: TLS, SuperNode authentication, a killed server -----------------------------
DEPLOYED = {"num-users": 600, "dim": 10, "rounds": 1, "epsilon": 2.0, "seed": 5,
            "aggregation": "secure", "accountant": "rdp"}


@pytest.mark.integration
def test_a_secure_deployment_with_tls_and_node_authentication_resumes_after_a_server_kill(
        processes):  # noqa: F811 -- tests/test_deployment.py's fixture: stops all it started
    """SuperLink + 2 registered SuperNodes on 127.0.0.1, TLS and SuperNode authentication on,
    aggregation = "secure". A third SuperNode, whose valid key is not registered, claims
    partition 1 too and is refused; the SuperLink lists exactly the two registered ones. The
    ServerApp (the SuperLink's subprocess) is SIGKILLed after it
    checkpointed step 1 (init); the run submitted again with resume = true continues from there
    (its nodes, in a new Flower run, check a ledger with a release they did not see), and its
    ledger is that of an uninterrupted run. (Each SecAgg stage starts a ClientApp process on
    each SuperNode: about 45 s per step on 2 cores; one round after the kill shows the resume.)"""
    certs = processes.short / "certs"
    made = subprocess.run(_python([*dep.DEPLOY_COMMAND, "certs", str(certs), "--nodes", "3"]),
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    d = dep.Deployment(num_nodes=2, superlink_host="127.0.0.1", bind_host="127.0.0.1",
                       superlink_port=_free_port(),
                       node_ports=tuple(_free_port() for _ in range(2)), certs=str(certs),
                       mounted=False, app_dir=str(ROOT))
    ca = str(certs / "public" / "ca.crt")
    assert dep.check_health(d.superlink_address, ca) is False  # nothing listens yet
    env = processes.env
    processes.env = {**env, checkpoint.PAUSE_ENV: "1"}  # the ServerApp holds after step 1
    _start_superlink(processes, d, ca)
    processes.env = env
    assert not dep.check_health(d.superlink_address, None)  # no plain HTTP on a TLS SuperLink
    for _ in range(2):  # registering again (compose re-runs `register`) is harmless
        reg = subprocess.run(_python(dep.register_command(d)), env=env, capture_output=True,
                             text=True, timeout=120)
        assert reg.returncode == 0, reg.stdout + reg.stderr
    for i in range(d.num_nodes):
        processes.start(f"supernode-{i}", dep.supernode_command(d, i))
    intruder = processes.start("intruder", dep.supernode_command(
        d, 1, role="supernode-2", port=_free_port()))  # a valid key, but not registered
    _wait(lambda: intruder.poll() is not None, 90, "the unregistered SuperNode to be refused")
    assert intruder.returncode != 0
    assert "Failed to activate SuperNode" in processes.log("intruder")

    results = processes.short / "results" / "run.json"
    ckpt = results.with_suffix(checkpoint.SUFFIX)
    first = processes.start("submit-1", _python(dep.submit_command(d, str(results), DEPLOYED)))
    _wait(lambda: first.poll() is not None or (
        ckpt.exists() and checkpoint.load(ckpt)["completed"] == 1), 300,
        "the checkpoint of step 1")
    assert first.poll() is None, processes.tails()
    server_pid = checkpoint.load(ckpt)["pid"]
    assert "flwr-serverapp" in Path(f"/proc/{server_pid}/cmdline").read_text()
    os.kill(server_pid, signal.SIGKILL)  # the crash
    _wait(lambda: not _alive(server_pid), 30, "the ServerApp to die")
    os.killpg(first.pid, signal.SIGTERM)  # `flwr run --stream` of the dead run: our group
    first.wait(timeout=30)
    assert not results.exists() and checkpoint.load(ckpt)["completed"] == 1

    # submitted again with resume = true (the checkpoint is the ServerApp's to check)
    resumed = subprocess.run(_python(dep.submit_command(d, str(results), {
        **DEPLOYED, "resume": True})), env=env, cwd=processes.logs, capture_output=True,
        text=True, timeout=420)
    assert resumed.returncode == 0, (resumed.stdout[-3000:] + resumed.stderr[-3000:]
                                     + processes.tails())
    _wait(results.is_file, 30, "the resumed run's results")
    out = json.loads(results.read_text())
    assert out["runtime"] == "flower" and out["num_nodes"] == 2
    assert out["resumed_from_step"] == 1 and not ckpt.exists()
    whole = _in_process({k.replace("-", "_"): v for k, v in DEPLOYED.items()},
                        num_partitions=2)
    ledger = out["privacy"]["ledger"]
    assert ledger == whole["privacy"]["ledger"]
    assert [e["release"] for e in ledger] == ["init", "round-1"]
    assert [e["honest_nodes"] for e in ledger] == [2] * 2
    assert out["privacy"]["epsilon"] == pytest.approx(whole["privacy"]["epsilon"])
    assert out["privacy"]["epsilon"] <= 2.0
    assert out["privacy"]["trust"]["aggregation"] == "secure"
    assert [r["step"] for r in out["rounds"]] == ["init", "round-1", "final"]
    assert all(r["nodes_answered"] == 2 and r["users_contributing"] == 600
               for r in out["rounds"][:-1])
    assert out["metrics"] == whole["metrics"] == {}  # no exact metrics reach the server
    assert whole["simulation_metrics"]["population_mse"] < (
        0.1 * whole["simulation_metrics"]["local_only_mse"])
    # the SuperLink knows exactly the two registered SuperNodes
    listed = subprocess.run(["flwr", "supernode", "ls", d.connection, "--format", "json"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    nodes = json.loads(listed.stdout[listed.stdout.index("{"):])["nodes"]
    assert len(nodes) == 2 and {n["status"] for n in nodes} == {"online"}


# -- docker compose ---------------------------------------------------------------------------
OVERRIDE = "docker-compose.secure-aggregation.yml"


def _override() -> dict:
    return yaml.safe_load((ROOT / OVERRIDE).read_text())


def _submit_settings(command: list[str]) -> dict:
    return dict(command[i + 1].split("=", 1) for i, a in enumerate(command) if a == "--set")


def test_the_secure_aggregation_override_is_the_submit_command_with_its_settings():
    """The override replaces only `submit`'s command: the module's submit command (what the
    integration tests run) with aggregation = "secure"; everything else is docker-compose.yml's
    secure deployment (TLS, SuperNode authentication)."""
    services = _override()["services"]
    assert set(services) == {"submit"} and set(services["submit"]) == {"command"}
    d = dep.Deployment(certs=dep.CONTAINER_CERTS)
    results = f"{dep.CONTAINER_RESULTS}/{dep.RESULTS_FILE}"
    command = services["submit"]["command"]
    assert command == dep.submit_command(d, results, SECURE)
    assert _submit_settings(command) == {"aggregation": '"secure"', "accountant": '"rdp"'}
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert base["submit"]["command"] == dep.submit_command(d, results)  # what it overrides
    assert f"-f docker-compose.yml -f {OVERRIDE}" in (ROOT / OVERRIDE).read_text()


def test_the_override_settings_are_a_valid_secure_run_for_the_composes_nodes():
    """The settings reach the run config as `flwr run --run-config` gets them; the default job
    with them is a valid secure run on the compose file's SuperNodes (a threshold above the
    colluders, at most the nodes), and it runs."""
    from fedpriv.cli import build_parser
    from fedpriv.config_files import app_config_keys, parse_overrides
    from fedpriv.server import check_run

    command = _override()["services"]["submit"]["command"]
    args = build_parser().parse_args(command[1:])
    overrides = parse_overrides(args.set)
    assert overrides == SECURE and set(overrides) <= set(app_config_keys(str(ROOT)))
    config = parse_config(overrides, strict=True)
    assert config.aggregation == "secure" and config.noise_shares
    nodes = dep.Deployment().num_nodes
    assert len([s for s in _compose_services() if s.startswith("supernode-")]) == nodes
    assert check_threshold(config, nodes).t == 2  # majority of 3; floor(0.1 * 3) = 0 colluders
    assert check_run(config, num_partitions=nodes).secure
    quick = parse_config({**overrides, "num-users": 300, "rounds": 1})
    ran = run_in_process(quick, num_partitions=nodes, log=lambda _: None)
    assert [e["honest_nodes"] for e in ran["privacy"]["ledger"]] == [nodes] * 2


def _compose_services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_docker_compose_merges_the_override_onto_the_secure_deployment():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose not installed (apt-get install docker-compose); the YAML "
                    "checks above still ran")
    proc = subprocess.run([exe, "-f", "docker-compose.yml", "-f", OVERRIDE, "config"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    merged = yaml.safe_load(proc.stdout)["services"]
    assert merged["submit"]["command"] == _override()["services"]["submit"]["command"]
    base = _compose_services()
    assert set(merged) == set(base)
    for name in base:  # nothing else changed: TLS, authentication, mounts, ordering
        if name != "submit":
            assert merged[name]["command"] == base[name]["command"], name
    assert merged["submit"]["volumes"] and merged["submit"]["depends_on"]


def test_submit_refuses_secure_aggregation_with_the_pld_accountant(tmp_path):
    """The secure settings are checked before `flwr run`: without accountant = "rdp" the
    submit command stops with the key named."""
    argv = _python(dep.submit_command(
        dep.Deployment(superlink_host="127.0.0.1", certs=None, app_dir=str(ROOT)),
        str(tmp_path / "r.json"), {"aggregation": "secure"}))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FLWR_HOME": str(tmp_path)})
    assert proc.returncode == 2 and "accountant" in proc.stderr
    assert "flwr run" not in proc.stdout

