"""A coordinator killed with SIGKILL mid-run and restarted from the same SQLite file keeps
committed offsets, live leases and the membership version; the run then finishes its data
epoch and `agora audit` is clean. Renewals are soft state (never written): a lease and a
membership carried past their stored expiry by heartbeats alone survive a SIGKILL through
the restart's grace period."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from coordinator_harness import write_config

from coordinator.store import read_leases
from node.coordinator_client import ClientConfig, CoordinatorClient, CoordinatorError, lease_ref
from protocol import control as c
from protocol.identity import NodeKey
from swarmlab.coordinator import audit, start_coordinator
from swarmlab.procs import REPO

FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0)


def test_sigkill_restart_keeps_state_and_audit_is_clean(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    cfg = write_config(tmp_path, lease_ttl_s=20.0, heartbeat_interval_s=1.0)
    db = tmp_path / "c.sqlite"
    key_a, key_b = NodeKey.generate(), NodeKey.generate()
    coord = start_coordinator(tmp_path, config=cfg, db=db)

    async def phase1() -> tuple[c.LeaseInfo, int, c.StatusReply]:
        async with CoordinatorClient("127.0.0.1", coord.port, key_a, config=FAST) as a:
            joined = await a.join(c.JoinRequest(addrs=["/ip4/127.0.0.1/tcp/1"], throughput=100.0))
            assert joined.run.run_id == "test-run" and joined.run.n_stages == 2
            async with CoordinatorClient("127.0.0.1", coord.port, key_b, config=FAST) as b:
                await b.join(c.JoinRequest(throughput=100.0))
                assert (await b.membership()).peers.keys() == {key_a.peer_id, key_b.peer_id}
            lease = await a.acquire()
            assert lease is not None
            data = await a.fetch_shard(lease.shard_id)
            assert len(data) == lease.shard_tokens
            heldout = (await a.manifest()).heldout[0].shard_id
            with pytest.raises(CoordinatorError, match="held out"):  # evaluation data
                await a.fetch_shard(heldout)
            await a.commit(lease, 0, 100)
            await a.commit(lease, 100, 300)
            return lease, joined.membership_version, await a.status()

    lease, _, before = trio.run(phase1)
    assert before.committed_tokens == 300 and before.leases["active"] == 1
    assert coord.kill(signal.SIGKILL) == -signal.SIGKILL
    assert audit(db).exit_code == 0  # an in-progress epoch with no holes

    coord = start_coordinator(tmp_path, config=cfg, db=db)

    async def phase2() -> None:
        async with CoordinatorClient("127.0.0.1", coord.port, key_a, config=FAST) as a:
            after = await a.status()
            assert after.membership_version == before.membership_version
            assert after.committed_tokens == 300
            assert after.leases["active"] == 1 and after.peers == 2
            # still a member: the heartbeat renews the surviving lease, nothing is fenced
            hb = await a.heartbeat([lease_ref(lease)])
            assert hb.renewed == [lease_ref(lease)] and hb.fenced == []
            reply = await a.commit(lease, 300, lease.limit)
            assert reply.lease.state == "complete"
            # finish the data epoch, with another kill in the middle
            n = 0
            while (await a.status()).data_epoch == 0:
                got = await a.acquire()
                assert got is not None
                await a.commit(got, got.committed, got.limit)
                n += 1
            assert n > 3

    trio.run(phase2)
    assert coord.kill(signal.SIGKILL) == -signal.SIGKILL
    res = audit(db)
    assert res.exit_code == 0, res.stdout
    assert "data epoch 0 (complete)" in res.stdout and "lost 0 ranges; duplicated 0" in res.stdout

    coord = start_coordinator(tmp_path, config=cfg, db=db)

    async def phase3() -> None:
        async with CoordinatorClient("127.0.0.1", coord.port, key_a, config=FAST) as a:
            st = await a.status()
            assert st.data_epoch == 1 and st.committed_tokens == 0

    trio.run(phase3)
    shown = subprocess.run(
        [sys.executable, "-m", "swarmlab.status", "--coordinator", coord.address],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "data epoch 1" in shown.stdout and "stage" in shown.stdout
    assert coord.stop() == 0  # SIGTERM shuts down cleanly


def _stored_expiry(db: Path, lease_id: int) -> tuple[float, float]:
    """(the lease's, its holder's) expiry as written in the database, unix seconds."""
    (row,) = [r for r in read_leases(db) if r[0] == lease_id]
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        (peer,) = conn.execute("SELECT expires_at FROM peers WHERE peer_id = ?", (row[2],))
    finally:
        conn.close()
    return float(row[8]), float(peer[0])


def test_leases_renewed_only_in_memory_survive_a_sigkill_restart(tmp_path: Path) -> None:
    ttl = 8.0  # seconds
    cfg = write_config(tmp_path, lease_ttl_s=ttl, heartbeat_interval_s=1.0)
    db = tmp_path / "c.sqlite"
    key = NodeKey.generate()
    coord = start_coordinator(tmp_path, config=cfg, db=db)

    async def phase1() -> tuple[c.LeaseInfo, float]:
        async with CoordinatorClient("127.0.0.1", coord.port, key, config=FAST) as a:
            await a.join(c.JoinRequest(throughput=100.0))
            lease = await a.acquire()
            assert lease is not None
            await a.commit(lease, lease.committed, lease.committed + 100)
            stored = _stored_expiry(db, lease.lease_id)
            # heartbeats alone carry the lease and the membership past their stored expiry
            deadline = time.monotonic() + 10 * ttl
            while time.time() < max(stored) + 1.0:
                assert time.monotonic() < deadline, "heartbeats did not get past the expiry"
                hb = await a.heartbeat([lease_ref(lease)], throughput=200.0)
                assert hb.renewed == [lease_ref(lease)] and hb.fenced == []
                await trio.sleep(0.5)
            assert hb.expires_at > max(stored) + 1.0
            assert _stored_expiry(db, lease.lease_id) == stored  # no renewal was written
            return lease, max(stored)

    lease, stored = trio.run(phase1)
    assert coord.kill(signal.SIGKILL) == -signal.SIGKILL
    coord = start_coordinator(tmp_path, config=cfg, db=db)
    assert time.time() > stored  # the stored expiries alone would end both at the restart

    async def phase2() -> None:
        async with CoordinatorClient("127.0.0.1", coord.port, key, config=FAST) as a:
            st = await a.status()
            assert st.peers == 1 and st.leases["active"] == 1  # the grace period
            hb = await a.heartbeat([lease_ref(lease)])
            assert hb.renewed == [lease_ref(lease)] and hb.fenced == []
            reply = await a.commit(lease, lease.committed + 100, lease.limit)
            assert reply.lease.state == "complete"

    trio.run(phase2)
    assert coord.kill(signal.SIGKILL) == -signal.SIGKILL
    res = audit(db)
    assert res.exit_code == 0, res.stdout
    assert "lost 0 ranges; duplicated 0" in res.stdout
