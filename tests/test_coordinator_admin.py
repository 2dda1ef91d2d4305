"""Over-the-wire tests of what was only unit-tested, against a real coordinator process:
the drain and ban admin calls (with the admin token, a ban surviving a SIGKILL restart),
deadline-aware granting, the Prometheus file-SD writer and the audit gauge, stage
rebalancing, and `agora status --watch`. Plus unit tests of the hot-path pieces behind
the coordinator benchmark: incremental stage aggregates, coarse expiry journaling and
the incremental audit monitor (checked against `agora audit`'s replay)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import trio
from coordinator_harness import SHARD_TOKENS, write_config
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.audit import AuditMonitor, replay
from coordinator.journal import AuditEvent, Journal
from coordinator.leases import LeaseBook, Shard, restore_book
from coordinator.membership import BANNED, LEFT, Membership, Peer
from node.coordinator_client import ClientConfig, CoordinatorClient, CoordinatorError
from protocol import control as c
from protocol.identity import NodeKey
from swarmlab.coordinator import CoordinatorProc, start_coordinator
from swarmlab.procs import REPO, wait_for

FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0)
ADMIN = "adm1n-t0ken"


async def _error_code(coro) -> str:  # type: ignore[no-untyped-def]
    try:
        await coro
    except CoordinatorError as exc:
        return exc.code
    raise AssertionError("the call succeeded but an error reply was expected")


# --- admin calls ---------------------------------------------------------------------


def test_drain_and_ban_over_the_wire(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, admin_token=ADMIN, lease_ttl_s=20.0, heartbeat_interval_s=1.0)
    db = tmp_path / "c.sqlite"
    coord = start_coordinator(tmp_path, config=cfg, db=db)
    ka, kb, kc, kadmin = (NodeKey.generate() for _ in range(4))

    async def phase1() -> None:
        port = coord.port
        async with (
            CoordinatorClient("127.0.0.1", port, ka, config=FAST, pin=coord.fingerprint) as a,
            CoordinatorClient("127.0.0.1", port, kb, config=FAST, pin=coord.fingerprint) as b,
            CoordinatorClient("127.0.0.1", port, kc, config=FAST, pin=coord.fingerprint) as cc,
            CoordinatorClient(
                "127.0.0.1", port, kadmin, config=FAST, pin=coord.fingerprint
            ) as admin,
        ):
            await a.join(c.JoinRequest(throughput=100.0))
            await b.join(c.JoinRequest(throughput=100.0))
            lease_b = await b.acquire()
            assert lease_b is not None
            await b.commit(lease_b, lease_b.committed, lease_b.committed + 100)

            # drain: refused without the right token, then the flag reaches the peer
            drain_a = c.AdminDrain(admin_token="wrong", peer_id=ka.peer_id)
            assert await _error_code(admin.call(drain_a)) == "forbidden"
            assert not (await a.heartbeat()).drain
            ok = await admin.call(c.AdminDrain(admin_token=ADMIN, peer_id=ka.peer_id))
            assert isinstance(ok, c.OkReply)
            assert (await a.heartbeat()).drain
            grant = await a.acquire_grant()
            assert grant.lease is None and grant.reason == "draining"
            gone = c.AdminDrain(admin_token=ADMIN, peer_id=kc.peer_id)  # never joined
            assert await _error_code(admin.call(gone)) == "not_found"

            # ban the lease holder: it is out, its lease ends, its shard resumes elsewhere
            assert await _error_code(
                admin.call(c.AdminBan(admin_token="", peer_id=kb.peer_id))
            ) in ("forbidden",)
            ban_b = await admin.call(c.AdminBan(admin_token=ADMIN, peer_id=kb.peer_id))
            assert isinstance(ban_b, c.OkReply)
            assert await _error_code(b.heartbeat()) == "banned"
            assert await _error_code(b.join(c.JoinRequest())) == "banned"
            assert await _error_code(b.commit(lease_b, 100, 200)) == "banned"
            st_ = await a.status()
            assert st_.peers == 1 and st_.leases["active"] == 0
            await cc.join(c.JoinRequest(throughput=100.0))
            again = await cc.acquire()
            assert again is not None and again.shard_id == lease_b.shard_id
            assert again.committed == lease_b.committed + 100 and again.epoch > lease_b.epoch

    trio.run(phase1)
    assert coord.kill(signal.SIGKILL) == -signal.SIGKILL
    coord = start_coordinator(tmp_path, config=cfg, db=db)

    async def phase2() -> None:
        async with CoordinatorClient(
            "127.0.0.1", coord.port, kb, config=FAST, pin=coord.fingerprint
        ) as b:
            assert await _error_code(b.join(c.JoinRequest())) == "banned"
        async with CoordinatorClient(
            "127.0.0.1", coord.port, ka, config=FAST, pin=coord.fingerprint
        ) as a:
            assert (await a.heartbeat()).drain  # the drain flag is durable too

    trio.run(phase2)
    assert coord.stop() == 0


# --- deadline-aware granting ---------------------------------------------------------


def test_deadline_aware_granting(tmp_path: Path) -> None:
    margin = 5.0
    cfg = write_config(
        tmp_path, deadline_margin_s=margin, lease_ttl_s=20.0, heartbeat_interval_s=1.0
    )
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    rate = 10.0  # tokens/s
    kshort, klong, kfree = (NodeKey.generate() for _ in range(3))

    async def main() -> None:
        port = coord.port
        async with (
            CoordinatorClient(
                "127.0.0.1", port, kshort, config=FAST, pin=coord.fingerprint
            ) as short,
            CoordinatorClient(
                "127.0.0.1", port, klong, config=FAST, pin=coord.fingerprint
            ) as long_,
            CoordinatorClient("127.0.0.1", port, kfree, config=FAST, pin=coord.fingerprint) as free,
        ):
            now = time.time()
            # 1 s of work left after the margin: 10 tokens < min_grant_tokens (16)
            await short.join(c.JoinRequest(throughput=rate, deadline=now + margin + 1.0))
            grant = await short.acquire_grant()
            assert grant.lease is None and grant.reason == "deadline"
            # 50 s left: at most 500 tokens, a partial range of a 2048-token shard
            await long_.join(c.JoinRequest(throughput=rate, deadline=now + margin + 50.0))
            part = await long_.acquire()
            assert part is not None
            span = part.limit - part.committed
            assert 400 <= span <= 500 and part.limit < part.shard_tokens == SHARD_TOKENS
            done = await long_.commit(part, part.committed, part.limit)
            assert done.lease.state == "complete" and not done.shard_done
            # no deadline: a whole shard (below grant_tokens); the partial shard's rest
            # waits behind the untouched shards (round robin)
            await free.join(c.JoinRequest(throughput=rate))
            rest = await free.acquire()
            assert rest is not None and rest.shard_id != part.shard_id
            assert (rest.committed, rest.limit) == (0, SHARD_TOKENS)

    trio.run(main)
    assert coord.stop() == 0


# --- Prometheus file-SD and the audit gauge ------------------------------------------


def _metrics_url(coord: CoordinatorProc) -> str:
    return f"http://127.0.0.1:{coord.metrics_port}/metrics"


def _sd_targets(path: Path) -> dict[str, str]:
    """target -> stage label, from the coordinator-written file-SD JSON."""
    if not path.exists():
        return {}
    out = {}
    for group in json.loads(path.read_text()):
        assert group["labels"]["job"] == "agora-node" and group["labels"]["run"] == "test-run"
        for t in group["targets"]:
            out[t] = group["labels"]["stage"]
    return out


def test_file_sd_follows_joins_and_leaves(tmp_path: Path) -> None:
    sd = tmp_path / "sd" / "agora-nodes.json"
    sd.parent.mkdir()
    cfg = write_config(tmp_path, prometheus_sd=str(sd), lease_ttl_s=20.0, heartbeat_interval_s=1.0)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite", metrics=True)
    url = _metrics_url(coord)
    ka, kb = NodeKey.generate(), NodeKey.generate()

    async def main() -> None:
        port = coord.port
        async with (
            CoordinatorClient("127.0.0.1", port, ka, config=FAST, pin=coord.fingerprint) as a,
            CoordinatorClient("127.0.0.1", port, kb, config=FAST, pin=coord.fingerprint) as b,
        ):
            ja = await a.join(c.JoinRequest(metrics_port=9101, metrics_host="127.0.0.1"))
            await b.join(c.JoinRequest())  # no metrics port: not a target
            got = await trio.to_thread.run_sync(
                lambda: wait_for(lambda: _sd_targets(sd), "file-SD with the joined node")
            )
            assert got == {"127.0.0.1:9101": str(ja.stage)}
            lease = await a.acquire()
            assert lease is not None
            await a.commit(lease, lease.committed, lease.committed + 64)
            await a.leave()
            await trio.to_thread.run_sync(
                lambda: wait_for(lambda: _sd_targets(sd) == {}, "the node leaving the file-SD")
            )

    trio.run(main)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'agora_coordinator_audit_problem_ranges{kind="lost"} 0.0' in text
    assert 'agora_coordinator_audit_problem_ranges{kind="duplicated"} 0.0' in text
    assert coord.stop() == 0


# --- rebalancing ---------------------------------------------------------------------


def test_rebalance_moves_a_peer_to_the_weak_stage(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, rebalance_interval_s=0.3, lease_ttl_s=20.0, heartbeat_interval_s=1.0
    )
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    keys = [NodeKey.generate() for _ in range(4)]

    async def main() -> None:
        clients = [
            CoordinatorClient("127.0.0.1", coord.port, k, config=FAST, pin=coord.fingerprint)
            for k in keys
        ]
        try:
            stages = [(await cl.join(c.JoinRequest(throughput=100.0))).stage for cl in clients]
            assert sorted(stages) == [0, 0, 1, 1]  # placement alternates while balanced
            strong = [cl for cl, s in zip(clients, stages, strict=True) if s == 0]
            for cl in strong:  # stage 0 gets 10x faster: stage 1 falls clearly behind
                await cl.heartbeat(throughput=1000.0)
            with trio.fail_after(20):
                while True:
                    replies = [await cl.heartbeat() for cl in strong]
                    moved = [r for r in replies if r.moved]
                    if moved:
                        break
                    await trio.sleep(0.1)
            assert len(moved) == 1 and moved[0].stage == 1
            st_ = await clients[0].status()
            assert [s.peers for s in st_.stages] == [1, 3]
        finally:
            for cl in clients:
                await cl.aclose()

    trio.run(main)
    assert coord.stop() == 0


# --- agora status --watch ------------------------------------------------------------


def test_status_watch_refreshes_and_exits_on_ctrl_c(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    cfg = write_config(tmp_path)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    out = tmp_path / "watch.txt"
    with open(out, "w") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swarmlab.status",
                "--coordinator",
                coord.address,
                "--watch",
                "--interval",
                "0.2",
            ],
            cwd=REPO,
            env=dict(child_env, COLUMNS="120"),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        time.sleep(1.5)  # several refreshes
        assert proc.poll() is None, out.read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    text = out.read_text()
    assert "stages" in text and "data epoch 0" in text and "Traceback" not in text
    assert f"coordinator certificate {coord.fingerprint}" in text
    bad = subprocess.run(
        [sys.executable, "-m", "swarmlab.status", "--coordinator", "x:1", "--interval", "0"],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--interval" in bad.stderr
    assert coord.stop() == 0


# --- hot-path pieces (unit) ----------------------------------------------------------


def _peer(i: int, stage: int, thr: float, now: float = 0.0, ttl: float = 10.0) -> Peer:
    return Peer(f"p{i}", b"k", stage, [], [], "cpu", thr, None, None, None, False, now, now + ttl)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("jrxmb"), st.integers(0, 7), st.floats(0, 5000)), max_size=60
    )
)
def test_stage_aggregates_match_a_full_recount(ops: list[tuple[str, int, float]]) -> None:
    m = Membership(n_stages=3, stage_costs=[1.0, 2.0, 1.0], ttl_s=10.0, journal=Journal())
    for op, i, thr in ops:
        pid = f"p{i}"
        if op == "j":
            m.join(_peer(i, m.place(), thr))
        elif op == "r":
            m.renew(pid, 1.0, thr)
        elif op == "x":
            m.remove(pid, LEFT)
        elif op == "b":
            m.remove(pid, BANNED)
        elif op == "m" and pid in m.live:
            m.move(m.live[pid], int(thr) % 3)
        rates, counts = m.stage_rates(), m.stage_counts()
        m.resum()
        assert counts == m.stage_counts()
        assert rates == pytest.approx(m.stage_rates(), rel=1e-9, abs=1e-6)


def test_renewals_are_soft_state_and_a_restart_grants_grace() -> None:
    j = Journal()
    m = Membership(n_stages=1, stage_costs=[1.0], ttl_s=20.0, journal=j)
    book = LeaseBook([Shard(0, 100)], journal=j, ttl_s=20.0)
    m.join(_peer(1, 0, 1.0, now=0.0, ttl=20.0))
    lease, _ = book.acquire("p1", 0.0)
    assert lease is not None
    first = j.take()
    assert len(first.peers) == 1 and len(first.leases) == 1
    for t in (1.0, 5.5, 19.0, 30.0):  # renewals, a throughput change among them
        m.renew("p1", t, 3.0 if t > 5 else None)
        book.renew("p1", t)
    assert not j  # nothing to write
    assert m.live["p1"].expires_at == 50.0 and lease.expires_at == 50.0  # live: exact
    # a restart from the stored rows (expiry 20.0) at t=45: one TTL of grace from then
    m2 = Membership(
        n_stages=1, stage_costs=[1.0], ttl_s=20.0, journal=Journal(),
        peers=[Peer.from_row(r) for r in first.peers], grace_until=65.0,
    )  # fmt: skip
    book2 = restore_book(
        first.shards, first.leases, {}, journal=Journal(), ttl_s=20.0, grace_until=65.0
    )
    assert m2.expire_due(64.0) == [] and book2.expire_due(64.0) == []
    assert m2.live["p1"].expires_at == 65.0 and book2.active[1].expires_at == 65.0
    assert [p.peer_id for p in m2.expire_due(65.0)] == ["p1"]
    assert [x.lease_id for x in book2.expire_due(65.0)] == [1]


def _events(ops: list[tuple[int, int, int]], sizes: dict[int, int]) -> list[AuditEvent]:
    """Commits (shard, start, len) in order, with an epoch rollover when every shard is
    covered by the latest commits (so both in-progress and complete epochs occur)."""
    out, epoch, top = [], 0, {s: 0 for s in sizes}
    for sid, start, n in ops:
        end = min(sizes[sid], start + n)
        if end <= start:
            continue
        out.append(AuditEvent(0.0, epoch, "commit", sid, 1, "h", 1, start, end))
        top[sid] = max(top[sid], end)
        if all(top[s] >= sizes[s] for s in sizes):
            epoch += 1
            out.append(AuditEvent(0.0, epoch, "epoch", -1, 0, "", 0, 0, sum(sizes.values())))
            top = {s: 0 for s in sizes}
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(1, 25)), max_size=40),
    st.booleans(),
)
def test_audit_monitor_agrees_with_replay(ops: list[tuple[int, int, int]], chain: bool) -> None:
    sizes = {0: 30, 1: 40, 2: 25}
    if chain:  # mostly contiguous commits, the normal case
        pos = dict.fromkeys(sizes, 0)
        chained = []
        for sid, _, n in ops:
            chained.append((sid, pos[sid], n))
            pos[sid] = min(sizes[sid], pos[sid] + n)
            if all(pos[s] >= sizes[s] for s in sizes):
                pos = dict.fromkeys(sizes, 0)
        ops = chained
    events = _events(ops, sizes)
    mon = AuditMonitor(sizes, 0)
    half = len(events) // 2
    mon.feed(events[:half])
    mon.problems()  # an intermediate refresh must not change the final answer
    mon.feed(events[half:])
    lost, dup = mon.problems()
    reports = replay(events, sizes)
    current = max(r.data_epoch for r in reports)
    shown = [r for r in reports if r.data_epoch >= current - 1]
    want_lost = sum(len(r.lost) for r in shown)
    want_dup = sum(len(r.duplicated) for r in shown)
    assert (lost == 0) == (want_lost == 0) and (dup == 0) == (want_dup == 0)
    assert lost <= want_lost and dup <= want_dup
    if chain:
        assert (lost, dup) == (want_lost, want_dup) == (0, 0)
