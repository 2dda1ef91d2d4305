"""PBS Professional: `qsub`, `qselect` (our jobs by name), `qstat -x -f -F json` and
`qdel`. PBS has no `--test-only`: the wait estimate is the scheduler's
`estimated.start_time` of our earliest queued job, or unknown. Command builders and
parsers are pure functions unit-tested on captured output formats; this module has NOT
been run against a live PBS server."""

from __future__ import annotations

import getpass
import json
import os

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
    parse_walltime,
    run_command,
)

# PBS job states: Q queued, H held, W waiting, T transit, S suspended, U user-suspended,
# R running, B array begun, E exiting, F finished (with -x), X finished subjob, M moved
_STATE = {"Q": PENDING, "H": PENDING, "W": PENDING, "T": PENDING, "S": PENDING,
          "U": PENDING, "R": RUNNING, "B": RUNNING, "E": ENDING, "F": ENDED, "X": ENDED,
          "M": ENDED}  # fmt: skip


def submit_args(spec: JobSpec) -> list[str]:
    select = f"select=1:ncpus={spec.cpus}" + (f":ngpus={spec.gpus}" if spec.gpus else "")
    argv = [
        "qsub",
        "-N", spec.name,
        "-q", spec.partition,
        "-l", f"walltime={format_walltime(spec.walltime_s)}",
        "-l", select,
        "-j", "oe",
        "-o", str(spec.workdir),
        "-V",
    ]  # fmt: skip
    if spec.account:
        argv += ["-A", spec.account]
    return [*argv, str(spec.script)]


def parse_submit(stdout: str) -> str:
    """`qsub` prints the job id, e.g. `1234.pbs-server`."""
    job_id = stdout.strip().splitlines()[-1].strip() if stdout.strip() else ""
    if not job_id or not job_id.split(".")[0].rstrip("[]").isdigit():
        raise SchedulerError(f"qsub printed no job id: {stdout.strip()[:200]!r}")
    return job_id


def select_args(spec: JobSpec, user: str) -> list[str]:
    return ["qselect", "-u", user, "-N", spec.name]


def status_args(job_ids: list[str]) -> list[str]:
    return ["qstat", "-x", "-f", "-F", "json", *job_ids]


def parse_status(stdout: str) -> list[Job]:
    """`qstat -x -f -F json` -> jobs (times are the server's ctime strings, local time)."""
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise SchedulerError(f"qstat -F json printed invalid JSON: {exc}") from exc
    jobs = []
    for job_id, attrs in (doc.get("Jobs") or {}).items():
        raw = str(attrs.get("job_state", "?"))
        state = _STATE.get(raw, ENDED)
        start = parse_local_time(str(attrs.get("stime", "")))
        end = None
        walltime = (attrs.get("Resource_List") or {}).get("walltime")
        if start is not None and walltime:
            end = start + parse_walltime(str(walltime))
        if state == PENDING:
            start = parse_local_time(str((attrs.get("estimated") or {}).get("start_time", "")))
        exit_ok = None
        if state == ENDED:
            exit_ok = attrs.get("Exit_status") == 0
        jobs.append(Job(job_id, state, raw, start, end, exit_ok))
    return jobs


class PbsScheduler:
    kind = "pbs"

    def __init__(self, runner: Runner | None = None, user: str | None = None) -> None:
        self.run: Runner = runner or run_command
        self.user = user or getpass.getuser()
        self.known: set[str] = set()  # ids we submitted (finished ones drop out of qselect)

    def estimate_wait(self, spec: JobSpec, now: float) -> float | None:
        starts = [j.start for j in self.jobs(spec, now) if j.state == PENDING and j.start]
        return max(0.0, min(starts) - now) if starts else None

    def jobs(self, spec: JobSpec, now: float) -> list[Job]:
        ids = checked(self.run(select_args(spec, self.user)), "qselect").split()
        ids = sorted(set(ids) | self.known)
        if not ids:
            return []
        jobs = parse_status(checked(self.run(status_args(ids)), "qstat"))
        self.known = {j.job_id for j in jobs if j.state != ENDED}
        return jobs

    def submit(self, spec: JobSpec) -> str:
        env = {**os.environ, **spec.env}
        job_id = parse_submit(checked(self.run(submit_args(spec), env=env), "qsub"))
        self.known.add(job_id)
        return job_id

    def cancel(self, job_id: str) -> None:
        checked(self.run(["qdel", job_id]), f"qdel {job_id}")
