"""The lease pool's rules: windows cut once, commits only of contiguous trained prefixes,
monotonic, never past a round's snapshot, nothing of a fenced lease, everything released.

A hypothesis state machine drives random opens, draws, finishes (in any order), round
snapshots, commits and fences, and checks the pool against a plain model of the same
history after every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from node.lease_pool import CommitRange, LeasePool, Window
from protocol.control import LeaseInfo

SEQ = 4


def lease(lease_id: int, *, shard_id: int = 0, committed: int = 0, limit: int = 40) -> LeaseInfo:
    return LeaseInfo(
        lease_id=lease_id, shard_id=shard_id, epoch=1, data_epoch=0, committed=committed,
        limit=limit, shard_tokens=64, expires_at=0.0, state="active",
    )  # fmt: skip


SHARD = bytes(range(64))


def test_windows_cover_the_range_and_a_short_tail_counts_as_trained() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    # tokens 8..62 of a 64-token shard: windows need SEQ + 1 tokens, so the last start is 56
    assert pool.open(lease(1, committed=8, limit=62), SHARD) == 13
    windows = pool.take(100)
    assert [w.start for w in windows] == list(range(8, 60, SEQ))
    pool.finish(windows)
    [only] = pool.commits()
    assert (only.start, only.end) == (8, 62)  # the 2-token tail needs no training
    assert pool.accept(only) and pool.leases == {} and pool.tokens_committed == 54


def test_commits_stop_at_a_gap_and_at_the_round_snapshot() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    w0, w1, w2, w3 = pool.take(4)
    pool.finish([w1, w2])
    assert pool.commits() == []  # [0, 4) is not trained: nothing can be committed
    pool.finish([w0])
    snap = pool.snapshot()
    assert snap == {1: 12}
    pool.finish([w3])  # trained after the round began: not in its snapshot
    [rng] = pool.commits(upto=snap)
    assert (rng.start, rng.end) == (0, 12)
    assert not pool.accept(rng)
    [rest] = pool.commits()
    assert (rest.start, rest.end) == (12, 16)


def test_fenced_lease_loses_its_windows_and_commits() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    pool.open(lease(2, shard_id=0, limit=16), SHARD)
    taken = pool.take(1)  # lease 1's first window is in flight
    rng = CommitRange(lease(1, limit=16), 0, 4)
    assert pool.fence(1) and pool.is_fenced(1)
    pool.finish(taken)  # the in-flight window returns: ignored
    assert pool.commits() == [] and not pool.pending(rng)
    assert {w.lease.lease_id for w in pool.take(100)} == {2}
    assert pool.refs()[0].lease_id == 2
    with pytest.raises(ValueError, match="fenced"):
        pool.open(lease(1, limit=16), SHARD)


def test_wants_lease_counts_leases_with_untaken_windows_and_cache_is_bounded() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=2)
    for i in range(3):
        pool.open(lease(i + 1, shard_id=i, limit=8), SHARD)
    assert not pool.wants_lease()
    pool.take(4)  # in lease order: leases 1 and 2 have nothing left to hand out
    assert pool.wants_lease() and pool.untaken == 2
    assert pool.shard(0) is None and pool.shard(2) == SHARD  # the oldest shard was evicted
    held = pool.release_all()
    assert sorted(le.lease_id for le in held) == [1, 2, 3] and pool.untaken == 0


class PoolMachine(RuleBasedStateMachine):
    """The pool against a model: per lease, the set of trained offsets and the committed
    offset; in flight, windows handed out and not yet finished."""

    @initialize()
    def setup(self) -> None:
        self.pool = LeasePool(seq_len=SEQ, max_open=3, shard_cache=4)
        self.next_id = 1
        self.in_flight: list[Window] = []
        self.trained: dict[int, set[int]] = {}
        self.committed: dict[int, int] = {}
        self.opened_at: dict[int, int] = {}
        self.limits: dict[int, int] = {}
        self.fenced: set[int] = set()
        self.handed: set[tuple[int, int]] = set()
        self.snap: dict[int, int] | None = None

    @rule(committed=st.integers(0, 6), length=st.integers(1, 10))
    def open(self, committed: int, length: int) -> None:
        start, limit = committed * SEQ, min(64, committed * SEQ + length * SEQ)
        le = lease(self.next_id, committed=start, limit=limit)
        self.pool.open(le, SHARD)
        self.trained[le.lease_id] = set()
        self.committed[le.lease_id] = start
        self.opened_at[le.lease_id] = start
        self.limits[le.lease_id] = limit
        self.next_id += 1

    @rule(n=st.integers(1, 5), seed=st.integers(0, 3))
    def take(self, n: int, seed: int) -> None:
        got = self.pool.take(n, random.Random(seed))
        for w in got:
            key = (w.lease.lease_id, w.start)
            assert key not in self.handed, f"window {key} handed out twice"
            assert w.lease.lease_id not in self.fenced
            self.handed.add(key)
        self.in_flight += got

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        w = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        self.pool.finish([w])
        if w.lease.lease_id not in self.fenced:
            self.trained[w.lease.lease_id].add(w.start)

    @rule()
    def snapshot(self) -> None:
        self.snap = self.pool.snapshot()

    @rule(use_snapshot=st.booleans())
    def commit(self, use_snapshot: bool) -> None:
        upto = self.snap if use_snapshot else None
        for rng in self.pool.commits(upto):
            lid = rng.lease.lease_id
            assert lid not in self.fenced
            assert rng.start == self.committed[lid] < rng.end
            if upto is not None:
                assert rng.end <= upto[lid]
            # every window in [start, end) was trained (the tail past the last window
            # needs none)
            for s in range(rng.start, rng.end, SEQ):
                if s + SEQ + 1 <= len(SHARD):
                    assert s in self.trained[lid], (lid, s, rng)
            assert self.pool.pending(rng)
            self.pool.accept(rng)
            self.committed[lid] = rng.end

    @precondition(lambda self: self.pool.leases)
    @rule(data=st.data())
    def fence(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.pool.leases)))
        self.pool.fence(lid)
        self.fenced.add(lid)

    @invariant()
    def held_leases_are_neither_fenced_nor_complete(self) -> None:
        for lid in self.pool.leases:
            assert lid not in self.fenced
            assert self.committed[lid] < self.limits[lid]

    @invariant()
    def committed_tokens_add_up(self) -> None:
        total = sum(self.committed[i] - start for i, start in self.opened_at.items())
        assert self.pool.tokens_committed == total


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_lease_pool_state_machine = PoolMachine.TestCase
