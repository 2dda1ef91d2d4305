"""`agora plan` end to end: help, a prediction with plots and JSON, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FLEET = """
[[group]]
count = 8
device = "rtx4090"
up_mbit = 80
down_mbit = 80
rtt_ms = [40, 120]
relayed = 0.25

[churn]
mean_session_min = 20
startup_s = 30

[node]
micro_batch = 4
seq_len = 256
codec = "int8"
outer_every_steps = 10
"""


def agora(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmlab.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_explains_the_command() -> None:
    r = agora("plan", "--help")
    assert r.returncode == 0
    for word in ("--fleet", "--validate", "--json", "--plots", "discrete-event"):
        assert word in r.stdout


def test_a_gpu_fleet_prediction_writes_json_and_plots(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    out = tmp_path / "plan.json"
    r = agora(
        "plan", "--model", "llama-125m", "--fleet", str(fleet), "--minutes", "4",
        "--sweep-minutes", "0.5", "--json", str(out), "--plots", str(tmp_path / "plots"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    pred = report["prediction"]
    assert pred["tokens_per_s"] > 0 and 0 < pred["efficiency"] <= 1.05
    assert pred["stages"] == report["recommendation"]["stages"]
    assert "vendor datasheets" in pred["profiles"]["rtx4090"]["source"]
    assert pred["departures"] > 0  # 20-minute sessions over 5 simulated minutes
    assert report["validation"] is None
    for name in ("rtt", "bandwidth", "churn", "replicas"):
        assert (tmp_path / "plots" / f"efficiency_vs_{name}.png").stat().st_size > 1000
    # slower links cannot make the swarm faster
    bw = [p["efficiency"] for p in report["sweeps"]["mbit"]]
    assert bw[0] <= bw[-1]
    assert "efficiency" in r.stdout


def test_a_cpu_fleet_uses_the_stages_measured_here(tmp_path: Path) -> None:
    fleet = tmp_path / "cpu.toml"
    fleet.write_text('[[group]]\ncount = 4\ndevice = "cpu"\nhost = "local"\n')
    out = tmp_path / "plan.json"
    r = agora(
        "plan", "--model", "tiny", "--fleet", str(fleet), "--stages", "2", "--minutes", "0.5",
        "--no-sweeps", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    pred = json.loads(out.read_text())["prediction"]
    assert pred["profiles"]["cpu"]["source"].startswith("measured here")
    assert pred["tokens_per_s"] > 0


def test_bad_input_gets_a_clear_error(tmp_path: Path) -> None:
    fleet = tmp_path / "bad.toml"
    fleet.write_text('[[group]]\ncount = 2\ndevice = "tpu"\n')
    r = agora("plan", "--model", "tiny", "--fleet", str(fleet))
    assert r.returncode == 2 and "device='tpu'" in r.stderr
    r = agora("plan", "--model", "no-such-model", "--fleet", str(fleet))
    assert r.returncode == 2 and "neither a preset" in r.stderr
    r = agora("plan", "--model", "tiny")
    assert r.returncode == 2 and "--fleet" in r.stderr
    used = tmp_path / "used"  # a swarm in it would resume the run its database holds
    used.mkdir()
    (used / "coordinator.sqlite").write_bytes(b"")
    r = agora("plan", "--model", "tiny", "--validate", "--keep-swarms", str(used))
    assert r.returncode == 2 and "new or empty directory" in r.stderr
    r = agora("plan", "--model", "tiny", "--measured", "v.json", "--keep-swarms", str(used))
    assert r.returncode == 2 and "--keep-swarms keeps the real swarms" in r.stderr
