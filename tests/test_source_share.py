"""No source address may hold more than `max_source_share` of one stage's replicas:
joins from one IP are placed on other stages, or refused (`source_share`), and a
rebalance never moves a member onto a stage where its source holds its share. Loopback
sources (a swarm on one machine) are exempt. Driven through the real `Service` on a real
SQLite file."""

from __future__ import annotations

import time
from pathlib import Path

from coordinator_harness import SHARD_TOKENS, CountingStore, small_dataset

from coordinator.config import CoordinatorConfig
from coordinator.dataset import load_dataset
from coordinator.metrics import CoordinatorMetrics
from coordinator.server import build_state
from coordinator.service import Service
from protocol import control as c
from protocol.codec import encode
from protocol.identity import NodeKey
from protocol.signing import sign_request

RUN = "share-run"


def service(tmp: Path, share: float) -> Service:
    cfg = CoordinatorConfig(
        run_id=RUN, dataset=str(small_dataset(tmp)), shard_tokens=SHARD_TOKENS,
        db=str(tmp / "unused.sqlite"), token_cache="", n_stages=2, max_source_share=share,
    )  # fmt: skip
    manifest, corpus = load_dataset(cfg)
    store = CountingStore(tmp / f"c{share}.sqlite")
    journal, membership, book, paused = build_state(cfg, store, manifest, time.time())
    return Service(
        cfg, manifest=manifest, corpus=corpus, journal=journal, membership=membership,
        book=book, metrics=CoordinatorMetrics(), paused=paused,
    )  # fmt: skip


def join(svc: Service, source: str, stage: int | None = None) -> c.JoinReply | c.ErrorReply:
    key = NodeKey.generate()
    raw = encode(sign_request(key, c.JoinRequest(stage=stage), now=svc.started, run=RUN))
    reply = svc.handle(raw, source, svc.started).reply
    assert isinstance(reply, c.JoinReply | c.ErrorReply), reply
    return reply


def stages_of(replies: list[c.JoinReply | c.ErrorReply]) -> list[int | str]:
    return [r.stage if isinstance(r, c.JoinReply) else r.code for r in replies]


def test_one_address_holds_at_most_its_share_of_a_stage(tmp_path: Path) -> None:
    svc = service(tmp_path, 0.5)
    sybil = "203.0.113.7"
    # one member per stage is always allowed; then the address holds half of each stage
    got = stages_of([join(svc, sybil) for _ in range(3)])
    assert sorted(got[:2]) == [0, 1] and got[2] == "source_share", got
    for i in range(2):  # honest members from their own addresses fill the stages
        join(svc, f"198.51.100.{i + 1}", stage=0)
        join(svc, f"198.51.100.{i + 11}", stage=1)
    # stage 0: the address holds 1 of 3; 2 of 4 is half, 3 of 5 is over it
    assert stages_of([join(svc, sybil, stage=0), join(svc, sybil, stage=0)]) == [0, "source_share"]
    join(svc, "198.51.100.21", stage=0)
    assert stages_of([join(svc, sybil, stage=0)]) == [0]  # 3 of 6
    counts = {s: 0 for s in (0, 1)}
    for p in svc.membership.live.values():
        if p.metrics_host == sybil:
            counts[p.stage] += 1
    assert counts[0] * 2 <= svc.membership.stage_counts()[0]
    assert counts[1] * 2 <= svc.membership.stage_counts()[1]


def test_loopback_sources_and_the_default_are_not_capped(tmp_path: Path) -> None:
    svc = service(tmp_path, 0.5)
    assert stages_of([join(svc, "127.0.0.1", stage=0) for _ in range(4)]) == [0, 0, 0, 0]
    off = service(tmp_path, 1.0)
    assert stages_of([join(off, "203.0.113.7", stage=1) for _ in range(4)]) == [1, 1, 1, 1]


def rebalance_rig(tmp: Path, share: float) -> tuple[Service, str]:
    """Stage 0 strong (a movable member from the Sybil address, a pinned honest one),
    stage 1 weak (one pinned member from the Sybil address, one pinned honest one)."""
    tmp.mkdir()
    svc = service(tmp, share)
    sybil = "203.0.113.7"
    for src, stage, rate in ((sybil, 0, 1000.0), ("198.51.100.1", 0, 1000.0),
                             (sybil, 1, 1.0), ("198.51.100.2", 1, 1.0)):  # fmt: skip
        key = NodeKey.generate()
        body = c.JoinRequest(stage=stage, throughput=rate)
        raw = encode(sign_request(key, body, now=svc.started, run=RUN))
        assert isinstance(svc.handle(raw, src, svc.started).reply, c.JoinReply)
        if src == sybil and stage == 0:
            svc.membership.live[key.peer_id].fixed_stage = False
    return svc, sybil


def test_a_rebalance_does_not_move_a_member_past_its_sources_share(tmp_path: Path) -> None:
    free, sybil = rebalance_rig(tmp_path / "free", 1.0)
    moved = free.membership.rebalance(0.5, busy=lambda _pid: False)
    assert moved is not None and moved.metrics_host == sybil and moved.stage == 1
    capped, _ = rebalance_rig(tmp_path / "capped", 0.5)
    assert capped.membership.rebalance(0.5, busy=lambda _pid: False) is None
