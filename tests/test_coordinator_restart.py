"""A coordinator killed with SIGKILL mid-run and restarted from the same SQLite file keeps
committed offsets, live leases (with their remaining TTL) and the membership version;
the run then finishes its data epoch and `agora audit` is clean."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from coordinator_harness import write_config

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
