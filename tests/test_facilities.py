"""Queue-aware placement decisions (coordinator/facilities.py) and the launch messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from coordinator_harness import write_config
from hypothesis import given
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig, load_config
from coordinator.facilities import FacilityBook, PlacementPolicy, job_value, plan
from node.coordinator_client import CoordinatorClient, CoordinatorError
from protocol import control as c
from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.launch import FacilityJob, FacilityPlan, FacilityReport
from swarmlab.coordinator import start_coordinator

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


LAUNCHER_TOKEN = "launcher-credential-0123456789"


def signed_by_launcher(r: FacilityReport, **fields: object) -> FacilityReport:
    """`r` carrying the launcher token (and any other `fields`)."""
    values = {f: getattr(r, f) for f in r.__dataclass_fields__}
    return FacilityReport(**{**values, "launcher_token": LAUNCHER_TOKEN, **fields})  # type: ignore[arg-type]


def test_book_auth_conflict_and_staleness() -> None:
    cfg = CoordinatorConfig(auth="token", join_token="s3cret", launcher_token=LAUNCHER_TOKEN)
    book = FacilityBook(PlacementPolicy(stale_s=100), cfg)
    r = signed_by_launcher(report("a", wait=0, max_jobs=2))
    bad = book.handle("launcher-1", r, NOW)
    assert isinstance(bad, c.ErrorReply) and bad.code == "unauthorized"
    r = signed_by_launcher(r, join_token="s3cret")
    ok = book.handle("launcher-1", r, NOW)
    assert isinstance(ok, FacilityPlan) and ok.target_jobs == 2
    other = book.handle("launcher-2", r, NOW + 10)
    assert isinstance(other, c.ErrorReply) and other.code == "conflict"
    taken_over = book.handle("launcher-2", r, NOW + 200)  # the first launcher went silent
    assert isinstance(taken_over, FacilityPlan)


def test_a_forged_report_is_refused_and_leaves_demand_alone() -> None:
    """A report claiming 4,096 running jobs would drive demand to zero and make the real
    launchers cancel their pending jobs: without the launcher token it is refused."""
    cfg = CoordinatorConfig(launcher_token=LAUNCHER_TOKEN)
    book = FacilityBook(PlacementPolicy(target_jobs=4), cfg)
    real = signed_by_launcher(report("real", wait=60, max_jobs=8, pending=4))
    first = book.handle("launcher", real, NOW)
    assert isinstance(first, FacilityPlan) and first.target_jobs == 4
    forged = report("fake", wait=0, max_jobs=4096, running=4096, ends_in=10 * HOUR)
    for token in ("", "launcher-credential-012345678X", LAUNCHER_TOKEN[:-1]):
        reply = book.handle("member", signed_by_launcher(forged, launcher_token=token), NOW + 1)
        assert isinstance(reply, c.ErrorReply) and reply.code == "unauthorized", reply
        assert "launcher token" in reply.detail
    assert set(book.reports) == {"real"} and book.refused["unauthorized"] == 3
    after = book.handle("launcher", real, NOW + 2)
    assert isinstance(after, FacilityPlan) and after.target_jobs == 4
    # the same attack with the token would have worked: the credential is what stops it
    assert targets([forged, real], target_jobs=4)["real"] == 0


def test_without_a_launcher_token_configured_every_report_is_refused() -> None:
    book = FacilityBook(PlacementPolicy(), CoordinatorConfig())
    for token in ("", LAUNCHER_TOKEN):
        reply = book.handle("l", signed_by_launcher(report("a", wait=0), launcher_token=token), NOW)
        assert isinstance(reply, c.ErrorReply) and reply.code == "unauthorized"
        assert "no launcher_token" in reply.detail
    assert book.reports == {}


def test_stale_reports_are_pruned() -> None:
    cfg = CoordinatorConfig(launcher_token=LAUNCHER_TOKEN, facility_stale_s=100)
    book = FacilityBook(PlacementPolicy.from_config(cfg), cfg)
    assert book.policy.stale_s == 100
    assert isinstance(
        book.handle("l1", signed_by_launcher(report("old", wait=0)), NOW), FacilityPlan
    )
    assert isinstance(
        book.handle("l2", signed_by_launcher(report("new", wait=0)), NOW + 50), FacilityPlan
    )
    assert set(book.reports) == {"old", "new"}
    book.handle("l2", signed_by_launcher(report("new", wait=0)), NOW + 101)
    assert set(book.reports) == {"new"}  # dropped, not only ignored
    assert book.prune(NOW + 500) == 1 and book.reports == {}


def test_the_number_of_facilities_is_capped() -> None:
    cfg = CoordinatorConfig(launcher_token=LAUNCHER_TOKEN, max_facilities=2, facility_stale_s=100)
    book = FacilityBook(PlacementPolicy.from_config(cfg), cfg)
    for i, name in enumerate(("a", "b")):
        assert isinstance(
            book.handle(f"l{i}", signed_by_launcher(report(name, wait=0)), NOW), FacilityPlan
        )
    full = book.handle("l2", signed_by_launcher(report("c", wait=0)), NOW + 1)
    assert isinstance(full, c.ErrorReply) and full.code == "too_many"
    # a known facility still reports; once the others go silent a new one gets in
    assert isinstance(
        book.handle("l0", signed_by_launcher(report("a", wait=0)), NOW + 90), FacilityPlan
    )
    assert isinstance(
        book.handle("l2", signed_by_launcher(report("c", wait=0)), NOW + 150), FacilityPlan
    )
    assert set(book.reports) == {"a", "c"}


def test_launcher_token_config_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        CoordinatorConfig(launcher_token="short")
    with pytest.raises(ValueError, match="differ from join_token"):
        CoordinatorConfig(auth="token", join_token=LAUNCHER_TOKEN, launcher_token=LAUNCHER_TOKEN)
    token_file = tmp_path / "launcher.token"
    token_file.write_text(LAUNCHER_TOKEN + "\n")
    assert (
        load_config(None, {"launcher_token_file": str(token_file)}).launcher_token == LAUNCHER_TOKEN
    )
    monkeypatch.setenv("AGORA_LAUNCHER_TOKEN", LAUNCHER_TOKEN)
    assert load_config(None, {}).launcher_token == LAUNCHER_TOKEN
    assert LAUNCHER_TOKEN not in repr(load_config(None, {}))
    with pytest.raises(ValueError, match="not both"):
        load_config(None, {"launcher_token_file": str(token_file)})


def test_a_real_coordinator_refuses_forged_reports(tmp_path: Path) -> None:
    """Against a coordinator process: the forged report is refused, the launcher's is
    planned, and the forged one did not move the plan."""
    cfg = write_config(tmp_path, launcher_token=LAUNCHER_TOKEN)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    real = signed_by_launcher(report("real", wait=60, max_jobs=4, pending=4))
    forged = report("fake", wait=0, max_jobs=4096, running=4096, ends_in=10 * HOUR)

    async def go() -> None:
        async with (
            CoordinatorClient.to(coord.pinned, NodeKey.generate()) as launcher,
            CoordinatorClient.to(coord.pinned, NodeKey.generate()) as attacker,
        ):
            first = await launcher.call(real, retry=False)
            assert isinstance(first, FacilityPlan) and first.target_jobs == 4
            with pytest.raises(CoordinatorError) as err:
                await attacker.call(forged, retry=False)
            assert err.value.code == "unauthorized" and "launcher token" in err.value.detail
            again = await launcher.call(real, retry=False)
            assert isinstance(again, FacilityPlan) and again.target_jobs == 4

    try:
        trio.run(go)
    finally:
        assert coord.stop() == 0


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
