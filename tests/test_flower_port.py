"""The port benchmark (benchmarks/flower_port_compare.py): each stage of a Flower app ported from
Flower's DP wrapper to ``PrivateStrategy`` runs, on a few nodes, through the apps' own code on an
in-memory grid, and prints what it should (the RDP and the PLD epsilon of the same noise, the
calibrated target with fedpriv, no privacy cost without federation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(),
                                reason="needs Debian's dataset-fashion-mnist")


@pytest.fixture(scope="module")
def port():
    for path in (ROOT / "benchmarks", ROOT / "examples" / "flower-app"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import flower_port_app

    return flower_port_app


def settings(out: Path, seed: int = 0) -> dict:
    return {"num_nodes": 5, "rounds": 2, "seed": seed, "epsilon": 1.0, "delta": 1e-5,
            "clip_norm": 0.15, "head_steps": 3, "local_steps": 1, "lr": 0.1, "batch_size": 24,
            "out": str(out)}


def test_every_stage_of_the_port_runs_and_states_its_epsilon(port, tmp_path):
    runs = {}
    for variant in port.VARIANTS:
        s = settings(tmp_path / f"{variant}.json")
        runs[variant] = port.serve(variant, s, port.InProcessGrid(port.client_app(variant, s), 5))
        assert json.loads(Path(s["out"]).read_text()) == runs[variant]
        assert 0.0 <= runs[variant]["accuracy"] <= 1.0
    private = [v for v in port.VARIANTS if v != "local"]
    z = {runs[v]["noise_multiplier"] for v in private}
    assert len(z) == 1 and z.pop() > 1.0  # one calibration for every private stage
    # the same noise: Flower's RDP accountant states more than the PLD accountant's target
    assert runs["flower-rdp"]["epsilon"] > 1.05
    for v in ("flower-pld", "fedpriv-finetune", "fedpriv-fedrep"):
        assert 0.99 <= runs[v]["epsilon"] <= 1.0 + 1e-9, v
    assert runs["local"]["epsilon"] == 0.0


def test_the_fedrep_stage_keeps_each_head_on_its_node(port, tmp_path):
    s = settings(tmp_path / "fedrep.json")
    client = port.client_app("fedpriv-fedrep", s)
    sent = []

    class Recording(port.InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            replies = super().send_and_receive(messages, timeout=timeout)
            sent.extend(r for r in replies if r.has_content() and "arrays" in r.content)
            return replies

    port.serve("fedpriv-fedrep", s, Recording(client, 5))
    assert sent, "no train reply was recorded"
    for reply in sent:
        keys = set(reply.content["arrays"].keys())
        assert keys == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}, keys


def test_the_script_prints_its_table(tmp_path):
    out = tmp_path / "table.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/flower_port_compare.py", "--engine", "inprocess",
         "--num-nodes", "4", "--rounds", "1", "--seeds", "1", "--head-steps", "2",
         "--variants", "local", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no federation (head on the untrained model)" in done.stdout
    table = json.loads(out.read_text())
    assert list(table["summary"]) == ["local"]
    assert table["runs"]["local"][0]["epsilon"] == 0.0
    bad = subprocess.run([sys.executable, "benchmarks/flower_port_compare.py", "--variants",
                          "flower-dp"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--variants: flower-dp" in bad.stderr
