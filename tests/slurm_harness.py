"""A single-node Slurm for the tests: `slurm` fixture runs deploy/ci-slurm.sh (installs
slurm-wlm and munge if needed, starts munged, slurmctld and slurmd) and skips, naming the
reason, only where the daemons cannot be started. Also small helpers over squeue."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "deploy" / "ci-slurm.sh"


def start_slurm(timeout_s: float = 600.0) -> str | None:
    """Start the test cluster; None when up, else why it could not be started."""
    if shutil.which("bash") is None:
        return "bash is missing"
    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"deploy/ci-slurm.sh did not finish within {timeout_s}s"
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr + proc.stdout).strip().splitlines()[-6:])
        return f"deploy/ci-slurm.sh exited {proc.returncode}: {tail}"
    return None


@pytest.fixture(scope="session")
def slurm() -> None:
    why = start_slurm()
    if why is not None:
        pytest.skip(f"cannot start a local Slurm (slurmctld/slurmd/munged): {why}")


def job_states(name: str) -> dict[str, str]:
    """{job id: Slurm state} of every job called `name` (finished ones too)."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", f"--name={name}", "-o", "%i|%T"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    return dict(line.split("|", 1) for line in out.split() if "|" in line)
