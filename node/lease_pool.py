"""Stage 0's leases: what it holds, which windows it has trained, and what it may commit.

A pure state machine, with no I/O and no clock: the driver asks it what to do and tells
it what happened. Its rules:
- `open(lease, shard)` cuts the lease's range `[committed, limit)` into windows of
  `seq_len + 1` tokens every `seq_len` tokens; a tail too short for a window (the shard's
  end) counts as trained at once, since there is nothing in it to train.
- `wants_lease()` while fewer than `max_open` leases have untaken windows;
  `room_for_freed()` while fewer than twice that: a range an expired or released lease
  left (the coordinator says so in the heartbeat reply) is taken at once, not when the
  pool next runs short, so a dead holder's data waits one heartbeat, not one lease.
- `take(n, rng)` hands out untaken windows, at random across the open leases with an
  `rng` (so one inner step sees many places of the corpus) or in lease order without.
  A window is handed out at most once.
- `finish(windows, final)` marks windows trained. Without an outer loop (`final`) they
  may be committed at once; with one, they wait for the round that carries them. Only
  the contiguous prefix of committable ranges from a lease's committed offset can be
  committed (`LeaseProgress`).
- `snapshot()` marks the start of an outer round: windows trained before it ride in that
  round, windows trained after it in the next one (and so do the windows of a round that
  never reported a result: the working copy still holds their training).
- `round_result(facts)` applies the commit rule (below) to a round's result and says what
  may be committed now and which ranges went back to be trained again.
- `state_replaced(lineage)`: the replica took another replica's state outside a round
  (its outer loop moved to the run's DHT and downloaded the stage's state there,
  rebasing its progress onto it); held rounds whose state is not in the new state's
  chain are gone from it, so their windows go back. Those in the chain stay held (the
  other replica had fetched a state that held them): their training is there.
- `accept(range)` records a commit the coordinator took; a lease whose range is all
  committed is forgotten. Commits are monotonic per lease.
- `fence(lease_id)` forgets a lease the coordinator fenced: its untaken windows are
  dropped, windows in flight are no longer finished, nothing of it is ever committed.
- `release_all()` hands back every held lease (the node is leaving): what was not
  committed returns to the coordinator's queue at its committed offset.

The commit rule. A range is committed only when the round that carries its training was
applied with this replica's contribution weighted above zero (`contributed`), and the
state that round made is one the stage agreed on:
- not contributed (the round was not applied, or the group left this replica's
  pseudo-gradient out): the working copy dropped that training at the merge, so the
  round's windows go back to be trained again (untaken windows of the same lease);
- contributed: the round is held, under the (round, digest) of the state it made;
- a later group round whose canonical state at least two members held as it began
  (`agreed`), a state this replica now holds or stepped from (it is in `lineage`),
  commits every held round whose state is in that chain up to `agreed`: two replicas
  held it, so the stage's lineage runs through it. A group round alone is no proof: its
  members may end it in different states of one round (one stepped alone when its
  exchange failed, one missed a part), and the next group keeps one of them;
- on a stage where this replica is the only one (`sole`), the round and every held
  round are committed at once: there is no other lineage. That holds for a round that
  did not apply too (a drain's last replica, whose groupmate left before the round that
  would have agreed on its last contribution): its state still holds the held rounds;
- `adopted` (this replica replaced its state with another replica's, rebase or download):
  a held round whose state (round, digest) is in the adopted state's chain (`lineage`)
  is an ancestor of it: its training is still there and it stays held (another
  replica stepped on top of it); every other held round's training is gone from the
  state, so its windows go back. The round's own contribution may still be in the
  adopted state (a group merged it); when that contribution `carried` the lone rounds
  since this replica last held a group's state, those are the held rounds off the
  chain, and they stay held under the round's state instead of going back.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from node.lease_progress import LeaseProgress
from protocol.control import LeaseInfo, LeaseRef
from protocol.lineage import Link


@dataclass(frozen=True, slots=True)
class Window:
    """One training sequence of a leased shard: `seq_len + 1` tokens from `start`."""

    lease: LeaseInfo
    shard: np.ndarray  # the whole shard's token ids (shared by its windows)
    start: int  # token offset in the shard


@dataclass(frozen=True, slots=True)
class CommitRange:
    """`[start, end)` of the lease's shard, ready to be committed."""

    lease: LeaseInfo
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class RoundMark:
    """An outer round's start: the round carries the windows trained before it."""

    gen: int  # the pool's round counter when the round began


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundFacts:
    """What one outer round's result says, as the commit rule needs it."""

    mark: RoundMark  # the round
    applied: bool  # this replica's global state changed
    contributed: bool  # its pseudo-gradient is in the state now held, with weight > 0
    adopted: bool  # its state was replaced by another replica's (rebase or download)
    sole: bool  # no other replica trains this stage
    round: int = -1  # outer round (outer steps) of the state held after the round
    digest: str = ""  # that state's digest (hex; "" = not known)
    lineage: tuple[Link, ...] = ()  # that state's chain, ending with it (protocol.lineage)
    # the group's canonical state when two or more members held it as the round began
    # (None: stepped alone, or no state of the group was held twice)
    agreed: Link | None = None
    # its contribution carried the lone rounds since the replica last held a group's
    # state: their training is in the state now held (node.outer.parts.carried_view)
    carried: bool = False


@dataclass(frozen=True, slots=True)
class RoundVerdict:
    """What the commit rule made of a round."""

    commits: list[CommitRange]  # ranges that may be committed now
    returned: list[CommitRange]  # trained ranges put back to be trained again
    held: int  # contributed rounds whose commits wait for the stage to agree on their state
    # the state that holds the training of the rounds this verdict made committable: the
    # agreed state, or the sole replica's own (None: no round became committable)
    rode_in: Link | None = None


class LeasePool:
    def __init__(self, *, seq_len: int, max_open: int, shard_cache: int) -> None:
        if seq_len < 1 or max_open < 1 or shard_cache < 1:
            raise ValueError("seq_len, max_open and shard_cache must be >= 1")
        self.seq_len = seq_len  # tokens per window (plus one for the last target)
        self.max_open = max_open  # leases with untaken windows at once
        self.shard_cache = shard_cache  # shards whose bytes are kept
        self.leases: dict[int, LeaseInfo] = {}  # held leases by id
        self.tokens_committed = 0  # lease tokens the coordinator accepted from this pool
        self._progress: dict[int, LeaseProgress] = {}  # committable ranges per lease
        # trained windows waiting for their round: lease id -> start -> (end, round gen)
        self._trained: dict[int, dict[int, tuple[int, int]]] = {}
        self._gen = 0  # the round that carries windows trained now
        self._unresolved: int | None = None  # the round begun last, until its result
        # rounds applied alone, not yet on the canonical lineage: gen -> the state they made
        self._held: dict[int, Link] = {}
        self._lease_shard: dict[int, np.ndarray] = {}  # lease id -> its shard's ids
        self._fenced: set[int] = set()
        self._untaken: list[Window] = []
        self._shards: dict[int, np.ndarray] = {}  # shard id -> token ids, oldest first

    # --- shards ------------------------------------------------------------------------

    def shard(self, shard_id: int) -> np.ndarray | None:
        """A cached shard's token ids, or None when it must be fetched."""
        return self._shards.get(shard_id)

    def _cache(self, shard_id: int, data: np.ndarray) -> None:
        if shard_id not in self._shards and len(self._shards) >= self.shard_cache:
            self._shards.pop(next(iter(self._shards)))
        self._shards[shard_id] = data

    # --- leases and windows --------------------------------------------------------------

    def open(self, lease: LeaseInfo, shard: np.ndarray) -> int:
        """Hold a granted lease and cut its windows; returns how many."""
        if lease.lease_id in self.leases or lease.lease_id in self._fenced:
            raise ValueError(f"lease {lease.lease_id} is already held or was fenced")
        self._cache(lease.shard_id, shard)
        progress = LeaseProgress(committed=lease.committed, end=lease.limit)
        t = self.seq_len
        starts = [s for s in range(lease.committed, lease.limit, t) if s + t + 1 <= len(shard)]
        tail = starts[-1] + t if starts else lease.committed
        if tail < lease.limit:
            progress.finish(tail, lease.limit)
        self.leases[lease.lease_id] = lease
        self._progress[lease.lease_id] = progress
        self._trained[lease.lease_id] = {}
        self._lease_shard[lease.lease_id] = shard  # to cut windows that go back
        self._untaken.extend(Window(lease, shard, s) for s in starts)
        return len(starts)

    @property
    def open_leases(self) -> int:
        """Leases that still have untaken windows."""
        return len({w.lease.lease_id for w in self._untaken})

    @property
    def untaken(self) -> int:
        return len(self._untaken)

    def wants_lease(self) -> bool:
        return self.open_leases < self.max_open

    def room_for_freed(self) -> bool:
        """The pool may take one more freed range (up to twice `max_open` open leases)."""
        return self.open_leases < 2 * self.max_open

    def take(self, n: int, rng: random.Random | None = None) -> list[Window]:
        """Up to `n` untaken windows: drawn with `rng`, or the oldest ones without."""
        n = min(n, len(self._untaken))
        if rng is None:
            out, self._untaken = self._untaken[:n], self._untaken[n:]
            return out
        return [self._untaken.pop(rng.randrange(len(self._untaken))) for _ in range(n)]

    def finish(self, windows: Iterable[Window], *, final: bool) -> None:
        """These windows were trained (fenced leases' windows are ignored): committable
        now when `final` (no outer loop), else once the round that carries them says so."""
        for w in windows:
            progress = self._progress.get(w.lease.lease_id)
            if progress is None:
                continue
            end = min(w.start + self.seq_len, w.lease.limit)
            if final:
                progress.finish(w.start, end)
            else:
                self._trained[w.lease.lease_id][w.start] = (end, self._gen)

    def is_fenced(self, lease_id: int) -> bool:
        return lease_id in self._fenced

    def fence(self, lease_id: int) -> bool:
        """The coordinator fenced this lease; True if it was held."""
        held = lease_id in self.leases
        self._fenced.add(lease_id)
        self._forget(lease_id)
        return held

    def fence_all(self) -> list[int]:
        """Fence every held lease (the membership lapsed); their ids."""
        ids = list(self.leases)
        for lease_id in ids:
            self.fence(lease_id)
        return ids

    def _forget(self, lease_id: int) -> None:
        self.leases.pop(lease_id, None)
        self._progress.pop(lease_id, None)
        self._trained.pop(lease_id, None)
        self._lease_shard.pop(lease_id, None)
        self._untaken = [w for w in self._untaken if w.lease.lease_id != lease_id]

    def refs(self) -> list[LeaseRef]:
        """The held leases as the heartbeat renews them."""
        return [LeaseRef(lease_id=i, epoch=le.epoch) for i, le in self.leases.items()]

    # --- commits -----------------------------------------------------------------------

    def snapshot(self) -> RoundMark:
        """An outer round begins: it carries the windows trained so far. One round runs
        at a time; when the last one never reported a result (it failed, so the working
        copy still holds its training), its windows ride in this one."""
        if self._unresolved is not None:
            for trained in self._trained.values():
                for start, (end, gen) in trained.items():
                    if gen == self._unresolved:
                        trained[start] = (end, self._gen)
        mark = RoundMark(self._gen)
        self._unresolved = self._gen
        self._gen += 1
        return mark

    def round_result(self, facts: RoundFacts) -> RoundVerdict:
        """The commit rule (module docstring) applied to one round's result."""
        if facts.mark.gen != self._unresolved:
            raise ValueError(f"round {facts.mark.gen} is not the round in flight")
        self._unresolved = None
        back: set[int] = set()
        if facts.adopted:  # held rounds that are not ancestors of the new state are gone
            for gen in self._held_outside(facts.lineage):
                if facts.carried and facts.contributed:  # they rode in this round instead
                    self._held[gen] = (facts.round, facts.digest)
                else:
                    del self._held[gen]
                    back.add(gen)
        if facts.contributed:
            self._held[facts.mark.gen] = (facts.round, facts.digest)
        else:  # the merge dropped this round's training from the working copy
            back.add(facts.mark.gen)
        agreed: set[int] = set()
        rode_in: Link | None = None
        if facts.sole:  # no other lineage, applied or not (the state holds the held rounds)
            agreed, rode_in = set(self._held), (facts.round, facts.digest)
        elif facts.agreed is not None and facts.agreed in facts.lineage:
            upto = facts.lineage[: facts.lineage.index(facts.agreed) + 1]
            agreed = {gen for gen, link in self._held.items() if link in upto}
            rode_in = facts.agreed
        self._resolve(agreed, keep=True)
        for gen in agreed:
            del self._held[gen]
        returned = self._resolve(back, keep=False)
        return RoundVerdict(
            commits=self.commits(),
            returned=returned,
            held=len(self._held),
            rode_in=rode_in if agreed else None,
        )

    @property
    def held(self) -> int:
        """Contributed rounds whose commits wait for the stage to agree on their state."""
        return len(self._held)

    def state_replaced(self, lineage: tuple[Link, ...]) -> list[CommitRange]:
        """The global state was replaced by another replica's, whose chain is `lineage`,
        outside a round (a rebase: the working copy keeps what it trained since its last
        round, which rides in the next round): a held round whose state is not in that
        chain is gone from it, so its windows go back; returns them, as ranges. The same
        rule as an adopted state in `round_result`."""
        back = self._held_outside(lineage)
        for gen in back:
            del self._held[gen]
        return self._resolve(back, keep=False)

    def _held_outside(self, lineage: tuple[Link, ...]) -> set[int]:
        """Held rounds whose state is not in `lineage`: their training is not in it."""
        ancestors = set(lineage)
        return {gen for gen, link in self._held.items() if link not in ancestors}

    def _resolve(self, gens: set[int], *, keep: bool) -> list[CommitRange]:
        """The trained windows of rounds `gens` become committable (`keep`), or go back to
        the front of the untaken windows (the oldest work, which holds commits back);
        returns what went back, as ranges."""
        back: list[CommitRange] = []
        again: list[Window] = []
        if not gens:
            return back
        for lease_id, trained in self._trained.items():
            lease, progress = self.leases[lease_id], self._progress[lease_id]
            for start in sorted(s for s, (_, gen) in trained.items() if gen in gens):
                end, _ = trained.pop(start)
                if keep:
                    progress.finish(start, end)
                    continue
                again.append(Window(lease, self._lease_shard[lease_id], start))
                if back and back[-1].lease.lease_id == lease_id and back[-1].end == start:
                    back[-1] = CommitRange(lease, back[-1].start, end)
                else:
                    back.append(CommitRange(lease, start, end))
        self._untaken[:0] = again
        return back

    def commits(self) -> list[CommitRange]:
        """Ranges that may be committed now: every lease's committable prefix."""
        out = []
        for lease_id, progress in self._progress.items():
            point = progress.commit_point()
            if point > progress.committed:
                out.append(CommitRange(self.leases[lease_id], progress.committed, point))
        return out

    def pending(self, commit: CommitRange) -> bool:
        """`commit` can still be sent: its lease is held and its start is the committed
        offset (a commit that raced with another, or with a fence, cannot)."""
        progress = self._progress.get(commit.lease.lease_id)
        return progress is not None and progress.committed == commit.start

    def accept(self, commit: CommitRange) -> bool:
        """The coordinator accepted `commit`; True when its lease is now complete (and
        forgotten)."""
        lease_id = commit.lease.lease_id
        progress = self._progress[lease_id]
        if commit.start != progress.committed:
            raise ValueError(
                f"lease {lease_id}: commit from {commit.start} but committed is {progress.committed}"
            )
        progress.accept(commit.end)
        self.tokens_committed += commit.end - commit.start
        if progress.complete:
            self._forget(lease_id)
            return True
        return False

    def release_all(self) -> list[LeaseInfo]:
        """Every held lease, forgotten (the node is leaving)."""
        held = list(self.leases.values())
        for lease in held:
            self._forget(lease.lease_id)
        return held
