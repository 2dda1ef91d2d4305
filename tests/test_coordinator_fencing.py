"""A holder frozen with SIGSTOP past the TTL and then resumed is fenced; its shard is
finished by another holder exactly once, and the audit shows it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from coordinator_harness import write_config

from coordinator.audit import replay
from coordinator.store import read_audit, read_shard_sizes
from node.coordinator_client import ClientConfig, CoordinatorClient, FencedError
from protocol import control as c
from protocol.identity import NodeKey
from swarmlab.coordinator import audit, start_coordinator
from swarmlab.procs import REPO, wait_for

FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0)


def test_sigstopped_holder_is_fenced_and_shard_finished_once(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    cfg = write_config(tmp_path, lease_ttl_s=2.0, heartbeat_interval_s=0.4)
    db = tmp_path / "c.sqlite"
    coord = start_coordinator(tmp_path, config=cfg, db=db)
    holder = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "coordinator_holder.py"), str(coord.port)],
        cwd=REPO,
        env=child_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    ready = holder.stdout.readline().split()
    assert ready[0] == "ready", ready
    shard_id, old_epoch = int(ready[1]), int(ready[2])
    key = NodeKey.generate()

    async def status() -> c.StatusReply:
        async with CoordinatorClient("127.0.0.1", coord.port, key, config=FAST) as cl:
            return await cl.status()

    holder.send_signal(signal.SIGSTOP)
    try:
        # the frozen holder lapses: no peers, no active lease
        wait_for(lambda: trio.run(status).leases["active"] == 0, "lease expiry", timeout_s=30)

        async def take_over() -> None:
            async with CoordinatorClient("127.0.0.1", coord.port, key, config=FAST) as b:
                await b.join(c.JoinRequest(throughput=100.0))
                lease = await b.acquire()
                assert lease is not None
                assert lease.shard_id == shard_id and lease.epoch > old_epoch
                assert lease.committed == 100  # resumes at the committed offset
                done = await b.commit(lease, 100, lease.limit)
                assert done.shard_done

        trio.run(take_over)
    finally:
        holder.send_signal(signal.SIGCONT)
    holder.stdin.write("commit\n")
    holder.stdin.flush()
    out = holder.stdout.readline()
    assert out.startswith("fenced:") and "fenced" in out, out
    assert holder.wait(timeout=30) == 0
    coord.stop()
    res = audit(db)
    assert res.exit_code == 0, res.stdout
    events = read_audit(db)
    commits = [(e.start, e.end) for e in events if e.kind == "commit" and e.shard_id == shard_id]
    assert commits == [(0, 100), (100, read_shard_sizes(db)[shard_id])]
    assert any(e.kind == "fence" and e.shard_id == shard_id for e in events)
    assert any(e.kind == "expire" and e.shard_id == shard_id for e in events)
    (report,) = replay(events, read_shard_sizes(db))
    assert report.clean


def test_a_stranger_cannot_fence_or_write_the_audit_log(tmp_path: Path) -> None:
    """Lease calls from a key that holds no lease (never a member) are refused as
    `fenced` without reaching the lease book: no audit row, no durable write, and the
    holder's lease is untouched."""
    db = tmp_path / "c.sqlite"
    coord = start_coordinator(tmp_path, config=write_config(tmp_path), db=db)
    holder_key, stranger_key = NodeKey.generate(), NodeKey.generate()

    async def go() -> None:
        async with (
            CoordinatorClient("127.0.0.1", coord.port, holder_key, config=FAST) as holder,
            CoordinatorClient("127.0.0.1", coord.port, stranger_key, config=FAST) as stranger,
        ):
            await holder.join(c.JoinRequest())
            lease = await holder.acquire()
            assert lease is not None
            for call in (stranger.commit(lease, 0, 100), stranger.release(lease)):
                with pytest.raises(FencedError, match="not held by this peer"):
                    await call
            await holder.commit(lease, 0, 100)  # the holder's lease is untouched

    try:
        trio.run(go)
    finally:
        coord.stop()
    kinds = [e.kind for e in read_audit(db)]
    assert "fence" not in kinds and kinds.count("commit") == 1
