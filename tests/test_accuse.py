"""Accusations between a stage's replicas (coordinator/accuse.py): who gets dropped, and
that a lying minority never drops an honest replica (hypothesis); then over the wire,
against a real coordinator process: two replicas of a stage of three accuse the third
in three rounds and it is banned, its leases released; one accuser alone, an accusation
across stages and a stage of two drop nobody."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from coordinator_harness import write_config
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.accuse import Accusations
from node.coordinator_client import ClientConfig, CoordinatorClient, CoordinatorError, JoinRefused
from protocol import control as c
from protocol.identity import NodeKey
from swarmlab.coordinator import start_coordinator

FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0)


def test_most_of_a_stage_accusing_in_enough_rounds_drops_a_replica() -> None:
    acc = Accusations(strikes=3, window_s=100.0)
    stage = ["a", "b", "x"]
    for r in (1, 2):
        acc.record("a", "x", r, now=10.0)
        acc.record("b", "x", r, now=10.0)
    assert not acc.guilty("x", stage, len(stage), now=10.0)  # two rounds: not yet
    acc.record("a", "x", 2, now=11.0)  # the same round again is no new strike
    assert acc.accusers("x", now=11.0) == set()
    acc.record("a", "x", 3, now=12.0)
    assert acc.accusers("x", now=12.0) == {"a"} and not acc.guilty("x", stage, len(stage), now=12.0)
    acc.record("b", "x", 3, now=12.0)
    assert acc.guilty("x", stage, len(stage), now=12.0)
    assert not acc.guilty("x", stage, len(stage), now=200.0)  # past the window they no longer count
    acc.forget("x")
    assert acc.accusers("x", now=12.0) == set()


def test_a_stage_of_two_drops_nobody_and_one_liar_drops_no_one() -> None:
    acc = Accusations(strikes=1, window_s=100.0)
    acc.record("a", "b", 1, now=0.0)
    assert not acc.guilty("b", ["a", "b"], 2, now=0.0)  # either could be the liar
    acc.record("x", "a", 1, now=0.0)
    assert not acc.guilty("a", ["a", "b", "x"], 3, now=0.0)
    acc.record("x", "a", 1, now=0.0)
    acc.record("y", "a", 1, now=0.0)  # y is not on the stage: its word does not count
    assert not acc.guilty("a", ["a", "b", "x"], 3, now=0.0)
    assert acc.guilty("a", ["a", "x", "y"], 3, now=0.0)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=9),
    reports=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 5)), max_size=60),
    strikes=st.integers(min_value=1, max_value=3),
)
def test_a_minority_of_liars_never_drops_an_honest_replica(
    n: int, reports: list[tuple[int, int]], strikes: int
) -> None:
    """Replica 0 is honest; the liars are at most half of the others, and accuse it in
    any rounds they like: it is never dropped."""
    stage = [f"p{i}" for i in range(n)]
    liars = stage[1 : 1 + (n - 1) // 2]
    acc = Accusations(strikes=strikes, window_s=1e9)
    for who, rnd in reports:
        if liars:
            acc.record(liars[who % len(liars)], "p0", rnd, now=1.0)
        assert not acc.guilty("p0", stage, len(stage), now=1.0)


def test_accusations_over_the_wire_ban_the_replica_its_stage_caught(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, n_stages=2, lease_ttl_s=20.0, heartbeat_interval_s=1.0)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    ka, kb, kx, ko = (NodeKey.generate() for _ in range(4))

    async def go() -> None:
        port, pin = coord.port, coord.fingerprint
        async with (
            CoordinatorClient("127.0.0.1", port, ka, config=FAST, pin=pin) as a,
            CoordinatorClient("127.0.0.1", port, kb, config=FAST, pin=pin) as b,
            CoordinatorClient("127.0.0.1", port, kx, config=FAST, pin=pin) as x,
            CoordinatorClient("127.0.0.1", port, ko, config=FAST, pin=pin) as other,
        ):
            for cl in (a, b, x):
                await cl.join(c.JoinRequest(throughput=100.0, stage=0))
            await other.join(c.JoinRequest(throughput=100.0, stage=1))
            held = await x.acquire()
            assert held is not None
            # x lies about a: a is one accuser's word, never enough; other (stage 1)
            # accusing x does not count either
            for r in range(1, 5):
                x.accuse(ka.peer_id, r, "lie")
                other.accuse(kx.peer_id, r, "not its stage")
                await x.heartbeat([c.LeaseRef(lease_id=held.lease_id, epoch=held.epoch)])
                await other.heartbeat()
            assert (await a.heartbeat()).stage == 0
            # a and b each catch x in three rounds: banned at the third
            for r in range(1, 4):
                a.accuse(kx.peer_id, r, "part 0: non-finite values")
                b.accuse(kx.peer_id, r, "part 1: non-finite values")
                await a.heartbeat()
                await b.heartbeat()
            try:
                await x.heartbeat()
            except CoordinatorError as exc:
                assert exc.code == "banned", exc
            else:
                raise AssertionError("x was not banned")
            with pytest.raises(JoinRefused, match="banned"):  # a node's loop stops for good
                with trio.fail_after(10):
                    await x.heartbeat_loop(list)
            status = await a.status()
            assert status.peers == 3 and status.leases["active"] == 0  # x's lease released
            assert (await a.heartbeat()).stage == 0 and (await b.heartbeat()).stage == 0

    try:
        trio.run(go)
    finally:
        coord.stop()
