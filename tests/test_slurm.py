"""`agora launch slurm` against a real single-node Slurm (tests/slurm_harness.py).

The launcher places two real jobs (one per pipeline stage: the test cluster has 2 CPUs);
their nodes join a real coordinator and train. The jobs' walltime is short: each node
drains before it (Slurm records COMPLETED, not TIMEOUT), the launcher replaces the jobs,
and `agora audit` finds no lost or duplicated data.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio
from slurm_harness import job_states, slurm, wait_until

from node.swarm import LocalSwarm, child_env
from protocol.control import StatusReply

__all__ = ["slurm"]

REPO = Path(__file__).resolve().parent.parent


def status(swarm: LocalSwarm) -> StatusReply | None:
    """The coordinator's status, or None if it did not answer in time (a busy CI box)."""
    try:
        return swarm.status(timeout_s=20)
    except (OSError, trio.TooSlowError):
        return None


class Swarm(LocalSwarm):
    def _run_toml(self) -> Path:
        path = super()._run_toml()
        # short jobs: keep less time free before a deadline than the 60 s default
        path.write_text(path.read_text() + "deadline_margin_s = 20.0\nmin_grant_tokens = 256\n")
        return path


def test_launcher_places_jobs_that_train_drain_and_get_replaced(
    slurm: None, tmp_path: Path
) -> None:
    swarm = Swarm(tmp_path / "swarm", preset="tiny", stages=2)
    swarm.start_coordinator()
    facility = f"ci{int(time.time()) % 100000}"
    name = f"agora-{facility}"
    node_toml = tmp_path / "node.toml"
    # drain margin = drain_timeout_s + 2 * request_timeout_s = 30 s before the deadline
    # no DiLoCo outer rounds: a 2-minute job tests placement and draining, not DiLoCo
    node_toml.write_text(
        "[node]\ndrain_timeout_s = 10.0\nrequest_timeout_s = 10.0\nouter_every_steps = 0\n"
    )
    env = child_env()
    env["AGORA_JOIN_TOKEN"] = ""
    launcher_log = tmp_path / "launcher.log"
    with launcher_log.open("wb") as fh:
        launcher = subprocess.Popen(
            [
                sys.executable, "-m", "node.cli", "launch", "slurm",
                "--coordinator", swarm.address, "--facility", facility,
                "--partition", "debug", "--max-jobs", "2", "--time", "00:02:00",
                "--interval", "2", "--startup", "10",
                "--workdir", str(tmp_path / "jobs"),
                "--identity", str(tmp_path / "launcher.key"),
                "--node-args", f"--config {node_toml}",
            ],
            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )  # fmt: skip
    first: set[str] = set()
    try:
        wait_until(
            lambda: sum(s == "RUNNING" for s in job_states(name).values()) == 2,
            60, "two launched jobs to run",
        )  # fmt: skip
        first = set(job_states(name))
        wait_until(
            lambda: (st := status(swarm)) is not None and st.peers == 2,
            90,
            "both job nodes to join",
        )
        wait_until(
            lambda: (st := status(swarm)) is not None and st.committed_tokens > 0,
            120,
            "the job nodes to commit tokens",
        )
        # the walltime ends: the nodes drain before it, Slurm records a clean completion
        wait_until(
            lambda: all(job_states(name).get(j) == "COMPLETED" for j in first),
            150, f"jobs {sorted(first)} to complete before their walltime",
        )  # fmt: skip
        states = job_states(name)
        assert all(states[j] == "COMPLETED" for j in first), states
        for j in first:
            log = (tmp_path / "jobs" / f"{name}-{j}.log").read_text()
            assert re.search(r"deadline in \d+ s: draining", log), log[-2000:]
        # the launcher replaces them
        wait_until(
            lambda: any(
                s in ("PENDING", "RUNNING") for j, s in job_states(name).items() if j not in first
            ),
            30, "the launcher to submit replacement jobs",
        )  # fmt: skip
        wait_until(
            lambda: (st := status(swarm)) is not None and st.peers >= 1,
            90,
            "a replacement node to join",
        )
    finally:
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(20)
        except subprocess.TimeoutExpired:
            launcher.kill()
        for j, s in job_states(name).items():
            if s in ("PENDING", "RUNNING"):
                subprocess.run(["scancel", j], timeout=30, check=False)  # SIGTERM: nodes drain
        wait_until(
            lambda: not any(s in ("PENDING", "RUNNING", "COMPLETING")
                            for s in job_states(name).values()),
            60, "the replacement jobs to end",
        )  # fmt: skip
        swarm.stop()
    log_text = launcher_log.read_text()
    assert "submitted job" in log_text and "plan: 2 jobs" in log_text, log_text[-3000:]
    audit = subprocess.run(
        [sys.executable, "-m", "node.cli", "audit", "--db", str(swarm.db)],
        capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60,
    )  # fmt: skip
    assert audit.returncode == 0, audit.stdout + audit.stderr
