"""Queue-aware placement across HPC facilities.

Launchers (`agora launch slurm|pbs`) report each facility's queue: the estimated wait
for a new job, the job's walltime and start-up time, its `--max-jobs`, and the jobs it
has. `plan` decides, across every facility that reported recently, how many jobs each
should have (pending + running). It is pure: the caller passes `now`.

The policy, in words:
- A new job at facility f is useful after `t2u = queue wait + start-up` seconds and
  then for `useful = walltime - start-up - drain` seconds. Its value is the useful time
  it delivers within the planning horizon: `min(useful, horizon - t2u)`. A facility
  whose jobs would give less than `min_useful_s` gets no new jobs.
- Running jobs are never cancelled (they end at their walltime, draining first). A
  running job still counts toward the wanted total only if it outlives the time a
  replacement would need (`remaining > t2u`); otherwise its replacement is queued now.
- The remaining demand (`target_jobs` minus counted running jobs; unbounded if
  `target_jobs` is None) goes to facilities in order of value (ties: shorter t2u, then
  name), each up to its `--max-jobs` less its running jobs. Pending jobs beyond a
  facility's share are the launcher's to cancel.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import math
from typing import Any

from protocol import control as c
from protocol.launch import FacilityPlan, FacilityReport
from protocol.message import Message

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class PlacementPolicy:
    target_jobs: int | None = None  # jobs wanted across all facilities (None = all worth it)
    horizon_s: float = 4 * 3600.0  # seconds ahead the value of a job is counted over
    min_useful_s: float = 30.0  # seconds of useful work below which a job is not worth it
    drain_s: float = 60.0  # seconds a node spends draining before its deadline
    default_wait_s: float = 1800.0  # seconds assumed when a facility cannot estimate its wait
    stale_s: float = 600.0  # seconds after which a silent facility is ignored

    def __post_init__(self) -> None:
        if self.target_jobs is not None and self.target_jobs < 0:
            raise ValueError(f"target_jobs must be >= 0 or None, got {self.target_jobs}")
        for name in ("horizon_s", "stale_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_useful_s", "drain_s", "default_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, cfg: Any) -> PlacementPolicy:
        """Read `facility_<field>` attributes of a coordinator config where present."""
        values = {}
        for f in dataclasses.fields(cls):
            v = getattr(cfg, f"facility_{f.name}", None)
            if v is not None:
                values[f.name] = v
        return cls(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    target: int  # jobs (pending + running) the facility should have
    reason: str  # one line, for the launcher's log


def time_to_useful(r: FacilityReport, policy: PlacementPolicy) -> float:
    """Seconds from submitting a job now until it does useful work."""
    wait = policy.default_wait_s if r.queue_wait_s is None else r.queue_wait_s
    return wait + r.startup_s


def job_value(r: FacilityReport, policy: PlacementPolicy) -> float:
    """Useful seconds a job submitted now delivers within the horizon (may be <= 0)."""
    useful = r.walltime_s - r.startup_s - policy.drain_s
    if useful < policy.min_useful_s:
        return 0.0
    return min(useful, policy.horizon_s - time_to_useful(r, policy))


def plan(
    reports: dict[str, FacilityReport], policy: PlacementPolicy, now: float
) -> dict[str, Decision]:
    """How many jobs each facility should have now (see the module docstring)."""
    base: dict[str, int] = {}
    counted = 0
    for name, r in reports.items():
        live = [j for j in r.jobs if j.state in ("running", "ending")]
        base[name] = min(len(live), r.max_jobs)
        t2u = time_to_useful(r, policy)
        counted += sum(
            1
            for j in live
            if j.state == "running" and (j.end is None or j.end - now - policy.drain_s > t2u)
        )
    demand = math.inf if policy.target_jobs is None else max(0, policy.target_jobs - counted)
    order = sorted(
        reports,
        key=lambda n: (-job_value(reports[n], policy), time_to_useful(reports[n], policy), n),
    )
    out: dict[str, Decision] = {}
    for name in order:
        r = reports[name]
        value = job_value(r, policy)
        t2u = time_to_useful(r, policy)
        room = max(0, r.max_jobs - base[name])
        if value <= 0:
            useful = r.walltime_s - r.startup_s - policy.drain_s
            why = (
                f"walltime too short: {useful:.0f}s useful < {policy.min_useful_s:.0f}s"
                if useful < policy.min_useful_s
                else f"queue wait + start-up {t2u:.0f}s beyond the {policy.horizon_s:.0f}s horizon"
            )
            out[name] = Decision(base[name], f"no new jobs ({why})")
            continue
        add = int(min(room, demand))
        demand -= add
        out[name] = Decision(
            base[name] + add,
            f"{base[name]} running + {add} queued; value {value:.0f}s, time to useful {t2u:.0f}s",
        )
    return out


class FacilityBook:
    """Soft state: the latest report of each facility (launchers re-report every poll, so
    nothing here needs to survive a coordinator restart).

    A report moves jobs on real clusters (a low target makes launchers cancel pending
    jobs), so it needs the run's launcher token, a credential apart from the join token;
    with none configured every report is refused. Reports older than `stale_s` are
    dropped, and at most `max_facilities` facilities are held."""

    def __init__(self, policy: PlacementPolicy, cfg: Any) -> None:
        self.policy = policy
        self.cfg = cfg  # CoordinatorConfig: auth, join_token, allowlist, launcher_token
        self.reports: dict[str, tuple[FacilityReport, str, float]] = {}  # name -> (r, owner, t)
        self.refused: collections.Counter[str] = collections.Counter()  # by error code

    def fresh(self, now: float) -> dict[str, FacilityReport]:
        return {n: r for n, (r, _, t) in self.reports.items() if now - t <= self.policy.stale_s}

    def prune(self, now: float) -> int:
        """Drop the reports of facilities silent for longer than `stale_s`; returns how many."""
        stale = [n for n, (_, _, t) in self.reports.items() if now - t > self.policy.stale_s]
        for name in stale:
            log.info("facility %s silent for %.0f s: dropped", name, now - self.reports[name][2])
            del self.reports[name]
        return len(stale)

    def _refuse(self, code: str, detail: str) -> c.ErrorReply:
        self.refused[code] += 1
        return c.ErrorReply(code=code, detail=detail)

    def handle(self, peer_id: str, report: FacilityReport, now: float) -> Message:
        cfg = self.cfg
        if not cfg.launcher_token:
            return self._refuse(
                "unauthorized", "this coordinator takes no facility reports (no launcher_token)"
            )
        if not hmac.compare_digest(report.launcher_token.encode(), cfg.launcher_token.encode()):
            log.debug("facility report for %r refused: bad launcher token", report.facility)
            return self._refuse("unauthorized", "facility reports need the run's launcher token")
        if cfg.auth == "token" and not hmac.compare_digest(
            report.join_token.encode(), cfg.join_token.encode()
        ):
            return self._refuse("unauthorized", "this run needs a valid join token")
        if cfg.auth == "allowlist" and peer_id not in set(cfg.allowlist):
            return self._refuse("unauthorized", "launcher key not on the allowlist")
        self.prune(now)
        old = self.reports.get(report.facility)
        if old is not None and old[1] != peer_id:
            return self._refuse(
                "conflict", f"facility {report.facility!r} is reported by another launcher key"
            )
        if old is None and len(self.reports) >= cfg.max_facilities:
            return self._refuse(
                "too_many", f"this run takes reports from at most {cfg.max_facilities} facilities"
            )
        if old is None:
            log.info(
                "facility %s (%s) reporting via %s", report.facility, report.scheduler, peer_id
            )
        self.reports[report.facility] = (report, peer_id, now)
        decision = plan(self.fresh(now), self.policy, now)[report.facility]
        return FacilityPlan(
            facility=report.facility, target_jobs=decision.target, reason=decision.reason[:256]
        )
