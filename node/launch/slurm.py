"""Slurm: `sbatch` (and `sbatch --test-only` for the wait estimate), `squeue` (our jobs by
name; `squeue --start` for pending ones) and `scancel`. Command builders and parsers are
pure functions; `SlurmScheduler` runs them."""

from __future__ import annotations

import getpass
import os
import re

from node.launch.base import (
    ENDED,
    ENDING,
    PENDING,
    RUNNING,
    Job,
    JobSpec,
    Runner,
    SchedulerError,
    checked,
    format_walltime,
    parse_local_time,
    run_command,
)

PENDING_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                  "RESV_DEL_HOLD", "SUSPENDED", "RESIZING"}  # fmt: skip
RUNNING_STATES = {"RUNNING"}
ENDING_STATES = {"COMPLETING", "STAGE_OUT", "SIGNALING", "STOPPED"}
CLEAN_END = {"COMPLETED"}
SQUEUE_FORMAT = "%i|%T|%S|%e"

_TEST_ONLY = re.compile(r"Job (\S+) to start at (\S+)")


def submit_args(spec: JobSpec, *, test_only: bool = False) -> list[str]:
    argv = [
        "sbatch",
        "--test-only" if test_only else "--parsable",
        f"--job-name={spec.name}",
        f"--partition={spec.partition}",
        f"--time={format_walltime(spec.walltime_s)}",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={spec.cpus}",
        f"--chdir={spec.workdir}",
        f"--output={spec.workdir}/{spec.name}-%j.log",
        "--export=ALL",
    ]
    if spec.account:
        argv.append(f"--account={spec.account}")
    if spec.gpus:
        argv.append(f"--gpus-per-node={spec.gpus}")
    return [*argv, str(spec.script)]


def parse_submit(stdout: str) -> str:
    """`sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    job_id = line.split(";")[0].strip()
    if not job_id.isdigit():
        raise SchedulerError(f"sbatch printed no job id: {stdout.strip()[:200]!r}")
    return job_id


def parse_test_only(output: str) -> float | None:
    """`sbatch: Job 12 to start at 2026-11-29T17:57:30 using 1 processors on nodes ...`
    (on stderr) -> expected start, unix s."""
    m = _TEST_ONLY.search(output)
    return parse_local_time(m.group(2)) if m else None


def list_args(spec: JobSpec, user: str) -> list[str]:
    return ["squeue", "-h", "-t", "all", "-u", user, f"--name={spec.name}", "-o", SQUEUE_FORMAT]


def start_args(spec: JobSpec, user: str) -> list[str]:
    return ["squeue", "-h", "--start", "-u", user, f"--name={spec.name}", "-o", "%i|%S"]


def parse_jobs(stdout: str) -> list[Job]:
    jobs = []
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        job_id, raw, start, end = parts
        raw = raw.strip().upper()
        if raw in PENDING_STATES:
            state = PENDING
        elif raw in RUNNING_STATES:
            state = RUNNING
        elif raw in ENDING_STATES:
            state = ENDING
        else:
            state = ENDED
        jobs.append(
            Job(
                job_id=job_id.strip(),
                state=state,
                raw_state=raw,
                start=parse_local_time(start),
                end=parse_local_time(end),
                exit_ok=(raw in CLEAN_END) if state == ENDED else None,
            )
        )
    return jobs


def parse_starts(stdout: str) -> dict[str, float]:
    out = {}
    for line in stdout.splitlines():
        job_id, _, start = line.strip().partition("|")
        when = parse_local_time(start)
        if job_id and when is not None:
            out[job_id] = when
    return out


class SlurmScheduler:
    kind = "slurm"

    def __init__(self, runner: Runner | None = None, user: str | None = None) -> None:
        self.run: Runner = runner or run_command
        self.user = user or getpass.getuser()

    def estimate_wait(self, spec: JobSpec, now: float) -> float | None:
        proc = self.run(submit_args(spec, test_only=True), env=self._env(spec))
        start = parse_test_only(proc.stderr + proc.stdout)
        if start is None:
            checked(proc, "sbatch --test-only")
            return None
        return max(0.0, start - now)

    def jobs(self, spec: JobSpec, now: float) -> list[Job]:
        jobs = parse_jobs(checked(self.run(list_args(spec, self.user)), "squeue"))
        if any(j.state == PENDING for j in jobs):
            starts = parse_starts(checked(self.run(start_args(spec, self.user)), "squeue --start"))
            jobs = [
                Job(j.job_id, j.state, j.raw_state, starts.get(j.job_id, j.start), j.end)
                if j.state == PENDING
                else j
                for j in jobs
            ]
        return jobs

    def submit(self, spec: JobSpec) -> str:
        return parse_submit(checked(self.run(submit_args(spec), env=self._env(spec)), "sbatch"))

    def cancel(self, job_id: str) -> None:
        checked(self.run(["scancel", job_id]), f"scancel {job_id}")

    @staticmethod
    def _env(spec: JobSpec) -> dict[str, str]:
        return {**os.environ, **spec.env}
