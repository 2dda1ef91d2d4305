"""The launcher loop: every interval, read this facility's queue, report it to the
coordinator, and submit or cancel jobs to match the coordinator's plan.

- Jobs are found by name (`agora-<facility>`), so a restarted launcher adopts its jobs.
- A job that ended is logged once; one that did not end cleanly (failed, pre-empted,
  node failure, timeout) counts as `replaced`. Either way the plan's target brings the
  count back up, which is the replacement.
- Only pending jobs are cancelled when there are too many: a running job drains at its
  deadline and would only waste its start-up if cancelled.
- If the coordinator cannot be reached, the last plan stands (nothing is submitted
  before the first plan arrives).
"""

from __future__ import annotations

import logging
import time

import trio

from node.coordinator_client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable
from node.launch.base import ENDED, PENDING, Job, JobSpec, Scheduler, SchedulerError
from node.launch.config import LaunchConfig
from protocol.launch import FacilityJob, FacilityPlan, FacilityReport

log = logging.getLogger(__name__)


def job_spec(cfg: LaunchConfig) -> JobSpec:
    env = {
        "AGORA_COORDINATOR": cfg.coordinator,
        "AGORA_NODE": cfg.node_command,
        "AGORA_NODE_ARGS": cfg.node_args,
        "AGORA_KEY_DIR": str(cfg.workdir / "keys"),
        "AGORA_WALLTIME_S": str(cfg.walltime_s),
    }
    if cfg.join_token:
        env["AGORA_JOIN_TOKEN"] = cfg.join_token
    assert cfg.script is not None
    return JobSpec(
        name=cfg.job_name,
        partition=cfg.partition,
        walltime_s=cfg.walltime_s,
        account=cfg.account,
        gpus=cfg.gpus_per_job,
        cpus=cfg.cpus_per_job,
        script=cfg.script,
        workdir=cfg.workdir,
        env=env,
    )


class Launcher:
    def __init__(self, cfg: LaunchConfig, scheduler: Scheduler, client: CoordinatorClient) -> None:
        self.cfg, self.scheduler, self.client = cfg, scheduler, client
        self.spec = job_spec(cfg)
        self.target: int | None = None  # the coordinator's latest plan for this facility
        self.ended: set[str] = set()  # job ids already seen ending
        self.replaced = 0  # jobs that ended uncleanly (failed, pre-empted, ...)
        self.submitted: list[str] = []  # every job id this launcher submitted

    async def _sched(self, fn: object, *args: object) -> object:
        return await trio.to_thread.run_sync(fn, *args)  # type: ignore[arg-type]

    def _note_ended(self, jobs: list[Job]) -> None:
        for j in jobs:
            if j.state == ENDED and j.job_id not in self.ended:
                self.ended.add(j.job_id)
                if not j.exit_ok:
                    self.replaced += 1
                log.info(
                    "job %s ended: %s%s", j.job_id, j.raw_state,
                    "" if j.exit_ok else " (will be replaced)",
                )  # fmt: skip

    def report(self, jobs: list[Job], wait_s: float | None) -> FacilityReport:
        return FacilityReport(
            facility=self.cfg.facility,
            scheduler=self.scheduler.kind,
            max_jobs=self.cfg.max_jobs,
            queue_wait_s=wait_s,
            startup_s=self.cfg.startup_s,
            walltime_s=float(self.cfg.walltime_s),
            gpus_per_job=self.cfg.gpus_per_job,
            jobs=[
                FacilityJob(job_id=j.job_id, state=j.state, start=j.start, end=j.end)
                for j in jobs
                if j.state != ENDED
            ],
            replaced=self.replaced,
            join_token=self.cfg.join_token,
            launcher_token=self.cfg.launcher_token,
        )

    async def step(self) -> None:
        """One poll: queue -> report -> plan -> submit/cancel."""
        now = time.time()
        jobs: list[Job] = await self._sched(self.scheduler.jobs, self.spec, now)  # type: ignore[assignment]
        self._note_ended(jobs)
        try:
            wait_s: float | None = await self._sched(self.scheduler.estimate_wait, self.spec, now)  # type: ignore[assignment]
        except SchedulerError as exc:
            log.warning("queue wait estimate failed: %s", exc)
            wait_s = None
        try:
            reply = await self.client.call(self.report(jobs, wait_s), retry=False)
            if isinstance(reply, FacilityPlan):
                if reply.target_jobs != self.target:
                    log.info("plan: %d jobs (%s)", reply.target_jobs, reply.reason)
                self.target = reply.target_jobs
            else:
                log.warning("coordinator answered %s to a facility report", reply.TYPE)
        except (CoordinatorUnavailable, CoordinatorError) as exc:
            log.warning("coordinator: %s; keeping the last plan (%s)", exc, self.target)
        if self.target is None:
            return
        live = [j for j in jobs if j.state != ENDED]
        want = min(self.target, self.cfg.max_jobs)
        for _ in range(want - len(live)):
            job_id = await self._sched(self.scheduler.submit, self.spec)
            self.submitted.append(str(job_id))
            log.info("submitted job %s (wait estimate %s s)", job_id,
                     "unknown" if wait_s is None else f"{wait_s:.0f}")  # fmt: skip
        if len(live) > want:
            pending = sorted((j for j in live if j.state == PENDING), key=_job_order, reverse=True)
            for j in pending[: len(live) - want]:
                await self._sched(self.scheduler.cancel, j.job_id)
                log.info("cancelled pending job %s (plan is %d jobs)", j.job_id, want)

    async def run(self, *, once: bool = False) -> None:
        while True:
            try:
                await self.step()
            except SchedulerError as exc:
                log.warning("scheduler: %s; retrying next poll", exc)
            if once:
                return
            await trio.sleep(self.cfg.interval_s)


def _job_order(j: Job) -> tuple[int, str]:
    head = j.job_id.split(".")[0]
    return (int(head) if head.isdigit() else -1, j.job_id)
