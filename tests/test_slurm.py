"""`agora launch slurm` against a real single-node Slurm (tests/slurm_harness.py).

The launcher places two real jobs (one per pipeline stage: the test cluster has 2 CPUs);
their nodes join a real coordinator and train. The jobs' walltime is short: each node
drains before it (Slurm records COMPLETED, not TIMEOUT), the launcher replaces the jobs,
and `agora audit` finds no lost or duplicated data.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import trio
from slurm_harness import job_states, slurm

from node.events import read_events
from protocol.control import StatusReply
from swarmlab.procs import child_env, wait_for
from swarmlab.swarm import LocalSwarm

__all__ = ["slurm"]

REPO = Path(__file__).resolve().parent.parent
LAUNCHER_TOKEN = "slurm-launcher-credential-0123"


def status(swarm: LocalSwarm) -> StatusReply | None:
    """The coordinator's status, or None if it did not answer in time (a busy CI box)."""
    try:
        return swarm.status(timeout_s=20)
    except (OSError, trio.TooSlowError):
        return None


def test_launcher_places_jobs_that_train_drain_and_get_replaced(
    slurm: None, tmp_path: Path
) -> None:
    swarm = LocalSwarm(
        tmp_path / "swarm",
        preset="tiny",
        stages=2,
        # short jobs: keep less time free before a deadline than the 60 s default
        run_config={
            "deadline_margin_s": 20.0,
            "min_grant_tokens": 256,
            "launcher_token": LAUNCHER_TOKEN,
        },
    )
    swarm.start_coordinator()
    facility = f"ci{int(time.time()) % 100000}"
    name = f"agora-{facility}"
    # drain margin = drain_timeout_s + 2 * request_timeout_s = 30 s before the deadline
    # no DiLoCo outer rounds: a 2-minute job tests placement and draining, not DiLoCo
    events = tmp_path / "jobs.events.jsonl"  # every job node appends its events here
    node_toml = swarm.write_node_config(
        drain_timeout_s=10.0, request_timeout_s=10.0, outer_every_steps=0, events_file=str(events)
    )
    env = child_env()
    env["AGORA_JOIN_TOKEN"] = ""
    env.pop("AGORA_LAUNCHER_TOKEN", None)
    token_file = tmp_path / "launcher.token"  # the launcher's credential, off its command line
    token_file.write_text(LAUNCHER_TOKEN + "\n")
    launcher_log = tmp_path / "launcher.log"
    with launcher_log.open("wb") as fh:
        launcher = subprocess.Popen(
            [
                sys.executable, "-m", "swarmlab.cli", "launch", "slurm",
                "--coordinator", swarm.address, "--facility", facility,
                "--partition", "debug", "--max-jobs", "2", "--time", "00:02:00",
                "--interval", "2", "--startup", "10",
                "--workdir", str(tmp_path / "jobs"),
                "--identity", str(tmp_path / "launcher.key"),
                "--launcher-token-file", str(token_file),
                "--node-args", f"--config {node_toml}",
            ],
            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )  # fmt: skip
    first: set[str] = set()
    try:
        wait_for(
            lambda: sum(s == "RUNNING" for s in job_states(name).values()) == 2,
            "two launched jobs to run",
            60,
            poll_s=1.0,
        )
        first = set(job_states(name))
        wait_for(
            lambda: (st := status(swarm)) is not None and st.peers == 2,
            "both job nodes to join",
            90,
            poll_s=1.0,
        )
        wait_for(
            lambda: (st := status(swarm)) is not None and st.committed_tokens > 0,
            "the job nodes to commit tokens",
            120,
            poll_s=1.0,
        )
        # the walltime ends: the nodes drain before it, Slurm records a clean completion
        wait_for(
            lambda: all(job_states(name).get(j) == "COMPLETED" for j in first),
            f"jobs {sorted(first)} to complete before their walltime",
            150,
            poll_s=1.0,
        )
        states = job_states(name)
        assert all(states[j] == "COMPLETED" for j in first), states
        drains = [e["reason"] for e in read_events(events, "draining")]
        assert len(drains) >= len(first) and all(r.startswith("deadline in") for r in drains)
        # the launcher replaces them
        wait_for(
            lambda: any(
                s in ("PENDING", "RUNNING") for j, s in job_states(name).items() if j not in first
            ),
            "the launcher to submit replacement jobs",
            30,
            poll_s=1.0,
        )
        wait_for(
            lambda: (st := status(swarm)) is not None and st.peers >= 1,
            "a replacement node to join",
            90,
            poll_s=1.0,
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
        wait_for(
            lambda: (
                not any(
                    s in ("PENDING", "RUNNING", "COMPLETING") for s in job_states(name).values()
                )
            ),
            "the replacement jobs to end",
            60,
            poll_s=1.0,
        )
        swarm.stop()
    log_text = launcher_log.read_text()
    assert "submitted job" in log_text and "plan: 2 jobs" in log_text, log_text[-3000:]
    audit = swarm.audit()
    assert audit.exit_code == 0, audit.stdout
