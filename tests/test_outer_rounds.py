"""`OuterRounds` turns each round's result into the facts of the commit rule, and the
lease pool commits or hands back accordingly: a real `OuterLink` against a scripted
outer process (the test answers each `Begin` with the `RoundResult` it wants), a real
torch worker and lease pool, and a stand-in for the stage's compute."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from node import metrics
from node.checkpoint import GlobalState
from node.events import EventLog, read_events
from node.lease_pool import LeasePool, RoundFacts, RoundVerdict
from node.outer import contract as c
from node.outer_link import OuterLink
from node.outer_rounds import OuterRounds
from node.worker import TorchWorker
from protocol.codec import packb
from protocol.control import LeaseInfo
from protocol.framing import FrameDecoder, frame

SEQ = 4
NUMEL = 8


class Compute:
    """The part of `StageCompute` that `OuterRounds` uses."""

    def __init__(self) -> None:
        self.weights = torch.zeros(NUMEL)
        self.inner_steps = 0
        self.tokens_trained = 0
        self.steps_at_snapshot = 0  # `step()` calls (the snapshot's flush)

    def parameters(self) -> list[torch.Tensor]:
        return [self.weights]

    def weights_changed(self) -> None:
        pass

    def step(self) -> None:
        self.steps_at_snapshot += 1


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[OuterLink, socket.socket]]:
    """An `OuterLink` whose "outer process" is the test: replies go through `peer`."""
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    paths = [tmp_path / name for name in ("snap", "result", "m")]
    for path in paths:
        path.write_bytes(bytes(4 * NUMEL))
    # a stand-in for the outer process's pid: it waits on its stdin, which teardown closes
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    link = OuterLink(proc, ours, *paths, numel=NUMEL)
    yield link, peer
    assert proc.stdin is not None
    proc.stdin.close()
    proc.kill()
    link.close(timeout=5.0)
    peer.close()


def chain(rnd: int, mark: str = "0") -> list[tuple[int, str]]:
    """The lineage of the state of round `rnd` on a line of states marked `mark`."""
    return [(r, f"{mark}{r:015x}") for r in range(rnd + 1)]


def result(rnd: int, mark: str = "0", **kw: Any) -> c.RoundResult:
    """A round's result whose state is round `rnd` of the line `mark` (`chain`)."""
    fields: dict[str, Any] = dict(
        round=rnd, applied=True, contributed=True, rebased=False, group_size=2, tokens=8,
        eta_r=0.7, bytes_out=0, bytes_in=0, raw_bytes=4 * NUMEL, seconds=0.1, rejected={},
        digest=f"{mark}{rnd:015x}", lineage=chain(rnd, mark),
    )  # fmt: skip
    fields.update(kw)
    return c.RoundResult(**fields)


def run_rounds(
    link: OuterLink, peer: socket.socket, events: Path, replies: list[c.RoundResult]
) -> tuple[LeasePool, list[tuple[RoundFacts, RoundVerdict]], Compute]:
    """Trains two windows of one lease before each round, runs one round per reply
    (others exist on the stage), and returns the pool and every round's facts and
    verdict."""
    pool = LeasePool(seq_len=SEQ, max_open=1, shard_cache=1)
    pool.open(
        LeaseInfo(
            lease_id=1,
            shard_id=0,
            epoch=1,
            data_epoch=0,
            committed=0,
            limit=4 * SEQ * 4,
            shard_tokens=64,
            expires_at=0.0,
            state="active",
        ),  # fmt: skip
        bytes(64),
    )
    compute = Compute()
    worker = TorchWorker()
    seen: list[tuple[RoundFacts, RoundVerdict]] = []

    async def on_round(_state: object, facts: RoundFacts) -> None:
        seen.append((facts, pool.round_result(facts)))

    rounds = OuterRounds(
        worker, compute, link, every_steps=1, snapshot=pool.snapshot,  # type: ignore[arg-type]
        on_round=on_round, sole_replica=lambda: False, events=EventLog(events),
    )  # fmt: skip
    decoder = FrameDecoder(max_frame=c.MAX_CONTROL_FRAME)
    peer.settimeout(5.0)

    async def main() -> None:
        for reply in replies:
            pool.finish(pool.take(2), final=False)
            compute.tokens_trained += 2 * SEQ
            await rounds.begin()
            [begin] = [c.decode_command(p) for p in decoder.feed(peer.recv(1 << 16))]
            assert isinstance(begin, c.Begin)
            peer.sendall(c.encode(reply))
            with trio.fail_after(5.0):
                while rounds.in_flight:
                    await rounds.tick()
                    await trio.sleep(0.01)

    try:
        trio.run(main)
    finally:
        worker.close()
    return pool, seen, compute


def spans(verdict: RoundVerdict) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    return [(r.start, r.end) for r in verdict.commits], [(r.start, r.end) for r in verdict.returned]


def steps() -> float:
    return metrics.OUTER_STEPS._value.get()  # type: ignore[attr-defined, no-any-return]


def test_a_round_not_applied_and_a_rejected_contribution_commit_nothing(
    scripted: tuple[OuterLink, socket.socket], tmp_path: Path
) -> None:
    link, peer = scripted
    events = tmp_path / "events.jsonl"
    before = steps()
    _, seen, compute = run_rounds(
        link, peer, events,
        [
            result(0, applied=False, contributed=False),  # the state did not move
            result(1, contributed=False, rejected={"me": "staleness 9 above bound 4"}),
            result(2, agreed=chain(1)[-1]),  # a group round with this replica's contribution
            result(3, agreed=chain(2)[-1]),  # the next group agrees on the state it made
        ],
    )  # fmt: skip
    assert steps() - before == 3  # only applied rounds are outer steps
    assert compute.steps_at_snapshot == 4  # every snapshot flushed pending gradients
    (f0, v0), (f1, v1), (f2, v2), (f3, v3) = seen
    assert not f0.applied and not f0.contributed
    assert spans(v0) == ([], [(0, 8)])
    assert f1.applied and not f1.contributed and spans(v1) == ([], [(0, 8)])
    # the windows that went back were trained again and ride in the third round, which
    # holds them until a group agrees on the state it made
    assert f2.contributed and f2.agreed == chain(1)[-1] and spans(v2) == ([], [])
    assert v2.held == 1
    assert spans(v3) == ([(0, 8)], []) and v3.held == 1 and v3.rode_in == chain(2)[-1]
    assert [e["round"] for e in read_events(events, "round_not_applied")] == [0]
    applied = read_events(events, "round_applied")
    assert [(e["round"], e["contributed"]) for e in applied] == [(1, False), (2, True), (3, True)]


def test_a_lone_round_then_an_adopted_state_hands_the_lone_rounds_ranges_back(
    scripted: tuple[OuterLink, socket.socket], tmp_path: Path
) -> None:
    link, peer = scripted
    theirs = chain(3, "b")
    _, seen, _ = run_rounds(
        link, peer, tmp_path / "events.jsonl",
        [
            result(1, group_size=1),  # stepped alone while other replicas exist: held
            # the group's state replaced this replica's
            result(3, "b", rebased=True, agreed=theirs[2]),
            # [0, 8) trained again, alone again: held
            result(4, digest="0" * 16, lineage=[*theirs, (4, "0" * 16)], group_size=1),
            # a group agrees on this replica's state: what it carried is committed
            result(5, digest="1" * 16, lineage=[*theirs, (4, "0" * 16), (5, "1" * 16)],
                   agreed=(4, "0" * 16)),
        ],
    )  # fmt: skip
    (f0, v0), (f1, v1), (f2, v2), (f3, v3) = seen
    assert f0.agreed is None and not f0.sole and spans(v0) == ([], []) and v0.held == 1
    # the lone round's [0, 8) is gone from the adopted state; this round's [8, 16) was
    # merged by the group into it, and waits
    assert f1.adopted and spans(v1) == ([], [(0, 8)]) and v1.held == 1
    assert spans(v2) == ([], []) and v2.held == 2
    assert spans(v3) == ([(0, 16)], []) and v3.held == 1  # this round's [16, 24) waits


@pytest.mark.parametrize("confirm", ["agrees", "disagrees", "nothing_waits"])
def test_a_drain_runs_one_more_round_while_a_contribution_waits_for_agreement(
    scripted: tuple[OuterLink, socket.socket], tmp_path: Path, confirm: str
) -> None:
    """The last round before a drain carried a contribution no group has agreed on yet:
    `finish` runs one more round (with no tokens) for a group to agree on it, once,
    whether or not that round agreed; and none when no contribution waits."""
    link, peer = scripted
    compute = Compute()
    worker = TorchWorker()
    pool = LeasePool(seq_len=SEQ, max_open=1, shard_cache=1)
    pool.open(
        LeaseInfo(
            lease_id=1, shard_id=0, epoch=1, data_epoch=0, committed=0, limit=64,
            shard_tokens=64, expires_at=0.0, state="active",
        ),
        bytes(64),
    )  # fmt: skip
    held: list[int] = []

    async def on_round(_state: object, facts: RoundFacts) -> None:
        held.append(pool.round_result(facts).held)

    rounds = OuterRounds(
        worker, compute, link, every_steps=1, snapshot=pool.snapshot,  # type: ignore[arg-type]
        on_round=on_round, sole_replica=lambda: False, events=EventLog(tmp_path / "ev.jsonl"),
        waiting=lambda: pool.held > 0,
    )  # fmt: skip
    decoder = FrameDecoder(max_frame=c.MAX_CONTROL_FRAME)
    peer.settimeout(5.0)
    begins: list[c.Begin] = []

    def answer(reply: c.RoundResult) -> None:
        [begin] = [c.decode_command(p) for p in decoder.feed(peer.recv(1 << 16))]
        assert isinstance(begin, c.Begin)
        begins.append(begin)
        peer.sendall(c.encode(reply))

    async def main() -> None:
        pool.finish(pool.take(2), final=False)
        compute.tokens_trained += 2 * SEQ
        await rounds.begin()
        answer(result(1, agreed=chain(0)[-1], contributed=confirm != "nothing_waits"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rounds.finish, 10.0)
            if confirm != "nothing_waits":  # the drain begins one more round for agreement
                agreed = chain(1)[-1] if confirm == "agrees" else None
                await trio.to_thread.run_sync(answer, result(2, contributed=False, agreed=agreed))

    try:
        trio.run(main)
    finally:
        worker.close()
    if confirm == "nothing_waits":  # the group left round 1's contribution out
        assert [b.tokens for b in begins] == [2 * SEQ] and held == [0]
    else:  # round 1's contribution waited; round 2's group agreed on its state, or not
        assert [b.tokens for b in begins] == [2 * SEQ, 0]
        assert held == [1, 0 if confirm == "agrees" else 1]
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):  # no third round began
        peer.recv(1 << 16)


def test_a_malformed_result_fails_the_round_and_the_next_round_begins(
    scripted: tuple[OuterLink, socket.socket], tmp_path: Path
) -> None:
    """A result the contract refuses (an outer process of another version, say) fails
    that round with a clear error; the link is not left waiting for it, so the next
    round begins."""
    link, peer = scripted
    pool = LeasePool(seq_len=SEQ, max_open=1, shard_cache=1)
    worker = TorchWorker()
    compute = Compute()
    rounds = OuterRounds(
        worker, compute, link, every_steps=1, snapshot=pool.snapshot,  # type: ignore[arg-type]
        on_round=lambda _s, _f: trio.sleep(0), sole_replica=lambda: False,
        events=EventLog(tmp_path / "ev.jsonl"),
    )  # fmt: skip
    decoder = FrameDecoder(max_frame=c.MAX_CONTROL_FRAME)
    peer.settimeout(5.0)
    failed_before = metrics.OUTER_ROUNDS.labels("failed")._value.get()  # type: ignore[attr-defined]

    async def main() -> None:
        await rounds.begin()
        [begin] = [c.decode_command(p) for p in decoder.feed(peer.recv(1 << 16))]
        assert isinstance(begin, c.Begin)
        bad = {**result(1).to_wire(), "group_size": 0}
        peer.sendall(frame(packb(bad), max_frame=c.MAX_CONTROL_FRAME))
        with trio.fail_after(5.0):
            while rounds.in_flight:
                await rounds.tick()
                await trio.sleep(0.01)
        await rounds.begin()  # not refused as "an operation is in flight"
        [again] = [c.decode_command(p) for p in decoder.feed(peer.recv(1 << 16))]
        assert isinstance(again, c.Begin)

    try:
        trio.run(main)
    finally:
        worker.close()
    failed = metrics.OUTER_ROUNDS.labels("failed")._value.get()  # type: ignore[attr-defined]
    assert failed == failed_before + 1


def test_a_replica_joins_a_forming_group_after_a_quarter_of_its_steps(
    scripted: tuple[OuterLink, socket.socket], tmp_path: Path
) -> None:
    """Between rounds, once a quarter of `every_steps` is trained, the rounds look (at most
    once a `PEEK_S`) whether another replica is forming a group, and begin early if so."""
    link, peer = scripted
    events = tmp_path / "events.jsonl"
    pool = LeasePool(seq_len=SEQ, max_open=1, shard_cache=1)
    compute = Compute()
    worker = TorchWorker()

    async def on_round(_state: object, facts: RoundFacts) -> None:
        pass

    rounds = OuterRounds(
        worker, compute, link, every_steps=8, snapshot=pool.snapshot,  # type: ignore[arg-type]
        on_round=on_round, sole_replica=lambda: False, events=EventLog(events),
    )  # fmt: skip
    decoder = FrameDecoder(max_frame=c.MAX_CONTROL_FRAME)
    peer.settimeout(5.0)
    peer.setblocking(False)

    def commands() -> list[c.Command]:
        try:
            return [c.decode_command(p) for p in decoder.feed(peer.recv(1 << 16))]
        except BlockingIOError:
            return []

    async def answer(waiting: int) -> list[c.Command]:
        """Tick until the rounds send a command; answer a Peek with `waiting`."""
        rounds._peeked_at = 0.0  # do not wait out PEEK_S
        with trio.fail_after(5.0):
            while True:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(rounds.tick)
                    await trio.sleep(0.05)
                    got = commands()
                    if got and isinstance(got[0], c.Peek):
                        peer.sendall(c.encode(c.Peeked(waiting=waiting)))
                if got:
                    return got

    async def main() -> None:
        compute.inner_steps = 1  # below a quarter of 8: no look
        rounds._peeked_at = 0.0
        await rounds.tick()
        await trio.sleep(0.05)
        assert commands() == [] and not rounds.in_flight
        compute.inner_steps = 2
        assert isinstance((await answer(0))[0], c.Peek) and not rounds.in_flight
        assert isinstance((await answer(1))[0], c.Peek)
        got = commands()
        with trio.fail_after(5.0):
            while not got:
                await trio.sleep(0.01)
                got = commands()
        assert isinstance(got[0], c.Begin) and rounds.in_flight and rounds.joined_early == 1
        peer.sendall(c.encode(result(1)))
        with trio.fail_after(5.0):
            while rounds.in_flight:
                await rounds.tick()
                await trio.sleep(0.01)

    try:
        trio.run(main)
    finally:
        worker.close()
    [applied] = read_events(events, "round_applied")
    assert applied["joined_early"] is True


def test_a_first_replica_starts_the_stage_from_its_initial_weights_and_keeps_its_progress(
    scripted: tuple[OuterLink, socket.socket], tmp_path: Path
) -> None:
    """A stage > 0 trains on forwards before its outer loop starts: the stage's round 0
    is still the weights as built (the same bits on every replica), and what the node
    trained meanwhile stays in its weights as progress on top of it."""
    link, peer = scripted
    compute = Compute()
    initial = torch.arange(NUMEL, dtype=torch.float32)
    compute.weights.copy_(initial + 0.5)  # trained before the outer loop started
    worker = TorchWorker()
    rounds = OuterRounds(
        worker, compute, link, every_steps=1, snapshot=lambda: None,  # type: ignore[arg-type]
        on_round=None, sole_replica=lambda: True,  # type: ignore[arg-type]
    )  # fmt: skip
    decoder = FrameDecoder(max_frame=c.MAX_CONTROL_FRAME)
    peer.settimeout(5.0)
    got: list[object] = []

    def answer() -> None:
        [cmd] = [c.decode_command(p) for p in decoder.feed(peer.recv(1 << 16))]
        got.append(cmd)
        peer.sendall(c.encode(c.StateSet(round=0, digest="d0", lineage=[(0, "d0")])))

    async def main() -> GlobalState:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, answer)
            with trio.fail_after(10.0):
                return await rounds.load_state(
                    False, GlobalState(theta_g=initial, momentum=None, round=0), keep_progress=True
                )

    try:
        state = trio.run(main)
    finally:
        worker.close()
    [cmd] = got
    assert isinstance(cmd, c.SetState) and cmd.round == 0 and not cmd.momentum
    handed = torch.frombuffer(bytearray((tmp_path / "snap").read_bytes()), dtype=torch.float32)
    assert torch.equal(handed, initial)  # the outer process got the weights as built
    assert torch.equal(compute.weights, initial + 0.5)  # the progress stays in the weights
    assert state.round == 0 and state.digest == "d0" and not rounds.loaded_from_replica


def test_a_replica_that_carries_the_attested_state_keeps_its_weights_and_downloads_nothing(
    scripted: tuple[OuterLink, socket.socket], tmp_path: Path
) -> None:
    """A node moving to the run's DHT before its first round (or a joiner while its
    stage is still at round 0) carries the state its stage attests: it hands that to its
    new outer process before asking for the stage's state, so the outer process answers
    the fetch from what it holds (`node.outer.process`, `holds`) and downloads nothing,
    and the weights keep what was trained since, bit for bit."""
    link, peer = scripted
    compute = Compute()
    initial = torch.arange(NUMEL, dtype=torch.float32)
    compute.weights.copy_(initial + 0.5)  # trained before the outer loop (re)started
    worker = TorchWorker()
    rounds = OuterRounds(
        worker, compute, link, every_steps=1, snapshot=lambda: None,  # type: ignore[arg-type]
        on_round=None, sole_replica=lambda: False,  # type: ignore[arg-type]
        attested=lambda: (0, "d0"), members=lambda: ["QmA", "QmB"],
    )  # fmt: skip
    decoder = FrameDecoder(max_frame=c.MAX_CONTROL_FRAME)
    peer.settimeout(5.0)
    got: list[object] = []

    def answer() -> None:
        for _ in range(2):
            [cmd] = [c.decode_command(p) for p in decoder.feed(peer.recv(1 << 16))]
            got.append(cmd)
            if isinstance(cmd, c.SetState):
                peer.sendall(c.encode(c.StateSet(round=0, digest="d0", lineage=chain(0))))
            else:  # what it holds is the attested state: the fetch is answered from it
                peer.sendall(
                    c.encode(c.StateFetched(ok=True, round=0, digest="d0", lineage=chain(0)))
                )

    async def main() -> GlobalState:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, answer)
            with trio.fail_after(10.0):
                carried = GlobalState(theta_g=initial, momentum=None, round=0, digest="d0")
                return await rounds.load_state(True, carried, keep_progress=True)

    try:
        state = trio.run(main)
    finally:
        worker.close()
    seeded, fetched = got
    assert isinstance(seeded, c.SetState) and seeded.round == 0 and seeded.members == ["QmA", "QmB"]
    assert isinstance(fetched, c.Fetch) and fetched.attested == (0, "d0")
    handed = torch.frombuffer(bytearray((tmp_path / "snap").read_bytes()), dtype=torch.float32)
    assert torch.equal(handed, initial)  # the outer process holds the carried state
    assert torch.equal(compute.weights, initial + 0.5)  # no rebase: the weights are untouched
    assert state.round == 0 and state.digest == "d0" and not rounds.loaded_from_replica


def test_a_joiner_waits_for_the_attested_state_and_takes_no_unvouched_one(
    scripted: tuple[OuterLink, socket.socket],
) -> None:
    """Other replicas exist but the coordinator attests nothing yet: the joiner asks its
    outer process for no state until the attested one is known, then fetches only that
    (round 3). With nothing attested through the state timeout it fetches nothing at all
    and starts from its initial weights. Both times the outer process is told the
    stage's members."""
    link, peer = scripted
    link.state_timeout_s = 2.0
    worker = TorchWorker()
    decoder = FrameDecoder(max_frame=c.MAX_CONTROL_FRAME)
    peer.settimeout(10.0)
    known: list[tuple[int, str] | None] = [None]
    rounds = OuterRounds(
        worker, Compute(), link, every_steps=1, snapshot=lambda: None,  # type: ignore[arg-type]
        on_round=None, sole_replica=lambda: False, attested=lambda: known[0],  # type: ignore[arg-type]
        members=lambda: ["QmA", "QmB"],
    )  # fmt: skip
    got: list[object] = []

    def answer() -> None:
        [cmd] = [c.decode_command(p) for p in decoder.feed(peer.recv(1 << 16))]
        got.append(cmd)
        if isinstance(cmd, c.Fetch):
            peer.sendall(c.encode(c.StateFetched(ok=True, round=3, digest="d3", lineage=chain(3))))
        else:
            peer.sendall(c.encode(c.StateSet(round=0, digest="d0", lineage=[(0, "d0")])))

    async def load(attested_after: float | None) -> tuple[GlobalState, float]:
        async def attest() -> None:
            if attested_after is not None:
                await trio.sleep(attested_after)
                known[0] = (3, "d3")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, answer)
            nursery.start_soon(attest)
            t0 = trio.current_time()
            with trio.fail_after(10.0):
                state = await rounds.load_state(True, None, keep_progress=False)
            return state, trio.current_time() - t0

    try:
        fetched, waited = trio.run(load, 0.8)
        assert rounds.loaded_from_replica and fetched.round == 3 and waited >= 0.8
        known[0] = None
        started, gave_up = trio.run(load, None)
    finally:
        worker.close()
    first, second = got
    assert isinstance(first, c.Fetch) and first.attested == (3, "d3")  # never an unvouched one
    assert isinstance(second, c.SetState) and second.round == 0  # nothing fetched at all
    # either way the outer process learns the stage's members with the state it starts from
    assert first.members == second.members == ["QmA", "QmB"]
    assert started.round == 0 and not rounds.loaded_from_replica and 1.5 <= gave_up < 4.0
