"""DARL data leases: the pure state machine. No I/O, no clock.

A lease is (lease id, shard, holder, fencing epoch, expiry, committed offset) plus the
`limit` of the granted range. Rules:

- A shard has at most one active lease. Granting takes the shard's next fencing epoch.
- Heartbeats renew every active lease of the holder (`renew`): soft state. A renewal
  moves the expiry in memory only and journals nothing, so a heartbeat costs no durable
  write; a lease's stored expiry is the one its row had when last written (grant,
  commit, end). A restarted book therefore does not trust stored expiries: every lease
  active in the stored rows gets `grace_until` (`restore_book`; the coordinator passes
  its restart time plus one TTL), so a holder that kept heartbeating keeps its lease,
  and a dead holder's lease expires one TTL after the restart. Expiry only ever ends a
  lease at its committed offset, so neither a late nor an early expiry can break
  exactly-once; grants, commits, ends and fences stay durable.
- A lease past its expiry is expired (`expire_due`): the shard returns to the front of
  the queue at its committed offset; the next grant carries a higher epoch. The old
  holder's commits are refused with `LeaseError("fenced")` (and audited as `fence`).
- A range an expired or released lease left is *freed*: `freed_waiting()` counts those
  not granted again, and `acquire(freed_only=True)` grants only one of them (reason
  "no_freed" otherwise), so the coordinator can tell stage-0 nodes in the heartbeat reply
  and a node with a full pool can take one at once. Held in memory only: after a
  restart such shards are ordinary resumed shards at the front of the queue.
- `commit(start, end)` requires `start == committed` and `end <= limit`, so commits are
  monotonic and never overlap. Committing up to `limit` completes the lease; when the
  limit is the shard end the shard is done, otherwise it is re-queued at the offset.
- When every shard is done the data epoch advances and all shards start over.

Every mutation but a renewal is recorded in the `Journal` (rows + audit events) for the
store.
docs/data-path.md shows where leases sit between the manifest, commit points and audit.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Iterable
from typing import Any, NoReturn

from coordinator.journal import AuditEvent, Journal

ACTIVE, COMPLETE, RELEASED, EXPIRED = "active", "complete", "released", "expired"
PENDING, LEASED, DONE = "pending", "leased", "done"
RECENT_LEASES = 100_000  # finished leases kept in memory for idempotent retries
Lineage = tuple[int, int, str]  # (stage, outer round, state digest) a commit rode in
NO_LINEAGE: Lineage = (-1, -1, "")


class LeaseError(Exception):
    """A refused lease call; `code` is a protocol error code (fenced, conflict, ...)."""

    def __init__(self, code: str, detail: str, *, recorded: bool = False) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.recorded = recorded  # the refusal was put on the audit record (a `fence` row)


@dataclasses.dataclass(slots=True)
class Shard:
    shard_id: int
    tokens: int  # tokens in the shard
    committed: int = 0  # tokens committed in the current data epoch
    epoch: int = 0  # highest fencing epoch granted so far (never decreases)
    state: str = PENDING  # pending | leased | done
    lease_id: int = 0  # the active lease, 0 when none

    def row(self) -> tuple[Any, ...]:
        return (self.shard_id, self.tokens, self.committed, self.epoch, self.state, self.lease_id)


@dataclasses.dataclass(slots=True)
class Lease:
    lease_id: int
    shard_id: int
    holder: str  # peer id
    epoch: int  # fencing epoch
    data_epoch: int
    committed: int  # shard offset committed so far
    limit: int  # end of the granted range
    shard_tokens: int
    expires_at: float  # unix seconds; renewals move it in memory only (soft state)
    state: str = ACTIVE
    last_start: int = -1  # start of the last accepted commit (for idempotent retries)
    fence_recorded: bool = False  # not persisted: a refused call of its holder is audited

    def row(self) -> tuple[Any, ...]:
        return (
            self.lease_id,
            self.shard_id,
            self.holder,
            self.epoch,
            self.data_epoch,
            self.committed,
            self.limit,
            self.shard_tokens,
            self.expires_at,
            self.state,
            self.last_start,
        )

    @classmethod
    def from_row(cls, r: Iterable[Any]) -> Lease:
        return cls(*r)


class LeaseBook:
    def __init__(
        self,
        shards: Iterable[Shard],
        *,
        journal: Journal,
        ttl_s: float,
        data_epoch: int = 0,
        next_lease_id: int = 1,
        leases: Iterable[Lease] = (),
        order_seed: int = 0,
    ) -> None:
        self.journal = journal
        self.order_seed = order_seed  # seeds each data epoch's shard order
        self.ttl_s = ttl_s  # seconds
        self.data_epoch = data_epoch
        self.next_lease_id = next_lease_id
        self.shards: dict[int, Shard] = {s.shard_id: s for s in shards}
        if not self.shards:
            raise ValueError("a lease book needs at least one shard")
        self.leases: collections.OrderedDict[int, Lease] = collections.OrderedDict()
        self.active: dict[int, Lease] = {}
        self.by_holder: dict[str, dict[int, Lease]] = {}
        for lease in sorted(leases, key=lambda x: x.lease_id):
            self.leases[lease.lease_id] = lease
            if lease.state == ACTIVE:
                self._index(lease)
        self.epoch_tokens = sum(s.tokens for s in self.shards.values())
        self._done = sum(s.state == DONE for s in self.shards.values())  # shards, this epoch
        self._queue: collections.deque[int] = collections.deque()
        # shards an expired or released lease left pending, oldest first (not persisted)
        self._freed: dict[int, None] = {}
        self._rebuild_queue()
        self.fenced_total = 0  # refused stale calls since start

    # -- queries ------------------------------------------------------------------------

    def committed_tokens(self) -> int:
        return sum(s.committed for s in self.shards.values())

    def counts(self) -> dict[str, int]:
        out = {PENDING: 0, LEASED: 0, DONE: 0}
        for s in self.shards.values():
            out[s.state] += 1
        return out

    def holder_leases(self, holder: str) -> list[Lease]:
        return list(self.by_holder.get(holder, {}).values())

    def over_share(self, holder: str, drawers: int) -> bool:
        """Whether another lease for `holder`, one of `drawers` replicas that draw on the
        book (stage 0), would take a shard a replica holding fewer needs: it holds its
        share of the shards not done, ceil(open / drawers), and the pending shards are no
        more than the other replicas' shares lack. Without it the first replica of a
        corpus of few shards leases them all (its pool keeps `lease_pool` open plus the
        finished ones awaiting their round) and its groupmates idle."""
        if drawers < 2:
            return False
        open_ = len(self.shards) - self._done
        share = -(-open_ // drawers)
        mine = len(self.by_holder.get(holder, {}))
        if mine < share:
            return False
        lack = (drawers - 1) * share - (len(self.active) - mine)
        return 0 < open_ - len(self.active) <= lack  # none pending: acquire says so

    def freed_waiting(self) -> int:
        """Freed ranges (of expired or released leases) not yet granted again."""
        return len(self._freed)

    # -- operations ---------------------------------------------------------------------

    def acquire(
        self,
        holder: str,
        now: float,
        *,
        max_tokens: int | None = None,
        budget_tokens: int | None = None,
        min_tokens: int = 1,
        freed_only: bool = False,
    ) -> tuple[Lease | None, str]:
        """Grant the next queued shard (resumed shards first); with `freed_only`, the
        oldest freed range or nothing (reason "no_freed"). `budget_tokens` caps the
        range at what the holder can finish before its deadline; below `min_tokens`
        nothing is granted (reason "deadline")."""
        cap = max_tokens
        if budget_tokens is not None:
            if budget_tokens < min_tokens:
                return None, "deadline"
            cap = budget_tokens if cap is None else min(cap, budget_tokens)
        if freed_only:
            shard = self._next_freed()
            if shard is None:
                return None, "no_freed"
        else:
            shard = self._next_pending()
        if shard is None:
            return None, "no_shards"
        self._freed.pop(shard.shard_id, None)
        remaining = shard.tokens - shard.committed
        limit = shard.committed + (remaining if cap is None else min(remaining, cap))
        shard.epoch += 1
        lease = Lease(
            lease_id=self.next_lease_id,
            shard_id=shard.shard_id,
            holder=holder,
            epoch=shard.epoch,
            data_epoch=self.data_epoch,
            committed=shard.committed,
            limit=limit,
            shard_tokens=shard.tokens,
            expires_at=now + self.ttl_s,
        )
        self.next_lease_id += 1
        self.journal.meta["next_lease_id"] = str(self.next_lease_id)
        shard.state, shard.lease_id = LEASED, lease.lease_id
        self._remember(lease)
        self._index(lease)
        self._touch(shard, lease)
        self._audit(now, "grant", lease, lease.committed, limit)
        return lease, ""

    def renew(self, holder: str, now: float) -> list[Lease]:
        """Extend every active lease of `holder` to now + TTL, in memory only (nothing is
        journaled: see the module docstring)."""
        held = self.by_holder.get(holder)
        if not held:
            return []
        expires_at = now + self.ttl_s
        for lease in held.values():
            lease.expires_at = expires_at
        return list(held.values())

    def lookup(self, holder: str, lease_id: int, epoch: int) -> Lease | None:
        """The holder's active lease with this id and epoch, or None if fenced/unknown."""
        lease = self.active.get(lease_id)
        if lease is None or lease.holder != holder or lease.epoch != epoch:
            return None
        return lease

    def commit(
        self,
        holder: str,
        lease_id: int,
        epoch: int,
        start: int,
        end: int,
        now: float,
        lineage: Lineage = NO_LINEAGE,
    ) -> tuple[Lease, bool]:
        """Commit `[start, end)`; returns (lease, shard_done). `lineage` is recorded with
        the commit (or with its fence, when refused)."""
        lease = self._owned(
            holder, lease_id, epoch, now, start, end, allow_complete=True, lineage=lineage
        )
        if start == lease.last_start and end == lease.committed:  # a retry of the last commit
            return lease, lease.state == COMPLETE and lease.limit == lease.shard_tokens
        if lease.state == COMPLETE:
            raise LeaseError("conflict", f"lease {lease_id} is already complete")
        if start != lease.committed:
            raise LeaseError(
                "conflict",
                f"commit must start at the committed offset {lease.committed}, not {start}",
            )
        if not start < end <= lease.limit:
            raise LeaseError(
                "conflict", f"commit end {end} outside ({start}, {lease.limit}] of lease {lease_id}"
            )
        shard = self.shards[lease.shard_id]
        lease.committed = shard.committed = end
        lease.last_start = start
        self._touch(shard, lease)
        self._audit(now, "commit", lease, start, end, lineage)
        if end < lease.limit:
            return lease, False
        return lease, self._finish(lease, shard, now)

    def refuse_commit(
        self, holder: str, lease_id: int, epoch: int, start: int, end: int, now: float, why: str
    ) -> NoReturn:
        """Refuse a commit of the holder's own lease whose range rode in no canonical state
        of its stage (`coordinator.attest`): the lease ends, released at its committed
        offset, so the range goes back to the queue to be trained on the stage's lineage,
        and the call is refused as fenced, on the record. The fence names no lineage: the
        range's training reached no state the stage holds, so it is not trained twice."""
        lease = self._owned(holder, lease_id, epoch, now, start, end, allow_complete=True)
        if lease.state == ACTIVE:
            self._end(lease, RELEASED, now)
        self._fence(holder, lease_id, epoch, now, start, end, why)
        raise AssertionError("unreachable")

    def complete(self, holder: str, lease_id: int, epoch: int, now: float) -> tuple[Lease, bool]:
        lease = self._owned(holder, lease_id, epoch, now, 0, 0, allow_complete=True)
        if lease.state != COMPLETE:
            raise LeaseError(
                "conflict",
                f"lease {lease_id} has {lease.limit - lease.committed} uncommitted tokens",
            )
        return lease, lease.limit == lease.shard_tokens

    def release(self, holder: str, lease_id: int, epoch: int, now: float) -> Lease:
        lease = self._owned(holder, lease_id, epoch, now, 0, 0, allow_complete=True)
        if lease.state == COMPLETE:
            return lease
        self._end(lease, RELEASED, now)
        return lease

    def release_holder(self, holder: str, now: float, *, expired: bool) -> list[Lease]:
        """End every active lease of a holder that left (released) or lapsed (expired)."""
        out = list(self.by_holder.get(holder, {}).values())
        for lease in out:
            self._end(lease, EXPIRED if expired else RELEASED, now)
        return out

    def expire_due(self, now: float) -> list[Lease]:
        """Expire every active lease whose expiry has passed."""
        due = [x for x in self.active.values() if x.expires_at <= now]
        for lease in due:
            self._end(lease, EXPIRED, now)
        return due

    # -- internals ----------------------------------------------------------------------

    def _owned(
        self,
        holder: str,
        lease_id: int,
        epoch: int,
        now: float,
        start: int,
        end: int,
        *,
        allow_complete: bool,
        lineage: Lineage = NO_LINEAGE,
    ) -> Lease:
        def fence(why: str) -> None:
            self._fence(holder, lease_id, epoch, now, start, end, why, lineage)

        lease = self.leases.get(lease_id)
        if lease is None:
            if 0 < lease_id < self.next_lease_id:  # ended long ago: its end is on record
                self._refuse(lease_id, epoch, "lease is no longer active")
            raise LeaseError("not_found", f"no lease {lease_id}")
        if lease.holder != holder:
            # a lease id is granted once, to one holder: only a caller that never held it
            # gets here, and a guess must not cost an audited, durable write
            self._refuse(lease_id, epoch, "held by another peer")
        if lease.epoch != epoch:
            fence(f"epoch {epoch} != {lease.epoch}")
        if lease.state == ACTIVE or (allow_complete and lease.state == COMPLETE):
            return lease
        fence(f"lease was {lease.state}")
        raise AssertionError("unreachable")

    def _fence(
        self,
        holder: str,
        lease_id: int,
        epoch: int,
        now: float,
        start: int,
        end: int,
        why: str,
        lineage: Lineage = NO_LINEAGE,
    ) -> None:
        """Refuse a call of the holder on its own lease that has moved on. The first such
        call is put on the record; repeats (a retry, or a member hammering its old lease)
        are refused without another audited write."""
        lease = self.leases[lease_id]
        recorded = not lease.fence_recorded
        if recorded:
            lease.fence_recorded = True
            self.journal.audit.append(
                AuditEvent(
                    now, lease.data_epoch, "fence", lease.shard_id, lease_id, holder, epoch, start,
                    end, *lineage,
                )
            )  # fmt: skip
        self._refuse(lease_id, epoch, why, recorded=recorded)

    def _refuse(self, lease_id: int, epoch: int, why: str, *, recorded: bool = False) -> None:
        self.fenced_total += 1
        raise LeaseError(
            "fenced",
            f"lease {lease_id} (epoch {epoch}) is fenced: {why}; the shard belongs to a newer"
            " holder, drop its uncommitted work",
            recorded=recorded,
        )

    def _finish(self, lease: Lease, shard: Shard, now: float) -> bool:
        lease.state = COMPLETE
        self._unindex(lease)
        self._audit(now, "complete", lease, lease.committed, lease.limit)
        shard.lease_id = 0
        if shard.committed < shard.tokens:
            # Round robin: the shard's next range waits behind the other shards, so that
            # small grants spread a run over the whole corpus, not along one shard.
            shard.state = PENDING
            self._queue.append(shard.shard_id)
            self._touch(shard, lease)
            return False
        shard.state = DONE
        self._done += 1
        self._touch(shard, lease)
        if self._done == len(self.shards):
            self._rollover(now)
        return True

    def _end(self, lease: Lease, state: str, now: float) -> None:
        lease.state = state
        self._unindex(lease)
        shard = self.shards[lease.shard_id]
        shard.state, shard.lease_id = PENDING, 0
        self._queue.appendleft(shard.shard_id)
        self._freed[shard.shard_id] = None
        self._touch(shard, lease)
        kind = "expire" if state == EXPIRED else "release"
        self._audit(now, kind, lease, lease.committed, lease.limit)

    def _rollover(self, now: float) -> None:
        self.data_epoch += 1
        for s in self.shards.values():
            s.committed, s.state, s.lease_id = 0, PENDING, 0
            self.journal.shards[s.shard_id] = s
        self._done = 0
        self.journal.meta["data_epoch"] = str(self.data_epoch)
        self._freed.clear()
        self.journal.audit.append(
            AuditEvent(now, self.data_epoch, "epoch", -1, 0, "", 0, 0, self.epoch_tokens)
        )
        self._rebuild_queue()

    def _next_freed(self) -> Shard | None:
        """The oldest freed shard still pending (its queue entry is skipped later: a
        granted shard is not pending)."""
        for shard_id in list(self._freed):
            shard = self.shards[shard_id]
            if shard.state == PENDING and shard.committed < shard.tokens:
                return shard
            del self._freed[shard_id]
        return None

    def _next_pending(self) -> Shard | None:
        while self._queue:
            shard = self.shards[self._queue.popleft()]
            if shard.state == PENDING and shard.committed < shard.tokens:
                return shard
        return None

    def _rebuild_queue(self) -> None:
        """Pending shards, resumed ones first, each group in the data epoch's seeded
        order: the corpus is sorted by path, so shard order is topic order; shuffled, a
        short run or a few rounds see the whole corpus (docs/outer-loop.md, data order)."""
        ids = sorted(self.shards)
        random.Random(f"{self.order_seed}/{self.data_epoch}").shuffle(ids)
        rank = {shard_id: i for i, shard_id in enumerate(ids)}
        pending = [s for s in self.shards.values() if s.state == PENDING]
        pending.sort(key=lambda s: (s.committed == 0, rank[s.shard_id]))
        self._queue = collections.deque(s.shard_id for s in pending)

    def _remember(self, lease: Lease) -> None:
        self.leases[lease.lease_id] = lease
        while len(self.leases) > RECENT_LEASES:
            old_id, old = next(iter(self.leases.items()))
            if old.state == ACTIVE:
                break
            del self.leases[old_id]

    def _index(self, lease: Lease) -> None:
        self.active[lease.lease_id] = lease
        self.by_holder.setdefault(lease.holder, {})[lease.lease_id] = lease

    def _unindex(self, lease: Lease) -> None:
        self.active.pop(lease.lease_id, None)
        held = self.by_holder.get(lease.holder)
        if held is not None:
            held.pop(lease.lease_id, None)
            if not held:
                del self.by_holder[lease.holder]

    def _touch(self, shard: Shard, lease: Lease) -> None:
        self.journal.shards[shard.shard_id] = shard
        self.journal.leases[lease.lease_id] = lease

    def _audit(
        self,
        now: float,
        kind: str,
        lease: Lease,
        start: int,
        end: int,
        lineage: Lineage = NO_LINEAGE,
    ) -> None:
        self.journal.audit.append(
            AuditEvent(
                now,
                lease.data_epoch,
                kind,
                lease.shard_id,
                lease.lease_id,
                lease.holder,
                lease.epoch,
                start,
                end,
                *lineage,
            )
        )


def restore_book(
    shard_rows: Iterable[Iterable[Any]],
    lease_rows: Iterable[Iterable[Any]],
    meta: dict[str, str],
    *,
    journal: Journal,
    ttl_s: float,
    grace_until: float = 0.0,
    order_seed: int = 0,
) -> LeaseBook:
    """Rebuild the book from stored rows (see `coordinator.store`). Every active lease
    expires no earlier than `grace_until` (unix seconds): renewals were never stored."""
    leases = [Lease(*r) for r in lease_rows]
    for lease in leases:
        if lease.state == ACTIVE:
            lease.expires_at = max(lease.expires_at, grace_until)
    return LeaseBook(
        [Shard(*r) for r in shard_rows],
        journal=journal,
        ttl_s=ttl_s,
        data_epoch=int(meta.get("data_epoch", "0")),
        next_lease_id=int(meta.get("next_lease_id", "1")),
        leases=leases,
        order_seed=order_seed,
    )
