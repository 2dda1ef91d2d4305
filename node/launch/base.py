"""What a batch scheduler must offer the launcher, and the pieces both share.

A `Scheduler` submits, lists and cancels this launcher's jobs and estimates the queue
wait of a new one. Implementations build command lines and parse outputs with pure
functions (unit-tested on captured samples) and run them through a `Runner`, so tests
can substitute a recorded or faulty one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

# job states as the launcher reports them (protocol.launch.JOB_STATES) plus "ended"
PENDING, RUNNING, ENDING, ENDED = "pending", "running", "ending", "ended"


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    job_id: str
    state: str  # pending | running | ending | ended
    raw_state: str  # the scheduler's own word, e.g. PREEMPTED, F
    start: float | None = None  # unix s: actual start, or the scheduler's expected start
    end: float | None = None  # unix s: walltime end when known
    exit_ok: bool | None = None  # for ended jobs: did it finish cleanly


@dataclasses.dataclass(kw_only=True, slots=True)
class JobSpec:
    name: str  # job name; the launcher finds its jobs by it
    partition: str  # Slurm partition / PBS queue
    walltime_s: int  # seconds
    account: str | None = None  # charged account / project
    gpus: int = 0  # GPUs per job
    cpus: int = 1  # CPUs per job
    script: Path  # batch script to submit
    workdir: Path  # job working directory and log directory
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # exported to the job


class SchedulerError(Exception):
    """A scheduler command failed or printed something we cannot parse."""


class Runner(Protocol):
    def __call__(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]: ...


def run_command(
    argv: Sequence[str], *, env: dict[str, str] | None = None, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run a scheduler command with a deadline; raise `SchedulerError` naming it."""
    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, env=env, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise SchedulerError(f"{argv[0]} did not answer within {timeout_s}s") from exc
    except FileNotFoundError as exc:
        raise SchedulerError(f"{argv[0]} not found: is this a {argv[0]} login node?") from exc


def checked(proc: subprocess.CompletedProcess[str], what: str) -> str:
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        raise SchedulerError(f"{what} failed ({proc.returncode}): {' | '.join(err[-3:])}")
    return proc.stdout


class Scheduler(Protocol):
    kind: str  # "slurm" | "pbs"

    def estimate_wait(self, spec: JobSpec, now: float) -> float | None: ...
    def jobs(self, spec: JobSpec, now: float) -> list[Job]: ...
    def submit(self, spec: JobSpec) -> str: ...
    def cancel(self, job_id: str) -> None: ...


_HMS = re.compile(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)")


def parse_walltime(text: str) -> int:
    """`[D-]HH:MM:SS`, `MM:SS` or minutes (Slurm's forms) -> seconds."""
    text = text.strip()
    if text.isdigit():
        return int(text) * 60
    m = _HMS.fullmatch(text)
    if not m:
        raise ValueError(f"walltime {text!r} is not [D-]HH:MM:SS")
    d, h, mi, s = (int(x) if x else 0 for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def format_walltime(seconds: int) -> str:
    h, rest = divmod(int(seconds), 3600)
    return f"{h:02d}:{rest // 60:02d}:{rest % 60:02d}"


def parse_local_time(text: str) -> float | None:
    """A scheduler timestamp in the login node's local time -> unix s; None if unset."""
    text = text.strip()
    if not text or text.upper() in ("N/A", "NONE", "UNKNOWN", "(NULL)", "0"):
        return None
    for parse in (dt.datetime.fromisoformat, _ctime):
        try:
            when = parse(text)
        except ValueError:
            continue
        return (when if when.tzinfo else when.astimezone()).timestamp()
    return None


def _ctime(text: str) -> dt.datetime:  # "Wed Nov 29 17:57:30 2023" (PBS)
    return dt.datetime.strptime(" ".join(text.split()), "%a %b %d %H:%M:%S %Y")
