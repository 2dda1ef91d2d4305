"""The lease pool's rules: windows cut once, commits only of contiguous trained prefixes,
monotonic, nothing of a fenced lease, everything released; and the commit rule: a range
is committed only once the round that carried it was applied with this replica's
contribution, in a state the stage agreed on (two members of a group held it, or the
replica is the stage's only one), and what did not reach the state goes back to be
trained again.

A hypothesis state machine drives random opens, draws, finishes (in any order), rounds
with random results, commits and fences, and checks the pool against the history."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from node.lease_pool import CommitRange, LeasePool, RoundFacts, RoundMark, Window
from protocol.control import LeaseInfo
from protocol.lineage import Link

SEQ = 4


def lease(lease_id: int, *, shard_id: int = 0, committed: int = 0, limit: int = 40) -> LeaseInfo:
    return LeaseInfo(
        lease_id=lease_id, shard_id=shard_id, epoch=1, data_epoch=0, committed=committed,
        limit=limit, shard_tokens=64, expires_at=0.0, state="active",
    )  # fmt: skip


SHARD = bytes(range(64))


def facts(
    mark: RoundMark,
    *,
    applied: bool = True,
    contributed: bool = True,
    adopted: bool = False,
    sole: bool = False,
    chain: tuple[Link, ...] = (),
    agreed: Link | None = None,
    carried: bool = False,
) -> RoundFacts:
    """A round's facts; `chain` is the lineage of the state held after it (its last entry
    is that state)."""
    head = chain[-1] if chain else (-1, "")
    return RoundFacts(
        mark=mark, applied=applied, contributed=contributed, adopted=adopted, sole=sole,
        round=head[0], digest=head[1], lineage=chain, agreed=agreed, carried=carried,
    )  # fmt: skip


def spans(ranges: list[CommitRange]) -> list[tuple[int, int]]:
    return [(r.start, r.end) for r in ranges]


def test_windows_cover_the_range_and_a_short_tail_counts_as_trained() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    # tokens 8..62 of a 64-token shard: windows need SEQ + 1 tokens, so the last start is 56
    assert pool.open(lease(1, committed=8, limit=62), SHARD) == 13
    windows = pool.take(100)
    assert [w.start for w in windows] == list(range(8, 60, SEQ))
    pool.finish(windows, final=True)
    [only] = pool.commits()
    assert (only.start, only.end) == (8, 62)  # the 2-token tail needs no training
    assert pool.accept(only) and pool.leases == {} and pool.tokens_committed == 54


def test_commits_stop_at_a_gap_and_at_the_round_that_carries_the_windows() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    w0, w1, w2, w3 = pool.take(4)
    pool.finish([w1, w2], final=False)
    pool.finish([w0], final=False)
    assert pool.commits() == []  # trained, but no round carried them into the state yet
    mark = pool.snapshot()
    pool.finish([w3], final=False)  # trained after the round began: the next round's
    verdict = pool.round_result(facts(mark, sole=True))
    assert spans(verdict.commits) == [(0, 12)] and verdict.returned == [] and verdict.held == 0
    assert not pool.accept(verdict.commits[0])
    assert pool.round_result(facts(pool.snapshot(), sole=True)).commits[0].end == 16


def test_a_gap_holds_back_the_commits_behind_it() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    _, w1, w2, _ = pool.take(4)
    pool.finish([w1, w2], final=True)
    assert pool.commits() == []  # [0, 4) is not trained: nothing can be committed


def test_a_round_not_applied_gives_its_windows_back_to_be_trained_again() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    w0, w1, w2, w3 = pool.take(4)
    pool.finish([w0, w1], final=False)
    mark = pool.snapshot()
    pool.finish([w2], final=False)  # in the working copy after the merge: kept
    verdict = pool.round_result(facts(mark, applied=False, contributed=False))
    assert verdict.commits == [] and spans(verdict.returned) == [(0, 8)]
    assert sorted(w.start for w in pool.take(10)) == [0, 4]  # handed out again
    pool.finish([w0, w1, w3], final=False)
    assert spans(pool.round_result(facts(pool.snapshot(), sole=True)).commits) == [(0, 16)]


def test_a_contribution_the_group_left_out_is_not_committed_and_goes_back() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    pool.finish(pool.take(2), final=False)
    verdict = pool.round_result(facts(pool.snapshot(), contributed=False))  # applied, weight 0
    assert verdict.commits == [] and spans(verdict.returned) == [(0, 8)]
    assert pool.untaken == 4


S0: Link = (0, "00")  # the seeded state every replica of the stage starts from


def test_a_round_waits_until_a_group_agrees_on_its_state() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    w0, w1, w2, w3 = pool.take(4)
    pool.finish([w0, w1], final=False)
    lone = pool.round_result(facts(pool.snapshot(), chain=(S0, (1, "a1"))))
    assert lone.commits == [] and lone.returned == [] and lone.held == 1
    pool.finish([w2, w3], final=False)
    # a group whose members both held this replica's state steps on it: the round is
    # committed, even though the group weighted this round's own contribution at zero
    verdict = pool.round_result(
        facts(
            pool.snapshot(), contributed=False, chain=(S0, (1, "a1"), (2, "a2")), agreed=(1, "a1")
        )
    )
    assert spans(verdict.commits) == [(0, 8)] and spans(verdict.returned) == [(8, 16)]
    assert verdict.held == 0 and verdict.rode_in == (1, "a1")


def test_a_group_round_commits_nothing_until_the_next_group_keeps_its_state() -> None:
    """Two replicas average a round, but end it in different states of one round (the
    other stepped alone when its exchange failed). The next group keeps the other's
    state: the training this replica's group round carried is not in it and goes back."""
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    w0, w1, w2, w3 = pool.take(4)
    pool.finish([w0, w1], final=False)
    group = pool.round_result(facts(pool.snapshot(), chain=(S0, (1, "a1")), agreed=S0))
    assert group.commits == [] and group.held == 1
    pool.finish([w2, w3], final=False)
    theirs = (S0, (1, "b1"), (2, "b2"))  # both held nothing in common but the seed
    verdict = pool.round_result(facts(pool.snapshot(), adopted=True, chain=theirs))
    assert verdict.commits == [] and spans(verdict.returned) == [(0, 8)] and verdict.held == 1
    # a group that agreed on the state the other stepped to commits the round it carried
    verdict = pool.round_result(
        facts(pool.snapshot(), contributed=False, chain=(*theirs, (3, "b3")), agreed=(2, "b2"))
    )
    assert verdict.commits == [] and verdict.held == 0  # 8..16 waits for 0..8, trained again
    pool.finish(pool.take(10), final=False)
    verdict = pool.round_result(
        facts(pool.snapshot(), sole=True, chain=(*theirs, (3, "b3"), (4, "b4")))
    )
    assert spans(verdict.commits) == [(0, 16)] and verdict.rode_in == (4, "b4")


def test_an_agreed_state_this_replica_does_not_hold_commits_nothing() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    pool.finish(pool.take(2), final=False)
    assert pool.round_result(facts(pool.snapshot(), chain=(S0, (1, "a1")))).held == 1
    # the group agreed on a state this replica failed to download: its own stays
    verdict = pool.round_result(
        facts(
            pool.snapshot(),
            applied=False,
            contributed=False,
            chain=(S0, (1, "a1")),
            agreed=(1, "b1"),
        )
    )
    assert verdict.commits == [] and verdict.held == 1 and verdict.rode_in is None


def test_a_lone_round_then_an_adopted_state_gives_the_lone_rounds_ranges_back() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    w0, w1, w2, w3 = pool.take(4)
    pool.finish([w0, w1], final=False)
    assert pool.round_result(facts(pool.snapshot(), chain=(S0, (1, "a1")))).held == 1
    pool.finish([w2, w3], final=False)
    # the group's canonical state replaced this replica's: the lone step is gone from it,
    # while this round's contribution was merged by the group into the state adopted
    theirs = (S0, (1, "b1"), (2, "b2"))
    verdict = pool.round_result(
        facts(pool.snapshot(), adopted=True, chain=theirs, agreed=(1, "b1"))
    )
    assert spans(verdict.returned) == [(0, 8)] and verdict.commits == [] and verdict.held == 1
    again = pool.take(10)
    assert sorted(w.start for w in again) == [0, 4]
    pool.finish(again, final=False)
    verdict = pool.round_result(
        facts(pool.snapshot(), chain=(*theirs, (3, "b3")), agreed=(2, "b2"))
    )
    assert verdict.commits == [] and verdict.held == 1  # 8..16 is agreed; 0..8 is not yet
    verdict = pool.round_result(
        facts(
            pool.snapshot(),
            contributed=False,
            chain=(*theirs, (3, "b3"), (4, "b4")),
            agreed=(3, "b3"),
        )
    )
    assert spans(verdict.commits) == [(0, 16)] and verdict.rode_in == (3, "b3")


def two_lone_rounds() -> tuple[LeasePool, list[Window]]:
    """A pool of one 24-token lease whose first two rounds (windows 0..8, then 8..16) each
    stepped alone (states a1, then a2), held; windows 16..24 taken, not yet finished."""
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=24), SHARD)
    w = pool.take(6)
    pool.finish(w[:2], final=False)
    assert pool.round_result(facts(pool.snapshot(), chain=(S0, (1, "a1")))).held == 1
    pool.finish(w[2:4], final=False)
    assert pool.round_result(facts(pool.snapshot(), chain=(S0, (1, "a1"), (2, "a2")))).held == 2
    return pool, w


def test_lone_rounds_carried_into_a_group_round_stay_held_under_its_state() -> None:
    pool, w = two_lone_rounds()
    pool.finish(w[4:], final=False)
    # the group stepped S0, the state the lone rounds left, with this replica's whole
    # progress from it: nothing goes back, and all three rounds wait under the new state
    theirs = (S0, (1, "b1"))
    verdict = pool.round_result(facts(pool.snapshot(), adopted=True, chain=theirs, carried=True))
    assert verdict.returned == [] and verdict.commits == [] and verdict.held == 3
    verdict = pool.round_result(
        facts(pool.snapshot(), contributed=False, chain=(*theirs, (2, "b2")), agreed=(1, "b1"))
    )
    assert spans(verdict.commits) == [(0, 24)] and verdict.rode_in == (1, "b1")


def test_a_lone_round_stays_held_when_the_adopted_state_descends_from_it() -> None:
    """Two replicas out of phase: this one steps alone, the other rebases on its state and
    steps alone on top, and this one rebases on that: its lone round is in the adopted
    state's chain, so its training is there; it is held, and an agreed state commits it."""
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    w0, w1, w2, w3 = pool.take(4)
    pool.finish([w0, w1], final=False)
    assert pool.round_result(facts(pool.snapshot(), chain=((7, "07"), (8, "a8")))).held == 1
    pool.finish([w2, w3], final=False)
    theirs = ((7, "07"), (8, "a8"), (9, "b9"), (10, "b10"))
    verdict = pool.round_result(facts(pool.snapshot(), adopted=True, chain=theirs))
    assert verdict.returned == [] and verdict.commits == [] and verdict.held == 2
    pool.finish(pool.take(10), final=False)
    verdict = pool.round_result(
        facts(pool.snapshot(), chain=(*theirs, (11, "b11")), agreed=(10, "b10"))
    )
    assert spans(verdict.commits) == [(0, 16)] and verdict.held == 1


def test_a_state_taken_outside_a_round_keeps_the_held_rounds_its_chain_holds() -> None:
    """A move to the run's DHT took another replica's state: a held lone round whose
    state that chain holds (the other replica had fetched it, or stepped from it) is still
    in the state and stays held; one it does not hold goes back to be trained again."""
    pool, _ = two_lone_rounds()
    # the state taken descends from a1 (fetched from this replica then) but not from a2
    returned = pool.state_replaced((S0, (1, "a1"), (2, "c2")))
    assert spans(returned) == [(8, 16)] and pool.held == 1
    assert sorted(x.start for x in pool.take(10)) == [8, 12]  # trained again, oldest first
    assert pool.state_replaced((S0, (1, "b1"))) and pool.held == 0  # another lineage: all back


def test_rounds_commit_at_once_on_a_stage_with_one_replica() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    pool.finish(pool.take(2), final=False)
    verdict = pool.round_result(facts(pool.snapshot(), sole=True, chain=(S0, (1, "a1"))))
    assert spans(verdict.commits) == [(0, 8)] and verdict.held == 0
    assert verdict.rode_in == (1, "a1")


def test_held_rounds_commit_when_a_round_that_did_not_apply_finds_the_replica_alone() -> None:
    # the last replica of a drain: its groupmate left before agreeing on its last
    # contribution, and the round after (nothing to step) finds no one
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    pool.finish(pool.take(2), final=False)
    held = pool.round_result(facts(pool.snapshot(), chain=(S0, (1, "a1")), agreed=S0))
    assert held.commits == [] and held.held == 1
    lone = facts(pool.snapshot(), applied=False, contributed=False, chain=(S0, (1, "a1")))
    assert pool.round_result(lone).commits == []  # not alone on the stage: still held
    verdict = pool.round_result(
        facts(pool.snapshot(), applied=False, contributed=False, sole=True,
              chain=(S0, (1, "a1")))
    )  # fmt: skip
    assert spans(verdict.commits) == [(0, 8)] and verdict.held == 0
    assert verdict.rode_in == (1, "a1")


def test_a_round_without_a_result_hands_its_windows_to_the_next_round() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    pool.finish(pool.take(2), final=False)
    failed = pool.snapshot()  # no result ever comes back for it
    mark = pool.snapshot()
    with pytest.raises(ValueError, match="not the round in flight"):
        pool.round_result(facts(failed))
    assert spans(pool.round_result(facts(mark, sole=True)).commits) == [(0, 8)]


def test_fenced_lease_loses_its_windows_and_commits() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=4)
    pool.open(lease(1, limit=16), SHARD)
    pool.open(lease(2, shard_id=0, limit=16), SHARD)
    taken = pool.take(1)  # lease 1's first window is in flight
    rng = CommitRange(lease(1, limit=16), 0, 4)
    assert pool.fence(1) and pool.is_fenced(1)
    pool.finish(taken, final=True)  # the in-flight window returns: ignored
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


def test_a_full_pool_has_room_for_freed_ranges_up_to_twice_its_size() -> None:
    pool = LeasePool(seq_len=SEQ, max_open=2, shard_cache=8)
    for i in range(2):
        pool.open(lease(i + 1, shard_id=i, limit=8), SHARD)
    assert not pool.wants_lease() and pool.room_for_freed()
    pool.open(lease(3, shard_id=2, limit=8), SHARD)
    assert pool.room_for_freed()
    pool.open(lease(4, shard_id=3, limit=8), SHARD)
    assert not pool.room_for_freed()  # 4 open leases: a freed range waits for room
    pool.take(4)  # in lease order: leases 1 and 2 have nothing left to hand out
    assert pool.room_for_freed() and not pool.wants_lease()


# a round's outcome -> (applied, contributed, adopted, sole)
OUTCOMES = {
    "failed": (False, False, False, False),  # no result came back
    "not_applied": (False, False, False, False),
    "rejected": (True, False, False, False),
    "stepped": (True, True, False, False),  # alone or by a group: the state is its own
    "sole": (True, True, False, True),
    "adopted": (True, True, True, False),
    "adopted_rejected": (True, False, True, False),
}


class PoolMachine(RuleBasedStateMachine):
    """The pool against the history: per lease, the trained windows (with the round that
    carried each) and the committed offset; in flight, windows handed out and not yet
    finished; the chain of the state held; every round's result. A commit must only
    cover windows whose round reached a state the stage agreed on by the history; a
    window that went back must not have."""

    @initialize()
    def setup(self) -> None:
        self.pool = LeasePool(seq_len=SEQ, max_open=3, shard_cache=4)
        self.next_id = 1
        self.in_flight: list[Window] = []
        self.trained: dict[int, dict[int, int]] = {}  # lease -> start -> carrying round
        self.committed: dict[int, int] = {}
        self.opened_at: dict[int, int] = {}
        self.limits: dict[int, int] = {}
        self.fenced: set[int] = set()
        self.handed: set[tuple[int, int]] = set()
        self.round = 0  # rounds begun: windows trained now ride in round `self.round`
        self.results: dict[int, RoundFacts] = {}
        self.chain: tuple[Link, ...] = ((0, "00"),)  # the state held, last
        # states taken outside a round: rounds begun before it -> the chain taken
        self.replaced: dict[int, list[tuple[Link, ...]]] = {}

    @rule(committed=st.integers(0, 6), length=st.integers(1, 10))
    def open(self, committed: int, length: int) -> None:
        start, limit = committed * SEQ, min(64, committed * SEQ + length * SEQ)
        le = lease(self.next_id, committed=start, limit=limit)
        self.pool.open(le, SHARD)
        self.trained[le.lease_id] = {}
        self.committed[le.lease_id] = start
        self.opened_at[le.lease_id] = start
        self.limits[le.lease_id] = limit
        self.next_id += 1

    @rule(n=st.integers(1, 5), seed=st.integers(-1, 3))
    def take(self, n: int, seed: int) -> None:
        got = self.pool.take(n, random.Random(seed) if seed >= 0 else None)
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
        self.pool.finish([w], final=False)
        if w.lease.lease_id not in self.fenced:
            self.trained[w.lease.lease_id][w.start] = self.round

    def reached(self, gen: int) -> bool:
        """Round `gen`'s training is in a state the stage agreed on, by the history: it
        contributed, and a later round's agreed state (in the chain then held) descends
        from the state round `gen` made, or an applied round as the only replica holds
        it, with no adopted state in between that dropped it."""
        first = self.results.get(gen)
        if first is None or not first.contributed:
            return False
        made = (first.round, first.digest)
        for r in range(gen, self.round):
            f = self.results.get(r)
            if f is not None:
                if made not in f.lineage:
                    return False  # an adopted state does not descend from round gen's
                if f.applied and f.sole:
                    return True
                agreed = f.agreed
                if agreed in f.lineage and made in f.lineage[: f.lineage.index(agreed) + 1]:
                    return True
            if any(made not in chain for chain in self.replaced.get(r + 1, [])):
                return False  # a state taken after round r does not hold it
        return False

    @rule(
        outcome=st.sampled_from(sorted(OUTCOMES)),
        descends=st.booleans(),
        agreed=st.integers(-1, 4),
    )
    def outer_round(self, outcome: str, descends: bool, agreed: int) -> None:
        """One round's result; an adopted state `descends` from the state held (another
        replica stepped on top of it) or not. `agreed` picks the group's agreed state: one
        of the chain's states held as the round began (counting back from the newest), a
        state this replica never held, or none (-1)."""
        applied, contributed, adopted, sole = OUTCOMES[outcome]
        mark = self.pool.snapshot()
        if outcome == "failed":  # its windows ride in the next round
            for trained in self.trained.values():
                for s, g in trained.items():
                    if g == self.round:
                        trained[s] = self.round + 1
            self.round += 1
            return
        self.round += 1
        before = self.chain
        if adopted:
            theirs: Link = (self.round, f"b{self.round:x}")
            self.chain = (*before, theirs) if descends else ((self.round - 1, "ee"), theirs)
        elif applied:
            self.chain = (*before, (self.round, f"{self.round:x}"))
        began = self.chain[:-1] if self.chain != before else self.chain
        pick = None if agreed < 0 else began[-1 - agreed] if agreed < len(began) else (0, "ff")
        f = facts(
            mark, applied=applied, contributed=contributed, adopted=adopted, sole=sole,
            chain=self.chain, agreed=pick,
        )  # fmt: skip
        self.results[mark.gen] = f
        verdict = self.pool.round_result(f)
        for rng in verdict.returned:
            lid = rng.lease.lease_id
            for s in range(rng.start, rng.end, SEQ):
                assert not self.reached(self.trained[lid][s]), (lid, s, rng)
                del self.trained[lid][s]
                self.handed.discard((lid, s))  # it may be handed out again

    @rule(keep=st.integers(0, 5))
    def take_state(self, keep: int) -> None:
        """The outer loop moved and took another replica's state outside a round: one
        that descends from the chain held less its newest `keep` states, or (past the
        chain's length) one of another lineage."""
        n = sum(len(c) for c in self.replaced.values())
        base = self.chain[: len(self.chain) - keep] if keep < len(self.chain) else ((0, "dd"),)
        self.chain = (*base, (base[-1][0] + 1, f"c{n:x}"))
        self.replaced.setdefault(self.round, []).append(self.chain)
        for rng in self.pool.state_replaced(self.chain):
            lid = rng.lease.lease_id
            for s in range(rng.start, rng.end, SEQ):
                assert not self.reached(self.trained[lid][s]), (lid, s, rng)
                del self.trained[lid][s]
                self.handed.discard((lid, s))

    @rule()
    def commit(self) -> None:
        for rng in self.pool.commits():
            lid = rng.lease.lease_id
            assert lid not in self.fenced
            assert rng.start == self.committed[lid] < rng.end
            # every window in [start, end) reached the state (the tail past the last
            # window needs no training)
            for s in range(rng.start, rng.end, SEQ):
                if s + SEQ + 1 <= len(SHARD):
                    assert s in self.trained[lid], (lid, s, rng)
                    assert self.reached(self.trained[lid][s]), (lid, s, rng)
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


PoolMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)
test_lease_pool_state_machine = PoolMachine.TestCase
