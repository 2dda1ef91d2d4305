"""The DARL lease state machine: unit tests and a hypothesis state-machine test that runs
random acquire / heartbeat / commit / release / expire / restart / crash sequences with time
jumps against a real SQLite store and checks the invariants after every step: among them,
that a heartbeat writes nothing (renewals are soft state) and that every lease live at a
restart survives it for the grace period."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from coordinator_harness import CountingStore
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from coordinator.audit import replay
from coordinator.journal import Journal
from coordinator.leases import (
    ACTIVE,
    DONE,
    LEASED,
    RELEASED,
    LeaseBook,
    LeaseError,
    Shard,
    restore_book,
)
from coordinator.reconcile import check_leases
from coordinator.store import read_audit, read_shard_sizes

TTL = 10.0


def _book(sizes: list[int]) -> LeaseBook:
    return LeaseBook(
        [Shard(shard_id=i, tokens=n) for i, n in enumerate(sizes)], journal=Journal(), ttl_s=TTL
    )


def test_grant_commit_complete_and_rollover() -> None:
    book = _book([10, 5])
    a, _ = book.acquire("a", 0.0)
    b, _ = book.acquire("b", 0.0)
    assert a is not None and b is not None and a.shard_id != b.shard_id
    assert book.acquire("c", 0.0) == (None, "no_shards")
    book.commit("a", a.lease_id, a.epoch, 0, 4, 1.0)
    lease, done = book.commit("a", a.lease_id, a.epoch, 4, a.limit, 1.0)
    assert done and lease.state == "complete"
    # a retry of the final commit is acknowledged again, not double counted
    assert book.commit("a", a.lease_id, a.epoch, 4, a.limit, 1.5)[1]
    assert book.data_epoch == 0
    book.commit("b", b.lease_id, b.epoch, 0, b.limit, 2.0)
    assert book.data_epoch == 1 and book.counts()["pending"] == 2


def test_shards_in_a_seeded_order_and_small_grants_in_round_robin() -> None:
    """Each data epoch visits the shards in an order seeded by (run seed, epoch); a shard
    whose granted range is done waits behind the others for its next range, while an
    expired or released one resumes first."""

    def grants(seed: int) -> list[tuple[int, int]]:
        book = LeaseBook(
            [Shard(shard_id=i, tokens=20) for i in range(6)],
            journal=Journal(), ttl_s=TTL, order_seed=seed,
        )  # fmt: skip
        out = []
        for t in range(12):
            lease, _ = book.acquire("a", float(t), max_tokens=10)
            assert lease is not None
            out.append((lease.shard_id, lease.committed))
            book.commit("a", lease.lease_id, lease.epoch, lease.committed, lease.limit, float(t))
        return out

    first = grants(0)
    order = [shard for shard, _ in first[:6]]
    assert sorted(order) == list(range(6)) and order != list(range(6))
    assert first[6:] == [(shard, 10) for shard in order]  # round robin: second halves
    assert grants(0) == first and grants(1) != first  # reproducible, seeded

    book = LeaseBook([Shard(shard_id=i, tokens=20) for i in range(3)], journal=Journal(), ttl_s=TTL)
    a, _ = book.acquire("a", 0.0, max_tokens=10)
    assert a is not None
    book.release("a", a.lease_id, a.epoch, 1.0)
    again, _ = book.acquire("b", 2.0, max_tokens=10)
    assert again is not None and again.shard_id == a.shard_id  # a released shard first


def test_commit_must_start_at_committed_offset_and_stay_in_range() -> None:
    book = _book([10])
    a, _ = book.acquire("a", 0.0)
    assert a is not None
    with pytest.raises(LeaseError) as err:
        book.commit("a", a.lease_id, a.epoch, 1, 3, 0.0)
    assert err.value.code == "conflict"
    with pytest.raises(LeaseError):
        book.commit("a", a.lease_id, a.epoch, 0, 11, 0.0)
    with pytest.raises(LeaseError):
        book.commit("a", a.lease_id, a.epoch, 0, 0, 0.0)


def test_expired_lease_is_fenced_and_requeued_with_higher_epoch() -> None:
    book = _book([10])
    a, _ = book.acquire("a", 0.0)
    assert a is not None
    book.commit("a", a.lease_id, a.epoch, 0, 3, 1.0)
    assert book.expire_due(TTL + 0.5) == [a]
    b, _ = book.acquire("b", TTL + 1)
    assert b is not None and b.shard_id == a.shard_id and b.epoch > a.epoch
    assert b.committed == 3
    with pytest.raises(LeaseError) as err:
        book.commit("a", a.lease_id, a.epoch, 3, 5, TTL + 2)
    assert err.value.code == "fenced" and "fenced" in err.value.detail
    assert any(e.kind == "fence" for e in book.journal.audit)


def test_a_commit_off_the_attested_lineage_ends_the_lease_and_requeues_its_range() -> None:
    """A commit the coordinator refuses for the state it rode in (`refuse_commit`): the
    call is fenced, on the record, the lease is released at its committed offset, and
    the next grant of the shard starts there; the lease's life still adds up."""
    book = _book([10])
    a, _ = book.acquire("a", 0.0)
    assert a is not None
    book.commit("a", a.lease_id, a.epoch, 0, 3, 1.0)
    with pytest.raises(LeaseError) as err:
        book.refuse_commit("a", a.lease_id, a.epoch, 3, 6, 2.0, "round 4 is 44")
    assert err.value.code == "fenced" and err.value.recorded and "round 4 is 44" in err.value.detail
    assert a.state == RELEASED and a.committed == 3
    b, _ = book.acquire("b", 3.0)
    assert b is not None and b.shard_id == a.shard_id and b.committed == 3 and b.epoch > a.epoch
    with pytest.raises(LeaseError):  # the old holder's next call on it is fenced too
        book.commit("a", a.lease_id, a.epoch, 3, 6, 4.0)
    book.commit("b", b.lease_id, b.epoch, 3, 10, 5.0)
    events = book.journal.audit
    assert [e.kind for e in events if e.lease_id == a.lease_id] == [
        "grant", "commit", "release", "fence"
    ]  # fmt: skip
    assert check_leases(events, set()) == []
    assert all(r.clean for r in replay(events, {0: 10}))
    with pytest.raises(LeaseError) as err:
        book.refuse_commit("a", 99, 0, 0, 1, 6.0, "no such lease")
    assert err.value.code == "not_found"


def test_a_freed_range_is_counted_until_granted_and_freed_only_asks_take_just_those() -> None:
    book = _book([10, 10, 10])
    a, _ = book.acquire("a", 0.0)
    b, _ = book.acquire("b", 0.0)
    assert a is not None and b is not None
    book.commit("a", a.lease_id, a.epoch, 0, 3, 1.0)
    assert book.freed_waiting() == 0
    assert book.acquire("c", 1.0, freed_only=True) == (None, "no_freed")
    book.renew("b", TTL)
    assert book.expire_due(TTL + 0.5) == [a]  # a's holder died; b's heartbeat kept b
    book.release("b", b.lease_id, b.epoch, TTL + 0.6)
    assert book.freed_waiting() == 2
    # the oldest freed range first, from its committed offset, at a higher epoch
    c, _ = book.acquire("c", TTL + 1, freed_only=True)
    assert c is not None and (c.shard_id, c.committed, c.limit) == (a.shard_id, 3, 10)
    assert c.epoch > a.epoch and book.freed_waiting() == 1
    d, _ = book.acquire("d", TTL + 1)  # an ordinary ask takes a freed range first too
    assert d is not None and d.shard_id == b.shard_id and book.freed_waiting() == 0
    assert book.acquire("e", TTL + 1, freed_only=True) == (None, "no_freed")
    e, _ = book.acquire("e", TTL + 1)  # the untouched shard is still there for a plain ask
    assert e is not None and e.shard_id not in (a.shard_id, b.shard_id)


def test_heartbeat_renewal_keeps_lease_alive() -> None:
    book = _book([10])
    a, _ = book.acquire("a", 0.0)
    assert a is not None
    for t in range(1, 50):
        book.renew("a", float(t))
        assert book.expire_due(float(t)) == []
    assert a.state == ACTIVE


def test_deadline_budget_grants_a_shorter_range_or_nothing() -> None:
    book = _book([100])
    assert book.acquire("a", 0.0, budget_tokens=5, min_tokens=10) == (None, "deadline")
    a, _ = book.acquire("a", 0.0, budget_tokens=40, min_tokens=10)
    assert a is not None and a.limit == 40
    _, done = book.commit("a", a.lease_id, a.epoch, 0, 40, 1.0)
    assert not done and book.shards[0].state == "pending"
    b, _ = book.acquire("b", 1.0)
    assert b is not None and (b.committed, b.limit) == (40, 100)


def test_a_replica_holding_its_share_leaves_the_rest_to_the_others() -> None:
    book = _book([4] * 6)  # 6 shards, 2 stage-0 replicas: a share of 3 each

    def take(holder: str) -> list[int]:
        got = []
        while not book.over_share(holder, 2):
            lease, _ = book.acquire(holder, 0.0)
            if lease is None:
                break
            got.append(lease.shard_id)
        return got

    assert len(take("a")) == 3 and book.over_share("a", 2)
    assert not book.over_share("a", 1)  # alone on the stage, it may take every shard
    assert len(take("b")) == 3
    # A done shard shrinks the shares: 5 open, 3 each; a holds 2 after its commit.
    lease = book.holder_leases("a")[0]
    book.commit("a", lease.lease_id, lease.epoch, 0, 4, 1.0)
    assert book.counts()[DONE] == 1 and not book.over_share("a", 2)


class LeaseMachine(RuleBasedStateMachine):
    """Random operations against a LeaseBook backed by a real SQLite file."""

    holders = ("a", "b", "c")

    @initialize(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5))
    def setup(self, sizes: list[int]) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.db = Path(self.dir.name) / "c.sqlite"
        self.store = CountingStore(self.db)
        self.now = 1000.0
        self.book = _book(sizes)
        for s in self.book.shards.values():
            self.book.journal.shards[s.shard_id] = s
        self.flush()
        self.acked: dict[tuple[int, int], int] = defaultdict(int)  # (epoch, shard) -> offset
        self.acked_epoch = 0

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            self.dir.cleanup()

    def flush(self) -> None:
        batch = self.book.journal.take()
        if len(batch):
            self.store.write(batch)

    def _durable(self, fn, *args):  # type: ignore[no-untyped-def]
        """Run an op; its effects count as acknowledged only once written."""
        try:
            out = fn(*args)
        except LeaseError as exc:
            assert exc.code in ("fenced", "conflict", "not_found")
            out = None
        self.flush()
        reports = replay(read_audit(self.db), read_shard_sizes(self.db))
        assert all(r.clean for r in reports), reports
        self.acked_epoch = self.book.data_epoch
        for sid, s in self.book.shards.items():
            self.acked[(self.book.data_epoch, sid)] = s.committed
        return out

    @rule(holder=st.sampled_from(holders), cap=st.none() | st.integers(1, 30))
    def acquire(self, holder: str, cap: int | None) -> None:
        self._durable(lambda: self.book.acquire(holder, self.now, max_tokens=cap))

    @rule(holder=st.sampled_from(holders))
    def heartbeat(self, holder: str) -> None:
        writes = self.store.writes
        renewed = self._durable(self.book.renew, holder, self.now)
        assert self.store.writes == writes  # a renewal is soft state: nothing is written
        assert all(x.expires_at == self.now + TTL for x in renewed)

    @rule(
        impostor=st.sampled_from((None, *holders)),
        pick=st.integers(0, 50),
        size=st.integers(1, 30),
        skew=st.integers(-2, 2),
        stale=st.booleans(),
    )
    def commit(self, impostor: str | None, pick: int, size: int, skew: int, stale: bool) -> None:
        if not self.book.active:
            self._durable(lambda: self.book.acquire(impostor or "a", self.now))
        leases = list(self.book.active.values() if pick % 4 else self.book.leases.values())
        if not leases:
            return
        lease = leases[pick % len(leases)]
        holder = impostor or lease.holder
        start = max(0, lease.committed + (skew if stale else 0))
        end = min(lease.limit, start + size) if not stale else start + size
        before = self.book.shards[lease.shard_id].committed
        epoch = self.book.data_epoch
        self._durable(self.book.commit, holder, lease.lease_id, lease.epoch, start, end, self.now)
        after = self.book.shards[lease.shard_id].committed
        assert after >= before or self.book.data_epoch == epoch + 1  # only a rollover resets

    @rule(
        impostor=st.sampled_from((None, *holders)), pick=st.integers(0, 50), size=st.integers(1, 30)
    )
    def commit_off_lineage(self, impostor: str | None, pick: int, size: int) -> None:
        """A commit refused for the state it rode in: its holder's lease ends at its
        committed offset; an impostor's call ends nothing. The lease log adds up."""
        leases = list(self.book.leases.values())
        if not leases:
            return
        lease = leases[pick % len(leases)]
        holder, was = impostor or lease.holder, (lease.state, lease.committed)
        self._durable(
            self.book.refuse_commit, holder, lease.lease_id, lease.epoch, lease.committed,
            lease.committed + size, self.now, "off the attested lineage",
        )  # fmt: skip
        if holder != lease.holder or was[0] != ACTIVE:
            assert (lease.state, lease.committed) == was
        else:
            assert lease.state == RELEASED and lease.committed == was[1]
        assert check_leases(read_audit(self.db), set(self.book.active)) == []

    @rule(holder=st.sampled_from(holders), pick=st.integers(0, 50))
    def release(self, holder: str, pick: int) -> None:
        leases = list(self.book.active.values())
        if leases:
            lease = leases[pick % len(leases)]
            self._durable(self.book.release, holder, lease.lease_id, lease.epoch, self.now)

    @rule(dt=st.floats(0.0, 3 * TTL))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._durable(self.book.expire_due, self.now)

    @rule(crash=st.booleans(), holder=st.sampled_from(holders))
    def restart(self, crash: bool, holder: str) -> None:
        """Restart from the store; a crash first applies an op whose write never lands.
        Every lease live before it (renewed in memory only) survives one TTL of grace."""
        live = {x.lease_id for x in self.book.active.values() if x.expires_at > self.now}
        if crash:
            lease, _ = self.book.acquire(holder, self.now)
            if lease is not None and lease.limit > lease.committed:
                self.book.commit(
                    holder, lease.lease_id, lease.epoch, lease.committed, lease.limit, self.now
                )
            self.book.journal.drop()
        else:
            self.flush()
        snap = self.store.load()
        self.book = restore_book(
            snap.shards, snap.leases, snap.meta, journal=Journal(), ttl_s=TTL,
            grace_until=self.now + TTL,
        )  # fmt: skip
        self._durable(self.book.expire_due, self.now)
        assert live <= set(self.book.active)
        assert all(x.expires_at >= self.now + TTL for x in self.book.active.values())

    @rule()
    def drain(self) -> None:
        """Finish the data epoch with a fresh holder; the audit must then be exact."""
        epoch = self.book.data_epoch
        while self.book.data_epoch == epoch:
            self.now += 2 * TTL
            self.book.expire_due(self.now)
            lease, reason = self.book.acquire("drainer", self.now)
            assert lease is not None, reason
            self.book.commit(
                "drainer", lease.lease_id, lease.epoch, lease.committed, lease.limit, self.now
            )
            self.flush()
        reports = replay(read_audit(self.db), read_shard_sizes(self.db))
        done = [r for r in reports if r.complete]
        assert done and all(r.clean for r in reports), reports
        sizes = sum(s.tokens for s in self.book.shards.values())
        assert all(r.committed_tokens == sizes for r in done)
        self._durable(lambda: None)

    @invariant()
    def refused_only_at_a_full_share(self) -> None:
        if not hasattr(self, "book"):
            return
        open_ = len(self.book.shards) - self.book.counts()[DONE]
        for h in self.holders:
            if self.book.over_share(h, len(self.holders)):
                assert len(self.book.holder_leases(h)) >= -(-open_ // len(self.holders))

    @invariant()
    def one_live_holder_per_shard(self) -> None:
        if not hasattr(self, "book"):
            return
        per_shard: dict[int, int] = defaultdict(int)
        for lease in self.book.active.values():
            assert lease.state == ACTIVE
            per_shard[lease.shard_id] += 1
        for sid, s in self.book.shards.items():
            assert per_shard[sid] <= 1
            assert (s.state == LEASED) == (per_shard[sid] == 1)
            assert 0 <= s.committed <= s.tokens
            if s.state == DONE:
                assert s.committed == s.tokens

    @invariant()
    def acknowledged_commits_survive(self) -> None:
        if not hasattr(self, "book"):
            return
        if self.book.data_epoch != self.acked_epoch:
            return
        for sid, s in self.book.shards.items():
            assert s.committed >= self.acked[(self.book.data_epoch, sid)]


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_audit_replay_is_clean_for_a_live_log_and_flags_overlaps() -> None:
    from coordinator.journal import AuditEvent

    ev = [
        AuditEvent(0, 0, "commit", 0, 1, "a", 1, 0, 5),
        AuditEvent(0, 0, "commit", 0, 1, "a", 1, 5, 8),
    ]
    (r,) = replay(ev, {0: 10})
    assert r.clean and r.committed_tokens == 8 and not r.complete
    ev.append(AuditEvent(0, 0, "commit", 0, 2, "b", 2, 6, 10))
    (r,) = replay(ev, {0: 10})
    assert r.duplicated == [(0, 6, 8)]
    ev2 = [
        AuditEvent(0, 0, "commit", 0, 1, "a", 1, 0, 5),
        AuditEvent(0, 1, "epoch", -1, 0, "", 0, 0, 10),
    ]
    reports = replay(ev2, {0: 10})
    assert reports[0].complete and reports[0].lost == [(0, 5, 10)]
