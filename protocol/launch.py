"""Messages between `agora launch` (a launcher on a cluster login node) and the
coordinator: queue-aware placement across facilities (coordinator.facilities).

A launcher signs a `FacilityReport` with its own key (membership is not required) every
poll interval. Every report carries the run's launcher token, a credential apart from the
join token (a member must not be able to steer placement); in auth mode "token" it also
carries the join token, in "allowlist" its peer id must be listed. The coordinator answers `FacilityPlan`: how many agora-node
jobs this facility should have queued or running now. The launcher then submits or
cancels pending jobs to match, and replaces jobs that ended early.
"""

from __future__ import annotations

from protocol.message import Message, bounded, message, record

MAX_JOBS = 4096  # jobs one facility may report
SCHEDULERS = ("slurm", "pbs")
JOB_STATES = ("pending", "running", "ending")  # ending: draining or completing


@record
class FacilityJob(Message):
    """One of the launcher's scheduler jobs as it stands now."""

    job_id: str = bounded(max_len=128)
    state: str = bounded(choices=JOB_STATES)
    start: float | None = bounded(ge=0.0, default=None)  # unix s: actual or expected start
    end: float | None = bounded(ge=0.0, default=None)  # unix s: walltime end (if known)


@message("facility.report", version=1)
class FacilityReport(Message):
    """A facility's queue as the launcher sees it, and what one job there looks like."""

    facility: str = bounded(min_len=1, max_len=64)  # unique name of the cluster/partition
    scheduler: str = bounded(choices=SCHEDULERS)
    max_jobs: int = bounded(ge=0, le=MAX_JOBS)  # --max-jobs: never ask for more
    queue_wait_s: float | None = bounded(ge=0.0, le=1e8, default=None)  # estimate, s
    startup_s: float = bounded(ge=0.0, le=1e6, default=60.0)  # job start to useful work, s
    walltime_s: float = bounded(ge=1.0, le=1e8)  # --time of each job, s
    gpus_per_job: int = bounded(ge=0, le=1024, default=0)
    jobs: list[FacilityJob] = bounded(max_len=MAX_JOBS, default_factory=list)
    replaced: int = bounded(ge=0, default=0)  # jobs that ended early so far (failed/preempted)
    join_token: str = bounded(max_len=256, default="")  # for auth mode "token"
    launcher_token: str = bounded(max_len=256, default="")  # the run's launcher credential


@message("facility.plan", version=1)
class FacilityPlan(Message):
    """How many jobs (pending + running) the facility should have now."""

    facility: str = bounded(max_len=64)
    target_jobs: int = bounded(ge=0, le=MAX_JOBS)
    reason: str = bounded(max_len=256, default="")
