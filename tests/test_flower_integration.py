"""Real Flower runs: the fedpriv CLI drives `flwr run` on the simulation engine (Ray)."""

import json
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.integration


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_cli(env, workdir, **settings):
    """Run `fedpriv run` (which drives `flwr run`) with key=value overrides; return the results
    and the process output."""
    out = workdir / "results.json"
    cmd = [sys.executable, "-m", "fedpriv.cli", "run", "--out", str(out)]
    for key, value in settings.items():
        cmd += ["--set", f"{key.replace('_', '-')}={value}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480, cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


def test_private_fedrep_through_the_flower_simulation_engine(tmp_path, flower_env, monkeypatch,
                                                            deadline, capfd):
    """``fedpriv run`` in a new user's environment: no FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION
    (``fedpriv run`` sets it itself for the SuperLink it starts, so Flower installs no
    dependencies per run; measured control (=0): the log shows "Installing application
    dependencies..." and "uv sync took 5.8 seconds", and the default job took 52 s instead of
    29 s), and no RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (Ray would otherwise leave the loopback
    address and hang). The command starts a Ray head when it starts (launcher.early_ray_head)
    and Flower's simulation attaches to it (one driver connected to that head); the head and
    the local SuperLink are stopped with the run."""
    from pathlib import Path

    from fedpriv import cli, launcher
    from fedpriv.ray_head import group_running

    heads = []

    class Recorded(launcher.RayHead):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            heads.append(self)
            self.drivers = []

        def stop(self, grace=0.0):
            self.drivers = sorted({p.name for p in Path(self.folder).glob(
                "session_*/logs/python-core-driver-*")})
            super().stop(grace)

    monkeypatch.setattr(launcher, "RayHead", Recorded)
    for key, value in flower_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    monkeypatch.delenv("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results.json"
    settings = {"num-users": 800, "dim": 10, "epsilon": 2.0, "users-per-node": 200, "rounds": 3}
    with deadline(480):  # a driver that cannot reach the head retries for many minutes
        code = cli.main(["run", "--out", str(out),
                         *[a for k, v in settings.items() for a in ("--set", f"{k}={v}")]])
    captured = capfd.readouterr()
    log = captured.out + captured.err
    assert code == 0, "the run failed or hung (stopped after 480 s):\n" + log[-3000:]
    assert "Installing application dependencies" not in log and "uv sync" not in log
    head, = heads
    assert len(head.drivers) == 1, head.drivers  # Flower's simulation process, and no other
    assert not group_running(head.proc.pid)
    results = json.loads(out.read_text())
    assert results["runtime"] == "flower" and results["num_nodes"] == 4
    assert results["metrics"]["population_mse"] < 0.2 * results["metrics"]["local_only_mse"]
    privacy = results["privacy"]
    assert 1.9 < privacy["epsilon"] <= 2.0
    assert [e["release"] for e in privacy["ledger"]] == ["init", "round-1", "round-2",
                                                        "round-3"]
    assert all(r["nodes_answered"] == 4 for r in results["rounds"])
    assert "epsilon_spent=" in captured.out  # per-round progress was shown
    # where the time went (benchmarks/profile_flower.py), in the operator report only
    profile = results["profile"]
    assert [s["step"] for s in profile["steps"]] == ["init", "round-1", "round-2", "round-3",
                                                     "final"]
    assert all(0 < s["nodes_compute_s"] and 0 <= s["server_s"] < s["wall_s"]
               for s in profile["steps"])
    assert (profile["serverapp_started_unix"] <= profile["nodes_discovered_unix"]
            <= profile["steps_done_unix"])
    assert profile["indexed_dispatch"] is True  # strategies.sim_dispatch, in the engine's state
    release = json.loads((tmp_path / "results.release.json").read_text())
    assert "profile" not in release and "profile" not in json.dumps(release)
    # the local SuperLink the CLI started has been stopped
    assert not _port_open(int(flower_env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]))


def test_bad_config_fails_before_the_run_starts(tmp_path, flower_env):
    proc = subprocess.run([sys.executable, "-m", "fedpriv.cli", "run", "--set", "epsilon=0"],
                          env=flower_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "epsilon" in proc.stderr and "Flower" not in proc.stdout


def test_one_user_per_node_is_the_faithful_deployment(tmp_path, shared_flower_env):
    results, _ = run_cli(shared_flower_env, tmp_path, num_users=12, dim=6, epsilon=8.0,
                         users_per_node=1, rounds=2)
    assert results["num_nodes"] == 12
    assert all(r["nodes_answered"] == 12 and r["users_contributing"] == 12
               for r in results["rounds"])
    assert results["privacy"]["epsilon"] <= 8.0


def test_priv_altmin_with_user_groups_matches_the_in_process_run(tmp_path, shared_flower_env):
    """Two released parts per round and steps covering one user group each, over Flower."""
    from fedpriv.configure import parse_config
    from fedpriv.engine import run_in_process

    settings = dict(algorithm="priv-altmin", num_users=900, dim=8, epsilon=4.0, rounds=2,
                    user_groups=2, users_per_node=300, feature_clip=1e-4, response_clip=1e-4)
    results, _ = run_cli(shared_flower_env, tmp_path, **settings)
    assert results["runtime"] == "flower" and results["num_nodes"] == 3
    rounds = [r for r in results["rounds"] if r["step"].startswith("round")]
    assert [r["user_group"] for r in rounds] == [0, 1]
    assert sum(r["users_contributing"] for r in rounds) == 900  # each user in one round
    ledger = results["privacy"]["ledger"]
    assert [p["name"] for p in ledger[1]["parts"]] == ["cov", "corr"]
    local = run_in_process(parse_config(
        {k.replace("_", "-"): v for k, v in settings.items()}), num_partitions=3,
        log=lambda _: None)
    assert results["metrics"]["population_mse"] == pytest.approx(
        local["metrics"]["population_mse"], rel=1e-9)
    assert results["privacy"]["epsilon"] == pytest.approx(local["privacy"]["epsilon"])


def test_private_meta_clustering_matches_the_in_process_run(tmp_path, shared_flower_env):
    """Poisson-sampled tasks chosen on the nodes from the public seed, (q, d) releases."""
    from fedpriv.configure import parse_config
    from fedpriv.engine import run_in_process

    settings = dict(algorithm="private-meta-cluster", meta_models=2, task_clusters=2,
                    task_std=0.5, num_users=600, dim=12, epsilon=4.0, rounds=4,
                    users_per_node=200, feature_dist="unit-ball", label_noise=0.5,
                    clip_norm=1.0, learning_rate=5.0, meta_lambda=0.2, delta=1e-5)
    results, proc = run_cli(shared_flower_env, tmp_path, **settings)
    assert results["runtime"] == "flower" and results["num_nodes"] == 3
    ledger = results["privacy"]["ledger"]
    assert [e["mechanism"] for e in ledger] == ["poisson-sampled gaussian"] * 4
    assert "transfer risk" in proc.stdout
    local = run_in_process(parse_config(
        {k.replace("_", "-"): v for k, v in settings.items()}), num_partitions=3,
        log=lambda _: None)
    assert [r["users_contributing"] for r in results["rounds"]] == [
        r["users_contributing"] for r in local["rounds"]]
    assert results["metrics"]["transfer_risk"] == pytest.approx(
        local["metrics"]["transfer_risk"], rel=1e-9)
    assert results["privacy"]["epsilon"] == pytest.approx(local["privacy"]["epsilon"])
    assert results["metrics"]["transfer_risk"] < results["metrics"]["local_risk"]


def test_a_exp_nodes_score_and_the_server_samples_through_flower(tmp_path, shared_flower_env):
    """The exponential mechanism over Flower: each SuperNode scores every candidate for its
    users, the strategy samples; identical to the in-process run, pure epsilon in the ledger."""
    from fedpriv.configure import parse_config
    from fedpriv.engine import run_in_process

    settings = dict(algorithm="a-exp", num_users=600, dim=8, rank=1, samples_per_user=6,
                    label_noise=0.1, epsilon=1.0, candidates=3000, users_per_node=200)
    results, proc = run_cli(shared_flower_env, tmp_path, **settings)
    assert results["runtime"] == "flower" and results["num_nodes"] == 3
    (entry,) = results["privacy"]["ledger"]
    assert entry["mechanism"] == "exponential" and results["privacy"]["delta"] == 0.0
    assert "pure epsilon-DP" in proc.stdout
    local = run_in_process(parse_config(
        {k.replace("_", "-"): v for k, v in settings.items()}), num_partitions=3,
        log=lambda _: None)
    assert entry["chosen"] == local["privacy"]["ledger"][0]["chosen"]
    assert results["metrics"]["population_mse"] == pytest.approx(
        local["metrics"]["population_mse"], rel=1e-9)


def test_a_deep_run_through_flower_matches_the_in_process_run(tmp_path, shared_flower_env):
    """Deep Private FedRep on real data (digits): the Flower simulation and the in-process
    engine give the same metrics, release and epsilon for the same seed (with the heads
    cross-fitted: the key reaches the nodes through Flower's run config), and the same
    learning curve (eval steps before round 1 and after it)."""
    from fedpriv.configure import parse_config
    from fedpriv.engine import run_in_process

    settings = dict(algorithm="deep-private-fedrep", num_users=60, hidden_sizes="32",
                    rounds=2, epsilon=8.0, delta=1e-5, users_per_node=20, users_per_round=30,
                    cross_fit=2, eval_every=1)
    results, _ = run_cli(shared_flower_env, tmp_path, **settings)
    assert results["runtime"] == "flower" and results["num_nodes"] == 3
    local = run_in_process(parse_config(
        {k.replace("_", "-"): v for k, v in settings.items()}), num_partitions=3,
        log=lambda _: None)
    assert results["metrics"]["accuracy"] == pytest.approx(local["metrics"]["accuracy"],
                                                           abs=1e-6)
    assert np.allclose(results["server_state"]["parameters"],
                       local["server_state"]["parameters"], atol=1e-6)
    assert results["privacy"]["epsilon"] == pytest.approx(local["privacy"]["epsilon"])
    flower_eval, local_eval = results["rounds"][2], local["rounds"][2]
    assert flower_eval["step"] == local_eval["step"] == "eval-1"
    assert flower_eval["accuracy"] == pytest.approx(local_eval["accuracy"], abs=1e-6)
    assert (tmp_path / "results.curve.png").is_file()  # drawn by the ServerApp


def test_fewshot_meta_learning_through_flower_gives_the_in_process_release(tmp_path,
                                                                          shared_flower_env):
    """Task-level private meta-learning of a network (few-shot tasks of digits' images, q = 2
    networks): the meta-gradients computed by the ClientApps, the clipped aggregation, noise
    and accounting by the ServerApp; the same release, metrics and epsilon as in-process."""
    from fedpriv.configure import parse_config
    from fedpriv.engine import run_in_process

    settings = dict(algorithm="fewshot-private-meta-cluster", meta_models=2, num_users=60,
                    hidden_sizes="16", queries=3, rounds=2, tasks_per_round=30, epsilon=4.0,
                    delta=1e-5, users_per_node=20)
    results, _ = run_cli(shared_flower_env, tmp_path, **settings)
    assert results["runtime"] == "flower" and results["num_nodes"] == 3
    local = run_in_process(parse_config(
        {k.replace("_", "-"): v for k, v in settings.items()}), num_partitions=3,
        log=lambda _: None)
    assert np.allclose(results["server_state"]["meta_models"],
                       local["server_state"]["meta_models"], atol=1e-6)
    for key in ("transfer_accuracy", "local_accuracy", "model_0_share"):
        assert results["metrics"][key] == pytest.approx(local["metrics"][key], abs=1e-9), key
    assert results["privacy"]["ledger"] == local["privacy"]["ledger"]


def test_distributed_noise_shares_travel_through_flower(tmp_path, shared_flower_env):
    """aggregation = distributed through the real runtime: the share parameters reach the
    nodes in the broadcast, their int64 vectors mod 2^b come back, the server decodes the sum,
    and the ledger's epsilon is the run's; the release says who is trusted."""
    results, _ = run_cli(shared_flower_env, tmp_path, num_users=800, dim=10, epsilon=2.0,
                         users_per_node=200, rounds=2, aggregation="distributed",
                         accountant="rdp")
    privacy = results["privacy"]
    assert results["num_nodes"] == 4 and results["rejections"] == {}
    assert [e["mechanism"] for e in privacy["ledger"]] == ["distributed skellam"] * 3
    assert all(e["honest_nodes"] == 4 for e in privacy["ledger"])
    assert 1.9 < privacy["epsilon"] <= 2.0
    # the nodes send no exact metrics: the final step is not sent at all
    assert results["metrics"] == {} and results["rounds"][-1]["note"].startswith("not sent")
    assert [r["users_contributing"] for r in results["rounds"]] == [800] * 3 + [None]
    release = json.loads((tmp_path / "results.release.json").read_text())
    assert release["publishable"] is True
    assert release["privacy"]["trust"]["aggregation"] == "distributed"
