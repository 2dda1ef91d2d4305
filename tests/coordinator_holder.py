"""A lease holder process for the fencing test: joins, takes a lease, commits its first
100 tokens and heartbeats. On a line `commit` on stdin it tries to commit the next 100
tokens and prints `fenced` or `committed`. Run: python coordinator_holder.py PORT."""

from __future__ import annotations

import sys

import trio

from node.coordinator_client import ClientConfig, CoordinatorClient, FencedError, lease_ref
from protocol import control as c
from protocol.identity import NodeKey


async def main(port: int) -> None:
    cfg = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0)
    async with CoordinatorClient("127.0.0.1", port, NodeKey.generate(), config=cfg) as client:
        await client.join(c.JoinRequest(throughput=100.0))
        lease = await client.acquire()
        assert lease is not None
        await client.commit(lease, lease.committed, lease.committed + 100)
        print(f"ready {lease.shard_id} {lease.epoch}", flush=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.heartbeat_loop, lambda: [lease_ref(lease)])
            stdin = trio.lowlevel.FdStream(0)
            line = await stdin.receive_some(100)
            assert line.strip() == b"commit", line
            try:
                await client.commit(lease, lease.committed + 100, lease.committed + 200)
                print("committed", flush=True)
            except FencedError as exc:
                print(f"fenced: {exc.detail}", flush=True)
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]))
