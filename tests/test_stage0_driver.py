"""Stage 0's driver against a real coordinator (its SQLite file, its lease book) with the
pipeline on the in-process transport: it leases, trains through a stage-1 replica that
fails on schedule, commits what it trained, releases the rest, and the audit is clean.
Also: a fence that empties the pool while the driver waits for a pipeline slot, and a
dead holder's range that the driver takes over at its heartbeat reply's word, with its
pool already full."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import trio
from coordinator_harness import write_config

from node.coordinator_client import ClientConfig, CoordinatorClient
from node.drain import Drain
from node.lease_pool import LeasePool
from node.model import preset
from node.p2p.inproc import FaultPlan, InProcessNetwork
from node.peer_view import PeerView
from node.pipeline_hop import PipelineHop
from node.routing import Router
from node.stage0_driver import Stage0Driver
from node.stage_compute import InnerConfig, StageCompute
from node.worker import TorchWorker
from protocol import control as c
from protocol.identity import NodeKey
from protocol.pipeline import FORWARD_PROTOCOL
from swarmlab.coordinator import audit, start_coordinator

SEQ = 32
INNER = InnerConfig(lr=1e-3, warmup_steps=1, weight_decay=0.0, inner_batch_tokens=1024,
                    cache_size=8)  # fmt: skip
FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=30.0)


def run_driver(
    tmp_path: Path,
    faults: Callable[[dict[str, str]], FaultPlan],
    *,
    in_flight: int,
    max_tokens: int | None,
    shuffle: bool = True,
    during: Callable[..., object] | None = None,
) -> tuple[Stage0Driver, dict[str, PipelineHop]]:
    """One stage-0 driver (joined to a real coordinator) and stage-1 replicas `a`, `b`
    in process; runs until the driver has drained. `during(driver, port)` runs as a task
    (`port`: the coordinator's)."""
    coord = start_coordinator(tmp_path, config=write_config(tmp_path), db=tmp_path / "c.sqlite")
    keys = {name: NodeKey.generate() for name in ("s0", "a", "b")}
    ids = {name: k.peer_id for name, k in keys.items()}
    network = InProcessNetwork(faults(ids))
    members = {
        ids[n]: c.PeerInfo(peer_id=ids[n], stage=s, addrs=[], device="cpu", throughput=0.0)
        for n, s in (("s0", 0), ("a", 1), ("b", 1))
    }
    workers = [TorchWorker() for _ in ids]
    hops: dict[str, PipelineHop] = {}
    for (name, stage), worker in zip((("s0", 0), ("a", 1), ("b", 1)), workers, strict=True):
        transport = network.transport(ids[name])
        view = PeerView(transport, Router(jitter=0.0, explore=0.0), stage=stage)
        view.update(1, members)
        hop = PipelineHop(transport, view, worker, request_timeout_s=5.0, max_rows=8)
        hop.stage_built(StageCompute(preset("tiny"), stage, 2, "subspace_int4", INNER))
        transport.set_handler(FORWARD_PROTOCOL, hop.serve_forward)
        hops[name] = hop
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)

    async def main() -> Stage0Driver:
        async with CoordinatorClient("127.0.0.1", coord.port, keys["s0"], config=FAST) as cl:
            await cl.join(c.JoinRequest(stage=0))
            drain = Drain(timeout_s=20.0)
            driver = Stage0Driver(
                pool, hops["s0"], cl, drain, micro_batch=4, in_flight=in_flight,
                max_attempts=3, shuffle=shuffle, max_tokens=max_tokens, seed="t",
            )  # fmt: skip
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cl.heartbeat_loop, pool.refs)
                if during is not None:
                    nursery.start_soon(during, driver, coord.port)
                with trio.fail_after(120):
                    await driver.run()
                await driver.release_all()
                nursery.cancel_scope.cancel()
            return driver

    try:
        return trio.run(main), hops
    finally:
        for w in workers:
            w.close()
        coord.stop()
        report = audit(tmp_path / "c.sqlite")
        assert report.clean and report.lost_ranges == 0 and report.duplicated_ranges == 0


def test_the_driver_trains_commits_and_reroutes_around_failures(tmp_path: Path) -> None:
    def faults(ids: dict[str, str]) -> FaultPlan:
        return FaultPlan().add(ids["a"], 0, "drop").add(ids["a"], 3, "timeout")

    driver, hops = run_driver(tmp_path, faults, in_flight=2, max_tokens=2048)
    assert driver.pool.tokens_committed >= 2048
    assert hops["s0"].tokens_trained >= 2048 and driver.loss is not None
    assert hops["b"].tokens_trained > 0  # the failed routes went through the other replica
    assert driver.pool.leases == {}  # everything committed or released


def test_a_fence_that_empties_the_pool_while_waiting_for_a_slot(tmp_path: Path) -> None:
    """With one pipeline slot, two leases open and a micro-batch in flight, the driver can
    only be waiting for the slot; the coordinator then fences both leases. When the slot
    frees, the driver finds nothing to cut, leases again and trains on."""
    fenced: list[int] = []

    async def fence_while_waiting(driver: Stage0Driver, port: int) -> None:
        compute = driver.hop.compute
        assert compute is not None
        while not (driver.pool.open_leases >= 2 and compute._cache):
            await trio.sleep(0)
        fenced.extend(driver.pool.fence_all())

    driver, _ = run_driver(
        tmp_path, lambda ids: FaultPlan(), in_flight=1, max_tokens=256, shuffle=False,
        during=fence_while_waiting,
    )  # fmt: skip
    assert len(fenced) == 2 and driver.pool.tokens_committed >= 256


def test_a_dead_holders_range_is_taken_over_at_the_heartbeat_replys_word(tmp_path: Path) -> None:
    """Another stage-0 member takes a lease and dies (no more heartbeats). Once its
    membership lapses, the coordinator counts the freed range in the driver's heartbeat
    replies, and the driver asks for it at once although its pool is full (it asks for
    no ordinary lease: stage 1 drops every request, so no window is used up): the same
    shard, from the committed offset, at a higher fencing epoch."""
    dead: list[c.LeaseInfo] = []

    def faults(ids: dict[str, str]) -> FaultPlan:
        plan = FaultPlan()
        for step in range(500):
            plan.add(ids["a"], step, "drop").add(ids["b"], step, "drop")
        return plan

    async def die_holding_a_lease(driver: Stage0Driver, port: int) -> None:
        with trio.fail_after(60):
            while driver.pool.open_leases < 2:  # the driver's pool fills up
                await trio.sleep(0.05)
            async with CoordinatorClient("127.0.0.1", port, NodeKey.generate(), config=FAST) as z:
                await z.join(c.JoinRequest(stage=0))
                lease = await z.acquire()
                assert lease is not None
                dead.append(lease)
            while driver.freed_opened == 0:  # its TTL lapses; then the next heartbeat
                assert not driver.pool.wants_lease()
                await trio.sleep(0.05)
        driver.drain.start("test done")

    driver, _ = run_driver(
        tmp_path, faults, in_flight=1, max_tokens=None, during=die_holding_a_lease,
    )  # fmt: skip
    [lease] = dead
    conn = sqlite3.connect(tmp_path / "c.sqlite")
    try:
        grants = conn.execute(
            "SELECT holder, epoch, start FROM audit WHERE kind = 'grant' AND shard_id = ?"
            " AND epoch > ? ORDER BY seq",
            (lease.shard_id, lease.epoch),
        ).fetchall()
        s0 = conn.execute(
            "SELECT holder FROM audit WHERE kind = 'grant' ORDER BY seq LIMIT 1"
        ).fetchone()[0]
    finally:
        conn.close()
    assert driver.freed_opened == 1
    assert grants[0] == (s0, lease.epoch + 1, lease.committed)  # the driver took it over
