"""Queue-aware placement decisions (coordinator/facilities.py) and the launch messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.facilities import FacilityBook, PlacementPolicy, job_value, plan
from protocol import control as c
from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.launch import FacilityJob, FacilityPlan, FacilityReport

NOW = 1_000_000.0
HOUR = 3600.0


def report(name: str, *, wait: float | None, walltime: float = 4 * HOUR, max_jobs: int = 4,
           running: int = 0, pending: int = 0, ends_in: float = 2 * HOUR,
           startup: float = 60.0) -> FacilityReport:  # fmt: skip
    jobs = [
        FacilityJob(job_id=f"{name}-r{i}", state="running", start=NOW - 60, end=NOW + ends_in)
        for i in range(running)
    ] + [FacilityJob(job_id=f"{name}-p{i}", state="pending") for i in range(pending)]
    return FacilityReport(
        facility=name, scheduler="slurm", max_jobs=max_jobs, queue_wait_s=wait,
        startup_s=startup, walltime_s=walltime, jobs=jobs,
    )  # fmt: skip


def targets(reports: list[FacilityReport], **policy: object) -> dict[str, int]:
    decided = plan({r.facility: r for r in reports}, PlacementPolicy(**policy), NOW)  # type: ignore[arg-type]
    return {name: d.target for name, d in decided.items()}


def test_shortest_queue_wait_gets_the_jobs_first() -> None:
    out = targets(
        [report("slow", wait=2 * HOUR), report("fast", wait=60), report("mid", wait=600)],
        target_jobs=6,
    )
    assert out == {"fast": 4, "mid": 2, "slow": 0}


def test_max_jobs_is_respected_even_with_unbounded_demand() -> None:
    out = targets([report("a", wait=0, max_jobs=3), report("b", wait=0, max_jobs=1)])
    assert out == {"a": 3, "b": 1}


def test_short_walltime_is_weighed_against_a_longer_wait() -> None:
    # a 10-minute job now gives ~7 useful minutes; a 4-hour job after 20 minutes far more
    out = targets([report("short", wait=0, walltime=600), report("long", wait=1200)], target_jobs=2)
    assert out == {"long": 2, "short": 0}


def test_jobs_too_short_to_be_useful_get_nothing() -> None:
    d = plan({"tiny": report("tiny", wait=0, walltime=100)}, PlacementPolicy(), NOW)["tiny"]
    assert d.target == 0 and "walltime too short" in d.reason


def test_wait_beyond_the_horizon_gets_nothing_and_pending_jobs_go() -> None:
    r = report("far", wait=10 * HOUR, pending=2)
    d = plan({"far": r}, PlacementPolicy(horizon_s=4 * HOUR), NOW)["far"]
    assert d.target == 0 and "horizon" in d.reason


def test_running_jobs_are_never_cancelled_and_count_toward_the_target() -> None:
    out = targets([report("a", wait=0, running=3), report("b", wait=0)], target_jobs=2)
    assert out == {"a": 3, "b": 0}


def test_a_running_job_near_its_end_gets_a_replacement_queued_ahead() -> None:
    # it ends in 5 minutes; a new job needs 10 minutes of queue: queue the replacement now
    r = report("a", wait=600, running=1, ends_in=300)
    assert targets([r], target_jobs=1) == {"a": 2}
    # with plenty of walltime left, nothing more is queued
    r = report("a", wait=600, running=1, ends_in=2 * HOUR)
    assert targets([r], target_jobs=1) == {"a": 1}


def test_unknown_wait_ranks_behind_a_known_short_one() -> None:
    out = targets([report("unknown", wait=None), report("known", wait=300)], target_jobs=1)
    assert out == {"known": 1, "unknown": 0}


def test_excess_pending_jobs_are_trimmed_when_demand_falls() -> None:
    assert targets([report("a", wait=0, pending=4)], target_jobs=1) == {"a": 1}


@given(
    st.lists(
        st.tuples(
            st.floats(0, 5 * HOUR), st.integers(0, 6), st.integers(0, 6), st.floats(60, 8 * HOUR)
        ),
        min_size=1,
        max_size=5,
    ),
    st.one_of(st.none(), st.integers(0, 20)),
)
def test_plan_invariants(specs: list[tuple[float, int, int, float]], want: int | None) -> None:
    reports = {
        f"f{i}": report(f"f{i}", wait=w, max_jobs=m, running=min(r, m), walltime=wt)
        for i, (w, m, r, wt) in enumerate(specs)
    }
    decided = plan(reports, PlacementPolicy(target_jobs=want), NOW)
    assert set(decided) == set(reports)
    for name, r in reports.items():
        running = sum(j.state == "running" for j in r.jobs)
        assert running <= decided[name].target <= r.max_jobs
        if job_value(r, PlacementPolicy(target_jobs=want)) <= 0:
            assert decided[name].target == running
    if want is not None:
        new = sum(d.target for d in decided.values()) - sum(
            sum(j.state == "running" for j in r.jobs) for r in reports.values()
        )
        assert new <= want


def test_book_auth_conflict_and_staleness() -> None:
    cfg = CoordinatorConfig(auth="token", join_token="s3cret")
    book = FacilityBook(PlacementPolicy(stale_s=100), cfg)
    r = report("a", wait=0, max_jobs=2)
    bad = book.handle("launcher-1", r, NOW)
    assert isinstance(bad, c.ErrorReply) and bad.code == "unauthorized"
    r = FacilityReport(
        **{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "join_token": "s3cret"}
    )
    ok = book.handle("launcher-1", r, NOW)
    assert isinstance(ok, FacilityPlan) and ok.target_jobs == 2
    other = book.handle("launcher-2", r, NOW + 10)
    assert isinstance(other, c.ErrorReply) and other.code == "conflict"
    taken_over = book.handle("launcher-2", r, NOW + 200)  # the first launcher went silent
    assert isinstance(taken_over, FacilityPlan)


def test_launch_messages_round_trip_and_reject_bad_values() -> None:
    r = report("a", wait=12.5, running=1, pending=1)
    assert decode(encode(r)) == r
    p = FacilityPlan(facility="a", target_jobs=3, reason="x")
    assert decode(encode(p)) == p
    wire = r.to_wire()
    wire["jobs"][0]["state"] = "exploded"
    with pytest.raises(ProtocolError):
        FacilityReport.from_wire(wire)
    with pytest.raises(ProtocolError):
        FacilityReport.from_wire({**r.to_wire(), "max_jobs": -1})


@given(st.binary(max_size=256))
def test_decoder_never_raises_anything_but_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass
